"""GGUF's block types as leanlm writes and reads them: the legacy blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
the K-quants' super-blocks of 256 (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the non-linear 4-bit types (IQ4_NL in blocks
of 32, IQ4_XS in super-blocks of 256), per the layouts of llama.cpp's `ggml-common.h` and the de-quantization
rules of its `ggml-quants.c`.

Every type is one rule over sub-blocks of `sub` weights that share a multiplier A and an offset B:

    w = A * v(q) + B,     q an unsigned code of `bits` bits,

with v(q) = q - offset on the uniform grids and v(q) = the type's `levels`[q] on the non-linear ones:
- symmetric types (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K): B = 0 and `offset` centres the codes (Q3_K: 4, Q6_K: 32);
- affine types: offset 0; Q4_1 / Q5_1 store B itself as a float16 ("min"), Q2_K / Q4_K / Q5_K store B = -dmin * m;
- non-linear types (IQ4_NL, IQ4_XS): B = 0 and sixteen fixed integer levels, denser near zero, where the
  weights of a block are;
- legacy types and IQ4_NL: A is the block's float16 scale d; K-quants and IQ4_XS: A = d * sc, with sc an integer
  sub-block scale of `scale_bits` bits (Q3_K, Q6_K and IQ4_XS: signed), d (and dmin) one float16 per super-block.

De-quantization does the float32 products in the order the `gguf` package does (A = d * sc first, then
A * q, then the offset), so a block leanlm writes de-quantizes to the same float32 values here and there, bit for
bit (tests/formats/test_gguf_blocks.py checks every type on random bytes). A block is described as bit fields
(`_Piece`): packing and unpacking are one gather / scatter each, the same code for every type.

`fit_statistics` fits a weight's per-block statistics the way the format stores them: each sub-block's (A, B) by
a weighted least-squares search over candidate scales (weights: an importance vector such as the Hessian's
diagonal, else uniform; on a non-linear grid the codes are the nearest levels), then, under a float16 d / dmin,
each sub-block's integer scale and min chosen by the weighted error of the codes they give (`_chosen_integers`).
`codes_for` rounds a weight to the nearest codes of fitted statistics (RTN); GPTQ rounds with error feedback on the
same grid (`zero_points`, and `nearest_levels` on a non-linear one).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import gguf
import numpy as np
import torch

from leanlm.errors import ConfigError
from leanlm.formats.codebooks import Codebook
from leanlm.formats.minmax import row_slices, search_symmetric

SUPER_BLOCK = 256  # weights per K-quant block (QK_K)
UNPACK_WEIGHTS = 1 << 20  # weights unpacked at a time (`unpack`, `dequantize`): unpacking widens every byte to
# int32 and every code to float32 several times over, so a whole weight at once would hold several float32 copies
# Weights fitted at a time (`fit_statistics`, `codes_for`): the search's many temporaries then stay below glibc's
# largest mmap threshold and are reused from its heap, where a whole weight's would each be a fresh mapping,
# page-faulted anew every step; and each elementwise step is still large enough for torch to split over threads.
FIT_WEIGHTS = 1 << 17
# IQ4_NL's and IQ4_XS's sixteen levels, code 0 to 15 (llama.cpp's kvalues_iq4nl): part of the file format
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class _Piece:
    """Some bits of one integer field: value `element` of the field has bits [low, low + width) at bit `shift`
    of block byte `byte` (arrays, one entry per element stored this way)."""

    field: str  # "codes", "scales" or "mins"
    element: np.ndarray
    low: int
    width: int
    byte: np.ndarray
    shift: np.ndarray


@dataclass(frozen=True)
class BlockType:
    name: str  # the GGML type's name, lower case
    sub: int  # weights per sub-block (one A and B)
    bits: int  # code bits
    offset: int  # subtracted from a code before scaling
    half_fields: tuple[tuple[str, int], ...]  # float16 fields: (name, byte offset): d, and dmin / min
    pieces: tuple[_Piece, ...]
    scale_bits: int | None = None  # K-quants: bits of the integer sub-block scales (and mins)
    signed_scales: bool = False  # Q3_K, Q6_K: sub-block scales are signed, stored as (scale + scale_bias) mod 2^bits
    scale_bias: int = 0  # Q3_K: 32 (its scales are stored as scale + 32); Q6_K: 0 (two's complement int8)
    code_xor: int = 0  # Q8_0: 0x80 (its codes are stored as the signed byte code - 128)
    has_min: bool = False  # affine: B stored (Q4_1 / Q5_1 as a float16, K-quants as dmin * m)
    fallback: str | None = None  # what llama.cpp writes when a row is not a whole number of blocks
    levels: tuple[int, ...] | None = None  # non-linear types: the value of each code (offset unused)

    @property
    def ggml(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.name.upper()]

    @property
    def block(self) -> int:
        """Weights per block."""
        return gguf.GGML_QUANT_SIZES[self.ggml][0]

    @property
    def bytes(self) -> int:
        """Bytes per block."""
        return gguf.GGML_QUANT_SIZES[self.ggml][1]

    @property
    def bits_per_weight(self) -> float:
        return self.bytes * 8 / self.block

    @property
    def subs(self) -> int:
        return self.block // self.sub

    @property
    def k_quant(self) -> bool:
        """Whether the sub-block scales are integers under a per-super-block d (K-quants and IQ4_XS)."""
        return self.scale_bits is not None

    @cached_property  # built once per type: GPTQ asks for it at every column
    def codebook(self) -> Codebook | None:
        """A non-linear type's levels as a code book (what finds the nearest code); None on a uniform grid."""
        return None if self.levels is None else Codebook(self.name, self.bits, torch.tensor(self.levels).float())


