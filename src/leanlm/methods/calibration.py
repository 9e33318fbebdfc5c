"""Calibration: run sample text through the model block by block and record, for every quantizable linear, the
running per-input-channel max|x| (SmoothQuant's act_scales; its max is the per-tensor static range)."""

from __future__ import annotations

import torch
from torch import nn

from leanlm.methods.blocks import observe_inputs, walk_blocks
from leanlm.models.architectures import ArchitectureTable, architecture_for


def record_channel_absmax(known: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> None:
    """known[name] becomes the running max |x| per input channel (last dimension of `x`)."""
    channel_max = torch.linalg.vector_norm(x.detach().reshape(-1, x.shape[-1]), float("inf"), dim=0).float()
    known[name] = torch.maximum(known[name], channel_max) if name in known else channel_max


def collect_input_absmax(
    model: nn.Module, batches: torch.Tensor, table: ArchitectureTable | None = None, desc: str = "calibrating"
) -> dict[str, torch.Tensor]:
    """{linear name: (in_features,) max |x| per input channel over all calibration tokens}, observed on the
    float model through the block pipeline (one window per forward: no padding to pollute the ranges)."""
    table = table or architecture_for(model)
    stats: dict[str, torch.Tensor] = {}

    def observe(index: int, block: nn.Module):
        prefix = f"{table.blocks}.{index}."
        return observe_inputs(
            ((prefix + path, block.get_submodule(path)) for path in table.quantizable_linears),
            lambda name, x: record_channel_absmax(stats, name, x),
        )

    walk_blocks(model, batches, observe=observe, desc=desc)
    return stats
