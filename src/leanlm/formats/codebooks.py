"""k-bit data types as normalized codebooks: 2^k values in [-1, 1]; a block of weights divided by its absmax is
mapped to the nearest value (Dettmers' thesis eq. 3.1). Codes are indices into `values`.

- integer: k-bit signed integers; symmetric (2^k - 1 levels with an exact zero, one code unused) or asymmetric
  (all 2^k levels, -2^(k-1)..2^(k-1)-1 scaled by 2^(k-1), so +1 is missing).
- float (e exponent bits, m mantissa bits, 1 + e + m = k): no codes spent on inf/NaN; exponent field 0 is
  subnormal; normalized by the largest value. The exponent bias cancels in that normalization.
- NormalFloat NF-k (QLoRA eq. 5.1 with the asymmetric fix): quantiles of N(0, 1) at evenly spaced
  probabilities, 2^(k-1) on the positive side and 2^(k-1) - 1 on the negative side, plus an exact zero.
- dynamic exponent (Dettmers 2016): per sign, for each decimal exponent 10^-(E-1) .. 10^0, a linear fraction
  region whose size doubles with the exponent (an indicator bit separates exponent from fraction); plus 0 and 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from leanlm.errors import ConfigError

DTYPES = ("int", "int_asym", "fp", "nf", "dynamic")
_COMPARED_CODES = 32  # books of up to 5 bits find codes by comparisons, larger ones by binary search


@dataclass(frozen=True)
class Codebook:
    name: str
    bits: int
    values: torch.Tensor  # (2^bits,) float32 in [-1, 1]; index = code

    def nearest(self, normalized: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Code of the nearest value for every element of `normalized` (in [-1, 1]), as uint8 (written into
        `out`, flat uint8 of as many elements, if given)."""
        order = torch.argsort(self.values, stable=True)
        ordered = self.values[order]
        # A value listed twice (the symmetric int books' unused last code repeats zero) is coded by its first
        # index, so that code is never emitted: the 8-bit kernel reads int codes as int8 values plus 127. (0.0
        # and -0.0 differ by sign bit and both stay, as bitsandbytes' FP4 codes them.)
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = (ordered[1:] != ordered[:-1]) | (ordered[1:].signbit() != ordered[:-1].signbit())
        order, ordered = order[first], ordered[first]
        midpoints = (ordered[:-1] + ordered[1:]) / 2
        flat = normalized.reshape(-1)
        if len(order) <= _COMPARED_CODES:
            # code = order[number of midpoints below the value], found with one comparison pass per midpoint, which
            # for small books is faster than bucketize's binary search (larger books keep the search; the bound
            # _COMPARED_CODES is where the two cross). From the top code down, each midpoint at or
            # above the value steps the code back by the difference of neighbouring codes, in uint8 arithmetic
            # (mod 256, so a negative step wraps exactly). A NaN is above every midpoint, where bucketize puts it.
            codes = (out if out is not None else torch.empty(flat.shape, dtype=torch.uint8)).fill_(int(order[-1]))
            steps = (order[1:] - order[:-1]) % 256
            for midpoint, step in zip(midpoints.tolist(), steps.tolist()):
                if step:
                    codes.sub_((flat <= midpoint).view(torch.uint8), alpha=step)
        else:  # int32 positions into a uint8 table: 4 bytes a value of temporaries, not 16 for int64 positions
            codes = torch.index_select(
                order.to(torch.uint8), 0, torch.bucketize(flat, midpoints, out_int32=True), out=out
            )
        return codes if out is not None else codes.reshape(normalized.shape)


def _check_bits(bits: int, low: int = 2, high: int = 8) -> None:
    if not low <= bits <= high:
        raise ConfigError(f"bits must be between {low} and {high}, got {bits}")


def integer(bits: int, symmetric: bool = True) -> Codebook:
    _check_bits(bits)
    half = 2 ** (bits - 1)
    if symmetric:
        levels = torch.arange(-(half - 1), half, dtype=torch.float32) / (half - 1)
        return Codebook(f"int{bits}", bits, torch.cat([levels, torch.zeros(1)]))  # the last code repeats zero
    return Codebook(f"int{bits}_asym", bits, torch.arange(-half, half, dtype=torch.float32) / half)


