"""Bit-packing of k-bit codes into bytes, so that storage really is k bits per value.

4 bits: two codes per byte, the first in the high nibble (bitsandbytes' layout). Any other k: the codes form
one big-endian bit stream, zero-padded to whole bytes (3 bits: 8 codes in 3 bytes).

3 bits also have the "planes" layout the 3-bit kernel reads (llama.cpp's Q3_K splits its codes the same way):
chunks of 64 codes in 24 bytes, 16 bytes of low bit pairs (byte i holds codes i, i + 16, i + 32 and i + 48 in
bits 0-1, 2-3, 4-5 and 6-7) then 8 bytes of high bits (bit i of the little-endian 64-bit word is code i's).
A register of 16 low bytes shifted by 0, 2, 4 or 6 gives 16 consecutive codes' low pairs, and 32 high bits are
one mask register, so a chunk decodes in order in a few instructions, where the bit stream's codes straddle
bytes. The last chunk is padded with zero codes.
"""

from __future__ import annotations

from typing import Literal

import torch

from leanlm.errors import ConfigError

CodeLayout = Literal["stream", "planes"]
PLANE_CHUNK = 64  # codes per chunk of the planes layout (24 bytes)


def preferred_layout(bits: int) -> CodeLayout:
    """How new codes are written: 3-bit ones as the 3-bit kernel reads them, the others as one bit stream."""
    return "planes" if bits == 3 else "stream"


def _check_layout(bits: int, layout: CodeLayout) -> None:
    if layout not in ("stream", "planes"):
        raise ConfigError(f"unknown code layout {layout!r}; choose stream or planes")
    if layout == "planes" and bits != 3:
        raise ConfigError(f"the planes layout holds 3-bit codes, not {bits}-bit ones")


def packed_bytes(count: int, bits: int, layout: CodeLayout = "stream") -> int:
    _check_layout(bits, layout)
    if layout == "planes":
        return -(-count // PLANE_CHUNK) * PLANE_CHUNK * 3 // 8
    return (count * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int, layout: CodeLayout = "stream") -> torch.Tensor:
    """uint8 codes (< 2^bits), any shape -> flat uint8 tensor of packed_bytes(numel, bits, layout) bytes."""
    if not 1 <= bits <= 8:
        raise ConfigError(f"bits must be between 1 and 8, got {bits}")
    _check_layout(bits, layout)
    flat = codes.reshape(-1).to(torch.uint8)
    if layout == "planes":
        chunks = torch.nn.functional.pad(flat, (0, (-flat.numel()) % PLANE_CHUNK)).reshape(-1, 4, 16)
        low = ((chunks & 3) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]).sum(dim=1, dtype=torch.uint8)
        high_bits = (chunks >> 2).reshape(-1, 8, 8) << torch.arange(8, dtype=torch.uint8)
        return torch.cat([low, high_bits.sum(dim=2, dtype=torch.uint8)], dim=1).reshape(-1)
    if bits == 8:
        return flat.clone()
    if bits == 4:
        padded = torch.nn.functional.pad(flat, (0, flat.numel() % 2))
        return (padded[0::2] << 4) | padded[1::2]
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.uint8)
    stream = ((flat[:, None] >> shifts) & 1).reshape(-1)  # most significant bit of each code first
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8)).reshape(-1, 8)
    return (stream << torch.arange(7, -1, -1, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int, layout: CodeLayout = "stream") -> torch.Tensor:
    """Inverse of `pack`: the first `count` codes, flat uint8."""
    _check_layout(bits, layout)
    if layout == "planes":
        chunks = packed.reshape(-1, 24)
        low = (chunks[:, None, :16] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3  # (n, 4, 16)
        high = (chunks[:, 16:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # (n, 8, 8): code 8j + b
        return (low.reshape(-1, 64) | (high.reshape(-1, 64) << 2)).reshape(-1)[:count]
    if bits == 8:
        return packed[:count].clone()
    if bits == 4:
        return torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:count]
    stream = ((packed[:, None] >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1).reshape(-1)
    groups = stream[: count * bits].reshape(count, bits)
    return (groups << torch.arange(bits - 1, -1, -1, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)