def _pieces(field: str, positions, low: int = 0, width: int = 8) -> _Piece:
    """A piece from (element, byte, shift) triples."""
    element, byte, shift = (np.array(column, dtype=np.int64) for column in zip(*positions))
    return _Piece(field, element, low, width, byte, shift.astype(np.int32))


def _nibbles_of_32(base: int, width: int = 4) -> _Piece:
    """Legacy 4-bit layout: weight i in the low nibble of byte i, weight i + 16 in its high nibble."""
    return _pieces("codes", [(e, base + e % 16, 4 * (e // 16)) for e in range(32)], 0, width)


def _bit_per_weight(base: int, count: int, low: int) -> _Piece:
    """One code bit per weight, K-quant style: weight t * 32 + i has it at bit t of byte base + i."""
    return _pieces("codes", [(e, base + e % 32, e // 32) for e in range(count)], low, 1)


def _high_bits_of_32(base: int) -> _Piece:
    """Q5_0 / Q5_1's fifth bits: weight i's at bit i of the little-endian 32-bit word at `base`."""
    return _pieces("codes", [(e, base + e // 8, e % 8) for e in range(32)], 4, 1)


def _pairs(base: int) -> _Piece:
    """Q2_K / Q3_K low bit pairs: weight (h * 4 + t) * 32 + i at bits 2t of byte base + h * 32 + i."""
    return _pieces("codes", [(e, base + (e // 128) * 32 + e % 32, 2 * (e // 32 % 4)) for e in range(256)], 0, 2)


def _k_nibbles(base: int) -> _Piece:
    """Q4_K / Q5_K low nibbles: sub-block s's weight i at nibble s % 2 of byte base + (s // 2) * 32 + i."""
    return _pieces("codes", [(e, base + (e // 64) * 32 + e % 32, 4 * (e // 32 % 2)) for e in range(256)], 0, 4)


def _k_scales(base: int) -> tuple[_Piece, ...]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and mins: scale / min j < 4 in bytes j / 4 + j; for j >= 4
    the low four bits share byte 8 + j - 4 (scale low, min high) and the top two sit in bits 6-7 of bytes j - 4
    / j."""
    pieces = []
    for field, first, nibble in (("scales", 0, 0), ("mins", 4, 4)):
        pieces.append(_pieces(field, [(j, base + first + j, 0) for j in range(4)], 0, 6))
        pieces.append(_pieces(field, [(j, base + 8 + j - 4, nibble) for j in range(4, 8)], 0, 4))
        pieces.append(_pieces(field, [(j, base + first + j - 4, 6) for j in range(4, 8)], 4, 2))
    return tuple(pieces)


def _q3_k_scales(base: int) -> tuple[_Piece, ...]:
    """Q3_K's 12 bytes of sixteen 6-bit scales: low four bits of scale j at nibble j // 8 of byte j % 8, the top
    two at bits 2 * (j // 4) of byte 8 + j % 4."""
    return (
        _pieces("scales", [(j, base + j % 8, 4 * (j // 8)) for j in range(16)], 0, 4),
        _pieces("scales", [(j, base + 8 + j % 4, 2 * (j // 4)) for j in range(16)], 4, 2),
    )


def _q6_k_codes(low_base: int, high_base: int) -> tuple[_Piece, ...]:
    """Q6_K: weight g * 32 + i (g = h * 4 + r) has its low nibble at nibble r // 2 of byte
    low_base + h * 64 + (r % 2) * 32 + i and its top two bits at bits 2r of byte high_base + h * 32 + i."""
    low = [(e, low_base + (e // 128) * 64 + (e // 32 % 2) * 32 + e % 32, 4 * (e // 64 % 2)) for e in range(256)]
    high = [(e, high_base + (e // 128) * 32 + e % 32, 2 * (e // 32 % 4)) for e in range(256)]
    return _pieces("codes", low, 0, 4), _pieces("codes", high, 4, 2)


_D, _D_MIN = ("d", 0), ("dmin", 2)  # where most types keep their float16 fields
BLOCK_TYPES = {
    kind.name: kind
    for kind in (
        BlockType("q4_0", 32, 4, 8, (_D,), (_nibbles_of_32(2),)),
        BlockType("q4_1", 32, 4, 0, (_D, _D_MIN), (_nibbles_of_32(4),), has_min=True),
        BlockType("q5_0", 32, 5, 16, (_D,), (_nibbles_of_32(6), _high_bits_of_32(2))),
        BlockType("q5_1", 32, 5, 0, (_D, _D_MIN), (_nibbles_of_32(8), _high_bits_of_32(4)), has_min=True),
        BlockType("q8_0", 32, 8, 128, (_D,), (_pieces("codes", [(e, 2 + e, 0) for e in range(32)]),), code_xor=0x80),
        BlockType(
            "q2_k",
            16,
            2,
            0,
            (("d", 80), ("dmin", 82)),
            (
                _pairs(16),
                _pieces("scales", [(j, j, 0) for j in range(16)], 0, 4),
                _pieces("mins", [(j, j, 4) for j in range(16)], 0, 4),
            ),
            scale_bits=4,
            has_min=True,
            fallback="q4_0",
        ),
        BlockType(
            "q3_k",
            16,
            3,
            4,
            (("d", 108),),
            (_pairs(32), _bit_per_weight(0, 256, 2), *_q3_k_scales(96)),
            scale_bits=6,
            signed_scales=True,
            scale_bias=32,
            fallback="q4_0",
        ),
        BlockType(
            "q4_k", 32, 4, 0, (_D, _D_MIN), (_k_nibbles(16), *_k_scales(4)), scale_bits=6, has_min=True, fallback="q5_0"
        ),
        BlockType(
            "q5_k",
            32,
            5,
            0,
            (_D, _D_MIN),
            (_k_nibbles(48), _bit_per_weight(16, 256, 4), *_k_scales(4)),
            scale_bits=6,
            has_min=True,
            fallback="q5_1",
        ),
        BlockType(
            "q6_k",
            16,
            6,
            32,
            (("d", 208),),
            (*_q6_k_codes(0, 128), _pieces("scales", [(j, 192 + j, 0) for j in range(16)], 0, 8)),
            scale_bits=8,
            signed_scales=True,
            fallback="q8_0",
        ),
        BlockType("iq4_nl", 32, 4, 0, (_D,), (_nibbles_of_32(2),), levels=IQ4_LEVELS),
        BlockType(
            "iq4_xs",
            32,
            4,
            0,
            (_D,),
            (
                _pieces("codes", [(e, 8 + (e // 32) * 16 + e % 16, 4 * (e % 32 // 16)) for e in range(256)], 0, 4),
                _pieces("scales", [(j, 4 + j // 2, 4 * (j % 2)) for j in range(8)], 0, 4),
                _pieces("scales", [(j, 2 + j // 4, 2 * (j % 4)) for j in range(8)], 4, 2),
            ),
            scale_bits=6,
            signed_scales=True,
            scale_bias=32,
            fallback="iq4_nl",
            levels=IQ4_LEVELS,
        ),
    )
}


def block_type(name: str) -> BlockType:
    if name not in BLOCK_TYPES:
        raise ConfigError(f"GGUF block type {name!r}: choose from {', '.join(BLOCK_TYPES)}")
    return BLOCK_TYPES[name]


def type_for_row(name: str, columns: int) -> BlockType:
    """The block type a row of `columns` weights takes when `name` is asked for: `name` if the row is a whole
    number of its blocks, else llama.cpp's fallback for it (Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1,
    Q6_K -> Q8_0, IQ4_XS -> IQ4_NL); a ConfigError if not even that fits."""
    kind = block_type(name)
    if columns % kind.block and kind.fallback is not None:
        kind = BLOCK_TYPES[kind.fallback]
    if columns % kind.block:
        raise ConfigError(
            f"a row of {columns} weights is not a whole number of {name.upper()} blocks of {kind.block} "
            "(nor of its fallback's); GGUF has no block type for it"
        )
    return kind


@dataclass
class BlockStatistics:
    """A weight's stored statistics, per row and block: float16 d (and dmin, or Q4_1 / Q5_1's min) and, for
    K-quants, the integer sub-block scales (and mins) as numbers (signed where the type's are)."""

    d: torch.Tensor  # (rows, blocks) float16
    dmin: torch.Tensor | None = None  # (rows, blocks) float16
    scales: torch.Tensor | None = None  # (rows, blocks, subs) int32
    mins: torch.Tensor | None = None  # (rows, blocks, subs) int32


def sub_block_grid(kind: BlockType, statistics: BlockStatistics) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of every sub-block, (rows, blocks, subs) float32 each, computed as the `gguf` package does."""
    d = statistics.d.float()[..., None]
    multiplier = (d * statistics.scales.float()) if kind.k_quant else d.expand(*d.shape[:-1], kind.subs)
    if not kind.has_min:
        return multiplier, torch.zeros_like(multiplier)
    dmin = statistics.dmin.float()[..., None]
    offset = -(dmin * statistics.mins.float()) if kind.k_quant else dmin.expand_as(multiplier)
    return multiplier, offset


def decode(kind: BlockType, codes: torch.Tensor, statistics: BlockStatistics) -> torch.Tensor:
    """(rows, columns) float32 weights of codes (rows, columns) uint8 under `statistics`."""
    rows, columns = codes.shape
    multiplier, offset = sub_block_grid(kind, statistics)
    q = codes.reshape(rows, columns // kind.block, kind.subs, kind.sub)
    q = kind.codebook.values[q.long()] if kind.levels is not None else q.float()
    if kind.offset:
        q = q - kind.offset
    weight = multiplier[..., None] * q
    if kind.has_min:
        weight = weight + offset[..., None]
    return weight.reshape(rows, columns)


def _stored_integer(kind: BlockType, values: torch.Tensor) -> torch.Tensor:
    """Sub-block scales as their stored bits: signed ones as (scale + scale_bias) mod 2^scale_bits."""
    if not kind.signed_scales:
        return values
    return (values + kind.scale_bias) & ((1 << kind.scale_bits) - 1)


def _integer_value(kind: BlockType, stored: torch.Tensor) -> torch.Tensor:
    """The sub-block scales stored bits hold: signed ones are (stored - scale_bias) read as two's complement."""
    if not kind.signed_scales:
        return stored
    wrapped = (stored - kind.scale_bias) & ((1 << kind.scale_bits) - 1)
    return wrapped - ((wrapped >> (kind.scale_bits - 1)) << kind.scale_bits)


def pack(kind: BlockType, codes: torch.Tensor, statistics: BlockStatistics) -> torch.Tensor:
    """(rows, blocks * bytes) uint8: the GGUF blocks of codes (rows, columns) uint8 and their statistics."""
    rows, columns = codes.shape
    blocks = columns // kind.block
    out = torch.zeros(rows * blocks, kind.bytes, dtype=torch.int32)
    fields = {"codes": codes.reshape(rows * blocks, kind.block).to(torch.int32)}
    if kind.k_quant:
        fields["scales"] = _stored_integer(kind, statistics.scales.reshape(rows * blocks, kind.subs).to(torch.int32))
        if kind.has_min:
            fields["mins"] = statistics.mins.reshape(rows * blocks, kind.subs).to(torch.int32)
    fields["codes"] = fields["codes"] ^ kind.code_xor
    for piece in kind.pieces:
        bits = (fields[piece.field][:, piece.element] >> piece.low) & ((1 << piece.width) - 1)
        out.index_add_(1, torch.from_numpy(piece.byte), bits << torch.from_numpy(piece.shift))
    out = out.to(torch.uint8)
    for name, at in kind.half_fields:
        half = getattr(statistics, name).reshape(-1).to(torch.float16).view(torch.uint8).reshape(-1, 2)
        out[:, at : at + 2] = half
    return out.reshape(rows, blocks * kind.bytes)


def unpack(kind: BlockType, raw: torch.Tensor, columns: int) -> tuple[torch.Tensor, BlockStatistics]:
    """The codes (rows, columns) uint8 and statistics held in GGUF blocks (rows, blocks * bytes) uint8."""
    chunks = [_unpack_rows(kind, raw[rows], columns) for rows in row_slices(raw.shape[0], columns, UNPACK_WEIGHTS)]
    if len(chunks) == 1:
        return chunks[0]
    return torch.cat([chunk[0] for chunk in chunks]), _joined([chunk[1] for chunk in chunks])


def _joined(parts: list[BlockStatistics]) -> BlockStatistics:
    """The statistics of consecutive row ranges as one."""
    if len(parts) == 1:
        return parts[0]
    return BlockStatistics(**{name: torch.cat([getattr(part, name) for part in parts]) for name in _present(parts[0])})


def _present(statistics: BlockStatistics) -> list[str]:
    """The fields `statistics` holds (a type without mins or sub-block scales leaves theirs None)."""
    return [field.name for field in fields(statistics) if getattr(statistics, field.name) is not None]


def _unpack_rows(kind: BlockType, raw: torch.Tensor, columns: int) -> tuple[torch.Tensor, BlockStatistics]:
    rows = raw.shape[0]
    blocks = columns // kind.block
    flat = raw.reshape(rows * blocks, kind.bytes)
    wide = flat.to(torch.int32)
    sizes = {"codes": kind.block, "scales": kind.subs, "mins": kind.subs}
    fields = {name: torch.zeros(rows * blocks, size, dtype=torch.int32) for name, size in sizes.items()}
    for piece in kind.pieces:
        bits = (wide[:, piece.byte] >> torch.from_numpy(piece.shift)) & ((1 << piece.width) - 1)
        fields[piece.field].index_add_(1, torch.from_numpy(piece.element), bits << piece.low)
    halves = {
        name: flat[:, at : at + 2].contiguous().view(torch.float16).reshape(rows, blocks)
        for name, at in kind.half_fields
    }
    codes = fields["codes"] ^ kind.code_xor
    statistics = BlockStatistics(halves["d"], halves.get("dmin"))
    if kind.k_quant:
        statistics.scales = _integer_value(kind, fields["scales"]).reshape(rows, blocks, kind.subs)
        if kind.has_min:
            statistics.mins = fields["mins"].reshape(rows, blocks, kind.subs)
    return codes.to(torch.uint8).reshape(rows, columns), statistics


def dequantize(kind: BlockType, raw: torch.Tensor, columns: int) -> torch.Tensor:
    """(rows, columns) float32 weights held in GGUF blocks (rows, blocks * bytes) uint8, decoded a few rows at a
    time into the result."""
    weight = torch.empty(raw.shape[0], columns)
    for rows in row_slices(raw.shape[0], columns, UNPACK_WEIGHTS):
        weight[rows] = decode(kind, *_unpack_rows(kind, raw[rows], columns))
    return weight


def _affine_search(x: torch.Tensor, weights: torch.Tensor, top: int, nonpositive_offset: bool, steps: int = 10):
    """(A, B) per slice of x's last dimension minimising sum weights * (A q + B - x)^2 over codes q in [0, top]:
    for candidate scales around the min-max one (moved by tenths of a code), round, then solve the two-parameter
    weighted least squares for those codes; `nonpositive_offset`: B <= 0, as K-quants store B = -dmin * m."""
    low = x.amin(dim=-1)
    if nonpositive_offset:
        low = low.clamp(max=0)
    span = x.amax(dim=-1) - low
    span = torch.where(span > 0, span, 1.0)
    shifted = x - low[..., None]
    best_a, best_b = span / top, low
    best_error = (
        weights
        * (
            best_a[..., None] * torch.clamp(torch.round(shifted / best_a[..., None]), 0, top) + low[..., None] - x
        ).square()
    ).sum(-1)
    sw, sx = weights.sum(-1).expand_as(low), (weights * x).sum(-1)  # the same for every candidate
    for step in range(-steps, steps + 1):
        q = torch.round(shifted * ((top + 0.1 * step) / span)[..., None]).clamp_(0, top)
        weighted = weights * q
        sq, sqq, sqx = weighted.sum(-1), (weighted * q).sum(-1), weighted.mul_(x).sum(-1)
        det = sw * sqq - sq * sq
        solvable = det > 0
        safe = torch.where(solvable, det, 1.0)
        a = torch.where(solvable, (sw * sqx - sq * sx) / safe, best_a)
        b = torch.where(solvable, (sqq * sx - sq * sqx) / safe, best_b)
        if nonpositive_offset:
            clipped = b > 0
            a = torch.where(clipped, sqx / torch.where(sqq > 0, sqq, 1.0), a)
            b = torch.where(clipped, torch.zeros_like(b), b)
        a = a.clamp(min=0)
        error = q.mul_(a[..., None]).add_(b[..., None]).sub_(x).square_().mul_(weights).sum(-1)  # q, in place
        better = error < best_error
        best_a, best_b, best_error = (
            torch.where(better, new, old) for new, old in ((a, best_a), (b, best_b), (error, best_error))
        )
    return best_a, best_b


def _levels_search(x: torch.Tensor, book: Codebook, weights: torch.Tensor, steps: int = 9) -> torch.Tensor:
    """A per slice of x's last dimension minimising sum weights * (A v - x)^2 over levels v of `book`: for
    candidate rounding scales (the one putting the slice's extreme value on the level of largest magnitude, moved
    by one unit of the levels at a time), take the nearest levels, then their least-squares A
    (sum w x v / sum w v^2), and keep the best."""
    end = float(book.values[book.values.abs().argmax()])
    extreme = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    safe = torch.where(extreme == 0, 1.0, extreme)
    best_a = (extreme / end).squeeze(-1)
    best_error = torch.full_like(best_a, float("inf"))
    for step in range(-steps, steps + 1):
        v = book.values[book.nearest(x * ((end + step) / safe)).long()]
        denominator = (weights * v.square()).sum(dim=-1)
        a = (weights * x * v).sum(dim=-1) / torch.where(denominator > 0, denominator, 1.0)
        error = (weights * (x - a[..., None] * v).square()).sum(dim=-1)
        better = error < best_error
        best_a, best_error = torch.where(better, a, best_a), torch.where(better, error, best_error)
    return best_a


def _integers(values: torch.Tensor, step: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """values / step rounded into [low, high] (0 where step is 0)."""
    safe = torch.where(step == 0, 1.0, step)
    return torch.where(step == 0, 0.0, torch.clamp(torch.round(values / safe), low, high)).to(torch.int32)


def fit_statistics(kind: BlockType, weight: torch.Tensor, importance: torch.Tensor | None = None) -> BlockStatistics:
    """Stored statistics for weight (rows, columns), columns a whole number of blocks; `importance`: one weight
    per column (the Hessian's diagonal, an importance matrix) for the sub-block search, else all alike. Each row's
    are its own: the rows are fitted a few at a time."""
    chunks = row_slices(weight.shape[0], weight.shape[1], FIT_WEIGHTS)
    if importance is not None:  # a Hessian's diagonal is a view a whole row apart: every pass would stride over H
        importance = importance.float().contiguous()
    return _joined([_fit_rows(kind, weight[rows], importance) for rows in chunks])


def _fit_rows(kind: BlockType, weight: torch.Tensor, importance: torch.Tensor | None) -> BlockStatistics:
    rows, columns = weight.shape
    blocks = columns // kind.block
    x = weight.float().reshape(rows, blocks, kind.subs, kind.sub)
    weights = (
        torch.ones(blocks, kind.subs, kind.sub)
        if importance is None
        else importance.float().reshape(blocks, kind.subs, kind.sub)
    )
    if kind.has_min:
        a, b = _affine_search(x, weights.expand_as(x), 2**kind.bits - 1, nonpositive_offset=kind.k_quant)
    elif kind.levels is not None:
        a, b = _levels_search(x, kind.codebook, weights), None
    else:
        a, _ = search_symmetric(x, kind.bits, weights)
        b = None
    if not kind.k_quant:  # the block's float16 scale is the sub-block's
        return BlockStatistics(a[..., 0].half(), None if b is None else b[..., 0].half())
    if kind.signed_scales:  # the sub-block scale of largest magnitude lands on the end code, as for Q4_0's weights
        half = 2 ** (kind.scale_bits - 1)
        extreme = a.gather(-1, a.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        d = (extreme / -half).half()
        fitted = BlockStatistics(d, scales=_integers(a, d.float()[..., None], -half, half - 1))
    else:
        top = 2**kind.scale_bits - 1
        d, dmin = (a.amax(dim=-1) / top).half(), ((-b).amax(dim=-1) / top).half()
        fitted = BlockStatistics(
            d, dmin, _integers(a, d.float()[..., None], 0, top), _integers(-b, dmin.float()[..., None], 0, top)
        )
    return _chosen_integers(kind, x, weights.expand_as(x), fitted)


INTEGER_NEIGHBOURS = 1  # how far from its rounded value a sub-block's integer scale (or min) is tried


def _sub_block_errors(kind: BlockType, x: torch.Tensor, statistics: BlockStatistics, weights: torch.Tensor):
    """The weighted squared error of each sub-block (rows, blocks, subs) when x (rows, blocks, subs, sub) is
    rounded to the nearest codes of `statistics`."""
    weight = x.reshape(x.shape[0], -1)
    restored = decode(kind, codes_for(kind, weight, statistics), statistics).reshape(x.shape)
    return (weights * (x - restored).square()).sum(-1)


def _chosen_integers(kind: BlockType, x: torch.Tensor, weights: torch.Tensor, fitted: BlockStatistics):
    """`fitted` with each sub-block's integer scale (and min) chosen by the error of the codes it gives, d and dmin
    kept: among the rounded integers, their neighbours (scales, then mins, then scales again) and, on a uniform
    grid, the scale of the smallest gap between the sub-block's distinct values (on an affine type with each min
    that puts its lowest value on a code). Rounding A / d alone is not the best integer for the codes; a weight
    already on the type's grid (a de-quantized K-quant file) gets its own integers back."""
    half = 2 ** (kind.scale_bits - 1)
    min_range = (0, 2 * half - 1)
    scale_range = (-half, half - 1) if kind.signed_scales else min_range
    best = _sub_block_errors(kind, x, fitted, weights)
    chosen = {"scales": fitted.scales, "mins": fitted.mins}

    def consider(scales: torch.Tensor, mins: torch.Tensor | None) -> None:
        nonlocal best
        candidate = BlockStatistics(fitted.d, fitted.dmin, scales, mins)
        error = _sub_block_errors(kind, x, candidate, weights)
        better = error < best
        best = torch.where(better, error, best)
        chosen["scales"] = torch.where(better, scales, chosen["scales"])
        if mins is not None:
            chosen["mins"] = torch.where(better, mins, chosen["mins"])

    for field in ("scales", "mins", "scales") if kind.has_min else ("scales",):
        low, high = scale_range if field == "scales" else min_range
        base = chosen[field]
        for step in range(-INTEGER_NEIGHBOURS, INTEGER_NEIGHBOURS + 1):
            moved = (base + step).clamp(low, high)
            consider(*((moved, chosen["mins"]) if field == "scales" else (chosen["scales"], moved)))
    if kind.levels is None:  # on a uniform grid the smallest gap between distinct values is one step, d * |sc|
        values = x.sort(dim=-1).values
        gaps = values.diff(dim=-1)
        gap = torch.where(gaps > 0, gaps, torch.inf).amin(dim=-1)
        d = fitted.d.float()[..., None].abs()
        steps = torch.round(gap / torch.where(d == 0, 1.0, d))
        scales = torch.where(torch.isfinite(gap) & (d > 0), steps, chosen["scales"].float().abs())
        if not kind.has_min:  # the sign stays the fitted one
            scales = torch.where(chosen["scales"] < 0, -scales, scales)
            consider(scales.clamp(*scale_range).to(chosen["scales"].dtype), None)
        else:
            scales = scales.clamp(*scale_range).to(chosen["scales"].dtype)
            # the min that puts the lowest value on a code: of the codes it could have, the one whose min is
            # nearest an integer
            dmin = fitted.dmin.float()[..., None]
            codes = torch.arange(2**kind.bits, dtype=torch.float32)
            mins = (d * scales.float())[..., None] * codes - values[..., :1]
            mins = mins / torch.where(dmin == 0, 1.0, dmin)[..., None]
            nearest = (mins - mins.round()).abs().argmin(dim=-1, keepdim=True)
            mins = mins.gather(-1, nearest).squeeze(-1).round()
            consider(scales, mins.clamp(*min_range).to(chosen["mins"].dtype))
    return BlockStatistics(fitted.d, fitted.dmin, chosen["scales"], chosen["mins"])


def zero_points(kind: BlockType, statistics: BlockStatistics) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per sub-block, (rows, blocks * subs) each, in leanlm's grid form x = scale * (q - zero)
    (leanlm.formats.minmax), for rounding with error feedback; on a non-linear grid zero is 0 and x = scale * v(q)
    (`nearest_levels`)."""
    multiplier, offset = sub_block_grid(kind, statistics)
    safe = torch.where(multiplier == 0, 1.0, multiplier)
    zero = kind.offset - torch.where(multiplier == 0, 0.0, offset / safe)
    rows = multiplier.shape[0]
    return multiplier.reshape(rows, -1), zero.reshape(rows, -1)


def codes_for(kind: BlockType, weight: torch.Tensor, statistics: BlockStatistics) -> torch.Tensor:
    """The nearest codes (rows, columns) uint8 of weight under fitted statistics (round to nearest), a few rows at
    a time."""
    chunks = row_slices(weight.shape[0], weight.shape[1], FIT_WEIGHTS)
    if len(chunks) == 1:
        return _codes_for_rows(kind, weight, statistics)
    return torch.cat([_codes_for_rows(kind, weight[rows], _statistics_rows(statistics, rows)) for rows in chunks])


def _statistics_rows(statistics: BlockStatistics, rows: slice) -> BlockStatistics:
    return BlockStatistics(**{name: getattr(statistics, name)[rows] for name in _present(statistics)})


def _codes_for_rows(kind: BlockType, weight: torch.Tensor, statistics: BlockStatistics) -> torch.Tensor:
    rows, columns = weight.shape
    multiplier, offset = sub_block_grid(kind, statistics)
    x = weight.float().reshape(rows, columns // kind.block, kind.subs, kind.sub)
    if kind.levels is not None:
        return nearest_levels(kind, x, multiplier[..., None])[0].reshape(rows, columns)
    safe = torch.where(multiplier == 0, 1.0, multiplier)[..., None]
    q = torch.round((x - offset[..., None]) / safe) + kind.offset
    q = torch.where(multiplier[..., None] == 0, float(kind.offset), q)
    return torch.clamp(q, 0, 2**kind.bits - 1).to(torch.uint8).reshape(rows, columns)


def nearest_levels(kind: BlockType, x: torch.Tensor, multiplier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-linear type's nearest codes (uint8) of x under the multipliers A broadcast against it, and the values
    A * v(code) they stand for (a zero A takes the level nearest zero)."""
    book = kind.codebook
    safe = torch.where(multiplier == 0, 1.0, multiplier)
    codes = book.nearest(torch.where(multiplier == 0, 0.0, x / safe))
    return codes, multiplier * book.values[codes.long()]
