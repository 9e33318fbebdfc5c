"""SmoothQuant's smoothing (Xiao's thesis section 3.3): migrate activation outliers into the weights.

For the linears that read one input X, per input channel j:
    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)            (eq. 3.4; alpha = migration strength)
X is divided by s (folded into whatever produces X) and the linears' input columns are multiplied by s
(eq. 3.3), which leaves the model's function unchanged. Producers, from the architecture table:
  - a norm (the paper): its weight (and bias) is divided by s;
  - a linear whose output reaches the consumer through a scale-commuting op (beyond the paper, switchable):
    v_proj -> o_proj (attention is linear in V) and up_proj -> down_proj (the gated unit is linear in up).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.cache.prefix import follow_value_smoothing_
from leanlm.errors import ConfigError
from leanlm.methods.quantize import BlockPlan, QuantRun, quantize_, register_method
from leanlm.methods.w8a8 import CalibrationStats, int8_observation, int8_statistics
from leanlm.models.architectures import (
    ArchitectureTable,
    architecture_for,
    attention_shape,
    decoder_blocks,
    linear_weight_out_in,
)
from leanlm.models.scoring import next_token_nll
from leanlm.settings import option

_MIN = 1e-5  # floor for maxima and scales, as in the reference implementation


ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
AUTO = "auto"


@dataclass(frozen=True)
class SmoothQuantConfig:
    """SmoothQuant's smoothing, a transform before an int8 quantizer (`[SmoothQuantConfig(), W8A8Config("O3")]`
    is SmoothQuant as the paper runs it)."""

    alpha: float | Literal["auto"] = option(
        0.5, "migration strength in [0, 1] (eq. 3.4), or 'auto': a grid search on held-out calibration windows"
    )
    smooth_value_output: bool = option(
        True,
        "also smooth v_proj -> o_proj (beyond the paper)",
        flag="--no-smooth-extension",
        off="smooth only the linears a norm feeds, as the paper does",
    )
    smooth_mlp_output: bool = option(
        True,
        "also smooth up_proj -> down_proj, fc1 -> fc2 (beyond the paper)",
        flag="--no-smooth-extension",
        off="smooth only the linears a norm feeds, as the paper does",
    )
    alpha_grid: tuple[float, ...] = option(ALPHA_GRID, "the alphas 'auto' tries", cli=False)
    search_windows: int = option(8, "held-out calibration windows 'auto' scores per alpha", cli=False)
    calibration_samples: int = option(512, "calibration windows (SmoothQuant: 512 sentences)", flag="--calib-samples")

    def __post_init__(self):
        if self.alpha != AUTO and not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"alpha (migration strength) must lie in [0, 1] or be 'auto', got {self.alpha!r}")
        if self.calibration_samples < 1 or self.search_windows < 1:
            raise ConfigError("calibration_samples and search_windows must be at least 1")


def smoothing_factors(activation_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j from max|X_j| and max|W_j| (the max over every consumer's input column j)."""
    return (activation_absmax.clamp(min=_MIN).pow(alpha) / weight_absmax.clamp(min=_MIN).pow(1 - alpha)).clamp(min=_MIN)


def _input_column_absmax(modules: list[nn.Module], table: ArchitectureTable) -> torch.Tensor:
    return torch.stack([linear_weight_out_in(m, table).detach().abs().amax(dim=0).float() for m in modules]).amax(dim=0)


def _scale_input_columns(module: nn.Module, table: ArchitectureTable, s: torch.Tensor) -> None:
    weight = module.weight.data
    weight.mul_((s[:, None] if table.weight_layout == "in_out" else s[None, :]).to(weight.dtype))


def _divide_output_channels(module: nn.Module, table: ArchitectureTable, s: torch.Tensor) -> None:
    weight = module.weight.data
    weight.div_((s[None, :] if table.weight_layout == "in_out" else s[:, None]).to(weight.dtype))
    if getattr(module, "bias", None) is not None:
        module.bias.data.div_(s.to(module.bias.dtype))


