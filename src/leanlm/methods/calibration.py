"""Calibration: run sample text through the model and record, for every quantizable linear, the running
per-input-channel max|x| (SmoothQuant's act_scales; its max is the per-tensor static range)."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.models.architectures import ArchitectureTable, iter_quantizable_linears


def collect_input_absmax(
    model: nn.Module, batches: torch.Tensor, table: ArchitectureTable | None = None, desc: str = "calibrating"
) -> dict[str, torch.Tensor]:
    """{linear name: (in_features,) max |x| per input channel over all calibration tokens}.

    One sample per forward pass (no padding to pollute the ranges)."""
    stats: dict[str, torch.Tensor] = {}
    handles = []

    def observer(name: str):
        def hook(module, args):
            x = args[0].detach()
            channel_max = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), float("inf"), dim=0).float()
            stats[name] = torch.maximum(stats[name], channel_max) if name in stats else channel_max

        return hook

    for name, module in iter_quantizable_linears(model, table):
        handles.append(module.register_forward_pre_hook(observer(name)))
    try:
        with torch.inference_mode():
            for sample in tqdm(batches, desc=desc, unit="sample"):
                # Only the linears' inputs matter: skip the vocabulary projection of all but one position.
                model(input_ids=sample[None], use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return stats