def floating(exponent_bits: int, mantissa_bits: int) -> Codebook:
    bits = 1 + exponent_bits + mantissa_bits
    _check_bits(bits)
    if exponent_bits < 1:
        raise ConfigError("a float type needs at least one exponent bit (use int for none)")
    magnitudes = []
    for exponent in range(2**exponent_bits):
        for mantissa in range(2**mantissa_bits):
            fraction = mantissa / 2**mantissa_bits
            # exponent field 0: subnormal 0.m x 2^(1 - bias); otherwise 1.m x 2^(e - bias); bias = 2^(E-1) - 1
            bias = 2 ** (exponent_bits - 1) - 1
            magnitudes.append(
                fraction * 2.0 ** (1 - bias) if exponent == 0 else (1 + fraction) * 2.0 ** (exponent - bias)
            )
    magnitudes = torch.tensor(magnitudes)
    values = torch.cat([magnitudes, -magnitudes]) / magnitudes.max()  # sign bit on top: codes >= 2^(k-1) negative
    return Codebook(f"fp{bits}_e{exponent_bits}m{mantissa_bits}", bits, values)


def normal_float(bits: int) -> Codebook:
    _check_bits(bits)
    half = 2 ** (bits - 1)
    # The outermost probability sits midway between the (2^k - 1)- and 2^k-level choices, which keeps +-1 finite.
    offset = ((1 - 1 / (2 * (2**bits - 1))) + (1 - 1 / (2 * 2**bits))) / 2
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, half + 1, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, half, dtype=torch.float64)[:-1])
    values = torch.sort(torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive])).values
    return Codebook(f"nf{bits}", bits, (values / values.max()).float())


def dynamic_exponent(bits: int, signed: bool = True) -> Codebook:
    _check_bits(bits)
    if not signed:
        # The sign bit becomes one more exponent step (for non-negative tensors such as Adam's second moment);
        # the tiniest region (a single value) gives way to the exact 0 so that 2^bits values remain.
        regions = range(1, bits)
        exponents = bits
    else:
        regions = range(bits - 1)
        exponents = bits - 1  # every non-sign bit can serve as exponent (indicator-bit encoding)
    values = []
    for i in regions:
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - (exponents - 1))
        values += [*centres.tolist(), *((-centres).tolist() if signed else [])]
    values += [0.0, 1.0]
    # Sorted, so that codes are the order of the values (the layout bitsandbytes stores its 8-bit map in).
    name = f"dynamic{bits}" if signed else f"dynamic{bits}_unsigned"
    return Codebook(name, bits, torch.sort(torch.tensor(values, dtype=torch.float32)).values)


# bitsandbytes' FP4 as its kernels index it (sign bit on top, then e2m1 with its own subnormal 0.0625 / 12):
# the same codes as `floating(2, 1)` up to that subnormal, kept for bit-exact checkpoints.
FP4_BITSANDBYTES = Codebook(
    "fp4_bnb",
    4,
    torch.tensor(
        [
            0.0,
            0.0625 / 12,
            2 / 3,
            1.0,
            1 / 3,
            0.5,
            1 / 6,
            0.25,
            -0.0,
            -0.0625 / 12,
            -2 / 3,
            -1.0,
            -1 / 3,
            -0.5,
            -1 / 6,
            -0.25,
        ]
    ),
)
# NF4 exactly as published with QLoRA (float32). `normal_float(4)` rebuilds it to within 2e-7; the published
# constants are used so that codes agree bit for bit with existing NF4 checkpoints and with bitsandbytes.
NF4 = Codebook(
    "nf4",
    4,
    torch.tensor(
        [
            -1.0,
            -0.6961928009986877,
            -0.5250730514526367,
            -0.39491748809814453,
            -0.28444138169288635,
            -0.18477343022823334,
            -0.09105003625154495,
            0.0,
            0.07958029955625534,
            0.16093020141124725,
            0.24611230194568634,
            0.33791524171829224,
            0.44070982933044434,
            0.5626170039176941,
            0.7229568362236023,
            1.0,
        ]
    ),
)
DYNAMIC8 = dynamic_exponent(8)  # the map of double quantization's second level (and of 8-bit Adam's 1st moment)
DYNAMIC8_UNSIGNED = dynamic_exponent(8, signed=False)  # 8-bit Adam's 2nd moment


@cache
def codebook(dtype: str, bits: int, exponent_bits: int | None = None) -> Codebook:
    """The codebook for a data-type name: int, int_asym, fp (with `exponent_bits`; default half of the non-sign
    bits, rounded up: e2m1 at 4 bits, e4m3 at 8), nf, dynamic."""
    if dtype == "int":
        return integer(bits, symmetric=True)
    if dtype == "int_asym":
        return integer(bits, symmetric=False)
    if dtype == "fp":
        exponent = exponent_bits if exponent_bits is not None else max(1, bits // 2)
        return floating(exponent, bits - 1 - exponent)
    if dtype == "nf":
        return NF4 if bits == 4 else normal_float(bits)
    if dtype == "dynamic":
        return dynamic_exponent(bits)
    raise ConfigError(f"unknown data type {dtype!r}; choose from {', '.join(DTYPES)}")
