"""W8A8: int8 weights and int8 activations for every linear in the decoder blocks (and, switchably, the
attention matmuls): `quantize_(model, W8A8Config(...))`, after `SmoothQuantConfig` for SmoothQuant, and
`LLMInt8Config` for LLM.int8()'s vector-wise int8 with outlier decomposition.

Levels (thesis Table 3.2), weights per-tensor unless `weight_granularity` says otherwise:
    O1: per-token dynamic activations    O2: per-tensor dynamic    O3: per-tensor static (calibrated)
Naive W8A8 is O2 without smoothing; ZeroQuant-style is O1 with group-wise weights (`ZEROQUANT`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.errors import ConfigError, CorruptModelError
from leanlm.formats.int8 import QMAX, WeightGranularity
from leanlm.kernels.int8_gemm import Backend
from leanlm.methods.calibration import collect_input_absmax
from leanlm.methods.quantize import QuantRun, register_after_load, register_method
from leanlm.settings import option
from leanlm.models.architectures import architecture_for, decoder_blocks, iter_quantizable_linears, linear_weight_out_in
from leanlm.nn import ATTENTION_NAME, BmmQuantizer, SharedInputGemm, W8A8Linear, use_int8_bmm_attention

Level = Literal["O1", "O2", "O3"]
LEVELS: dict[str, tuple[str, bool]] = {  # level -> (activation granularity, static)
    "O1": ("per_token", False),
    "O2": ("per_tensor", False),
    "O3": ("per_tensor", True),
}


@dataclass(frozen=True)
class W8A8Config:
    level: Level = option("O2", "O1 per-token dynamic, O2 per-tensor dynamic, O3 per-tensor static activations")
    weight_granularity: WeightGranularity = option("per_tensor", "weight scales per tensor, per output channel, or "
                                                                 "per group of output channels (with O1: ZeroQuant)")
    group_size: int = option(128, "per_group: output channels per weight scale")
    quantize_bmm: bool = option(True, "also quantize attention's Q.K^T and P.V inputs q, k, v (thesis Fig. 3.3)",
                                flag="--no-bmm")
    quantize_probs: bool = option(False, "also round softmax probabilities to the int8 grid 1/127 (the int8 OPT "
                                         "kernel does)")
    # LLM.int8()'s mixed-precision decomposition: input dimensions with any |x| >= this go through float
    outlier_threshold: float | None = option(None, "outlier magnitude (LLM.int8(); use LLMInt8Config)", cli=False)
    asymmetric: bool = option(False, "per-tensor zero points on both operands (LLM.int8()'s zeropoint baseline)",
                              cli=False)
    backend: Backend | None = option(None, "int8 GEMM: reference or fbgemm (None: fbgemm where available)", cli=False)
    calibration_samples: int = option(512, "calibration windows for static ranges (SmoothQuant: 512 sentences)",
                                      flag="--calib-samples")

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ConfigError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.outlier_threshold is not None and LEVELS[self.level][1]:
            raise ConfigError("outlier decomposition needs dynamic activation scales (level O1 or O2)")
        if self.group_size < 1:
            raise ConfigError(f"group_size must be at least 1 output channel, got {self.group_size}")
        if self.calibration_samples < 1:
            raise ConfigError(f"calibration_samples must be at least 1, got {self.calibration_samples}")

    @property
    def method(self) -> str:
        return "w8a8" if self.outlier_threshold is None else "llm-int8"


ZEROQUANT = W8A8Config(level="O1", weight_granularity="per_group")


@dataclass(frozen=True)
class LLMInt8Config:
    """LLM.int8() (thesis ch. 2): vector-wise int8 (per-token activations x per-output-channel weights) with the
    outlier dimensions in float. Attention's matmuls stay in float, as in the paper."""

    threshold: float | None = option(6.0, "alpha: input dimensions with any |x| >= it run in float (inf: none, "
                                          "plain vector-wise int8)", none_word="inf")

    def __post_init__(self):
        if self.threshold is not None and not self.threshold > 0:
            raise ConfigError(f"threshold must be positive (or None), got {self.threshold}")

    def w8a8(self) -> W8A8Config:
        return W8A8Config(level="O1", weight_granularity="per_channel", quantize_bmm=False,
                          outlier_threshold=self.threshold)


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


def int8_statistics(model: nn.Module, config, run: QuantRun) -> CalibrationStats:
    """The run's int8 statistics of `model`, observed on first need from `config.calibration_samples` windows."""
    if run.stats is None:
        run.stats = calibrate(model, run.data(config).batches(config.calibration_samples))
    return run.stats


@register_method(W8A8Config, "w8a8", "quantizer", needs_calibration=lambda config: LEVELS[config.level][1])
def _quantize_w8a8(model: nn.Module, config: W8A8Config, run: QuantRun) -> dict:
    """Replace the block linears (and attention's matmul inputs) by int8 ones; static levels take their ranges
    from the run's statistics (observed here, or kept current by a transform before, such as smoothing)."""
    activation, static = LEVELS[config.level]
    stats = int8_statistics(model, config, run) if static else run.stats
    table = architecture_for(model)
    input_absmax = stats.input_absmax if stats else {}
    attention_ranges = stats.attention if stats else {}
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
    calibration = run.calibration.record(config.calibration_samples) if stats is not None and run.calibration else None
    return {"method": config.method, **asdict(config), "calibration": calibration}


@register_method(LLMInt8Config, "llm-int8", "quantizer", needs_calibration=lambda config: False)
def _quantize_llm_int8(model: nn.Module, config: LLMInt8Config, run: QuantRun) -> dict:
    return {**_quantize_w8a8(model, config.w8a8(), run), "method": "llm-int8"}


@register_after_load
def _restore_int8_runtime(model: nn.Module, record: dict, directory) -> None:
    """What W8A8 derives rather than stores: the shared GEMMs (like fbgemm's packed weights) and the int8
    attention function."""
    if "level" in record and record["level"] not in LEVELS:
        raise CorruptModelError(f"{directory}: level {record['level']!r} is not one of {', '.join(LEVELS)}")
    share_input_gemms_(model)
    if record.get("attn_implementation") == ATTENTION_NAME:
        model.config._attn_implementation = ATTENTION_NAME


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
