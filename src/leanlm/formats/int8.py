"""Symmetric absmax int8 quantization (SmoothQuant eq. 3.1): q = round(x / delta), delta = max|x| / 127.

Scales are computed along the dimensions an int8 GEMM can rescale after the integer product: per tensor,
per row of the activation (per token), or per output channel (or group of output channels) of the weight.
"""

from __future__ import annotations

from typing import Literal

import torch

from leanlm.errors import ConfigError

QMAX = 127  # absmax scales map the largest magnitude to 127
QMIN = -128  # the int8 floor: reached only by values beyond a static (calibrated) range
_TINY = 1e-8  # an all-zero row still gets a finite scale

ActivationGranularity = Literal["per_tensor", "per_token"]
WeightGranularity = Literal["per_tensor", "per_channel", "per_group"]


def absmax_scale(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """delta = max|x| / 127 over the whole tensor (dim=None, shape ()) or along `dim` (kept, size 1)."""
    # The inf-norm is max|x| in one pass, without materialising |x|.
    if dim is None:
        return (torch.linalg.vector_norm(x.detach(), float("inf")).float() / QMAX).clamp(min=_TINY)
    return (torch.linalg.vector_norm(x.detach(), float("inf"), dim=dim, keepdim=True).float() / QMAX).clamp(min=_TINY)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Integer values (as float) of x on the grid `scale`, clamped to the int8 range; round half to even."""
    return torch.clamp(torch.round(x / scale), QMIN, QMAX)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize then de-quantize: the values an int8 path computes with, in x's dtype. The codes are rounded in
    float32 whatever x's dtype, as an int8 kernel rounds them: x / scale in bfloat16 keeps 8 significant bits,
    which moves codes above 64 by one."""
    return (quantize(x.float(), scale) * scale).to(x.dtype)


def zeropoint_params(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Asymmetric ("zeropoint") quantization over the whole tensor (LLM.int8() paper, section 2.1): the range
    [min, max] maps onto -127..127, so a one-signed tensor uses every level. Returns (scale, zero point):
    q = round(x / scale) + zero_point, x ~ (q - zero_point) * scale."""
    low, high = torch.aminmax(x.detach().float())
    low, high = torch.clamp(low, max=0.0), torch.clamp(high, min=0.0)  # keep 0 exactly representable
    scale = ((high - low) / (2 * QMAX)).clamp(min=_TINY)
    return scale, int(torch.round(-low / scale).item()) - QMAX


def activation_scale(x: torch.Tensor, granularity: ActivationGranularity) -> torch.Tensor:
    """Dynamic activation scale: one for the tensor, or one per token (last dim is the channel dim)."""
    if granularity == "per_tensor":
        return absmax_scale(x)
    if granularity == "per_token":
        return absmax_scale(x, dim=-1)
    raise ConfigError(f"activation granularity must be per_tensor or per_token, got {granularity!r}")


def weight_scale(weight: torch.Tensor, granularity: WeightGranularity, group_size: int = 128) -> torch.Tensor:
    """Scale of an (out, in) weight, shaped (out,): one shared value, one per output channel, or one per group
    of `group_size` consecutive output channels (ZeroQuant's group-wise, along the GEMM's outer dimension)."""
    out_features = weight.shape[0]
    if granularity == "per_tensor":
        return absmax_scale(weight).expand(out_features).clone()
    if granularity == "per_channel":
        return absmax_scale(weight, dim=1).flatten()
    if granularity == "per_group":
        if group_size < 1:
            raise ConfigError(f"group_size must be positive, got {group_size}")
        groups = torch.arange(out_features) // group_size
        row_max = weight.detach().abs().amax(dim=1).float()
        group_max = torch.zeros(int(groups.max()) + 1).scatter_reduce(0, groups, row_max, "amax")
        return (group_max[groups] / QMAX).clamp(min=_TINY)
    raise ConfigError(f"weight granularity must be per_tensor, per_channel or per_group, got {granularity!r}")


def quantize_weight(
    weight: torch.Tensor, granularity: WeightGranularity, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight (out, in), float32 scale (out,))."""
    scale = weight_scale(weight, granularity, group_size)
    return quantize(weight.float(), scale[:, None]).to(torch.int8), scale
