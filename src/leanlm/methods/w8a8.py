"""W8A8: int8 weights and int8 activations for every linear in the decoder blocks (and, switchably, the
attention matmuls), with or without SmoothQuant's smoothing first. One verb: `quantize_w8a8_(model, config)`.

Levels (thesis Table 3.2), weights per-tensor unless `weight_granularity` says otherwise:
    O1: per-token dynamic activations    O2: per-tensor dynamic    O3: per-tensor static (calibrated)
Naive W8A8 is O2 without smoothing; ZeroQuant-style is O1 with group-wise weights (`ZEROQUANT`).
"""

from __future__ import annotations

import copy
import math

from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.data.calibration import calibration_batches
from leanlm.errors import ConfigError
from leanlm.formats.int8 import QMAX, WeightGranularity
from leanlm.kernels.int8_gemm import Backend
from leanlm.methods.calibration import collect_input_absmax
from leanlm.methods.smoothquant import SmoothQuantConfig, smooth_
from leanlm.models.architectures import architecture_for, decoder_blocks, iter_quantizable_linears, linear_weight_out_in
from leanlm.models.scoring import next_token_nll
from leanlm.nn import BmmQuantizer, SharedInputGemm, W8A8Linear, use_int8_bmm_attention

Level = Literal["O1", "O2", "O3"]
LEVELS: dict[str, tuple[str, bool]] = {  # level -> (activation granularity, static)
    "O1": ("per_token", False),
    "O2": ("per_tensor", False),
    "O3": ("per_tensor", True),
}
INT8_METHODS = ("w8a8", "smoothquant", "llm-int8")  # the names `W8A8Config.method` gives
ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass(frozen=True)
class W8A8Config:
    level: Level = "O2"
    weight_granularity: WeightGranularity = "per_tensor"
    group_size: int = 128  # output channels per weight scale, for per_group (ZeroQuant)
    smoothquant: SmoothQuantConfig | None = None  # None: naive (no smoothing)
    quantize_bmm: bool = True  # also quantize attention's Q.K^T and P.V inputs q, k, v (thesis Fig. 3.3)
    quantize_probs: bool = False  # and the softmax probabilities P on the grid 1/127 (int8 OPT kernel)
    # LLM.int8()'s mixed-precision decomposition: input dimensions with any |x| >= this go through float
    outlier_threshold: float | None = None
    asymmetric: bool = False  # per-tensor zero points on both operands (LLM.int8()'s "zeropoint" baseline)
    backend: Backend | None = None  # None: fbgemm where available

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ConfigError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.outlier_threshold is not None and LEVELS[self.level][1]:
            raise ConfigError("outlier decomposition needs dynamic activation scales (level O1 or O2)")
        if self.group_size < 1:
            raise ConfigError(f"group size must be at least 1 output channel, got {self.group_size}")

    @property
    def method(self) -> str:
        naive, smoothed, decomposed = INT8_METHODS
        if self.outlier_threshold is not None:
            return decomposed
        return naive if self.smoothquant is None else smoothed

    def as_record(self) -> dict:
        return asdict(self)


ZEROQUANT = W8A8Config(level="O1", weight_granularity="per_group")


def llm_int8_config(threshold: float | None = 6.0) -> W8A8Config:
    """LLM.int8() (thesis ch. 2): vector-wise int8 (per-token activations x per-output-channel weights) with
    the outlier dimensions (any |x| >= threshold, alpha = 6.0 in the paper) in float; threshold None is plain
    vector-wise int8. Attention's matmuls stay in float, as in the paper."""
    return W8A8Config(level="O1", weight_granularity="per_channel", quantize_bmm=False, outlier_threshold=threshold)


def _attention_modules(model: nn.Module):
    table = architecture_for(model)
    for index, block in enumerate(decoder_blocks(model, table)):
        yield f"{table.blocks}.{index}.{table.attention_module}", block.get_submodule(table.attention_module)


@dataclass
class CalibrationStats:
    input_absmax: dict[str, torch.Tensor]  # linear name -> per-input-channel max|x|
    attention: dict[str, dict[str, torch.Tensor]]  # attention module name -> observed q/k/v ranges


def calibrate(model: nn.Module, batches: torch.Tensor) -> CalibrationStats:
    """Input ranges of every linear and q/k/v ranges of every attention, in one pass over `batches` (n, L).
    The model is left as it was."""
    attentions = dict(_attention_modules(model))
    previous_attention = model.config._attn_implementation
    for attention in attentions.values():
        attention.bmm_quantizer = BmmQuantizer()
        attention.bmm_quantizer.observe = True
    use_int8_bmm_attention(model)
    try:
        input_absmax = collect_input_absmax(model, batches)
        observed = {name: attention.bmm_quantizer.state_dict() for name, attention in attentions.items()}
    finally:
        for attention in attentions.values():
            del attention.bmm_quantizer
        model.config._attn_implementation = previous_attention
    return CalibrationStats(input_absmax, observed)


