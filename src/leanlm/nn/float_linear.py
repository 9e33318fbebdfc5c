"""Float linears that decode fast: `GemvLinear` is an nn.Linear (same parameters, same state dict, same class
checks) whose forward at most 8 rows of input (a batch-1 or small-batch decode step) runs leanlm's
multi-threaded GEMV kernel (`leanlm.kernels.float_gemv`) instead of the single-threaded sgemv MKL picks there;
anything larger, or anything needing gradients, is nn.Linear's own forward.

`use_gemv_(model)` turns every plain float nn.Linear of a model into one (in place, by class: no copy), which is
what leanlm's loaders do, so the float model, the lm_head of every quantized checkpoint and the layers a
method leaves in float all decode through it.
"""

from __future__ import annotations

import torch
from torch import nn

from leanlm.kernels.float_gemv import small_m_linear
from leanlm.kernels.kbit_gemm import per_group
from leanlm.nn.rows import groups_of


class GemvLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = groups_of(x.numel() // x.shape[-1]) if x.numel() else None
        if groups is None:
            return self._forward_alone(x)
        # packed sequences (nn/rows.py): each group's rows as a call of its own, (1, rows, in) as a sequence is read
        rows = x.reshape(-1, self.in_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        per_group(groups, rows, out, lambda part, into: into.copy_(self._forward_alone(part[None])[0]))
        return out.reshape(*x.shape[:-1], self.out_features)

    def _forward_alone(self, x: torch.Tensor) -> torch.Tensor:
        out = small_m_linear(x, self.weight, self.bias)
        if out is not None:
            return out
        if x.dtype != self.weight.dtype:  # a head in another dtype than its inputs (`embeddings_to_`)
            return self._mixed_dtype_forward(x)
        return super().forward(x)

    def _mixed_dtype_forward(self, x: torch.Tensor, rows_at_once: int = 256) -> torch.Tensor:
        """The product in the weight's dtype, written into x's dtype a few rows at a time: a whole sequence's
        logits in bfloat16 beside their float32 copy would add half the logits' size to the peak memory (200 MB
        for SmolLM2's 49152-token vocabulary over 2048 positions)."""
        rows = x.reshape(-1, self.in_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.to(self.weight.dtype)
        for first in range(0, rows.shape[0], rows_at_once):
            chunk = rows[first : first + rows_at_once].to(self.weight.dtype)
            out[first : first + rows_at_once] = nn.functional.linear(chunk, self.weight, bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def use_gemv_(model: nn.Module, use: bool = True) -> int:
    """Every plain nn.Linear of `model` becomes a GemvLinear (subclasses, such as quantized or adapter layers,
    are left alone); `use=False` turns them back (for libraries that match modules by class name, such as
    compressed-tensors' "Linear" targets). Returns how many changed."""
    before, after = (nn.Linear, GemvLinear) if use else (GemvLinear, nn.Linear)
    count = 0
    for module in model.modules():
        if type(module) is before:
            module.__class__ = after
            count += 1
    return count
