"""GGUFLinear: a linear whose weight is stored as GGUF blocks of one type (Q4_0 .. Q8_0, Q2_K .. Q6_K), byte for
byte what a GGUF file holds (`leanlm.formats.gguf_blocks`), so that export writes the blocks as they are and a
file de-quantizes, through the `gguf` package, to exactly the weight this module computes with.

The forward pass de-quantizes the whole weight (float32) and runs one matmul: the plain-PyTorch reference, at the
cost of one float32 copy of the weight per call, freed after it."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from leanlm.formats import gguf_blocks
from leanlm.nn.base import QuantizedModule


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

    def gguf_blocks(self) -> tuple[np.ndarray, object]:
        return np.ascontiguousarray(self.blocks.numpy()), self.format.ggml

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"GGUFLinear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.block_type.upper()} "
            f"({self.format.bits_per_weight:g} bits per weight)"
        )
