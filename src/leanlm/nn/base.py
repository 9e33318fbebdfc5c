"""QuantizedModule: the one interface of leanlm's quantized modules. A subclass registers itself by its class
name (how a checkpoint's module records are turned back into modules) and declares, in words, what it stores
(`kind`, for messages that name it); it gives the arguments that rebuild it empty (`constructor_args`), the weight
it computes with (`dequantized_weight`) and the bits it stores per weight. Exporters ask a module for its own
exact form (`gguf_problems` / `gguf_blocks`) instead of switching on class names."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import nn

REGISTRY: dict[str, type[QuantizedModule]] = {}


class QuantizedModule(nn.Module):
    kind: ClassVar[str] = ""  # what the module stores, in the words of the methods that make it

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        REGISTRY[cls.__name__] = cls

    def constructor_args(self) -> dict:
        """The keyword arguments that build this module empty, before its buffers are loaded."""
        raise NotImplementedError

    def linear_args(self) -> dict:
        """The constructor arguments every quantized linear starts with."""
        return {"in_features": self.in_features, "out_features": self.out_features, "bias": self.bias is not None}

    def keep_bias(self, bias: torch.Tensor | None) -> None:
        """Store a float linear's bias (float32), if it has one."""
        if bias is not None:
            self.bias = bias.detach().float().clone()

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight this module computes with."""
        raise NotImplementedError

    def bits_per_weight(self) -> float:
        """Bits of every stored tensor (bias excluded) per weight."""
        stored = [t for name, t in self.named_buffers() if name != "bias" and t is not None]
        return sum(t.numel() * t.element_size() * 8 for t in stored) / (self.in_features * self.out_features)

    def gguf_problems(self) -> list[str]:
        """The `leanlm quantize` settings this module would need to be GGUF blocks exactly (empty: none)."""
        return [f"--method rtn or gptq with --gguf-type ({self.kind} are no GGUF block type)"]

    def gguf_type(self):
        """The gguf.GGMLQuantizationType of this module's blocks (known without building them); only for a module
        whose `gguf_problems` is empty."""
        raise NotImplementedError

    def gguf_blocks(self) -> tuple[np.ndarray, object]:
        """(rows, bytes per row) uint8 GGUF blocks holding exactly this module's weight, and their `gguf_type`;
        only for a module whose `gguf_problems` is empty."""
        raise NotImplementedError
