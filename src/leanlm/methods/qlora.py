"""QLoRA (Dettmers' thesis ch. 5): LoRA adapters on every linear of the decoder blocks over a frozen base, the base either
float32 (plain LoRA) or k-bit (NF4 + double quantization by default). One verb, `add_lora_(model, LoRAConfig())`;
adapters save and load in PEFT's format, and `merge_lora_` folds them into the de-quantized weights.

Defaults: r = 16, alpha = 16 (s = 1), dropout 0.05. QLoRA's published runs use r = 64, alpha = 16 on 7B-65B
models (not in Dettmers' thesis; artidoro/qlora); at 135M parameters r = 16 already gives ~4.9M trainable weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from leanlm.errors import ConfigError, CorruptModelError
from leanlm.methods.kbit import KbitConfig
from leanlm.methods.quantize import quantize_
from leanlm.models.architectures import architecture_for, iter_quantizable_linears, linear_weight_out_in
from leanlm.nn import KbitLinear
from leanlm.nn.lora import LoRALinear, frozen_linear
from leanlm.settings import option

# The frozen base formats of Dettmers' thesis Tables 5.2/5.3 (blocks of 64, as QLoRA).
LORA_BASES: dict[str, KbitConfig | None] = {
    "float": None,  # full-precision LoRA (float32 on this CPU)
    "nf4-dq": KbitConfig("nf", 4, 64, double_quant=True),
    "nf4": KbitConfig("nf", 4, 64),
    "fp4": KbitConfig("fp", 4, 64),  # e2m1
    "int4": KbitConfig("int", 4, 64),
}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_RECORD = "leanlm_adapter.json"  # which frozen base the adapter was trained over (PEFT's config has no field)
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAConfig:
    base: str = option(
        "nf4-dq", "qlora: the base's 4-bit format (nf4-dq: NF4 + double quantization)", choices=tuple(LORA_BASES)
    )
    rank: int = option(16, "LoRA r")
    alpha: float = option(16.0, "LoRA alpha: the update is scaled by s = alpha / r", flag="--lora-alpha")
    dropout: float = option(0.05, "LoRA dropout on the adapter path")

    def __post_init__(self):
        if self.base not in LORA_BASES:
            raise ConfigError(f"unknown LoRA base {self.base!r}; choose from {', '.join(LORA_BASES)}")
        if self.rank < 1:
            raise ConfigError(f"LoRA rank must be at least 1, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"LoRA alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def method(self) -> str:
        return "lora" if self.base == "float" else "qlora"


def add_lora_(model: nn.Module, config: LoRAConfig) -> dict:
    """Freeze `model`, quantize its block linears to the config's base format (unless they are k-bit already:
    a checkpoint written by `leanlm quantize --method kbit`, loaded with no float model, is the base as it is),
    and wrap each in a LoRALinear. Returns the record: the base's quantization record, trainable parameters."""
    table = architecture_for(model)
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ConfigError("the model already has LoRA adapters")
    model.requires_grad_(False)
    linears = [module for _, module in iter_quantizable_linears(model, table)]
    quantized_already = all(isinstance(module, KbitLinear) for module in linears)
    if quantized_already and config.base == "float":
        raise ConfigError("the model's linears are k-bit already: plain LoRA needs a float model (use qlora)")
    if not quantized_already and any(
        not isinstance(module, nn.Linear) and hasattr(module, "constructor_args") for module in linears
    ):
        raise ConfigError("QLoRA trains over float or k-bit linears; this model's are quantized otherwise")
    quantization = None if quantized_already else LORA_BASES[config.base]
    base_record = quantize_(model, quantization) if quantization else None
    for name, module in list(iter_quantizable_linears(model, table)):
        if not isinstance(module, (nn.Linear, KbitLinear)):  # GPT-2's Conv1D stores (in, out)
            module = frozen_linear(linear_weight_out_in(module, table), getattr(module, "bias", None))
        model.set_submodule(name, LoRALinear(module, config.rank, config.alpha, config.dropout))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "method": config.method,
        **asdict(config),
        "base_quantization": base_record,
        "trainable_parameters": trainable,
    }


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (`base_model.model.<module>.lora_A.weight`)."""
    layers = lora_layers(model)
    if not layers:
        raise ConfigError("the model has no LoRA adapters (call add_lora_ first)")
    return {
        f"{_PEFT_PREFIX}{name}.{part}.weight": getattr(layer, part).weight.detach().contiguous()
        for name, layer in layers.items()
        for part in ("lora_A", "lora_B")
    }


def load_adapter_tensors_(model: nn.Module, tensors: dict[str, torch.Tensor], source: str = "adapters") -> None:
    expected = adapter_tensors(model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CorruptModelError(f"{source} do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, layer in lora_layers(model).items():
        for part in ("lora_A", "lora_B"):
            value = tensors[f"{_PEFT_PREFIX}{name}.{part}.weight"]
            target = getattr(layer, part).weight
            if value.shape != target.shape:
                raise CorruptModelError(
                    f"{source}: {name}.{part} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(value)


def save_adapters(model: nn.Module, config: LoRAConfig, out_dir: str | os.PathLike, base_model: str) -> Path:
    """PEFT's adapter format: `adapter_config.json` + `adapter_model.safetensors` (peft loads it onto the
    de-quantized base with `PeftModel.from_pretrained`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora_layers(model)})
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
    }
    save_file(adapter_tensors(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    (out / BASE_RECORD).write_text(
        json.dumps(
            {
                "base": config.base,
                "base_quantization": (asdict(LORA_BASES[config.base]) if LORA_BASES[config.base] else None),
            },
            indent=2,
        )
        + "\n"
    )
    return out


def named_adapters(specs: Sequence[str]) -> list[tuple[str, Path]]:
    """(name, directory) of each `NAME=DIR` or `DIR` (named by its last path component); names must differ."""
    named = []
    for spec in specs:
        name, separator, directory = spec.partition("=")
        if not separator or "/" in name or not name:
            name, directory = Path(spec).name, spec
        named.append((name, Path(directory)))
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise ConfigError(f"two adapters share a name in {', '.join(names)}: name them with NAME=DIR")
    return named


def adapter_configs(directories: Sequence[str | os.PathLike]) -> list[LoRAConfig]:
    """The configs of adapters to run together, which must share their base quantization."""
    configs = [read_adapter_config(directory) for directory in directories]
    for directory, config in zip(directories[1:], configs[1:], strict=True):
        if config.base != configs[0].base:
            raise ConfigError(
                f"{directory} was trained over a {config.base} base, {directories[0]} over {configs[0].base}: "
                "adapters served together share their base"
            )
    return configs


def read_adapter_config(directory: str | os.PathLike) -> LoRAConfig:
    path = Path(directory) / ADAPTER_CONFIG
    base_path = Path(directory) / BASE_RECORD
    try:
        record = json.loads(path.read_text())
        base = json.loads(base_path.read_text())["base"] if base_path.is_file() else "float"
        return LoRAConfig(
            base=base,
            rank=int(record["r"]),
            alpha=float(record["lora_alpha"]),
            dropout=float(record.get("lora_dropout", 0.0)),
        )
    except (OSError, ValueError, KeyError) as error:
        raise CorruptModelError(f"{path} cannot be read as a LoRA adapter config: {error}") from error


def load_adapters_(model: nn.Module, directory: str | os.PathLike) -> None:
    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(path))
    except Exception as error:  # missing or damaged file: safetensors raises its own types
        raise CorruptModelError(f"{path} cannot be loaded: {error}") from error
    load_adapter_tensors_(model, tensors, str(path))


def load_another_adapter_(model: nn.Module, directory: str | os.PathLike, config: LoRAConfig) -> int:
    """Add the adapter in `directory` (its `config`, over the base of those before it: `adapter_configs`) beside
    those `model`'s LoRA layers hold, on the same modules; its index for `adapter_rows`."""
    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(path))
    except Exception as error:  # missing or damaged file: safetensors raises its own types
        raise CorruptModelError(f"{path} cannot be loaded: {error}") from error
    layers = lora_layers(model)
    expected = {f"{_PEFT_PREFIX}{name}.{part}.weight" for name in layers for part in ("lora_A", "lora_B")}
    if set(tensors) != expected:
        other = sorted(set(tensors) ^ expected)
        raise CorruptModelError(f"{path} adapts other modules than the adapters before it: {other[:3]}")
    indexes = {
        layer.add_adapter(
            tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"],
            tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"],
            config.alpha / config.rank,
        )
        for name, layer in layers.items()
    }
    return indexes.pop()


def merge_lora_(model: nn.Module, requantize: KbitConfig | None = None) -> dict:
    """Replace each LoRALinear by one linear with W' = dequant(W) + s B A (float32), or, with `requantize`, by
    a KbitLinear of W'. Returns the weight error re-quantization adds (relative Frobenius norm, weighted by
    parameter count)."""
    squared_error = squared_norm = 0.0
    for name, layer in lora_layers(model).items():
        merged = layer.merged_weight()
        bias = layer.base.bias
        if requantize is None:
            replacement = frozen_linear(merged, bias)
        else:
            replacement = KbitLinear.from_float(
                merged,
                bias,
                requantize.dtype,
                requantize.bits,
                requantize.block_size,
                requantize.double_quant,
                requantize.exponent_bits,
            )
            squared_error += (replacement.dequantized_weight() - merged).square().sum().item()
            squared_norm += merged.square().sum().item()
        model.set_submodule(name, replacement)
    record = {"merged": True, "requantized": asdict(requantize) if requantize else None}
    if requantize is not None:
        record["requantization_relative_error"] = (squared_error / squared_norm) ** 0.5
    return record
