"""The group grids of GPTQ / RTN and of both levels of SpQR's statistics. Every grid is

    q = clamp(round(x / scale + zero), 0, 2^b - 1),  x_hat = scale * (q - zero)

and they differ in how (scale, zero) are fitted to a group:
- min-max (asymmetric): scale = (max - min) / (2^b - 1), zero = -min / scale (fractional: SpQR quantizes it
  again, GPTQ keeps it);
- symmetric: zero = 2^(b-1) exactly and scale = (the value of largest magnitude) / -2^(b-1), llama.cpp's rule
  for Q4_0 and Q8_0, so that value lands on the end code and all 2^b codes are used (the scale is negative when
  that value is positive). With float16 scales and groups of 32 this is GGUF's Q4_0 (b = 4) / Q8_0 (b = 8)
  block, value for value.

Statistics are taken along the last dimension. A constant slice (max == min) gets the range [min - 1, min + 1]
so that its scale stays finite and its values are still represented exactly enough.
"""

from __future__ import annotations

import torch


def fit_minmax(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero), each of shape x.shape[:-1]."""
    low, high = x.amin(dim=-1), x.amax(dim=-1)
    flat = high == low
    low, high = torch.where(flat, low - 1, low), torch.where(flat, high + 1, high)
    scale = (high - low) / (2**bits - 1)
    return scale, -low / scale


def fit_symmetric(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of the symmetric grid, each of shape x.shape[:-1]; an all-zero slice gets scale 0."""
    half = 2 ** (bits - 1)
    extreme = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    scale = extreme / -half
    return scale, torch.full_like(scale, float(half))


SEARCH_WEIGHTS = 1 << 17  # weights searched at a time: the candidates' temporaries stay in cache and in the heap


def row_slices(rows: int, per_row: int, weights: int) -> list[slice]:
    """Consecutive slices of `rows` rows of `per_row` weights each, each slice holding about `weights` weights (at
    least one row): the unit of work that keeps a kernel's temporaries a bounded size."""
    step = max(1, weights // max(per_row, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def search_symmetric(
    x: torch.Tensor, bits: int, importance: torch.Tensor | None = None, steps: int = 9
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of the symmetric grid with each slice's scale chosen by weighted squared error, as
    llama.cpp's importance-matrix quantizer chooses a block's: for 2 * steps + 1 candidate rounding scales
    (the rule's -2^(b-1) / extreme, moved by tenths of a code), round, take the least-squares scale of those codes
    (sum w x q / sum w q^2) and keep the candidate whose error sum w (x - scale q)^2 is smallest. `importance`:
    weights broadcast against x (one per position of the last dimension: a Hessian's diagonal); None weighs all
    alike. Slices are searched SEARCH_WEIGHTS weights at a time along the first dimension where the weights do
    not vary along it."""
    half = 2 ** (bits - 1)
    weights = torch.ones(x.shape[-1]) if importance is None else importance.float().contiguous()
    slices = [slice(None)]
    if x.dim() > 1 and weights.dim() < x.dim():
        slices = row_slices(x.shape[0], x.numel() // max(x.shape[0], 1), SEARCH_WEIGHTS)
    if len(slices) <= 1:
        scale = _searched_scale(x, half, weights, steps)
    else:
        scale = torch.cat([_searched_scale(x[rows], half, weights, steps) for rows in slices])
    return scale, torch.full_like(scale, float(half))


def _searched_scale(x: torch.Tensor, half: int, weights: torch.Tensor, steps: int) -> torch.Tensor:
    """`search_symmetric`'s scales, each candidate's temporaries reused in place."""
    extreme = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))  # (..., 1)
    safe = torch.where(extreme == 0, 1.0, extreme)
    weighted = weights * x
    best_scale = extreme.squeeze(-1) / -half
    best_error = torch.full_like(best_scale, float("inf"))
    for step in range(-steps, steps + 1):
        codes = torch.round(x * (-(half + 0.1 * step) / safe)).clamp_(-half, half - 1)
        numerator = (weighted * codes).sum(dim=-1)
        denominator = (codes.square() * weights).sum(dim=-1)
        scale = numerator / torch.where(denominator > 0, denominator, 1.0)
        # sum w (s q - x)^2 directly: sum w x^2 - s * sum w x q cancels to float32 noise where the fit is close
        error = codes.mul_(scale[..., None]).sub_(x).square_().mul_(weights).sum(dim=-1)
        better = error < best_error
        best_scale, best_error = torch.where(better, scale, best_scale), torch.where(better, error, best_error)
    return best_scale


GRIDS = {"minmax": fit_minmax, "symmetric": fit_symmetric}  # grid name -> (x, bits) -> (scale, zero)


def quantize_minmax(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (as float, in [0, 2^bits - 1]) of x with per-slice `scale`, `zero` broadcast on the last dim."""
    # A stored scale can round to 0 (float16, or a quantized statistic); any code then de-quantizes the same.
    safe = torch.where(scale == 0, torch.finfo(torch.float32).tiny, scale)
    return torch.clamp(torch.round(x / safe[..., None] + zero[..., None]), 0, 2**bits - 1)


def dequantize_minmax(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale[..., None] * (codes - zero[..., None])


def round_trip_minmax(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x quantized and de-quantized with its own min-max statistics along the last dimension."""
    scale, zero = fit_minmax(x, bits)
    return dequantize_minmax(quantize_minmax(x, scale, zero, bits), scale, zero)
