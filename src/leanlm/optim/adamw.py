"""AdamW whose moment estimates can be stored in 8 bits (Dettmers et al. 2022, the optimizer QLoRA trains with).

Each state tensor is quantized block-wise (blocks of 256, one float32 absmax each) to the dynamic-exponent map:
the signed one for the first moment, the unsigned one for the second, so a parameter costs 2 bytes of state
instead of 8. The update itself runs in float32 on the de-quantized moments. Small tensors (fewer than
`min_8bit_size` elements, e.g. norms and biases) keep float32 states, as their quantization error would be
large relative to their size and their memory negligible.

QLoRA's *paged* optimizers move states between GPU and CPU memory under pressure (CUDA unified memory); on a
CPU-only machine every state already lives in host memory, so the memory lever here is the 8-bit storage.

The state is plain tensors (`state_tensors` / `load_state_tensors`) so that a training checkpoint can be
written with safetensors, never pickle.
"""

from __future__ import annotations

import math

import torch

from leanlm.errors import ConfigError
from leanlm.formats.blockwise import quantize_blockwise
from leanlm.formats.codebooks import DYNAMIC8, DYNAMIC8_UNSIGNED, Codebook

STATE_BLOCK = 256


class _QuantizedState:
    """One moment tensor stored as 8-bit codes + block absmax."""

    def __init__(self, tensor: torch.Tensor, codebook: Codebook):
        self.codebook = codebook
        self.shape = tensor.shape
        self.store(tensor)

    def store(self, tensor: torch.Tensor) -> None:
        quantized = quantize_blockwise(tensor.reshape(-1), self.codebook, STATE_BLOCK)
        self.codes, self.absmax = quantized.codes, quantized.absmax

    def load(self) -> torch.Tensor:
        scale = self.absmax.repeat_interleave(STATE_BLOCK)[: self.codes.numel()]
        return (self.codebook.values[self.codes.long()] * scale).reshape(self.shape)


class AdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 2e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_bits: int = 8,
        min_8bit_size: int = 4096,
    ):
        if state_bits not in (8, 32):
            raise ConfigError(f"optimizer state bits must be 8 or 32, got {state_bits}")
        if lr <= 0:
            raise ConfigError(f"learning rate must be positive, got {lr}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_bits, self.min_8bit_size = state_bits, min_8bit_size

    def _quantizes(self, param: torch.Tensor) -> bool:
        return self.state_bits == 8 and param.numel() >= self.min_8bit_size

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.float()
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    zeros = torch.zeros_like(param, dtype=torch.float32)
                    if self._quantizes(param):
                        state["m"], state["v"] = (
                            _QuantizedState(zeros, DYNAMIC8),
                            _QuantizedState(zeros, DYNAMIC8_UNSIGNED),
                        )
                    else:
                        state["m"], state["v"] = zeros, zeros.clone()
                state["step"] += 1
                quantized = isinstance(state["m"], _QuantizedState)
                m = state["m"].load() if quantized else state["m"]
                v = state["v"].load() if quantized else state["v"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if quantized:
                    state["m"].store(m)
                    state["v"].store(v)
                step = state["step"]
                step_size = group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)
                if group["weight_decay"]:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                param.addcdiv_(m, v.sqrt().add_(group["eps"] * math.sqrt(1 - beta2**step)), value=-step_size)
        return loss

    def state_bytes(self) -> int:
        """Bytes the moment estimates occupy."""
        total = 0
        for state in self.state.values():
            for key in ("m", "v"):
                value = state.get(key)
                tensors = [value.codes, value.absmax] if isinstance(value, _QuantizedState) else [value]
                total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return total

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every piece of state as named tensors (parameter index, field), for a safetensors checkpoint."""
        out = {}
        for index, param in enumerate(self._parameters()):
            state = self.state.get(param)
            if not state:
                continue
            out[f"{index}.step"] = torch.tensor(state["step"], dtype=torch.int64)
            for key in ("m", "v"):
                value = state[key]
                if isinstance(value, _QuantizedState):
                    out[f"{index}.{key}.codes"], out[f"{index}.{key}.absmax"] = value.codes, value.absmax
                else:
                    out[f"{index}.{key}"] = value
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        params = self._parameters()
        indices = {int(name.split(".")[0]) for name in tensors}
        if indices and max(indices) >= len(params):
            raise ConfigError(f"optimizer checkpoint names parameter {max(indices)}, the model has {len(params)}")
        for index in sorted(indices):
            param = params[index]
            state = {"step": int(tensors[f"{index}.step"])}
            for key, codebook in (("m", DYNAMIC8), ("v", DYNAMIC8_UNSIGNED)):
                if f"{index}.{key}.codes" in tensors:
                    value = _QuantizedState.__new__(_QuantizedState)
                    value.codebook, value.shape = codebook, param.shape
                    value.codes, value.absmax = tensors[f"{index}.{key}.codes"], tensors[f"{index}.{key}.absmax"]
                    state[key] = value
                else:
                    state[key] = tensors[f"{index}.{key}"].clone()
            self.state[param] = state
