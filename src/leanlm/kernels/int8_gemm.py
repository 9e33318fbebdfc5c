"""int8 x int8 -> int32 matrix products, returned as float32: the one GEMM that W8A8 methods need.

`reference` is plain PyTorch in float64 (exact for every int8 product sum up to 2^53) and is the test oracle.
`fbgemm` is PyTorch's quantized CPU backend (fbgemm, AVX2/AVX-512): on this machine it is many times faster
than fp32 matmul, whereas `torch._int_mm` falls back to a scalar loop. Both return the same numbers: the
integer accumulator rounded once to float32.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

Backend = Literal["reference", "fbgemm"]


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


def default_backend() -> Backend:
    return "fbgemm" if fbgemm_available() else "reference"


def pack_weight(weight_int8: torch.Tensor):
    """fbgemm's pre-packed form of an (out, in) int8 weight (scale 1, zero point 0: scales are applied by the
    caller). Derived data: never saved, rebuilt from the int8 weight after loading."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized-tensor creation is deprecated, not removed, in 2.13
        quantized = torch._make_per_tensor_quantized_tensor(weight_int8.contiguous(), 1.0, 0)
    return torch.ops.quantized.linear_prepack(quantized, None)


def int8_matmul(x_int: torch.Tensor, weight_int8: torch.Tensor, backend: Backend, packed=None) -> torch.Tensor:
    """x_int (M, K) holding integers in -127..127 (any float dtype) times weight_int8 (N, K) transposed:
    the exact int32 accumulator as float32 (M, N)."""
    if backend == "reference":
        return (x_int.double() @ weight_int8.double().T).float()
    if backend == "fbgemm":
        if packed is None:
            packed = pack_weight(weight_int8)
        # The op quantizes its fp32 input as uint8 with the given scale and zero point: with scale 1 and zero
        # point 128 the integers pass through unchanged (x + 128 in 1..255) and fbgemm removes the offset.
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x_int.float().contiguous(), 1.0, 128, packed)
    raise ValueError(f"unknown int8 backend {backend!r}; choose reference or fbgemm")
