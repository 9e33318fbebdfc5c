"""RTN, GPTQ and SpQR on a whole model (thesis ch. 4): one verb, `quantize_gptq_(model, GPTQConfig(...), batches)`.

Sequential, one decoder block at a time, so memory stays bounded: the calibration samples' inputs to block i
are the outputs of blocks 0..i-1 *already quantized*; hooks accumulate each linear's input Hessian while block i
runs in float, its linears are solved (`leanlm.formats.gptq.solve`) and replaced by SpQRLinear, and the
quantized block is run again to produce block i+1's inputs. Within a block every linear sees float inputs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.errors import ConfigError
from leanlm.formats.gptq import SolverSettings, solve
from leanlm.models.architectures import architecture_for, decoder_blocks, linear_weight_out_in
from leanlm.nn.spqr_linear import SpQRLinear

METHODS = ("rtn", "gptq", "spqr")


@dataclass(frozen=True)
class GPTQConfig:
    method: str = "gptq"  # rtn | gptq | spqr
    solver: SolverSettings = field(default_factory=SolverSettings)
    calibration_samples: int = 128
    calibration_seq_len: int = 512

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose from {', '.join(METHODS)}")
        if (self.method == "rtn") == self.solver.error_feedback:
            raise ConfigError("rtn means no error feedback and gptq/spqr need it: use rtn_config / gptq_config / "
                              "spqr_config")

    def record(self) -> dict:
        return {"method": self.method, **asdict(self.solver), "calibration_samples": self.calibration_samples,
                "calibration_seq_len": self.calibration_seq_len}


def rtn_config(bits: int = 4, group_size: int | None = 128) -> GPTQConfig:
    return GPTQConfig("rtn", SolverSettings(bits=bits, group_size=group_size, act_order=False, error_feedback=False))


def gptq_config(bits: int = 4, group_size: int | None = 128, act_order: bool = True, damping: float = 0.01,
                **calibration) -> GPTQConfig:
    return GPTQConfig("gptq", SolverSettings(bits=bits, group_size=group_size, act_order=act_order, damping=damping),
                      **calibration)


def spqr_config(bits: int = 3, beta1: int = 16, beta2: int = 16, outlier_threshold: float | None = 0.2,
                statistic_bits: int = 3, damping: float = 1.0, act_order: bool = True, **calibration) -> GPTQConfig:
    """Defaults: the chapter's ~4-bit recipe shape (3-bit base and statistics, beta1 = beta2 = 16, tau = 0.2,
    damping 1.0 as the reference near-lossless recipe)."""
    return GPTQConfig("spqr", SolverSettings(bits=bits, group_size=beta1, statistic_bits=statistic_bits,
                                             statistic_group_size=beta2, outlier_threshold=outlier_threshold,
                                             act_order=act_order, damping=damping), **calibration)


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


def quantize_gptq_(model: nn.Module, config: GPTQConfig, batches: torch.Tensor | None) -> dict:
    """Quantize the block linears of `model` in place; returns the record with the measured average bits per
    weight ("avg_bits"), the outlier rate and the wall time. `batches`: (samples, seq_len) calibration ids
    (unused by RTN)."""
    table = architecture_for(model)
    blocks = decoder_blocks(model, table)
    started = time.perf_counter()
    needs_data = config.solver.error_feedback
    if needs_data and (batches is None or len(batches) == 0):
        raise ConfigError(f"{config.method} needs calibration samples")
    if needs_data:
        hidden, block_arguments = _capture_block_inputs(model, blocks, batches)
    weights = stored_bits = outliers = 0
    for index, block in enumerate(tqdm(blocks, desc=config.method, unit="block")):
        linears = {path: block.get_submodule(path) for path in table.quantizable_linears}
        hessians: dict[str, torch.Tensor] = {}
        if needs_data:
            hessians = _block_hessians(block, linears, table, hidden, block_arguments[index])
        for path, linear in linears.items():
            weight = linear_weight_out_in(linear, table)
            solved = solve(weight, hessians.get(path), config.solver)
            quantized = SpQRLinear.from_solved(solved, config.solver, getattr(linear, "bias", None))
            block.set_submodule(path, quantized)
            count = weight.numel()
            weights += count
            stored_bits += quantized.bits_per_weight() * count
            outliers += quantized.outlier_count
        if needs_data and index + 1 < len(blocks):
            with torch.inference_mode():
                hidden = [_block_output(block(h, *args, **kwargs)) for h, (args, kwargs)
                          in zip(hidden, block_arguments[index])]
    return {**config.record(), "avg_bits": stored_bits / weights, "outlier_rate": outliers / weights,
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
