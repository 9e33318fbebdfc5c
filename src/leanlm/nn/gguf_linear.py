"""GGUFLinear: a linear whose weight is stored as GGUF blocks of one type (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL,
IQ4_XS), byte for
byte what a GGUF file holds (`leanlm.formats.gguf_blocks`), so that export writes the blocks as they are and a
file de-quantizes, through the `gguf` package, to exactly the weight this module computes with.

Two forward paths:
- `reference` de-quantizes the whole weight (float32) and runs one matmul, at the cost of one float32 copy of the
  weight per call, freed after it: every type, and the test oracle;
- `kernel` (4-bit types: Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS, on AVX2) runs leanlm's k-bit kernel, which computes
  with the sub-block rule w = A * v(q) + (B - offset * A): v(q) (the codes 0..15, or the non-linear types'
  levels) is the kernel's table, A its block scale and the rest its block offset, as for GPTQ's groups
  (`SpQRLinear`). It keeps that form beside the blocks (the codes again, and two float32 numbers per sub-block),
  built at the first forward.
The default is the kernel wherever it applies."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from leanlm.formats import gguf_blocks
from leanlm.formats.packing import pack
from leanlm.kernels.kbit_gemm import avx2_available, kbit_linear, prefill_dtype, supports_fast_path
from leanlm.nn.base import QuantizedModule
from leanlm.nn.spqr_linear import IDENTITY_TABLE


class GGUFLinear(QuantizedModule):
    kind = "GGUF blocks (RTN / GPTQ with --gguf-type)"

    def __init__(self, in_features: int, out_features: int, bias: bool, block_type: str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_type = gguf_blocks.type_for_row(block_type, in_features).name
        kind = self.format
        self.register_buffer(
            "blocks", torch.zeros(out_features, in_features // kind.block * kind.bytes, dtype=torch.uint8)
        )
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.backend: str | None = None  # "reference" or "kernel"; None: the kernel where it applies
        self._kernel_inputs = None  # (packed codes, scales, offsets), until `forget_runtime_forms`

    def forget_runtime_forms(self) -> None:
        self._kernel_inputs = None

    def _kernel_fits(self) -> bool:
        return self.format.bits == 4 and supports_fast_path(4, self.format.sub, self.in_features)

    def _resolve_backend(self) -> str:
        if self.backend is None:
            self.backend = "kernel" if self._kernel_fits() and avx2_available() else "reference"
        return self.backend

    def runtime_bytes(self) -> int:
        """The kernel's codes two per byte and its float32 scale and offset per sub-block (`kernel_inputs`)."""
        fits = self._kernel_fits() if self.backend is None else self.backend == "kernel"
        weights = self.out_features * self.in_features
        return weights // 2 + 2 * 4 * weights // self.format.sub if fits else 0

    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's form of the weight: codes two per byte, each sub-block's A (flat) and offset
        B - offset * A (rows, sub-blocks)."""
        if self._kernel_inputs is None:
            kind = self.format
            codes, statistics = gguf_blocks.unpack(kind, self.blocks, self.in_features)
            multiplier, offset = gguf_blocks.sub_block_grid(kind, statistics)
            offset = (offset - kind.offset * multiplier).reshape(self.out_features, -1)
            self._kernel_inputs = (pack(codes, 4), multiplier.reshape(-1).contiguous(), offset.contiguous())
        return self._kernel_inputs

    @property
    def format(self) -> gguf_blocks.BlockType:
        return gguf_blocks.BLOCK_TYPES[self.block_type]

    @classmethod
    def from_codes(
        cls,
        kind: gguf_blocks.BlockType,
        codes: torch.Tensor,
        statistics: gguf_blocks.BlockStatistics,
        bias: torch.Tensor | None,
    ) -> GGUFLinear:
        rows, columns = codes.shape
        module = cls(columns, rows, bias is not None, kind.name)
        module.blocks = gguf_blocks.pack(kind, codes, statistics)
        module.keep_bias(bias)
        return module

    def constructor_args(self) -> dict:
        return {
            **self.linear_args(),
            "block_type": self.block_type,
        }

    def dequantized_weight(self) -> torch.Tensor:
        return gguf_blocks.dequantize(self.format, self.blocks, self.in_features)

    def gguf_problems(self) -> list[str]:
        return []

    def gguf_type(self):
        return self.format.ggml

    def gguf_blocks(self) -> tuple[np.ndarray, object]:
        return np.ascontiguousarray(self.blocks.numpy()), self.gguf_type()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"GGUFLinear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        if self._resolve_backend() == "reference":
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return nn.functional.linear(x, self.dequantized_weight().to(x.dtype), bias)
        codes, scales, offsets = self.kernel_inputs()
        rows = x.reshape(-1, self.in_features)
        out = kbit_linear(
            rows,
            codes,
            scales,
            IDENTITY_TABLE if self.format.levels is None else self.format.codebook.values,
            self.out_features,
            self.format.sub,
            self.bias,
            "avx2",
            bits=4,
            compute_dtype=prefill_dtype(x.dtype),
            block_offsets=offsets,
        )
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.block_type.upper()} "
            f"({self.format.bits_per_weight:g} bits per weight)"
        )
