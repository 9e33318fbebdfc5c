"""LoRALinear: a low-rank adapter around any frozen linear layer (float or k-bit), QLoRA eq. 5.2 with PEFT's scale:

    Y = base(X) + s * dropout(X) A^T B^T,   s = alpha / r  (Dettmers' thesis' equation omits s; PEFT and QLoRA's code use it)

A (r x in) starts Kaiming-uniform and B (out x r) at zero, so the wrapped model is unchanged at step 0; dropout
acts on the adapter path only. The names `lora_A` / `lora_B` are PEFT's, so saved adapters load with `peft`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.nn.kbit_linear import KbitLinear


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

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + s B A with W the de-quantized base weight."""
        return base_weight(self.base) + self.scaling * (self.lora_B.weight.detach() @ self.lora_A.weight.detach())

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"
