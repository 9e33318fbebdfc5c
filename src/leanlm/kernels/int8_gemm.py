"""The int8 linear: Y = ((X_int8 - z_X) @ (W_int8 - z_W)^T) * delta_X * delta_W + b, X_int8 = round(X / delta_X)
+ z_X, with the product computed on integers (SmoothQuant eq. 3.2). delta_X is one scale (per tensor) or one
per row (per token); delta_W one per output channel. The zero points z are 0 except for LLM.int8()'s
asymmetric ("zeropoint") baseline, which is per tensor.

`reference` is plain PyTorch with the integer product in float64 (exact for any int8 sum below 2^53): the
test oracle. `fbgemm` is PyTorch's quantized CPU backend (AVX2/AVX-512), many times faster than fp32 matmul
here, where `torch._int_mm` falls back to a scalar loop: leanlm rounds the input codes as the reference does, and
its op runs the u8 x s8 GEMM and applies the scales in one call. The two give the same codes and integer sums and
agree to float32 rounding of the final scaling. Where fbgemm's kernel adds u8 x s8 products in pairs into int16
(vpmaddubsw, on CPUs without VNNI), a pair of large codes saturates; `fbgemm_saturates` probes for it once, and
there each code is split into two halves of at most 7 bits that cannot saturate, multiplied by two GEMM calls and
added: the same integer sums, the final scaling rounded once per half.

`int8_gemv` is leanlm's own kernel for one token (`csrc/w8a8_gemv.inc`: AVX512-VNNI or AVX2), what the fused decode
step runs: fbgemm's fixed cost per call is most of a decode-sized product. Its oracle is `reference` above.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from leanlm.errors import ConfigError
from leanlm.formats.int8 import QMAX, QMIN
from leanlm.kernels.kbit_gemm import INT8_ISAS, compiled_kernels, isa_code

Backend = Literal["reference", "fbgemm"]


def fbgemm_available() -> bool:
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines or "x86" in engines


@functools.cache
def fbgemm_saturates() -> bool:
    """Whether fbgemm's int8 GEMM loses exactness on this CPU to int16 saturation: probed with the worst case
    (input code 127, weights 127, so each pair of products is 2 * 255 * 127 in its uint8 x int8 form), not read
    from the CPU's flags."""
    weight = torch.full((1, 64), 127, dtype=torch.int8)
    out = _GEMM(torch.full((1, 64), 127.0), 1.0, 128, pack_weight(weight, torch.ones(1)).params)
    return float(out[0, 0]) != 64 * 127 * 127


def default_backend() -> Backend:
    return "fbgemm" if fbgemm_available() else "reference"


@dataclass
class PackedInt8Weight:
    """fbgemm's pre-packed int8 weight: a copy in its own layout, which becomes the only copy a layer keeps (the
    plain int8 tensor is released); `unpacked` gives it back exactly. The bias is not packed in: a
    per-token scale must be applied before the bias is added, and one packed copy serves every path. Derived
    data: rebuilt from the int8 weight, never saved."""

    params: object

    def unpacked(self) -> torch.Tensor:
        """The int8 weight (N, K) as it was packed (a new tensor)."""
        quantized, _ = torch.ops.quantized.linear_unpack(self.params)
        return quantized.int_repr()

    def dequantized_columns(self, columns: torch.Tensor, in_features: int) -> torch.Tensor:
        """(len(columns), N): the de-quantized weight columns (W_int8[:, c] - z_W) * delta_W, transposed, read
        through the GEMM itself: one-hot input rows of value 1 with scale 1 make the integer products the weight's
        entries, and fbgemm scales them by delta_W alone, so the values equal the reference's bit for bit."""
        pieces = []
        one_hot = torch.zeros(ONE_HOT_ROWS, in_features)
        for first in range(0, len(columns), ONE_HOT_ROWS):
            part = columns[first : first + ONE_HOT_ROWS]
            rows = torch.arange(len(part))
            one_hot[rows, part] = 1.0
            pieces.append(_GEMM(one_hot, 1.0, 0, self.params)[: len(part)])  # codes 0 and 1 never saturate
            one_hot[rows, part] = 0.0
        return torch.cat(pieces)


# Columns de-quantized per GEMM: the one-hot input is always this size, whatever the number of outlier columns, so
# the allocations of LLM.int8()'s decomposition repeat the same sizes and the C library's heap reuses them.
ONE_HOT_ROWS = 64
_GEMM = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32


