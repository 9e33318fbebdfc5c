"""SpQRLinear: the stored form of an RTN / GPTQ / SpQR weight (Dettmers' thesis section 4.4.2), in four parts:

1. b-bit min-max codes of the dense weight, bit-packed, columns in the solver's (act-order) order;
2. first-level statistics, one scale and one zero per row per beta1-column group: float16 (GPTQ), or
   statistic_bits-bit codes (SpQR) ...
3. ... with second-level float16 (scale, zero) per beta2 consecutive rows of each group's statistics;
4. sparse outliers as CSR: int32 row offsets, int16 column indices, float16 values. A value is stored as the
   difference from the dense part at its position, so dense + sparse is exact and the dense code there need
   not be special. (The chapter's 8-bit delta encoding of column indices is not used: 16 bits per index.)

The permutation (int16 per input column) maps the solver's column order back. `bits_per_weight` counts every
stored tensor. Three forward paths:
- `reference` de-quantizes the whole weight (outliers included) and runs one matmul: the test oracle;
- `dense_sparse` runs the de-quantized dense part, then adds the outliers' products;
- `kernel` (4-bit codes, and 3-bit codes in the planes layout) reuses the k-bit kernels: a group's weights are
  scale * q + offset (offset = -scale * zero), so at decode sizes y = kbit(x, codes, scale, table 0..2^b - 1) +
  (per-block sums of x) @ offset^T + the outliers' product; at prefill sizes each tile of 512 rows the kernel
  decodes takes its offsets and outliers before the GEMM (`kbit_linear`'s block_offsets and sparse). The
  kernel's blocks must tile each row, and a row need not be a whole number of groups (SmolLM2's 576 columns in
  groups of 128 end on a group of 64), so it runs blocks of gcd(group, columns) columns, each with its group's
  scale and offset. The default wherever those blocks are a multiple of 16 (4 bits) or the int8 kernel reads
  them (3 bits: 16, 32 or a multiple of 64).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.formats.gguf_blocks import BLOCK_TYPES, BlockStatistics
from leanlm.formats.gguf_blocks import pack as pack_blocks
from leanlm.formats.gptq import SolvedWeight, SolverSettings
from leanlm.formats.packing import CodeLayout, pack, packed_bytes, preferred_layout, unpack
from leanlm.kernels.kbit_gemm import (
    SMALL_M,
    SparseRows,
    avx2_available,
    compiled_kernels,
    int8_kernel_table,
    kbit_linear,
    per_group,
    prefill_dtype,
    supports_fast_path,
    supports_int8_activations,
)
from leanlm.nn.base import QuantizedModule
from leanlm.nn.rows import by_path, groups_of, linear_by_group

SpQRBackend = Literal["reference", "dense_sparse", "kernel"]
IDENTITY_TABLE = torch.arange(16, dtype=torch.float32)  # 3- and 4-bit codes are the integers themselves
GGUF_TYPES = {4: "q4_0", 8: "q8_0"}  # code bits -> the GGUF block type of symmetric groups of 32


class SpQRLinear(QuantizedModule):
    kind = "RTN / GPTQ / SpQR groups"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bits: int,
        group_size: int | None,
        statistic_bits: int | None,
        statistic_group_size: int,
        outliers: int,
        permuted: bool,
        code_layout: CodeLayout = "stream",
    ):  # how `codes` holds them; older checkpoints lack it
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.statistic_bits, self.statistic_group_size = bits, statistic_bits, statistic_group_size
        self.code_layout = code_layout
        self.group_size = group_size or in_features
        self.per_row = group_size is None
        self.backend: SpQRBackend | None = None  # None: the kernel where it applies, chosen at the first forward
        self._kernel_inputs = None  # (float32 scales flat, offsets (rows, groups)), until `forget_runtime_forms`
        self._sparse: SparseRows | None = None  # the outliers, until `forget_runtime_forms`
        groups = -(-in_features // self.group_size)
        self.register_buffer(
            "codes", torch.zeros(packed_bytes(out_features * in_features, bits, code_layout), dtype=torch.uint8)
        )
        if statistic_bits is None:
            self.register_buffer("scale", torch.zeros(out_features, groups, dtype=torch.float16))
            self.register_buffer("zero", torch.zeros(out_features, groups, dtype=torch.float16))
        else:
            count = out_features * groups
            row_groups = -(-out_features // statistic_group_size)
            self.register_buffer("scale_codes", torch.zeros(packed_bytes(count, statistic_bits), dtype=torch.uint8))
            self.register_buffer("zero_codes", torch.zeros(packed_bytes(count, statistic_bits), dtype=torch.uint8))
            self.register_buffer("scale_second", torch.zeros(groups, row_groups, 2, dtype=torch.float16))
            self.register_buffer("zero_second", torch.zeros(groups, row_groups, 2, dtype=torch.float16))
        if in_features > torch.iinfo(torch.int16).max:
            raise ConfigError(f"SpQRLinear stores column indices in 16 bits; {in_features} input features do not fit")
        self.register_buffer("permutation", torch.zeros(in_features, dtype=torch.int16) if permuted else None)
        self.register_buffer("outlier_row_offsets", torch.zeros(out_features + 1, dtype=torch.int32))
        self.register_buffer("outlier_columns", torch.zeros(outliers, dtype=torch.int16))
        self.register_buffer("outlier_values", torch.zeros(outliers, dtype=torch.float16))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_solved(cls, solved: SolvedWeight, settings: SolverSettings, bias: torch.Tensor | None) -> SpQRLinear:
        rows, columns = solved.codes.shape
        module = cls(
            columns,
            rows,
            bias is not None,
            settings.bits,
            settings.group_size,
            settings.statistic_bits,
            settings.statistic_group_size,
            int(solved.outlier_mask.sum()),
            solved.permutation is not None,
            preferred_layout(settings.bits),
        )
        module.codes = pack(solved.codes, settings.bits, module.code_layout)
        if settings.statistic_bits is None:
            module.scale = torch.stack([s.values for s in solved.scales], dim=1).half()
            module.zero = torch.stack([z.values for z in solved.zeros], dim=1).half()
        else:
            for name, statistics in (("scale", solved.scales), ("zero", solved.zeros)):
                codes = torch.stack([s.codes for s in statistics], dim=1)  # (rows, groups)
                setattr(module, f"{name}_codes", pack(codes, settings.statistic_bits))
                setattr(module, f"{name}_second", torch.stack([s.second_level for s in statistics]))
        if solved.permutation is not None:
            module.permutation = solved.permutation.to(torch.int16)
        row_index, column_index = solved.outlier_mask.nonzero(as_tuple=True)  # row-major order: CSR order
        module.outlier_row_offsets = torch.cat(
            [torch.zeros(1, dtype=torch.int64), solved.outlier_mask.sum(dim=1).cumsum(0)]
        ).to(torch.int32)
        module.outlier_columns = column_index.to(torch.int16)
        module.outlier_values = solved.outlier_residuals[row_index, column_index].half()
        module.keep_bias(bias)
        return module

    def constructor_args(self) -> dict:
        return {
            **self.linear_args(),
            "bits": self.bits,
            "group_size": None if self.per_row else self.group_size,
            "statistic_bits": self.statistic_bits,
            "statistic_group_size": self.statistic_group_size,
            "outliers": self.outlier_values.numel(),
            "permuted": self.permutation is not None,
            "code_layout": self.code_layout,
        }

    def _statistic(self, name: str) -> torch.Tensor:
        """(rows, groups) float32 scales or zeros, de-quantized from whatever is stored."""
        if self.statistic_bits is None:
            return getattr(self, name).float()
        groups = getattr(self, f"{name}_second").shape[0]
        codes = unpack(getattr(self, f"{name}_codes"), self.statistic_bits, self.out_features * groups)
        codes = codes.reshape(self.out_features, groups).float()
        second = getattr(self, f"{name}_second").float()  # (groups, row groups, 2)
        row_group = torch.arange(self.out_features) // self.statistic_group_size
        scale, zero = second[:, row_group, 0].T, second[:, row_group, 1].T  # (rows, groups)
        return scale * (codes - zero)

    def dense_weight(self) -> torch.Tensor:
        """The de-quantized codes (rows, columns), in the solver's column order, outliers not included."""
        codes = unpack(self.codes, self.bits, self.out_features * self.in_features, self.code_layout)
        codes = codes.reshape(self.out_features, self.in_features).float()
        column_group = torch.arange(self.in_features) // self.group_size
        return self._statistic("scale")[:, column_group] * (codes - self._statistic("zero")[:, column_group])

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) weight this layer computes with, in the original column order."""
        weight = self.dense_weight()
        if self.outlier_count:
            self._outliers().add_to(weight, 0)
        if self.permutation is None:
            return weight
        restored = torch.empty_like(weight)
        restored[:, self.permutation.long()] = weight
        return restored

    def _fractional_zeros(self) -> bool:
        """Float zeros off the symmetric grid's middle code (quantized statistics are codes themselves: no grid)."""
        return self.statistic_bits is None and not bool((self.zero == 2 ** (self.bits - 1)).all())

    def gguf_problems(self) -> list[str]:
        problems = []
        if self.statistic_bits is not None or self.outlier_count:
            problems.append("--method rtn or gptq (SpQR's quantized statistics and outliers have no GGUF form)")
        if self.bits not in GGUF_TYPES:
            problems.append(f"--bits 4 or 8 (Q4_0 holds 4-bit codes, Q8_0 8-bit; not {self.bits})")
        block = BLOCK_TYPES["q4_0"].block
        if self.per_row or self.group_size != block:
            problems.append(
                f"--group-size {block} (a block is {block} columns, not "
                f"{self.in_features if self.per_row else self.group_size})"
            )
        if self.permutation is not None:
            problems.append("--static-groups or --no-act-order (a block is 32 consecutive columns)")
        if self._fractional_zeros():
            problems.append(f"--grid symmetric (Q4_0 / Q8_0 put zero at code {2 ** (self.bits - 1)})")
        return problems

    def gguf_type(self):
        return BLOCK_TYPES[GGUF_TYPES[self.bits]].ggml

    def fused_problem(self) -> str | None:
        if self._resolve_backend() != "kernel" or not supports_int8_activations(
            self.kernel_block, self.in_features, self.bits
        ):
            return (
                f"{self.extra_repr()} (the fused step runs 3- and 4-bit GPTQ / SpQR codes in kernel blocks of a "
                f"multiple of 64, or 3-bit ones of 16 or 32; these are {self.kernel_block} columns)"
            )
        return None

    def add_to_fused(self, decoder, compact_constants: bool) -> int:
        """The codes go to the step as a k-bit linear whose code book is the integers, with each block's offset,
        the act-order permutation and the sparse outliers beside them."""
        scale, offset = self.kernel_constants()
        values, inverse = int8_kernel_table(IDENTITY_TABLE, self.bits)
        linear = decoder.add_linear(
            compiled_kernels().LINEAR_KINDS[f"kbit{self.bits}"],
            self.codes,
            self.in_features,
            self.out_features,
            None if self.bias is None else self.bias.detach(),
            scale,
            values,
            inverse,
            self.kernel_block,
        )
        outliers = {}
        if self.outlier_count:
            outliers = {
                "outlier_row_offsets": self.outlier_row_offsets,
                "outlier_columns": self.outlier_columns,
                "outlier_values": self.outlier_values,
            }
        decoder.add_spqr_parts(linear, offset, self.permutation, **outliers)
        return linear

    def compressed_tensors_problems(self) -> list[str]:
        problems = []
        if self.statistic_bits is not None or self.outlier_count:
            problems.append("--method rtn or gptq (SpQR's quantized statistics and outliers have no such form)")
        if self.permutation is not None:
            problems.append("--static-groups or --no-act-order (act-order columns)")
        if self.bits not in (4, 8):
            problems.append(f"--bits 4 or 8 (int4 and int8 are written, not {self.bits}-bit codes)")
        if not self.per_row and self.in_features % self.group_size:
            problems.append(
                f"a --group-size that divides every layer's input columns (a last group of "
                f"{self.in_features % self.group_size} columns of {self.in_features} in groups of "
                f"{self.group_size}; compressed-tensors packs whole groups)"
            )
        if self._fractional_zeros():
            problems.append(
                f"--grid symmetric (the min-max grid's fractional zeros; compressed-tensors' symmetric grid has zero "
                f"at {2 ** (self.bits - 1)})"
            )
        return problems

    def compressed_tensors_scheme(self) -> tuple[dict, str]:
        """Symmetric groups along the input, value = scale * (code - 2^(b-1)), packed."""
        strategy = {"strategy": "channel"} if self.per_row else {"strategy": "group", "group_size": self.group_size}
        return {"weights": {"num_bits": self.bits, "type": "int", "symmetric": True, **strategy}}, "pack-quantized"

    def compressed_tensors_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.dequantized_weight(), "weight_scale": self.scale.float()}

    def gguf_blocks(self):
        """Symmetric groups of 32 are Q4_0 (4 bits) / Q8_0 (8 bits) blocks: the codes, and the group's float16
        scale as the block's d."""
        kind = BLOCK_TYPES[GGUF_TYPES[self.bits]]
        codes = unpack(self.codes, self.bits, self.out_features * self.in_features, self.code_layout)
        blocks = pack_blocks(kind, codes.reshape(self.out_features, self.in_features), BlockStatistics(self.scale))
        return blocks.numpy(), self.gguf_type()

    @property
    def outlier_count(self) -> int:
        return self.outlier_values.numel()

    def forget_runtime_forms(self) -> None:
        self._kernel_inputs = self._sparse = None

    def _outliers(self) -> SparseRows | None:
        """The sparse part (columns in the solver's order), built once; None without outliers."""
        if self._sparse is None and self.outlier_count:
            self._sparse = SparseRows(
                self.outlier_row_offsets,
                self.outlier_columns,
                self.outlier_values,
                (self.out_features, self.in_features),
            )
        return self._sparse

    @property
    def kernel_block(self) -> int:
        """Columns per block of the kernel: the largest that tiles every row and lies within one group."""
        return math.gcd(self.group_size, self.in_features)

    def _kernel_fits(self) -> bool:
        """Whether the k-bit kernels read this layout (on a CPU that runs them)."""
        return (
            self.bits == 4
            and supports_fast_path(4, self.kernel_block, self.in_features)
            or self.bits == 3
            and self.code_layout == "planes"
            and supports_int8_activations(self.kernel_block, self.in_features, 3)
        )

    def _resolve_backend(self) -> SpQRBackend:
        if self.backend is None:
            self.backend = "kernel" if self._kernel_fits() and avx2_available() else "dense_sparse"
        return self.backend

    def runtime_bytes(self) -> int:
        """The kernel's float32 scale and offset per kernel block (`kernel_constants`) and the outliers' sparse
        form (`SparseRows`)."""
        fits = self._kernel_fits() if self.backend is None else self.backend == "kernel"
        constants = 2 * 4 * self.out_features * (self.in_features // self.kernel_block) if fits else 0
        sparse = SparseRows.bytes_for(self.out_features, self.outlier_count) if self.outlier_count else 0
        return constants + sparse

    def kernel_constants(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the kernel path reads beside the codes (built once): one scale per kernel block, flat
        (rows * blocks,), and each block's offset -scale * zero (rows, blocks); the code book is 0..2^b - 1."""
        if self._kernel_inputs is None:  # each kernel block takes its group's scale and offset
            block = self.kernel_block
            group_of_block = torch.arange(self.in_features // block) * block // self.group_size
            scale = self._statistic("scale")[:, group_of_block]
            offset = -scale * self._statistic("zero")[:, group_of_block]
            self._kernel_inputs = (scale.reshape(-1).contiguous(), offset.contiguous())
        return self._kernel_inputs

    def _product(self, rows: torch.Tensor, groups: tuple[int, ...] | None = None) -> torch.Tensor:
        """rows (M, K) in the model's dtype times the weight: (M, N) in the large-M GEMM's dtype or float32;
        `groups`: packed sequences' rows (nn/rows.py), each group taking the path its row count takes alone."""
        gemm = prefill_dtype(rows.dtype)
        if groups is not None and self._resolve_backend() == "dense_sparse":
            out = torch.empty(rows.shape[0], self.out_features, dtype=gemm if max(groups) > SMALL_M else torch.float32)
            per_group(groups, rows, out, lambda part, into: into.copy_(self._product(part)))
            return out
        if self._resolve_backend() == "dense_sparse":
            gemm = gemm if rows.shape[0] > SMALL_M else torch.float32
            out = nn.functional.linear(rows.to(gemm), self.dense_weight().to(gemm)).float()
            if self.outlier_count:
                out += self._outliers().product(rows.float())
            return out.add_(self.bias) if self.bias is not None else out
        # Codes 0..2^b - 1 times each block's scale, plus its offset (-scale * zero); at prefill sizes decoded a
        # tile of rows at a time, offsets included (centred as a float model's weight is), into the GEMM's dtype
        scale, offset = self.kernel_constants()
        return kbit_linear(
            rows,
            self.codes,
            scale,
            IDENTITY_TABLE,
            self.out_features,
            self.kernel_block,
            self.bias,
            "avx2",
            bits=self.bits,
            compute_dtype=gemm,
            block_offsets=offset,
            sparse=self._outliers(),
            groups=groups,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"SpQRLinear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        groups = groups_of(x.numel() // self.in_features)  # packed sequences (nn/rows.py)
        if self._resolve_backend() == "reference":
            return linear_by_group(x, self.dequantized_weight().to(x.dtype), self.bias, groups)
        rows = x.reshape(-1, self.in_features)
        if self.permutation is not None:
            rows = rows[:, self.permutation.long()]
        rows = rows.contiguous()
        if groups is None:
            out = self._product(rows).to(x.dtype)
        else:
            out = by_path(rows, groups, lambda n: n <= SMALL_M, lambda part, own: self._product(part, own).to(x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        stats = (
            "float16 statistics"
            if self.statistic_bits is None
            else (f"{self.statistic_bits}-bit statistics in groups of {self.statistic_group_size}")
        )
        group = "per-row" if self.per_row else f"groups of {self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit, {group}, "
            f"{stats}, {self.outlier_count} outliers"
        )
