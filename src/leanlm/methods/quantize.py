"""The one verb: `quantize_(model, config, *, calibration=None)` applies any leanlm method, or several in order.

    quantize_(model, KbitConfig(dtype="nf", bits=4, double_quant=True))
    quantize_(model, [SmoothQuantConfig(alpha=0.5), W8A8Config(level="O3")], calibration=Calibration(tokenizer))

A method is one config dataclass (its paper's defaults, and its help text on each field) registered with
`register_method`: a name, a role and the function that applies it. A list composes: transforms first (a
CushionCache prefix, SmoothQuant's smoothing), then exactly one quantizer; `check_composition` says why any other
list makes no sense. Calibration text is read once (`Calibration`) and shared by every step; the int8 input
statistics are observed once and kept current by the transforms that change them (`QuantRun.stats`).

Most methods are written as a `BlockPlan` (`register_method(..., blockwise=True)`): what they observe while each
float decoder block runs on the calibration windows and how they then change that block. All the plans of a call
run in one pass of the block pipeline (`walk_blocks`), over the blocks of a model in memory or over blocks read
one at a time from disk (`leanlm.methods.out_of_core`): the same code either way. A method that needs the whole
model at once (a CushionCache prefix search) registers a function that changes the model.

Quantized modules rebuild what they derive from their stored tensors; what a method adds on top of the modules
(SmoothQuant's shared GEMMs, a CushionCache prefix) is put back after a checkpoint loads by the hooks methods
register with `register_after_load`, so the checkpoint loader knows no method.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from leanlm.data.calibration import calibration_batches
from leanlm.errors import ConfigError, NeedsWholeModelError, UnsupportedArchitectureError
from leanlm.methods.blocks import ResidentBlocks, walk_blocks
from leanlm.settings import check_seed, option

Role = Literal["transform", "quantizer"]


@dataclass
class Calibration:
    """Calibration text for the methods that need it: windows of a text that is never an evaluation set, read
    once per size and shared by every step of a `quantize_` call."""

    tokenizer: Any = option(None, "reads the calibration text", cli=False)
    # The command line sets this through each method's `calibration_samples`, which holds the method's default.
    samples: int | None = option(None, "windows; None: each method's own default", cli=False)
    seq_len: int = option(512, "tokens per calibration window", flag="--calib-seq-len")
    seed: int = option(0, "which windows of the calibration text are drawn")
    source: str = option("lambada-dev", "calibration text (never an evaluation set)", cli=False)
    token_ids: torch.Tensor | None = option(
        None, "(samples, seq_len) windows given directly instead of read from text", cli=False
    )
    int8_stats: Any = option(
        None, "int8 statistics already observed on this very model (`calibrate`), to reuse", cli=False
    )
    _read: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        check_seed(self.seed)

    def batches(self, samples: int | None = None) -> torch.Tensor:
        """(samples, seq_len) token ids; `samples` is a method's own default, overridden by `self.samples`."""
        if self.token_ids is not None:
            return self.token_ids
        count = self.samples or samples
        if count is None:
            raise ConfigError("calibration samples: give Calibration(samples=N) or a method that has a default")
        if ("windows", count) not in self._read:
            self._read["windows", count] = calibration_batches(
                self._text_tokenizer(), count, self.seq_len, self.seed, self.source
            )
        return self._read["windows", count]

    def held_out(self, windows: int) -> torch.Tensor:
        """Windows from the same text under another seed, for choices made on calibration data (SmoothQuant's
        alpha search): never the windows the statistics came from, never evaluation data."""
        return calibration_batches(self._text_tokenizer(), windows, self.seq_len, self.seed + 1, self.source)

    def _text_tokenizer(self):
        if self.tokenizer is None:
            raise ConfigError(
                "this calibration has no tokenizer to read calibration text with: give Calibration(tokenizer)"
            )
        return self.tokenizer

    def record(self, samples: int | None) -> dict:
        return {"n_samples": self.samples or samples, "seq_len": self.seq_len, "seed": self.seed, "source": self.source}


class QuantRecord(dict):
    """What a `quantize_` call did, as a checkpoint's `leanlm_quant.json` records it: "method" (the steps' names
    joined by "+"), each step's settings, "avg_bits" for weight-only methods, "seconds"."""

    @property
    def method(self) -> str:
        return self["method"]

    @property
    def avg_bits(self) -> float | None:
        return self.get("avg_bits")


