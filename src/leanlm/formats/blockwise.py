"""Block-wise k-bit quantization (Dettmers' thesis eq. 3.1) with optional double quantization of the block constants
(QLoRA section 5.2), and the exact bits-per-parameter account of every configuration.

Blocking views the tensor as one flat sequence cut into blocks of `block_size` values (the last block may be
shorter), each scaled by its absmax; `block_size=None` means one block per row (per output channel). Double
quantization subtracts the mean of the (positive) block constants and quantizes them with the 8-bit dynamic
map in blocks of 256, keeping one float32 constant per second-level block and the mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanlm.errors import ConfigError
from leanlm.formats.codebooks import DYNAMIC8, Codebook

_TINY = 1e-38  # bitsandbytes' floor for an all-zero block: its values then quantize to code(0)
SECOND_LEVEL_BLOCK = 256


@dataclass
class BlockwiseQuantized:
    codes: torch.Tensor  # uint8, one code per value (unpacked), flat
    absmax: torch.Tensor  # float32 per block, or uint8 codes of the second level when double-quantized
    shape: tuple[int, ...]
    block_size: int
    codebook: Codebook
    # Double quantization: second-level constants (float32 per 256 first-level blocks) and the subtracted mean.
    absmax_scale: torch.Tensor | None = None
    absmax_offset: torch.Tensor | None = None

    @property
    def double_quantized(self) -> bool:
        return self.absmax_scale is not None

    def block_constants(self) -> torch.Tensor:
        if not self.double_quantized:
            return self.absmax
        return _dequantize_flat(self.absmax, self.absmax_scale, DYNAMIC8, SECOND_LEVEL_BLOCK) + self.absmax_offset

    def dequantize(self) -> torch.Tensor:
        return _dequantize_flat(self.codes, self.block_constants(), self.codebook, self.block_size).reshape(self.shape)


def _blocks(flat: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    return list(torch.split(flat, block_size))


_CHUNK_VALUES = 1 << 20  # values quantized at once: their temporaries (at most 12 bytes a value) stay under 12 MB


def _quantize_flat(flat: torch.Tensor, codebook: Codebook, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of `flat`, a whole number of blocks at a time, written into tensors made once: quantizing
    the temporaries are a fixed number of 1M-value chunks, of the same sizes in every chunk, which the allocator
    reuses; results concatenated at the end would scatter freed memory between live tensors and raise the peak
    resident memory (benchmarks/out_of_core.py)."""
    blocks = -(-flat.numel() // block_size)
    codes, absmax = torch.empty(flat.numel(), dtype=torch.uint8), torch.empty(blocks)
    step = max(1, _CHUNK_VALUES // block_size) * block_size
    for start in range(0, flat.numel(), step):
        stop = min(start + step, flat.numel())
        _quantize_chunk(
            flat[start:stop],
            codebook,
            block_size,
            codes[start:stop],
            absmax[start // block_size : -(-stop // block_size)],
        )
    return codes, absmax


def _quantize_chunk(
    flat: torch.Tensor, codebook: Codebook, block_size: int, codes: torch.Tensor, absmax: torch.Tensor
) -> None:
    """Quantize `flat` (whole blocks, but for a shorter last one) into `codes` and `absmax`."""
    full = flat.numel() - flat.numel() % block_size
    torch.amax(flat[:full].reshape(-1, block_size).abs(), dim=1, out=absmax[: full // block_size])
    if full < flat.numel():
        absmax[-1] = flat[full:].abs().amax()
    # Each value times its block's 1/absmax, broadcast rather than repeated per value: one temporary, clamped
    # in place.
    inverse = 1.0 / absmax.clamp(min=_TINY)
    normalized = torch.empty_like(flat)
    torch.mul(
        flat[:full].reshape(-1, block_size),
        inverse[: full // block_size, None],
        out=normalized[:full].view(-1, block_size),
    )
    torch.mul(flat[full:], inverse[full // block_size :], out=normalized[full:])
    codebook.nearest(normalized.clamp_(-1, 1), out=codes)


def _dequantize_flat(codes: torch.Tensor, absmax: torch.Tensor, codebook: Codebook, block_size: int) -> torch.Tensor:
    return codebook.values[codes.long()] * absmax.repeat_interleave(block_size)[: codes.numel()]


def quantize_blockwise(
    tensor: torch.Tensor, codebook: Codebook, block_size: int | None = 64, double_quant: bool = False
) -> BlockwiseQuantized:
    """Quantize `tensor` (any shape; a 2-D weight for per-row blocks) to `codebook`."""
    if block_size is None:
        if tensor.ndim != 2:
            raise ConfigError("per-row blocks need a 2-D weight")
        block_size = tensor.shape[1]
    if block_size < 1:
        raise ConfigError(f"block size must be positive, got {block_size}")
    codes, absmax = _quantize_flat(tensor.detach().float().reshape(-1), codebook, block_size)
    result = BlockwiseQuantized(codes, absmax, tuple(tensor.shape), block_size, codebook)
    if double_quant:
        offset = absmax.mean()
        result.absmax, result.absmax_scale = _quantize_flat(absmax - offset, DYNAMIC8, SECOND_LEVEL_BLOCK)
        result.absmax_offset = offset
    return result


def bits_per_parameter(
    bits: int, block_size: int, double_quant: bool, outlier_fraction: float = 0.0, constant_bits: int = 32
) -> float:
    """Exact storage per weight: k-bit codes, the block constants (float32, or 8-bit + float32 per 256 blocks
    with double quantization, plus one float32 mean per tensor, which vanishes per parameter) and 16-bit
    outlier columns kept aside at `outlier_fraction` (proxy quantization). leanlm keeps the k-bit codes of those
    columns (as zeros) so the packed layout stays regular: +16p, where Dettmers' thesis' account, which drops them,
    has +p(16 - k). The codebook and the column indices (32 bits per column, not per weight) are left out."""
    constants = (
        (8 / block_size + 32 / (block_size * SECOND_LEVEL_BLOCK)) if double_quant else constant_bits / block_size
    )
    return bits + constants + outlier_fraction * 16