def _divide_norm(norm: nn.Module, table: ArchitectureTable, s: torch.Tensor) -> None:
    offset = table.norm_weight_offset  # Gemma: y = x_hat * (1 + w), so (1 + w) / s = 1 + w'
    norm.weight.data.copy_((norm.weight.data.float() + offset) / s - offset)
    if getattr(norm, "bias", None) is not None:
        norm.bias.data.div_(s.to(norm.bias.dtype))


def consumer_to_producer_channels(config, produced: int, consumed: int) -> torch.Tensor:
    """For each input channel of the consumer, the producer output channel it comes from: the identity, or,
    for v_proj -> o_proj under grouped-query attention, the key/value head that serves each query head."""
    if produced == consumed:
        return torch.arange(consumed)
    head_dim = attention_shape(config).head_dim
    groups = consumed // produced
    channel = torch.arange(consumed)
    return (channel // head_dim // groups) * head_dim + channel % head_dim


@dataclass
class SmoothingResult:
    # Per-input-channel max|x| of every linear as it is after smoothing: max|X_j| / s_j, exact, so static
    # activation ranges need no second calibration pass.
    input_absmax: dict[str, torch.Tensor]
    # For each smoothed producer linear (v_proj, up_proj), the factors its output channels were divided by.
    producer_scales: dict[str, torch.Tensor] = field(default_factory=dict)


def smooth_block_(
    block: nn.Module,
    index: int,
    model_config,
    input_absmax: dict[str, torch.Tensor],
    config: SmoothQuantConfig,
    result: SmoothingResult,
) -> None:
    """Smooth decoder block `index` in place from its linears' input maxima observed on the unsmoothed model
    (`input_absmax`, keyed by full linear names); `result` receives the smoothed maxima and producer factors."""
    table = architecture_for(model_config)
    prefix = f"{table.blocks}.{index}."
    for feed in table.norm_feeds:
        consumers = [block.get_submodule(path) for path in feed.linears]
        s = smoothing_factors(
            input_absmax[prefix + feed.linears[0]], _input_column_absmax(consumers, table), config.alpha
        )
        _divide_norm(block.get_submodule(feed.norm), table, s)
        for path, module in zip(feed.linears, consumers):
            _scale_input_columns(module, table, s)
            result.input_absmax[prefix + path] = input_absmax[prefix + path] / s
    for feed in table.linear_feeds:
        is_value = feed.producer in table.attention_inputs
        if not (config.smooth_value_output if is_value else config.smooth_mlp_output):
            continue
        producer, consumer = block.get_submodule(feed.producer), block.get_submodule(feed.consumer)
        produced = linear_weight_out_in(producer, table).shape[0]
        x_absmax = input_absmax[prefix + feed.consumer]
        mapping = consumer_to_producer_channels(model_config, produced, x_absmax.numel())
        # One factor per producer channel: the max over every consumer channel it feeds.
        per_producer = lambda values: torch.zeros(produced).scatter_reduce(0, mapping, values, "amax")  # noqa: E731
        s = smoothing_factors(
            per_producer(x_absmax), per_producer(_input_column_absmax([consumer], table)), config.alpha
        )
        _divide_output_channels(producer, table, s)
        _scale_input_columns(consumer, table, s[mapping])
        result.input_absmax[prefix + feed.consumer] = x_absmax / s[mapping]
        result.producer_scales[prefix + feed.producer] = s


def smooth_(model: nn.Module, input_absmax: dict[str, torch.Tensor], config: SmoothQuantConfig) -> SmoothingResult:
    """Smooth `model` in place from calibration statistics collected on the unsmoothed model."""
    result = SmoothingResult(dict(input_absmax))
    for index, block in enumerate(decoder_blocks(model)):
        smooth_block_(block, index, model.config, input_absmax, config, result)
    # A CushionCache prefix attached to the model holds values v_proj produced before this smoothing.
    follow_value_smoothing_(model, result.producer_scales)
    return result


def _smooth_attention_ranges(
    stats: CalibrationStats, result: SmoothingResult, table: ArchitectureTable, attention_name: str
) -> None:
    """One attention's observed ranges as they are after smoothing: the value ranges divided where v_proj's
    outputs were (queries and keys do not change)."""
    value = next((feed.producer for feed in table.linear_feeds if feed.consumer == table.attention_output), None)
    value_proj = f"{attention_name.rsplit('.', 1)[0]}.{value}"
    ranges = stats.attention.get(attention_name)
    if ranges is not None and value is not None and value_proj in result.producer_scales:
        stats.attention[attention_name] = {
            **ranges,
            "v_channel_absmax": ranges["v_channel_absmax"] / result.producer_scales[value_proj],
        }


def smoothing_problem(model: nn.Module) -> str | None:
    """Why SmoothQuant cannot smooth the blocks of `model`'s family (its table lacks a fact it needs), or None."""
    table = architecture_for(model)
    fed = {path for feed in table.norm_feeds for path in feed.linears}
    unfed = [path for path in (*table.attention_inputs, *table.mlp_inputs) if path not in fed]
    if unfed:
        return (
            f"SmoothQuant divides the norm that feeds each linear, and in {table.family} no norm's output is the "
            f"input of {', '.join(unfed)} (its norms come after the sub-blocks)"
        )
    if table.norm_kind is None:
        return f"SmoothQuant folds its scales into {table.family}'s norms, which are neither RMSNorm nor LayerNorm"
    return None


@register_method(
    SmoothQuantConfig,
    "smoothquant",
    "transform",
    blockwise=True,
    architecture_problem=smoothing_problem,
    needs_whole_model=lambda config: (
        (
            "alpha 'auto' scores whole-model copies, which a model read block by block from disk cannot give: "
            "set alpha (the paper's default is 0.5)"
        )
        if config.alpha == AUTO
        else None
    ),
)
def _smoothquant_plan(model: nn.Module, config: SmoothQuantConfig, run: QuantRun) -> BlockPlan:
    """Each block smoothed from its statistics on the float model (observed block by block, or known), which
    are then replaced by the smoothed ones for the quantizer that follows (exact: no second calibration pass)."""
    record = {}
    if config.alpha == AUTO:
        alpha, searched = _search_alpha(model, config, int8_statistics(model, config, run), run)
        record["alpha_search"] = {str(value): ppl for value, ppl in searched.items()}
        config = replace(config, alpha=alpha)
    if run.stats is not None:
        run.stats = run.stats.copy()  # statistics given to the run stay as they were
    observe, windows = int8_observation(model, config, run)
    table = architecture_for(model)
    result = SmoothingResult(run.stats.input_absmax)  # the run's maxima become the smoothed ones, block by block

    def quantize_block(index: int, block: nn.Module) -> None:
        smooth_block_(block, index, model.config, dict(run.stats.input_absmax), config, result)
        _smooth_attention_ranges(run.stats, result, table, f"{table.blocks}.{index}.{table.attention_module}")

    def finish(model: nn.Module, counts: dict) -> dict:
        # A CushionCache prefix attached to the model holds values v_proj produced before this smoothing.
        follow_value_smoothing_(model, result.producer_scales)
        record["smoothquant"] = {
            "alpha": config.alpha,
            "smooth_value_output": config.smooth_value_output,
            "smooth_mlp_output": config.smooth_mlp_output,
        }
        return record

    return BlockPlan(quantize_block, finish, observe, windows)


def _search_alpha(
    model: nn.Module, config: SmoothQuantConfig, stats: CalibrationStats, run: QuantRun
) -> tuple[float, dict[float, float]]:
    """SmoothQuant's grid search: a copy of the model smoothed with each alpha and quantized by the steps that
    follow, scored on held-out calibration windows (never evaluation data). Returns (best, {alpha: ppl})."""
    held_out = run.data(config).held_out(config.search_windows)
    calibration = replace(run.calibration, int8_stats=stats)
    perplexities = {}
    for alpha in tqdm(config.alpha_grid, desc="alpha search", unit="alpha"):
        candidate = copy.deepcopy(model)
        quantize_(candidate, [replace(config, alpha=alpha), *run.later], calibration=calibration)
        nll = sum(next_token_nll(candidate, window[None]) for window in held_out)
        perplexities[alpha] = math.exp(nll / (held_out.numel() - held_out.shape[0]))
    return min(perplexities, key=perplexities.get), perplexities