@dataclass
class QuantRun:
    """What the steps of one `quantize_` call share."""

    calibration: Calibration | None
    later: tuple = ()  # the configs after the step being applied
    stats: Any = None  # int8 input statistics (w8a8.CalibrationStats), observed once, updated by transforms
    streamed: bool = False  # blocks come from disk one at a time: nothing may read the whole float model
    observing: Any = None  # the one observer filling `stats` block by block, once a plan has asked for it

    def __post_init__(self):
        if self.calibration is not None and self.stats is None:
            self.stats = self.calibration.int8_stats

    def data(self, config) -> Calibration:
        if self.calibration is None:
            raise _needs_text(config)
        return self.calibration


@dataclass
class BlockPlan:
    """A method as the block pipeline applies it. While each float block runs on the calibration `windows`,
    `observe(index, block)` is active; then `quantize_block(index, block)` changes the block in place and returns
    counts (summed over blocks, e.g. weights and stored bits); `finish(model, counts)` gives the step's record
    once every block is done. `feed_quantized`: later blocks read this block's quantized outputs."""

    quantize_block: Callable[[int, nn.Module], dict | None]
    finish: Callable[[nn.Module, dict], dict]
    observe: Callable[[int, nn.Module], AbstractContextManager] | None = None
    windows: torch.Tensor | None = None
    feed_quantized: bool = False


def run_plans(model: nn.Module, plans: list[BlockPlan], source: ResidentBlocks | None = None) -> list[dict]:
    """Every plan in one walk over the blocks (in order within each block: a transform's before the
    quantizer's); the plans' records."""
    windows = next((plan.windows for plan in plans if plan.windows is not None), None)

    def observe(index: int, block: nn.Module):
        stack = ExitStack()
        for plan in plans:
            if plan.observe is not None:
                stack.enter_context(plan.observe(index, block))
        return stack

    def quantize_block(index: int, block: nn.Module) -> list[dict]:
        return [plan.quantize_block(index, block) or {} for plan in plans]

    per_block = walk_blocks(
        model,
        windows,
        observe=observe,
        quantize_block=quantize_block,
        feed_quantized=any(plan.feed_quantized for plan in plans),
        source=source,
        desc="quantizing",
    )
    totals: list[dict] = [{} for _ in plans]
    for counts in per_block:
        for total, block_counts in zip(totals, counts):
            for key, value in block_counts.items():
                total[key] = total.get(key, 0) + value
    return [plan.finish(model, total) for plan, total in zip(plans, totals)]


def _needs_text(config) -> ConfigError:
    return ConfigError(
        f"{type(config).__name__} needs calibration text: pass calibration=Calibration(tokenizer) to quantize_"
    )


@dataclass(frozen=True)
class MethodSpec:
    name: str  # as records and `--method` name it
    role: Role
    # blockwise: (model, config, run) -> BlockPlan; else: transforms the whole model in place, returns its record
    apply: Callable[[nn.Module, Any, QuantRun], Any]
    needs_calibration: Callable[[Any], bool]
    # Config types one of which must come after this one in a list (a transform that prepares activations for
    # int8 needs an int8 quantizer after it); empty: any quantizer.
    followed_by: tuple[type, ...] = ()
    blockwise: bool = False
    # (model) -> why the method cannot run on the model's family (a fact it needs is missing), or None
    architecture_problem: Callable[[nn.Module], str | None] = lambda model: None
    # (config) -> why these settings of a blockwise method need the whole model in memory, or None
    needs_whole_model: Callable[[Any], str | None] = lambda config: None

    def whole_model_reason(self, config) -> str | None:
        """Why `config` cannot quantize a model read block by block from disk (None: it can)."""
        if not self.blockwise:
            return f"{self.name} needs the whole model in memory and cannot run block by block from disk"
        return self.needs_whole_model(config)


_METHODS: dict[type, MethodSpec] = {}
_AFTER_LOAD: list[Callable[[nn.Module, dict, Path], None]] = []
# A name a composition takes in the papers: SmoothQuant is smoothing followed by W8A8.
_FOLDED_NAMES = {("smoothquant", "w8a8"): "smoothquant"}


def register_method(
    config_type: type,
    name: str,
    role: Role,
    needs_calibration: Callable[[Any], bool] = lambda c: True,
    followed_by: tuple[type, ...] = (),
    blockwise: bool = False,
    architecture_problem: Callable[[nn.Module], str | None] = lambda model: None,
    needs_whole_model: Callable[[Any], str | None] = lambda config: None,
):
    """Decorator: how `config_type` quantizes (or transforms) a model: `plan(model, config, run) -> BlockPlan`
    when `blockwise`, else `apply(model, config, run) -> record`. `architecture_problem(model)` says why a model's
    family lacks what the method needs; `quantize_` asks it before any work. `needs_whole_model(config)` says
    why settings of a blockwise method cannot run on a model read block by block from disk."""

    def decorator(apply):
        _METHODS[config_type] = MethodSpec(
            name, role, apply, needs_calibration, followed_by, blockwise, architecture_problem, needs_whole_model
        )
        return apply

    return decorator


