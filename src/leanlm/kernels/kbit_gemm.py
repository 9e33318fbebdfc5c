"""The weight-only k-bit linear: y = x @ W^T + b with W = codebook[codes] * absmax[block].

`reference` is plain PyTorch (de-quantize the whole weight, then matmul): the test oracle, and the path for
layouts the kernels do not read. `avx2` is leanlm's C++ kernel (`csrc/kbit4_gemm.cpp`), compiled on
first use with the system's C++ compiler into leanlm's cache: for small M (decode) it decodes 4-bit codes in
registers and never writes a float weight (memory-bound: 4.5 bits moved per weight instead of 32), with an
AVX-512 variant chosen at run time where the CPU has it (`KernelIsa`); for large M it decodes tiles of output
rows straight into the GEMM's dtype (float32 or bfloat16) and hands them to PyTorch's GEMM, so the decoding is
amortised over M.

PyTorch's own CPU ops were the first choice and do not fit: `_weight_int4pack_mm_for_cpu` is affine int4 (no
code book, so no NF4/FP4), `_weight_int8pack_mm` is 8-bit per-channel only.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

import torch

from leanlm.errors import ConfigError
from leanlm.formats.packing import preferred_layout, unpack
from leanlm.kernels.cpu import has_native_bf16
from leanlm.storage import cache_root, exclusive_lock

KbitBackend = Literal["reference", "avx2"]
# The small-M kernel: "auto" = the fastest this CPU runs (int8 activations where the layout allows); the others
# name one, for tests and benchmarks. The float kernels ("avx512", "avx2", "in-order") serve M <= SMALL_M and
# keep x in float32; the int8 ones quantize x (llama.cpp's Q8_0 way) and, when named, serve every M.
KernelIsa = Literal["auto", "avx512", "avx2", "in-order", "avx512-vnni-int8", "avx2-int8"]
# The int8-activation kernels by the instruction set each runs (a name of the extension's `ISAS`).
INT8_ISAS = {"avx512-vnni-int8": "avx512", "avx2-int8": "avx2"}
INT8_CHUNK = 64  # activations are quantized per chunk of this many values; the int8 kernel's blocks are multiples
SMALL_M = 16  # up to this many rows the register-decoding GEMV wins; above, decode tiles + SGEMM
TILE_ROWS = 512  # output rows decoded at once on the large-M path (TILE_ROWS x K of scratch in the GEMM's dtype)
_SOURCE = Path(__file__).parent / "csrc" / "kbit4_gemm.cpp"
_log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    """One build directory per (kernel source, torch install): two checkouts or venvs never rebuild over each
    other's objects, and an edited source never loads a stale library."""
    sources = b"".join(path.read_bytes() for path in sorted(_SOURCE.parent.iterdir()))  # the .cpp and what it includes
    key = hashlib.sha256(sources + str(Path(torch.__file__).parent).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"torch-{torch.__version__}-{key}"


@lru_cache(maxsize=1)
def compiled_kernels():
    """leanlm's compiled CPU kernels (the 4-bit ones here, the float GEMV of `float_gemv`), or None (with the
    reason logged once) where they cannot be built or run."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _log.warning("k-bit kernel: this CPU has no AVX2; using the reference path")
        return None
    try:
        from torch.utils import cpp_extension

        directory = _cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        # torch guards the build with a bare `lock` file that a killed build leaves behind, after which every
        # later load waits on it forever (this hung CI once). An flock is released by the kernel when its holder
        # dies, so whoever holds it knows any `lock` file is stale and may remove it.
        with exclusive_lock(directory / "build.flock"):
            (directory / "lock").unlink(missing_ok=True)
            return cpp_extension.load(
                name="leanlm_kbit4",
                sources=[str(_SOURCE)],
                build_directory=str(directory),
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as error:  # no compiler, no headers: the reference path still works
        _log.warning("k-bit kernel could not be built (%s); using the reference path", str(error).splitlines()[0])
        return None


def isa_code(extension, isa: str) -> int:
    """The extension's code for kernel `isa` (an int8 kernel's: its instruction set's)."""
    return extension.ISAS[INT8_ISAS.get(isa, isa)]


def avx2_available() -> bool:
    return compiled_kernels() is not None


def kernel_isas() -> list[str]:
    """The small-M kernels this machine runs ("in-order" is the fallback for rows not a multiple of 64)."""
    extension = compiled_kernels()
    if extension is None:
        return []
    return (["avx512"] if extension.has_avx512() else []) + ["avx2", "in-order"]


def int8_kernel_isas() -> list[str]:
    """The int8-activation kernels this machine runs."""
    extension = compiled_kernels()
    if extension is None:
        return []
    return (["avx512-vnni-int8"] if extension.has_avx512_vnni() else []) + ["avx2-int8"]


def supports_int8_activations(block_size: int, in_features: int, bits: int = 4) -> bool:
    """The int8 kernel's layout: one block constant per chunk of 64 activations; 3-bit codes (in the planes layout,
    rows of a multiple of 64) may also have blocks of 16 or 32, each 16 codes of a chunk being scaled on their own."""
    small = bits == 3 and block_size in (16, 32)
    return (block_size % INT8_CHUNK == 0 or small) and in_features % block_size == 0 and in_features % INT8_CHUNK == 0


# 8-bit codes of the symmetric int code book (`codebooks.codebook("int", 8)`: value (code - 127) / 127) are the
# int8 weight plus 127, which the kernel reads as they are stored: no table.
INT8_CODE_BIAS = 127
_NO_TABLE = torch.zeros(16, dtype=torch.int8)


def is_int8_code_book(values: torch.Tensor) -> bool:
    """Whether an 8-bit code book is the symmetric int one the 8-bit kernel assumes."""
    grid = (torch.arange(255, dtype=torch.float32) - INT8_CODE_BIAS) / INT8_CODE_BIAS
    return values.numel() == 256 and torch.allclose(values[:255].float(), grid, rtol=0, atol=1e-7)


def default_backend() -> KbitBackend:
    return "avx2" if avx2_available() else "reference"


def supports_fast_path(bits: int, block_size: int, in_features: int) -> bool:
    """The kernel's layout: 4-bit codes, blocks of a multiple of 16 values that tile each row exactly."""
    return bits == 4 and block_size % 16 == 0 and in_features % block_size == 0


def code_table(values: torch.Tensor) -> torch.Tensor:
    """A code book as the kernel's 16-entry float32 table (smaller code books are padded; the padding is never
    indexed because no code points at it)."""
    if values.numel() > 16:
        raise ConfigError(f"a 4-bit table has 16 entries, got a code book of {values.numel()}")
    table = torch.zeros(16, dtype=torch.float32)
    table[: values.numel()] = values.float()
    return table


@lru_cache(maxsize=64)
def _int8_table(values: tuple[float, ...]) -> tuple[torch.Tensor, float]:
    table = torch.tensor(values, dtype=torch.float32)
    if torch.equal(table, table.round()) and table.abs().max() <= 127:
        return table.to(torch.int8), 1.0  # small integers (GPTQ's 0..15) stay exact
    factor = 127.0 / float(table.abs().max())
    return (table * factor).round().to(torch.int8), 1.0 / factor


def int8_table(table: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A 16-entry float code table as the int8 kernel reads it: (int8 values, factor back to the table's scale)."""
    return _int8_table(tuple(table.tolist()))


def int8_kernel_table(table: torch.Tensor | None, bits: int) -> tuple[torch.Tensor, float]:
    """What the int8 kernel reads for a layer's code book: 3 or 4 bits, `int8_table`; 8-bit int codes, no table (the
    codes are the int8 values plus 127) and the factor 1 / 127."""
    return (_NO_TABLE, 1.0 / INT8_CODE_BIAS) if bits == 8 else int8_table(table)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (int8 codes (M, K / 64, 64) in x's order, float32 scales (M, K / 64)): per chunk of 64,
    scale = amax / 127 and codes = round(x / scale), as the kernel quantizes (it then stores them reordered)."""
    chunks = x.reshape(x.shape[0], -1, INT8_CHUNK)
    scale = chunks.abs().amax(dim=2) / 127.0
    codes = torch.where(scale[..., None] > 0, chunks / scale[..., None], torch.zeros(())).round()
    return codes.to(torch.int8), scale


def reference_int8_activations(
    x: torch.Tensor,
    packed: torch.Tensor,
    constants: BlockConstants,
    table: torch.Tensor | None,
    out_features: int,
    block_size: int,
    bits: int = 4,
) -> torch.Tensor:
    """The int8 kernel's oracle in plain PyTorch: x quantized per chunk, the 3- or 4-bit code book rounded to int8
    (8-bit codes are int8 values already), the dot product of each chunk (or of each block, where blocks are
    smaller) exact (int64), then scaled by the block constant and the chunk's scale (in float64)."""
    codes, x_scale = quantize_activations(x)
    if bits == 8:
        weight_codes, inverse = packed.long() - INT8_CODE_BIAS, 1.0 / INT8_CODE_BIAS
    else:
        values, inverse = int8_table(table)
        weight_codes = values[unpack(packed, bits, out_features * x.shape[1], preferred_layout(bits)).long()]
    part = min(block_size, INT8_CHUNK)  # columns of one exact dot product: one weight and one x scale
    weight_codes = weight_codes.reshape(out_features, -1, part)
    dots = torch.einsum("mck,nck->mnc", codes.reshape(x.shape[0], -1, part).long(), weight_codes.long())  # exact
    weight_scale = (
        constants.dense().double().reshape(out_features, -1).repeat_interleave(block_size // part, dim=1) * inverse
    )
    x_scale = x_scale.double().repeat_interleave(INT8_CHUNK // part, dim=1)
    return (dots.double() * weight_scale[None] * x_scale[:, None, :]).sum(dim=2).float()


@dataclass(frozen=True)
class BlockConstants:
    """The per-block constants as the kernel reads them: float32 (`absmax`), or as double quantization (QLoRA)
    stores them: `absmax` holds uint8 codes into `code_values` (256 entries), scaled by one float32 of `scales`
    per `group` codes, plus `offset`. The kernel decodes a row's constants when it reaches the row, so no float32
    copy of them is kept (half a bit per weight at blocks of 64)."""

    absmax: torch.Tensor
    scales: torch.Tensor | None = None
    code_values: torch.Tensor | None = None
    offset: float = 0.0
    group: int = 256

    def dense(self) -> torch.Tensor:
        """Every constant in float32 (the reference: the values the kernel computes, rounded the same way)."""
        if self.scales is None:
            return self.absmax
        return self._decoded(torch.arange(self.absmax.numel()))

    def rows(self, index: slice | torch.Tensor, per_row: int) -> torch.Tensor:
        """The float32 constants of the weight rows `index` (a slice, or row ids), (rows, per_row): `dense()`'s
        values at those rows, decoded without decoding the others (an 8-bit head's embedding reads a few rows of
        262144 per token)."""
        if isinstance(index, slice):
            index = torch.arange(*index.indices(self.absmax.numel() // per_row))
        blocks = index.long()[:, None] * per_row + torch.arange(per_row)
        return self.absmax[blocks] if self.scales is None else self._decoded(blocks)

    def _decoded(self, blocks: torch.Tensor) -> torch.Tensor:
        """The double-quantized constants of block numbers `blocks` (any shape), in float32."""
        return self.code_values[self.absmax[blocks].long()] * self.scales[blocks // self.group] + self.offset

    def decoded_once(self) -> BlockConstants:
        """These constants in float32, decoded by the C++ kernel (`dense()` is its oracle, bit for bit): kernels
        then read them without decoding one per block, for 0.5 bits a weight (blocks of 64) more memory."""
        if self.scales is None:
            return self
        return BlockConstants(compiled_kernels().decode_block_constants(self.absmax, **self.kernel_arguments()))

    def kernel_arguments(self) -> dict:
        if self.scales is None:
            return {}
        return {
            "dq_scales": self.scales,
            "dq_values": self.code_values,
            "dq_offset": self.offset,
            "dq_group": self.group,
        }


class SparseRows:
    """A sparse part of a weight (SpQR's outliers), CSR by output row: multiplied on its own at decode sizes, and at
    prefill sizes added into each decoded tile before it is rounded (a sparse matmul over 512 tokens took longer
    than the dense GEMM)."""

    def __init__(self, row_offsets: torch.Tensor, columns: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]):
        self.row_offsets, self.columns, self.values = row_offsets.int(), columns.int(), values.float()
        self.rows = torch.repeat_interleave(torch.arange(shape[0], dtype=torch.int32), self.row_offsets.diff())
        with warnings.catch_warnings():  # "sparse CSR support is in beta": the ops used here are stable
            warnings.simplefilter("ignore", UserWarning)
            self.matrix = torch.sparse_csr_tensor(
                self.row_offsets, self.columns, self.values, shape, check_invariants=False
            )

    @staticmethod
    def bytes_for(rows: int, entries: int) -> int:
        """What the form holds beside the stored tensors: 32-bit row offsets, columns and rows, float32 values."""
        return 4 * (rows + 1) + (4 + 4 + 4) * entries

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) float32 times the sparse part, transposed: (M, N)."""
        return (self.matrix @ x.T).T

    def add_to(self, tile: torch.Tensor, first_row: int) -> None:
        """Adds the entries of rows first_row .. first_row + len(tile) into `tile` (float32, those rows)."""
        start, end = int(self.row_offsets[first_row]), int(self.row_offsets[first_row + tile.shape[0]])
        tile.index_put_(
            (self.rows[start:end] - first_row, self.columns[start:end]), self.values[start:end], accumulate=True
        )


def per_group(groups: Sequence[int] | None, x: torch.Tensor, out: torch.Tensor, product: Callable) -> None:
    """`product(rows of x, rows of out)` for each group of consecutive rows in turn (a GEMM whose rounding could
    depend on its row count, run on the rows a group has alone), or once for all rows without groups."""
    if groups is None:
        product(x, out)
        return
    start = 0
    for length in groups:
        product(x[start : start + length], out[start : start + length])
        start += length


def prefill_dtype(activations: torch.dtype) -> torch.dtype:
    """The GEMM dtype of the large-M path for a model computing in `activations`: bfloat16 where the model computes
    in it and the CPU multiplies bfloat16 in hardware (elsewhere PyTorch emulates it, slower than float32), else
    float32."""
    return torch.bfloat16 if activations == torch.bfloat16 and has_native_bf16() else torch.float32


def kbit_linear(
    x: torch.Tensor,  # (M, K) float32, or (read only by the large-M path's GEMM) in compute_dtype
    packed: torch.Tensor,  # uint8, two codes per byte, first code in the high nibble
    absmax: torch.Tensor | BlockConstants,  # (N * K / block,) float32, or double-quantized
    table: torch.Tensor,  # the code book as float32: (16,) for 3 or 4 bits (`code_table`), (256,) for 8
    out_features: int,
    block_size: int,
    bias: torch.Tensor | None,
    backend: KbitBackend,
    isa: KernelIsa = "auto",
    int8_activations: bool = True,  # whether "auto" may quantize x at decode sizes (not under autograd: see nn)
    bits: int = 4,  # 8: codes of the int code book, one byte each; 3: the planes layout (both: no float GEMV)
    compute_dtype: torch.dtype = torch.float32,  # the large-M path's GEMM: float32, or bfloat16 (see below)
    # (N, K / block) float32 added to every weight of its block: an asymmetric grid's -scale * zero (GPTQ / SpQR)
    block_offsets: torch.Tensor | None = None,
    sparse: SparseRows | None = None,  # a sparse part added to the weight (SpQR's outliers)
    # rows in groups of consecutive rows, each computed exactly as those rows alone (`leanlm.nn.rows`); every group
    # must select the same path (the caller splits them): its largest decides
    groups: Sequence[int] | None = None,
) -> torch.Tensor:
    in_features = x.shape[1]
    constants = absmax if isinstance(absmax, BlockConstants) else BlockConstants(absmax)
    if backend == "reference":
        x = x.float()
        codes = unpack(packed, 4, out_features * in_features).long()
        weight = table[codes].reshape(-1, block_size) * constants.dense()[:, None]
        if block_offsets is not None:
            weight += block_offsets.reshape(-1, 1)
        weight = weight.reshape(out_features, in_features)
        if sparse is not None:
            sparse.add_to(weight, 0)
        return torch.nn.functional.linear(x, weight, bias)
    if backend != "avx2":
        raise ValueError(f"unknown k-bit backend {backend!r}; choose reference or avx2")
    if isa not in get_args(KernelIsa):
        raise ConfigError(f"unknown k-bit kernel {isa!r}; choose one of {', '.join(get_args(KernelIsa))}")
    extension = compiled_kernels()
    if extension is None:
        raise ConfigError("the avx2 k-bit kernel is not available on this machine (see the warning logged)")
    rows_alone = x.shape[0] if groups is None else max(groups)
    int8 = isa in INT8_ISAS or (
        isa == "auto"
        and int8_activations
        and rows_alone <= SMALL_M
        and supports_int8_activations(block_size, in_features, bits)
    )
    # 3- and 8-bit codes have no float-activation GEMV: outside the int8 kernel they take the tiles at any M
    small = int8 or bits == 4 and rows_alone <= SMALL_M
    x = x.float().contiguous() if small else x
    if small and not int8 and groups is not None:  # the float GEMV reads a call's rows together: one call a group
        arguments = (packed, absmax, table, out_features, block_size, bias, backend, isa, int8_activations, bits)
        out = torch.empty(x.shape[0], out_features)
        per_group(
            groups,
            x,
            out,
            lambda rows, into: into.copy_(kbit_linear(rows, *arguments, compute_dtype, block_offsets, sparse)),
        )
        return out
    if int8:
        values, inverse = int8_kernel_table(table, bits)
        out = extension.kbit_gemv_int8(
            x,
            packed,
            constants.absmax,
            values,
            inverse,
            out_features,
            block_size,
            bits,
            isa_code(extension, isa if isa in INT8_ISAS else "auto"),
            **constants.kernel_arguments(),
        )
    elif small:
        out = extension.kbit4_gemv(
            x,
            packed,
            constants.absmax,
            table,
            out_features,
            block_size,
            isa_code(extension, isa),
            **constants.kernel_arguments(),
        )
    else:
        # A tile of output rows of W at a time is decoded into the GEMM's dtype and multiplied into its own columns
        # of out. The table is the code book in float32 (3 bits: 8 entries padded to 16; 8 bits: 256). In bfloat16
        # (a model computing in bfloat16, on a CPU with bfloat16 products) the decoded weights are rounded to
        # bfloat16 for oneDNN's bfloat16 GEMM, faster than float32's SGEMM where the CPU has bfloat16 products
        # (benchmarks/kbit_speed.py): the weights bitsandbytes computes with at compute_dtype=bfloat16. Block
        # offsets and sparse outliers go into the weight before it is rounded, so the operand is centred as a float
        # model's weight is (s * (q - z), not s * q rounded and then shifted).
        x = x.to(compute_dtype)
        out = torch.empty(x.shape[0], out_features, dtype=compute_dtype)
        decoded_dtype = torch.float32 if sparse is not None else compute_dtype  # outliers are added in float32
        decoded = torch.empty(min(TILE_ROWS, out_features), in_features, dtype=decoded_dtype)
        rounded = decoded if decoded_dtype == compute_dtype else torch.empty_like(decoded, dtype=compute_dtype)
        for first in range(0, out_features, TILE_ROWS):
            tile = decoded[: min(TILE_ROWS, out_features - first)]
            extension.dequantize_rows(
                packed,
                constants.absmax,
                table,
                block_size,
                first,
                tile,
                **constants.kernel_arguments(),
                bits=bits,
                block_offsets=block_offsets,
            )
            if sparse is not None:
                sparse.add_to(tile, first)
            operand = tile if rounded is decoded else rounded[: tile.shape[0]].copy_(tile)
            columns = out[:, first : first + tile.shape[0]]
            per_group(groups, x, columns, lambda rows, into: torch.mm(rows, operand.T, out=into))
    if small and block_offsets is not None:  # sum over a block of (offset * x) = offset * (the block's sum of x)
        per_group(
            groups,
            x,
            out,
            lambda rows, into: into.addmm_(rows.reshape(rows.shape[0], -1, block_size).sum(dim=2), block_offsets.T),
        )
    if small and sparse is not None:
        per_group(groups, x, out, lambda rows, into: into.add_(sparse.product(rows)))
    return out.add_(bias) if bias is not None else out


def dequantize_weight(
    packed: torch.Tensor,
    absmax: torch.Tensor | BlockConstants,
    table: torch.Tensor,
    out_features: int,
    in_features: int,
    block_size: int,
) -> torch.Tensor:
    """The whole (out, in) float32 weight, decoded by the kernel (the backward pass of a frozen k-bit layer)."""
    extension = compiled_kernels()
    if extension is None:
        raise ConfigError("the avx2 k-bit kernel is not available on this machine (see the warning logged)")
    constants = absmax if isinstance(absmax, BlockConstants) else BlockConstants(absmax)
    weight = torch.empty(out_features, in_features, dtype=torch.float32)
    extension.dequantize_rows(packed, constants.absmax, table, block_size, 0, weight, **constants.kernel_arguments())
    return weight
