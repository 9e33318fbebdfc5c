"""Quantized checkpoints: safetensors weights + the model's config and tokenizer + `leanlm_quant.json`, which
records the method, its settings and every replaced module, so that loading rebuilds the exact structure and
then reads the tensors (no pickle anywhere). A model with a CushionCache attached also gets `cushion.safetensors`
(its per-layer keys and values), re-attached on load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_model as load_safetensors_into
from safetensors.torch import save_model as save_safetensors_from
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from leanlm.errors import CorruptModelError, ModelNotFoundError
from leanlm.methods.cushion import attach_cushion, attached_cushion, load_cushion, save_cushion
from leanlm.methods.w8a8 import share_input_gemms_
from leanlm.models.architectures import architecture_for
from leanlm.models.loading import LoadedModel, load_model
from leanlm.nn import ATTENTION_NAME, QUANTIZED_MODULES

QUANT_FILE = "leanlm_quant.json"
WEIGHTS_FILE = "model.safetensors"


def save_quantized(loaded: LoadedModel, model: nn.Module, record: dict, out_dir: str | os.PathLike) -> Path:
    """Write `model` (quantized from `loaded`) with `record` (method and settings) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modules = {
        name: {"class": type(module).__name__, "args": module.constructor_args()}
        for name, module in model.named_modules()
        if type(module).__name__ in QUANTIZED_MODULES
    }
    model.config.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    save_safetensors_from(model, str(out / WEIGHTS_FILE))
    cushion = attached_cushion(model)
    if cushion is not None:
        save_cushion(cushion, out)
    quant = {
        **record,
        "source_model": loaded.name,
        "weights_note": loaded.weights_note,
        "attn_implementation": model.config._attn_implementation,
        "modules": modules,
    }
    (out / QUANT_FILE).write_text(json.dumps(quant, indent=2) + "\n")
    return out


def is_quantized_checkpoint(source: str | os.PathLike) -> bool:
    return (Path(source) / QUANT_FILE).is_file()


def load_quantized(directory: str | os.PathLike) -> tuple[LoadedModel, dict]:
    """(the rebuilt model, its leanlm_quant.json record)."""
    directory = Path(directory)
    try:
        record = json.loads((directory / QUANT_FILE).read_text())
        modules = record["modules"]
    except (OSError, ValueError, KeyError) as error:
        raise CorruptModelError(f"{directory / QUANT_FILE} cannot be read: {error}") from error
    if not (directory / WEIGHTS_FILE).is_file():
        raise ModelNotFoundError(f"{directory} has {QUANT_FILE} but no {WEIGHTS_FILE}")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    table = architecture_for(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, entry in modules.items():
        module_class = QUANTIZED_MODULES.get(entry.get("class"))
        if module_class is None:
            raise CorruptModelError(f"{directory / QUANT_FILE}: unknown module class {entry.get('class')!r} at {name}")
        model.set_submodule(name, module_class(**entry["args"]), strict=False)
    try:
        load_safetensors_into(model, str(directory / WEIGHTS_FILE), strict=True)
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise CorruptModelError(f"the weights in {directory / WEIGHTS_FILE} cannot be loaded: {error}") from error
    share_input_gemms_(model)  # derived, like fbgemm's packed weights: rebuilt, not saved
    if record.get("cushion"):
        attach_cushion(model, load_cushion(directory))
    if record.get("attn_implementation") == ATTENTION_NAME:
        model.config._attn_implementation = ATTENTION_NAME
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    name = str(directory)
    return LoadedModel(model, tokenizer, name, directory, table, record.get("weights_note")), record


def load_any(source: str | os.PathLike) -> LoadedModel:
    """A float model (registry name, HF directory, .gguf) or a leanlm quantized checkpoint."""
    if is_quantized_checkpoint(source):
        return load_quantized(source)[0]
    return load_model(source)
