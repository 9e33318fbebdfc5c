"""QuantizedModule: the one interface of leanlm's quantized modules. A subclass registers itself by its class
name (how a checkpoint's module records are turned back into modules) and declares, in words, what it stores
(`kind`, for messages that name it); it gives the arguments that rebuild it empty (`constructor_args`), the weight
it computes with (`dequantized_weight`) and the bits it stores per weight. The fused decode step and the exporters
ask a module for its own form (`fused_problem` / `add_to_fused`, `gguf_problems` / `gguf_blocks`,
`compressed_tensors_problems` / `compressed_tensors_scheme`) instead of switching on class names, so a new module
type is added here and in its own file only."""

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

    def forget_runtime_forms(self) -> None:
        """Drop what the module derived from its buffers for its kernels (`runtime_bytes`); the next forward makes it
        again. Called whenever the buffers change or go: a load, or a move (`.to(...)`, to the meta device included,
        as a finished block of an out-of-core run is emptied)."""

    def _apply(self, fn, recurse=True):
        self.forget_runtime_forms()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self.forget_runtime_forms()
        super()._load_from_state_dict(*args, **kwargs)

    def runtime_bytes(self) -> int:
        """What this module holds beside its stored buffers once its first forward has run: the forms its kernel
        reads, derived from them (known from its shape, on the meta device too)."""
        return 0

    def fused_problem(self) -> str | None:
        """Why the fused decode step (`leanlm.decoding.FusedDecoder`) cannot run this module, or None if
        `add_to_fused` hands it over."""
        return f"{self.kind}, which the fused step does not run"

    def add_to_fused(self, decoder, compact_constants: bool) -> int:
        """Hand this module to the fused step's C++ decoder (the compiled kernels' `FusedDecoder`); its linear id.
        `compact_constants`: keep double-quantized constants 8-bit rather than decoding them once."""
        raise NotImplementedError

    def compressed_tensors_problems(self) -> list[str]:
        """The `leanlm quantize` settings this module would need to have an exact compressed-tensors scheme
        (empty: none)."""
        return [
            f"--method w8a8, smoothquant, rtn or gptq ({self.kind} are not the integer grids compressed-tensors holds)"
        ]

    def compressed_tensors_scheme(self) -> tuple[dict, str]:
        """({"weights": ..., "input_activations": ...} as compressed-tensors' QuantizationArgs fields, the
        compressor's format name) holding this module exactly; only for a module whose
        `compressed_tensors_problems` is empty."""
        raise NotImplementedError

    def compressed_tensors_tensors(self) -> dict[str, torch.Tensor]:
        """The float (out, in) `weight` this module computes with, the `weight_scale` that re-creates its codes
        from it and, where the scheme has static activations, the `input_scale`."""
        raise NotImplementedError

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
