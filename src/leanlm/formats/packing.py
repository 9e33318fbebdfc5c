"""Bit-packing of k-bit codes into bytes, so that storage really is k bits per value.

4 bits: two codes per byte, the first in the high nibble (bitsandbytes' layout). Any other k: the codes form
one big-endian bit stream, zero-padded to whole bytes (3 bits: 8 codes in 3 bytes).
"""

from __future__ import annotations

import torch

from leanlm.errors import ConfigError


def packed_bytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (< 2^bits), any shape -> flat uint8 tensor of packed_bytes(numel, bits) bytes."""
    if not 1 <= bits <= 8:
        raise ConfigError(f"bits must be between 1 and 8, got {bits}")
    flat = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return flat.clone()
    if bits == 4:
        padded = torch.nn.functional.pad(flat, (0, flat.numel() % 2))
        return (padded[0::2] << 4) | padded[1::2]
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.uint8)
    stream = ((flat[:, None] >> shifts) & 1).reshape(-1)  # most significant bit of each code first
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8)).reshape(-1, 8)
    return (stream << torch.arange(7, -1, -1, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack`: the first `count` codes, flat uint8."""
    if bits == 8:
        return packed[:count].clone()
    if bits == 4:
        return torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:count]
    stream = ((packed[:, None] >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1).reshape(-1)
    groups = stream[: count * bits].reshape(count, bits)
    return (groups << torch.arange(bits - 1, -1, -1, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)
