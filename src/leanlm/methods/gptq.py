"""RTN, GPTQ and SpQR on a whole model (thesis ch. 4): `quantize_(model, GPTQConfig(...), calibration=...)`.

Sequential, one decoder block at a time, so memory stays bounded: the calibration samples' inputs to block i
are the outputs of blocks 0..i-1 *already quantized*; hooks accumulate each linear's input Hessian while block i
runs in float, its linears are solved (`leanlm.formats.gptq.solve`) and replaced by SpQRLinear, and the
quantized block is run again to produce block i+1's inputs. Within a block every linear sees float inputs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.errors import ConfigError
from leanlm.formats.gptq import SolverSettings, solve
from leanlm.methods.quantize import QuantRun, method_spec, option, register_method
from leanlm.models.architectures import architecture_for, decoder_blocks, linear_weight_out_in
from leanlm.nn.spqr_linear import SpQRLinear

@dataclass(frozen=True)
class RTNConfig:
    """Round to nearest: min-max groups, no calibration (the baseline of GPTQ and SpQR)."""

    bits: int = option(4, "bits per weight code (2-8)")
    group_size: int | None = option(128, "input columns per scale and zero, or the whole row", none_word="0")

    def __post_init__(self):
        self.solver()  # checks every setting now, before any model is loaded

    def solver(self) -> SolverSettings:
        return SolverSettings(bits=self.bits, group_size=self.group_size, act_order=False, error_feedback=False)


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ (Frantar et al. 2022; thesis ch. 4): min-max groups with Hessian error feedback, one block at a time."""

    bits: int = option(4, "bits per weight code (2-8)")
    group_size: int | None = option(128, "input columns per scale and zero, or the whole row", none_word="0")
    act_order: bool = option(True, "quantize columns by decreasing Hessian diagonal (else in their natural order)")
    damping: float = option(0.01, "lambda: Hessian damping as a fraction of its mean diagonal")
    calibration_samples: int = option(128, "calibration windows (GPTQ: 128 random segments)",
                                      flag="--calib-samples")

    def __post_init__(self):
        self.solver()  # checks every setting now, before any model is loaded
        if self.calibration_samples < 1:
            raise ConfigError(f"calibration_samples must be at least 1, got {self.calibration_samples}")

    def solver(self) -> SolverSettings:
        return SolverSettings(bits=self.bits, group_size=self.group_size, act_order=self.act_order,
                              damping=self.damping)


@dataclass(frozen=True)
class SpQRConfig:
    """SpQR (Dettmers et al. 2023; thesis ch. 4): GPTQ with small groups whose statistics are themselves quantized,
    and unstructured outliers kept in 16 bits. Defaults: the chapter's ~4-bit recipe shape (3-bit base and
    statistics, beta1 = beta2 = 16, tau = 0.2, damping 1.0 as the reference near-lossless recipe)."""

    bits: int = option(3, "bits per weight code (2-8)")
    beta1: int = option(16, "input columns per first-level group")
    beta2: int = option(16, "rows per second-level group of the quantized statistics")
    outlier_threshold: float | None = option(0.2, "tau, relative to the layer's mean sensitivity (none: no outliers)",
                                             none_word="none")
    statistic_bits: int = option(3, "bits of the group scales and zeros")
    damping: float = option(1.0, "lambda: Hessian damping as a fraction of its mean diagonal")
    act_order: bool = option(True, "quantize columns by decreasing Hessian diagonal (else in their natural order)")
    calibration_samples: int = option(128, "calibration windows", flag="--calib-samples")

    def __post_init__(self):
        self.solver()  # checks every setting now, before any model is loaded
        if self.calibration_samples < 1:
            raise ConfigError(f"calibration_samples must be at least 1, got {self.calibration_samples}")

    def solver(self) -> SolverSettings:
        return SolverSettings(bits=self.bits, group_size=self.beta1, statistic_bits=self.statistic_bits,
                              statistic_group_size=self.beta2, outlier_threshold=self.outlier_threshold,
                              act_order=self.act_order, damping=self.damping)


SolverConfig = RTNConfig | GPTQConfig | SpQRConfig


class _StopForward(Exception):
    pass


