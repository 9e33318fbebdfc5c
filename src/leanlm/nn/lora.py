"""LoRALinear: a low-rank adapter around any frozen linear layer (float or k-bit), QLoRA eq. 5.2 with PEFT's scale:

    Y = base(X) + s * dropout(X) A^T B^T,   s = alpha / r  (Dettmers' thesis' equation omits s; PEFT and QLoRA's code use it)

A (r x in) starts Kaiming-uniform and B (out x r) at zero, so the wrapped model is unchanged at step 0; dropout
acts on the adapter path only. The names `lora_A` / `lora_B` are PEFT's, so saved adapters load with `peft`.

A layer may hold further adapters over the same base (`add_adapter`, for a server answering each request with the
adapter it names); `adapter_rows` says, for the forwards run inside it, which adapter each batch row goes
through. Outside it every row goes through the layer's own (`lora_A` / `lora_B`, adapter 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.nn.kbit_linear import KbitLinear

_ADAPTER_ROWS: ContextVar[tuple[int, ...] | None] = ContextVar("leanlm_adapter_rows", default=None)


@contextmanager
def adapter_rows(indexes: Sequence[int]) -> Iterator[None]:
    """Forwards run inside send batch row i through adapter `indexes[i]` of every LoRALinear (0: its own; k: the
    k-th added with `add_adapter`; -1: none, the base alone)."""
    token = _ADAPTER_ROWS.set(tuple(indexes))
    try:
        yield
    finally:
        _ADAPTER_ROWS.reset(token)


def frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A frozen float32 nn.Linear holding `weight` (out, in) and `bias`: de-quantized, merged or converted weights."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight.data = weight.detach().float().clone()
    if bias is not None:
        linear.bias.data = bias.detach().float().clone()
    return linear.requires_grad_(False)


def base_weight(layer: nn.Module) -> torch.Tensor:
    """The (out, in) float weight a frozen base layer computes with."""
    if isinstance(layer, KbitLinear):
        return layer.dequantized_weight()
    if isinstance(layer, nn.Linear):
        return layer.weight.detach().float()
    raise ConfigError(f"LoRA wraps nn.Linear or KbitLinear layers, not {type(layer).__name__}")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, rank: int = 16, alpha: float = 16.0, dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ConfigError(f"LoRA rank must be at least 1, got {rank}")
        base_weight(base)  # refuses layer types it cannot merge into
        self.base = base
        for parameter in base.parameters():
            parameter.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank  # s
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.more = nn.ModuleList()  # adapters 1, 2, ...: each a module with lora_A, lora_B and its scaling

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def add_adapter(self, a: torch.Tensor, b: torch.Tensor, scaling: float) -> int:
        """Another adapter over the same base, A (r x in) and B (out x r) of any rank r; its index."""
        if a.shape[1] != self.in_features or b.shape[0] != self.out_features or a.shape[0] != b.shape[1]:
            raise ConfigError(
                f"an adapter of shapes {tuple(a.shape)}, {tuple(b.shape)} does not fit a "
                f"{self.out_features} x {self.in_features} layer"
            )
        adapter = nn.Module()
        adapter.lora_A, adapter.lora_B = frozen_linear(a, None), frozen_linear(b, None)
        adapter.scaling = scaling
        self.more.append(adapter)
        return len(self.more)

    def _update(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0:
            return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        adapter = self.more[index - 1]
        return adapter.lora_B(adapter.lora_A(x)) * adapter.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _ADAPTER_ROWS.get()
        if rows is None or set(rows) == {0}:
            return self.base(x) + self._update(0, x)
        if len(rows) != x.shape[0]:
            raise ValueError(f"adapter_rows names {len(rows)} rows for a batch of {x.shape[0]}")
        out = self.base(x)
        for index in sorted(set(rows) - {-1}):
            if not 0 <= index <= len(self.more):
                raise ValueError(f"adapter {index} of a layer holding {len(self.more) + 1}")
            select = torch.tensor([row == index for row in rows])
            out[select] += self._update(index, x[select])
        return out

    def merged_weight(self) -> torch.Tensor:
        """W + s B A with W the de-quantized base weight."""
        return base_weight(self.base) + self.scaling * (self.lora_B.weight.detach() @ self.lora_A.weight.detach())

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"
