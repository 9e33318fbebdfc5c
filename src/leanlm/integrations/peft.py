"""PEFT trains LoRA adapters over leanlm's k-bit layers: `peft.get_peft_model(model, LoraConfig(...))` on a leanlm
NF4 + DQ checkpoint loaded by transformers (QLoRA written the way peft users write it).

peft picks a LoRA layer per module type through a fixed list of dispatchers and has no registry for outside
types (`LoraConfig._register_custom_module` works per config). So, once peft is imported after `import leanlm`,
`LoraModel._create_new_module` first asks `dispatch`: a `KbitLinear` gets `KbitLoraLinear` (the frozen k-bit
product, differentiable in its input, plus the adapters: exactly `leanlm.nn.lora.LoRALinear`'s arithmetic);
another leanlm quantized layer is refused by name; anything else goes to peft's own dispatchers unchanged.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.lora.model import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer

from leanlm.errors import ConfigError
from leanlm.nn.kbit_linear import KbitLinear


class KbitLoraLinear(torch.nn.Module, LoraLayer):
    """LoRA adapters beside a frozen `KbitLinear` (merging is not offered: the base stays k-bit)."""

    def __init__(self, base_layer, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        if config.use_dora:
            raise ValueError("leanlm's k-bit layers take plain LoRA adapters; set use_dora=False")
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module: torch.nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def resolve_lora_variant(self, *, config, **kwargs):
        return None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disable_adapters:
            return result
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            update = lora_B(lora_A(self.lora_dropout[name](self._cast_input_dtype(x, lora_A.weight.dtype))))
            result = result + (update * self.scaling[name]).to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def dispatch(target: torch.nn.Module, adapter_name: str, config, **kwargs) -> torch.nn.Module | None:
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if isinstance(base, KbitLinear):
        module = KbitLoraLinear(target, adapter_name, config=config, **kwargs)
        target.qweight = base.packed  # where peft looks for a quantized layer's device (its GPTQ convention)
        return module
    if type(base).__module__.startswith("leanlm."):
        raise ConfigError(
            f"peft LoRA over leanlm's {type(base).__name__} is not supported: QLoRA trains over k-bit layers "
            "(leanlm quantize --method kbit)"
        )
    return None


def register() -> None:
    """Put `dispatch` before peft's own dispatchers (once)."""
    original = LoraModel._create_new_module
    if getattr(original, "leanlm_dispatch", False):
        return

    def create_new_module(lora_config, adapter_name, target, **kwargs):
        module = dispatch(target, adapter_name, config=lora_config, **kwargs)
        return module if module is not None else original(lora_config, adapter_name, target, **kwargs)

    create_new_module.leanlm_dispatch = True
    LoraModel._create_new_module = staticmethod(create_new_module)
