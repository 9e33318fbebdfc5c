"""Float linears at batch-1 decode: y = x @ W^T for at most 8 rows of x, W float32 or bfloat16.

At M = 1 a linear streams its weight once and does nothing else, so its speed is the memory bandwidth it gets.
MKL's sgemv, which `torch.nn.functional.linear` calls there, can run on one thread and read at a fraction of
what all cores read (benchmarks/decode.py measures both paths). leanlm's kernel (`csrc/float_gemv.inc`, built into the same extension as
the 4-bit kernels) splits the output rows over threads, and each thread reads its rows one after another, in
address order (one stream the hardware prefetcher follows; bfloat16 weights widened two at a time by a shift and
a mask); AVX-512 where the CPU has it, else AVX2 (`isa`). `reference` is `torch.nn.functional.linear` in
float32: the oracle.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from leanlm.errors import ConfigError
from leanlm.kernels.kbit_gemm import compiled_kernels

GemvIsa = Literal["auto", "avx512", "avx2"]
MAX_ROWS = 8  # beyond this many rows of x, GEMM libraries reuse the weight well enough


def gemv_isas() -> list[str]:
    """The GEMV variants this machine runs."""
    kernels = compiled_kernels()
    if kernels is None:
        return []
    return (["avx512"] if kernels.has_avx512() else []) + ["avx2"]


def reference_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), weight.float())


def float_gemv(x: torch.Tensor, weight: torch.Tensor, isa: GemvIsa = "auto") -> torch.Tensor:
    """(M, K) float32 x (N, K) float32 / bfloat16 -> (M, N) float32, M <= 8."""
    if isa not in get_args(GemvIsa):
        raise ConfigError(f"unknown GEMV kernel {isa!r}; choose one of {', '.join(get_args(GemvIsa))}")
    kernels = compiled_kernels()
    if kernels is None:
        raise ConfigError("leanlm's CPU kernels are not available on this machine (see the warning logged)")
    return kernels.float_gemv(x.contiguous(), weight.contiguous(), kernels.ISAS[isa])


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`linear(x, weight, bias)` through the GEMV kernel when it applies (at most 8 rows, a float32 or bfloat16
    weight, no autograd, the kernels built); None where it does not, for the caller's usual path. The result
    has x's dtype."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if (
        not 1 <= rows <= MAX_ROWS
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or weight.dim() != 2
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        or weight.is_meta
        or compiled_kernels() is None
    ):
        return None
    out = compiled_kernels().float_gemv(x.reshape(rows, -1).float().contiguous(), weight.contiguous(), 0)
    if bias is not None:
        out.add_(bias.float())
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
