"""W8A8: int8 weights and int8 activations for every linear in the decoder blocks (and, switchably, the
attention matmuls): `quantize_(model, W8A8Config(...))`, after `SmoothQuantConfig` for SmoothQuant, and
`LLMInt8Config` for LLM.int8()'s vector-wise int8 with outlier decomposition.

Levels (Xiao's thesis Table 3.2), weights per-tensor unless `weight_granularity` says otherwise:
    O1: per-token dynamic activations    O2: per-tensor dynamic    O3: per-tensor static (calibrated)
Naive W8A8 is O2 without smoothing; ZeroQuant-style is O1 with group-wise weights (`ZEROQUANT`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
from torch import nn

from leanlm.errors import ConfigError, CorruptModelError
from leanlm.formats.int8 import QMAX, WeightGranularity
from leanlm.kernels.int8_gemm import Backend
from leanlm.memory import trim_freed_memory
from leanlm.methods.blocks import observe_inputs, walk_blocks
from leanlm.methods.calibration import record_channel_absmax
from leanlm.methods.quantize import BlockPlan, QuantRun, register_after_load, register_method
from leanlm.models.architectures import architecture_for, decoder_blocks, linear_weight_out_in
from leanlm.nn import ATTENTION_NAME, BmmQuantizer, SharedInputGemm, W8A8Linear, use_int8_bmm_attention
from leanlm.settings import option

Level = Literal["O1", "O2", "O3"]
LEVELS: dict[str, tuple[str, bool]] = {  # level -> (activation granularity, static)
    "O1": ("per_token", False),
    "O2": ("per_tensor", False),
    "O3": ("per_tensor", True),
}


@dataclass(frozen=True)
class W8A8Config:
    level: Level = option("O2", "O1 per-token dynamic, O2 per-tensor dynamic, O3 per-tensor static activations")
    weight_granularity: WeightGranularity = option(
        "per_tensor",
        "weight scales per tensor, per output channel, or per group of output channels (with O1: ZeroQuant)",
    )
    group_size: int = option(128, "per_group: output channels per weight scale")
    quantize_bmm: bool = option(
        True,
        "also quantize attention's Q.K^T and P.V inputs q, k, v (Xiao's thesis Fig. 3.3)",
        flag="--no-bmm",
        off="keep attention's batched matmuls in float (what compressed-tensors export needs)",
    )
    quantize_probs: bool = option(
        False, "also round softmax probabilities to the int8 grid 1/127 (the int8 OPT kernel does)"
    )
    # LLM.int8()'s mixed-precision decomposition: input dimensions with any |x| >= this go through float
    outlier_threshold: float | None = option(None, "outlier magnitude (LLM.int8(); use LLMInt8Config)", cli=False)
    asymmetric: bool = option(
        False, "per-tensor zero points on both operands (LLM.int8()'s zeropoint baseline)", cli=False
    )
    backend: Backend | None = option(None, "int8 GEMM: reference or fbgemm (None: fbgemm where available)", cli=False)
    calibration_samples: int = option(
        512, "calibration windows for static ranges (SmoothQuant: 512 sentences)", flag="--calib-samples"
    )

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
    """LLM.int8() (Dettmers' thesis ch. 2): vector-wise int8 (per-token activations x per-output-channel weights) with the
    outlier dimensions in float. Attention's matmuls stay in float, as in the paper."""

    threshold: float | None = option(
        6.0,
        "alpha: input dimensions with any |x| >= it run in float (inf: none, plain vector-wise int8)",
        none_word="inf",
    )

    def __post_init__(self):
        if self.threshold is not None and not self.threshold > 0:
            raise ConfigError(f"threshold must be positive (or None), got {self.threshold}")

    def w8a8(self) -> W8A8Config:
        return W8A8Config(
            level="O1", weight_granularity="per_channel", quantize_bmm=False, outlier_threshold=self.threshold
        )


def _attention_modules(model: nn.Module):
    table = architecture_for(model)
    for index, block in enumerate(decoder_blocks(model, table)):
        yield f"{table.blocks}.{index}.{table.attention_module}", block.get_submodule(table.attention_module)


@dataclass
class CalibrationStats:
    input_absmax: dict[str, torch.Tensor]  # linear name -> per-input-channel max|x|
    attention: dict[str, dict[str, torch.Tensor]]  # attention module name -> observed q/k/v ranges

    def copy(self) -> CalibrationStats:
        """Another set of the same statistics whose entries a transform may replace (the tensors are shared)."""
        return CalibrationStats(
            dict(self.input_absmax), {name: dict(ranges) for name, ranges in self.attention.items()}
        )


class Int8Observer:
    """The int8 statistics of the float model, observed block by block as the block pipeline runs each block:
    every quantizable linear's max|x| per input channel and every attention's q/k/v ranges (a `BmmQuantizer`
    observing inside transformers' attention, routed through leanlm's int8 attention function from the start,
    so the masks the model prepares are the ones that function reads). `close()` puts the model's attention
    function back."""

    def __init__(self, model: nn.Module):
        self.table, self.config = architecture_for(model), model.config
        self.stats = CalibrationStats({}, {})
        self.previous_attention = model.config._attn_implementation
        use_int8_bmm_attention(model)

    def close(self) -> None:
        self.config._attn_implementation = self.previous_attention

    @contextmanager
    def observe(self, index: int, block: nn.Module):
        prefix = f"{self.table.blocks}.{index}."
        attention = block.get_submodule(self.table.attention_module)
        attention.bmm_quantizer = BmmQuantizer()
        attention.bmm_quantizer.observe = True
        try:
            with observe_inputs(
                ((prefix + path, block.get_submodule(path)) for path in self.table.quantizable_linears),
                lambda name, x: record_channel_absmax(self.stats.input_absmax, name, x),
            ):
                yield
            self.stats.attention[prefix + self.table.attention_module] = attention.bmm_quantizer.state_dict()
        finally:
            del attention.bmm_quantizer


def calibrate(model: nn.Module, batches: torch.Tensor) -> CalibrationStats:
    """Input ranges of every linear and q/k/v ranges of every attention, in one pass over `batches` (n, L).
    The model is left as it was."""
    observer = Int8Observer(model)
    try:
        walk_blocks(model, batches, observe=observer.observe, desc="calibrating")
    finally:
        observer.close()
    return observer.stats


def int8_statistics(model: nn.Module, config, run: QuantRun) -> CalibrationStats:
    """The run's int8 statistics of `model` (in memory), observed now from `config.calibration_samples` windows
    unless known."""
    if run.stats is None:
        run.stats = calibrate(model, run.data(config).batches(config.calibration_samples))
    return run.stats


def int8_observation(model: nn.Module, config, run: QuantRun):
    """(observe, windows) for a plan that needs the run's int8 statistics (`run.stats`): the one `Int8Observer`
    filling them block by block, for the first plan that asks; (None, None) when they are known or observed by
    an earlier plan of the run."""
    if run.stats is not None:
        return None, None
    run.observing = Int8Observer(model)
    run.stats = run.observing.stats
    return run.observing.observe, run.data(config).batches(config.calibration_samples)


@register_method(
    W8A8Config, "w8a8", "quantizer", needs_calibration=lambda config: LEVELS[config.level][1], blockwise=True
)
def _w8a8_plan(model: nn.Module, config: W8A8Config, run: QuantRun) -> BlockPlan:
    """Replace the block linears (and attention's matmul inputs) by int8 ones; static levels take their ranges
    from the run's statistics (observed here, or kept current by a transform before, such as smoothing)."""
    activation, static = LEVELS[config.level]
    observe, windows = int8_observation(model, config, run) if static else (None, None)
    table = architecture_for(model)

    def quantize_block(index: int, block: nn.Module) -> None:
        prefix = f"{table.blocks}.{index}."
        input_absmax = run.stats.input_absmax if run.stats else {}
        for path in table.quantizable_linears:
            module = block.get_submodule(path)
            input_scale = (input_absmax[prefix + path].max() / QMAX).clamp(min=1e-8) if static else None
            block.set_submodule(
                path,
                W8A8Linear.from_float(
                    linear_weight_out_in(module, table),
                    getattr(module, "bias", None),
                    config.weight_granularity,
                    config.group_size,
                    activation,
                    input_scale,
                    config.backend,
                    config.outlier_threshold,
                    config.asymmetric,
                ),
            )
        if config.quantize_bmm:
            ranges = run.stats.attention.get(prefix + table.attention_module) if run.stats else None
            kv_channels = ranges["v_channel_absmax"].numel() if ranges else 0
            quantizer = BmmQuantizer(activation, static, kv_channels, config.quantize_probs)
            if ranges is not None:
                quantizer.load_state_dict(ranges)
            block.get_submodule(table.attention_module).bmm_quantizer = quantizer

    def finish(model: nn.Module, counts: dict) -> dict:
        if run.observing is not None:
            run.observing.close()
        share_input_gemms_(model)
        if config.quantize_bmm:
            use_int8_bmm_attention(model)
        calibration = (
            run.calibration.record(config.calibration_samples) if run.stats is not None and run.calibration else None
        )
        return {"method": config.method, **asdict(config), "calibration": calibration}

    return BlockPlan(quantize_block, finish, observe, windows)


@register_method(LLMInt8Config, "llm-int8", "quantizer", needs_calibration=lambda config: False, blockwise=True)
def _llm_int8_plan(model: nn.Module, config: LLMInt8Config, run: QuantRun) -> BlockPlan:
    plan = _w8a8_plan(model, config.w8a8(), run)
    return replace(plan, finish=lambda model, counts: {**plan.finish(model, counts), "method": "llm-int8"})


@register_after_load
def _restore_int8_runtime(model: nn.Module, record: dict, directory) -> None:
    """What W8A8 derives rather than stores: the shared GEMMs (like fbgemm's packed weights) and the int8
    attention function."""
    if "level" in record and record["level"] not in LEVELS:
        raise CorruptModelError(f"{directory}: level {record['level']!r} is not one of {', '.join(LEVELS)}")
    share_input_gemms_(model)
    pack_int8_weights_(model)
    if record.get("attn_implementation") == ATTENTION_NAME:
        model.config._attn_implementation = ATTENTION_NAME


def pack_int8_weights_(model: nn.Module) -> None:
    """Pack every fbgemm W8A8 weight now, one layer (or shared group) at a time, each releasing its plain int8
    tensor as it goes, so a loaded model holds one copy of each int8 weight from the start (the loader's tensors
    are copies, not views of the mapped files, so a packed weight's pages go with it). What each packing frees
    goes back to the system before the next: glibc keeps freed blocks of up to 32 MiB in its heap, and the
    plain int8 weights would otherwise stay resident beside their packed copies until the load ends."""
    for module in model.modules():
        if isinstance(module, W8A8Linear) and module.backend == "fbgemm":
            module.pack_()
            trim_freed_memory()


def share_input_gemms_(model: nn.Module, share: bool = True) -> int:
    """Let the W8A8 linears that read one norm's output (the architecture table's `norm_feeds`: q/k/v, gate/up)
    run as one GEMM each (`SharedInputGemm`; same outputs, fewer and wider GEMMs); `share=False` undoes it.
    Groups whose members quantize their input differently (LLM.int8()'s decomposition, zero points, unequal
    static scales) stay separate. Returns the number of groups formed."""
    table = architecture_for(model)
    groups = 0
    for block in decoder_blocks(model, table):
        if any(tensor.is_meta for tensor in block.state_dict().values()):
            continue  # a block already written to disk by the out-of-core pipeline: the loader shares its GEMMs
        for feeds in table.norm_feeds:
            members = [block.get_submodule(path) for path in feeds.linears]
            for member in members:
                if isinstance(member, W8A8Linear):
                    if member.shared_input is not None:
                        member.shared_input.forget_weights()  # the members' int8 weights, back from the packed one
                    member.shared_input = None
            if share and SharedInputGemm.problem(members) is None:
                SharedInputGemm(members)
                groups += 1
    return groups
