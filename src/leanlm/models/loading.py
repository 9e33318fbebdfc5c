"""Resolve a model name or path to a float32 transformers model and its tokenizer, never touching the network.

`source` may be a registry name (`smollm2-135m`), a local Hugging Face model directory, or a `.gguf` file.
A GGUF is de-quantized once (about half a minute) and cached as a float safetensors checkpoint, which later
loads in seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from leanlm.checksums import sha256_of
from leanlm.errors import CorruptModelError, ModelNotFoundError, UnsupportedArchitectureError
from leanlm.models.architectures import ArchitectureTable, architecture_for
from leanlm.models.registry import REGISTRY, gguf_path_of

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user asked for
    path: Path  # the directory the float weights were read from
    table: ArchitectureTable
    weights_note: str | None = None  # what the "full-precision" weights really are, where that matters


def cache_root() -> Path:
    return Path(os.environ.get("LEANLM_CACHE", Path.home() / ".cache" / "leanlm"))


def load_model(source: str | os.PathLike, *, attn_implementation: str = "sdpa") -> LoadedModel:
    """Load `source` (registry name, HF directory or .gguf file) in float32, in eval mode."""
    source_str = str(source)
    weights_note = None
    if source_str in REGISTRY:
        registered = REGISTRY[source_str]
        gguf = gguf_path_of(registered, cache_root() / "gguf")
        directory = _cached_float_checkpoint(gguf, expected_sha256=registered.sha256)
        weights_note = registered.weights_note
    else:
        path = Path(source_str).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            directory = _cached_float_checkpoint(path, expected_sha256=None)
        elif path.is_dir():
            directory = path
        else:
            raise ModelNotFoundError(
                f"{source_str!r} is neither a registered model ({', '.join(sorted(REGISTRY))}), "
                "a local model directory, nor a .gguf file"
            )
    model, tokenizer = _load_hf_directory(directory, attn_implementation)
    return LoadedModel(model, tokenizer, source_str, directory, architecture_for(model), weights_note)


def _load_hf_directory(directory: Path, attn_implementation: str):
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(f"{directory} is not a model directory: it has no config.json")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, OSError) as error:
        raise CorruptModelError(f"{directory}/config.json cannot be read: {error}") from error
    architecture_for(config)  # refuse unsupported families before spending time on the weights
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (ValueError, OSError) as error:
        raise ModelNotFoundError(f"{directory} has no usable tokenizer files: {error}") from error
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation=attn_implementation, local_files_only=True
        )
    except Exception as error:  # safetensors, torch and transformers each raise their own types here
        raise CorruptModelError(f"the weights in {directory} cannot be loaded: {error}") from error
    model.eval()
    return model, tokenizer


def _cached_float_checkpoint(gguf: Path, expected_sha256: str | None) -> Path:
    """The float checkpoint made from `gguf`, converting it on first use. Keyed by the file's checksum, so a
    changed file is converted anew."""
    checksum = sha256_of(gguf)
    if expected_sha256 is not None and checksum != expected_sha256:
        raise CorruptModelError(
            f"{gguf} fails its checksum (sha256 {checksum}, expected {expected_sha256}); reinstall the package"
        )
    directory = cache_root() / "models" / f"{gguf.stem}-{checksum[:16]}"
    if (directory / "config.json").is_file():
        return directory
    _convert_gguf(gguf, directory)
    return directory


def _convert_gguf(gguf: Path, directory: Path) -> None:
    log.warning("converting %s to a float checkpoint in %s (once; about half a minute)", gguf, directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    except Exception as error:  # the GGUF reader raises anything from ValueError to struct errors
        if "not supported" in str(error).lower():
            raise UnsupportedArchitectureError(f"{gguf}: {error}") from error
        raise CorruptModelError(f"{gguf} cannot be read as a GGUF model: {error}") from error
    architecture_for(gguf_model.config)
    # save_pretrained refuses a GGUF-loaded model; a fresh model built from the same config (without the
    # GGUF quantization_config) with the same state dict gives identical logits and can be saved.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    staging = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    # Publish atomically, so an interrupted conversion never leaves a half-written cache entry behind.
    staging.replace(directory)