class _InputRecorder(nn.Module):
    """Stands in for a decoder block during the capture pass: records the block's keyword arguments (masks and
    position embeddings, which depend only on positions) and passes the hidden state through untouched."""

    def __init__(self, calls: list, stop: bool):
        super().__init__()
        self.calls, self.stop = calls, stop

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((hidden_states, args, kwargs))
        if self.stop:
            raise _StopForward
        return hidden_states


def _capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, batches: torch.Tensor):
    """(hidden states entering block 0 per sample, [per block: [per sample: (args, kwargs)]])."""
    originals = list(blocks)
    calls: list[list] = [[] for _ in originals]
    for index in range(len(originals)):
        blocks[index] = _InputRecorder(calls[index], stop=index == len(originals) - 1)
    try:
        with torch.inference_mode():
            for sample in batches:
                try:
                    model(input_ids=sample[None], use_cache=False)
                except _StopForward:
                    pass
    finally:
        for index, block in enumerate(originals):
            blocks[index] = block
    first = [hidden.clone() for hidden, _, _ in calls[0]]
    return first, [[(args, kwargs) for _, args, kwargs in block_calls] for block_calls in calls]


@register_method(RTNConfig, "rtn", "quantizer", needs_calibration=lambda config: False)
@register_method(GPTQConfig, "gptq", "quantizer")
@register_method(SpQRConfig, "spqr", "quantizer")
def _quantize_with_solver(model: nn.Module, config: SolverConfig, run: QuantRun) -> dict:
    """Replace the block linears by SpQRLinear, block by block; the record has the measured average bits per
    weight ("avg_bits"), the outlier rate and the wall time."""
    settings = config.solver()
    samples = getattr(config, "calibration_samples", None)
    batches = run.data(config).batches(samples) if settings.error_feedback else None
    seq_len = run.calibration.seq_len if run.calibration is not None else None
    table = architecture_for(model)
    blocks = decoder_blocks(model, table)
    started = time.perf_counter()
    if batches is not None:
        hidden, block_arguments = _capture_block_inputs(model, blocks, batches)
    weights = stored_bits = outliers = 0
    for index, block in enumerate(tqdm(blocks, desc=method_spec(config).name, unit="block")):
        linears = {path: block.get_submodule(path) for path in table.quantizable_linears}
        hessians: dict[str, torch.Tensor] = {}
        if batches is not None:
            hessians = _block_hessians(block, linears, table, hidden, block_arguments[index])
        for path, linear in linears.items():
            weight = linear_weight_out_in(linear, table)
            solved = solve(weight, hessians.get(path), settings)
            quantized = SpQRLinear.from_solved(solved, settings, getattr(linear, "bias", None))
            block.set_submodule(path, quantized)
            count = weight.numel()
            weights += count
            stored_bits += quantized.bits_per_weight() * count
            outliers += quantized.outlier_count
        if batches is not None and index + 1 < len(blocks):
            with torch.inference_mode():
                hidden = [_block_output(block(h, *args, **kwargs)) for h, (args, kwargs)
                          in zip(hidden, block_arguments[index])]
    return {**asdict(settings), "calibration_samples": len(batches) if batches is not None else samples,
            "calibration_seq_len": seq_len, "avg_bits": stored_bits / weights, "outlier_rate": outliers / weights,
            "seconds": time.perf_counter() - started}


def _block_output(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _block_hessians(block: nn.Module, linears: dict[str, nn.Module], table, hidden: list[torch.Tensor],
                    arguments: list) -> dict[str, torch.Tensor]:
    """H = 2/N sum_x x x^T over every calibration token entering each linear (float block)."""
    sums: dict[str, torch.Tensor] = {}
    tokens: dict[str, int] = {}

    def observer(path: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[path] = sums[path].addmm_(x.T, x) if path in sums else x.T @ x
            tokens[path] = tokens.get(path, 0) + x.shape[0]

        return hook

    handles = [linear.register_forward_pre_hook(observer(path)) for path, linear in linears.items()]
    try:
        with torch.inference_mode():
            for h, (args, kwargs) in zip(hidden, arguments):
                block(h, *args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {path: 2.0 * sums[path] / tokens[path] for path in sums}