def int8_gemv(
    x: torch.Tensor,
    weight_int8: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: float | None = None,
    outlier_threshold: float | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """One token x (1, K) float32 times the int8 weight (N, K): x quantized with the calibrated `input_scale`
    (static) or its own absmax (dynamic: per token and per tensor are one scale here), LLM.int8()'s
    |x| >= outlier_threshold positions multiplied in float. (1, N) float32, `int8_linear`'s result. `isa`: auto or
    one of `int8_kernel_isas()` (the k-bit int8 kernels' instruction sets, which this kernel shares)."""
    extension = compiled_kernels()
    if extension is None:
        raise ConfigError("leanlm's CPU kernels are not available on this machine (see the warning logged)")
    if isa != "auto" and isa not in INT8_ISAS:
        raise ConfigError(f"unknown W8A8 kernel {isa!r}; choose auto or one of {', '.join(INT8_ISAS)}")
    return extension.w8a8_gemv(
        x.float().contiguous(),
        weight_int8.contiguous(),
        weight_scale.float().contiguous(),
        bias,
        float(input_scale or 0.0),
        float(outlier_threshold or 0.0),
        isa_code(extension, isa),
    )


def pack_weight(weight_int8: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: int = 0) -> PackedInt8Weight:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated, not removed, in 2.13
        if weight_zero_point:  # asymmetric weights are per tensor: one scale
            quantized = torch._make_per_tensor_quantized_tensor(
                weight_int8.contiguous(), float(weight_scale[0]), weight_zero_point
            )
        else:
            quantized = torch._make_per_channel_quantized_tensor(
                weight_int8.contiguous(), weight_scale.double(), torch.zeros_like(weight_scale, dtype=torch.long), 0
            )
    return PackedInt8Weight(torch.ops.quantized.linear_prepack(quantized, None))


def int8_linear(
    x: torch.Tensor,  # (M, K) float32
    x_scale: torch.Tensor,  # () or (M, 1)
    weight_int8: torch.Tensor | None,  # (N, K); may be None on fbgemm when `packed` is given
    weight_scale: torch.Tensor | None,  # (N,); likewise
    bias: torch.Tensor | None,
    backend: Backend,
    packed: PackedInt8Weight | None = None,
    x_zero_point: int = 0,  # per-tensor scales only
    weight_zero_point: int = 0,
    overwrite_input: bool = False,  # x is a scratch copy: per-token scaling may happen in place
    compiled_rounding: bool = True,  # False rounds by the PyTorch ops (the oracle; timed beside it by the benchmark)
) -> torch.Tensor:
    if backend == "reference":
        x_int = torch.clamp(torch.round(x / x_scale) + x_zero_point, QMIN, QMAX) - x_zero_point
        accumulator = x_int.double() @ (weight_int8.double() - weight_zero_point).T
        out = (accumulator * x_scale.double() * weight_scale.double()).float()
        return out + bias if bias is not None else out
    if backend != "fbgemm":
        raise ValueError(f"unknown int8 backend {backend!r}; choose reference or fbgemm")
    if packed is None:
        packed = pack_weight(weight_int8, weight_scale, weight_zero_point)
    # The op quantizes its input to uint8 itself, but it adds the zero point 128 to x / s in float32 before
    # rounding, where a step is 2^-16: a value within ~1e-5 of a half step can land on the other code, and with
    # per-tensor scales (a step of several units) one such code moves the output measurably. So the codes are
    # rounded here as the reference rounds them (round(x / s) half to even, the rounding of vLLM's int8 kernel
    # and of compressed-tensors), and the op only ever sees values within 1e-4 of whole steps: its codes are the
    # reference's exactly (tested on ties).
    # Per tensor, the op is handed whole steps of s, so its scaling stays acc * (s * s_w), the one-token kernel's;
    # per token, bare codes scaled after.
    per_tensor = x_scale.numel() == 1
    split = fbgemm_saturates()
    codes = rounded_codes(
        x,
        x_scale,
        x_zero_point,
        rescale=per_tensor and not split,
        overwrite_input=overwrite_input,
        compiled=compiled_rounding,
    )
    scale = float(x_scale) if per_tensor else 1.0
    zero_point = 128 + x_zero_point
    out = _split_gemm(codes, scale, zero_point, packed) if split else _GEMM(codes, scale, zero_point, packed.params)
    if not per_tensor:
        out.mul_(x_scale)
    return out.add_(bias) if bias is not None else out


def _split_gemm(codes: torch.Tensor, scale: float, zero_point: int, packed: PackedInt8Weight) -> torch.Tensor:
    """The GEMM of int8 `codes` (float32, not rescaled) as two GEMMs whose uint8 inputs stay within [0, 128], so
    no pair of products leaves int16: u = codes + zero_point in [0, 255] is split into u // 2 and u - u // 2."""
    high_zero = zero_point // 2
    low_zero = zero_point - high_zero
    unsigned = codes.add_(zero_point)
    high = unsigned.mul(0.5).floor_()
    low = unsigned.sub_(high).sub_(low_zero)
    high.sub_(high_zero)
    if scale != 1.0:
        high.mul_(scale)
        low.mul_(scale)
    return _GEMM(high, scale, high_zero, packed.params).add_(_GEMM(low, scale, low_zero, packed.params))


def rounded_codes(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    x_zero_point: int = 0,
    *,
    rescale: bool,
    overwrite_input: bool = False,
    compiled: bool = True,
) -> torch.Tensor:
    """x's int8 codes, clamp(round(x / s) + z, -128, 127) - z (half to even), as float32 (times s if `rescale`).
    One C++ pass (`round_to_int8_codes`) where the kernels are built, else the PyTorch ops it equals bit for bit
    (its oracle, tested), which pass over x six times (`benchmarks/w8a8_speed.py --only rounding` times both)."""
    extension = compiled_kernels() if compiled and x.dtype == torch.float32 else None
    if extension is not None:
        x = x.contiguous()
        codes = x if overwrite_input else torch.empty_like(x)
        extension.round_to_int8_codes(x, codes, x_scale.float().contiguous().reshape(-1), int(x_zero_point), rescale)
        return codes
    codes = x.div_(x_scale) if overwrite_input and x.is_contiguous() else x / x_scale
    codes = codes.round_().add_(x_zero_point).clamp_(QMIN, QMAX).sub_(x_zero_point).contiguous()
    return codes.mul_(x_scale) if rescale else codes