def register_after_load(hook: Callable[[nn.Module, dict, Path], None]):
    """Decorator: `hook(model, record, directory)` runs on every loaded quantized checkpoint."""
    _AFTER_LOAD.append(hook)
    return hook


def after_load(model: nn.Module, record: dict, directory: Path) -> None:
    for hook in _AFTER_LOAD:
        hook(model, record, directory)


def method_spec(config) -> MethodSpec:
    spec = _METHODS.get(type(config))
    if spec is None:
        known = ", ".join(sorted(t.__name__ for t in _METHODS))
        raise ConfigError(f"{type(config).__name__} is not a leanlm method config; use one of {known}")
    return spec


def method_names() -> tuple[str, ...]:
    """Every name a record's method may be made of."""
    return tuple(spec.name for spec in _METHODS.values())


def check_composition(configs: tuple) -> list[MethodSpec]:
    """The specs of `configs`, after checking the list makes sense: transforms, then exactly one quantizer."""
    if not configs:
        raise ConfigError("quantize_ needs at least one method config")
    specs = [method_spec(config) for config in configs]
    quantizers = [spec.name for spec in specs if spec.role == "quantizer"]
    if len(quantizers) != 1:
        raise ConfigError(
            "a list of methods quantizes once: transforms (cushion, smoothquant) then one quantizer; "
            f"this one has {len(quantizers)} quantizers ({', '.join(quantizers) or 'none'})"
        )
    if specs[-1].role != "quantizer":
        raise ConfigError(
            f"{specs[-1].name} must come before the quantizer ({quantizers[0]}): it changes the float "
            "model that is then quantized"
        )
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{' + '.join(names)}: a method appears twice")
    for index, spec in enumerate(specs):
        after = configs[index + 1 :]
        if spec.followed_by and not any(isinstance(config, spec.followed_by) for config in after):
            needed = " or ".join(t.__name__ for t in spec.followed_by)
            raise ConfigError(
                f"{spec.name} prepares activations for int8 quantization: follow it with {needed}, "
                f"not {' + '.join(names[index + 1 :])}"
            )
    return specs


def composed_name(names: list[str]) -> str:
    for (first, second), folded in _FOLDED_NAMES.items():
        if first in names and second in names and names.index(second) == names.index(first) + 1:
            names = [*names[: names.index(first)], folded, *names[names.index(second) + 1 :]]
    return "+".join(names)


def quantize_(
    model: nn.Module, config, *, calibration: Calibration | None = None, source: ResidentBlocks | None = None
) -> QuantRecord:
    """Apply `config` (a method config, or a list of them: transforms then one quantizer) to `model` in place.
    `source`: where the block pipeline reads and writes blocks (default: `model`'s own, in memory)."""
    configs = tuple(config) if isinstance(config, (list, tuple)) else (config,)
    specs = check_composition(configs)
    needing_text = [config_ for config_, spec in zip(configs, specs) if spec.needs_calibration(config_)]
    for spec in specs:
        problem = spec.architecture_problem(model)
        if problem:
            raise UnsupportedArchitectureError(problem)
    if calibration is None and needing_text:
        raise _needs_text(needing_text[0])
    for config_, spec in zip(configs, specs) if source is not None else ():
        reason = spec.whole_model_reason(config_)
        if reason:
            raise NeedsWholeModelError(reason)
    started = time.perf_counter()
    run = QuantRun(calibration, streamed=source is not None)
    record = QuantRecord()
    steps: list[dict] = []
    plans: list[BlockPlan] = []  # consecutive blockwise steps, run together in one walk
    for index, (config_, spec) in enumerate(zip(configs, specs)):
        run.later = configs[index + 1 :]
        if spec.blockwise:
            plans.append(spec.apply(model, config_, run))
            continue
        steps += run_plans(model, plans, source) if plans else []
        plans = []
        steps.append(spec.apply(model, config_, run))
    steps += run_plans(model, plans, source) if plans else []
    names = []
    for spec, step in zip(specs, steps):
        names.append(step.pop("method", spec.name))
        record.update(step)
    record["method"] = composed_name(names)
    record["seconds"] = time.perf_counter() - started
    return record