def quantize_w8a8_(model: nn.Module, config: W8A8Config, stats: CalibrationStats | None = None) -> dict:
    """Quantize `model` in place, from calibration statistics collected on it beforehand (`calibrate`); they
    may be omitted only for dynamic levels without smoothing. Returns a record of what was done."""
    activation, static = LEVELS[config.level]
    if stats is None and (static or config.smoothquant is not None):
        raise ConfigError(f"{config.method} at level {config.level} needs calibration statistics")
    table = architecture_for(model)
    input_absmax = stats.input_absmax if stats else {}
    attention_ranges = {name: dict(ranges) for name, ranges in stats.attention.items()} if stats else {}
    if config.smoothquant is not None:
        smoothing = smooth_(model, input_absmax, config.smoothquant)
        input_absmax = smoothing.input_absmax
        for name, ranges in attention_ranges.items():
            value_proj = f"{name.rsplit('.', 1)[0]}.{table.attention_inputs[-1]}"
            if value_proj in smoothing.producer_scales:  # v itself was divided by s
                ranges["v_channel_absmax"] = ranges["v_channel_absmax"] / smoothing.producer_scales[value_proj]
    for name, module in tqdm(list(iter_quantizable_linears(model, table)), desc="quantizing", unit="linear", leave=False):
        input_scale = (input_absmax[name].max() / QMAX).clamp(min=1e-8) if static else None
        quantized = W8A8Linear.from_float(
            linear_weight_out_in(module, table), getattr(module, "bias", None),
            config.weight_granularity, config.group_size, activation, input_scale, config.backend,
            config.outlier_threshold, config.asymmetric,
        )
        model.set_submodule(name, quantized)
    share_input_gemms_(model)
    if config.quantize_bmm:
        for name, attention in _attention_modules(model):
            ranges = attention_ranges.get(name)
            kv_channels = ranges["v_channel_absmax"].numel() if ranges else 0
            quantizer = BmmQuantizer(activation, static, kv_channels, config.quantize_probs)
            if ranges is not None:
                quantizer.load_state_dict(ranges)
            attention.bmm_quantizer = quantizer
        use_int8_bmm_attention(model)
    return {"method": config.method, **config.as_record()}


def share_input_gemms_(model: nn.Module, share: bool = True) -> int:
    """Let the W8A8 linears that read one norm's output (the architecture table's `norm_feeds`: q/k/v, gate/up)
    run as one GEMM each (`SharedInputGemm`; same outputs, fewer and wider GEMMs); `share=False` undoes it.
    Groups whose members quantize their input differently (LLM.int8()'s decomposition, zero points, unequal
    static scales) stay separate. Returns the number of groups formed."""
    table = architecture_for(model)
    groups = 0
    for block in decoder_blocks(model, table):
        for feeds in table.norm_feeds:
            members = [block.get_submodule(path) for path in feeds.linears]
            for member in members:
                if isinstance(member, W8A8Linear):
                    member.shared_input = None
            if share and SharedInputGemm.problem(members) is None:
                SharedInputGemm(members)
                groups += 1
    return groups


def search_alpha(
    float_model: nn.Module, config: W8A8Config, stats: CalibrationStats, held_out: torch.Tensor, grid=ALPHA_GRID
) -> tuple[float, dict[float, float]]:
    """SmoothQuant's grid search for alpha: quantize a copy of the float model per alpha and keep the one with
    the lowest perplexity on held-out calibration windows (never evaluation data). Returns (best, {alpha: ppl})."""
    if config.smoothquant is None:
        raise ConfigError("alpha search needs a SmoothQuant config")
    perplexities = {}
    for alpha in tqdm(grid, desc="alpha search", unit="alpha"):
        model = copy.deepcopy(float_model)
        quantize_w8a8_(model, replace(config, smoothquant=replace(config.smoothquant, alpha=alpha)), stats)
        nll = sum(next_token_nll(model, window[None]) for window in held_out)
        perplexities[alpha] = math.exp(nll / (held_out.numel() - held_out.shape[0]))
    return min(perplexities, key=perplexities.get), perplexities


@dataclass(frozen=True)
class CalibrationSettings:
    n_samples: int = 512  # SmoothQuant: 512 sentences of up to 512 tokens
    seq_len: int = 512
    seed: int = 0
    source: str = "lambada-dev"  # not an evaluation set
    alpha_search_windows: int = 8  # held-out windows scored per alpha by `--alpha auto`


def quantize_loaded_w8a8_(
    model: nn.Module, tokenizer, config: W8A8Config, calibration: CalibrationSettings = CalibrationSettings(),
    search: bool = False,
) -> dict:
    """The whole recipe on a loaded model: calibrate (if the config needs it), pick alpha on held-out
    calibration windows (if `search`), quantize. Returns the record for the checkpoint."""
    _, static = LEVELS[config.level]
    stats = None
    if static or config.smoothquant is not None:
        batches = calibration_batches(tokenizer, calibration.n_samples, calibration.seq_len, calibration.seed,
                                      calibration.source)
        stats = calibrate(model, batches)
    searched = None
    if search:
        held_out = calibration_batches(tokenizer, calibration.alpha_search_windows, calibration.seq_len,
                                       calibration.seed + 1, calibration.source)
        best, searched = search_alpha(model, config, stats, held_out)
        config = replace(config, smoothquant=replace(config.smoothquant, alpha=best))
    record = quantize_w8a8_(model, config, stats)
    record["calibration"] = asdict(calibration) if stats is not None else None
    if searched is not None:
        record["alpha_search"] = {str(alpha): ppl for alpha, ppl in searched.items()}
    return record
