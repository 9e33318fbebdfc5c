"""Resolve a model name or path to a float transformers model and its tokenizer, never touching the network.

`source` may be a registry name (`smollm2-135m`), a local Hugging Face model directory, or a `.gguf` file.
A GGUF is de-quantized once (about half a minute) and cached as a float safetensors checkpoint, which later
loads in seconds.

The compute dtype is float32 (the reference every method and test is measured against) unless asked otherwise;
`auto` picks bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX, `kernels.cpu.has_native_bf16`),
decided at run time.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from leanlm.checksums import sha256_of
from leanlm.errors import ConfigError, CorruptModelError, ModelNotFoundError, first_line
from leanlm.kernels.cpu import has_native_bf16
from leanlm.models.architectures import ArchitectureTable, architecture_for, skeleton
from leanlm.models.gguf_conversion import convert_gguf
from leanlm.models.registry import REGISTRY, gguf_path_of
from leanlm.models.untrusted import (
    check_contained,
    check_float_weights,
    check_layer_count,
    from_pretrained,
    weight_files,
)
from leanlm.nn.float_linear import use_gemv_
from leanlm.settings import option
from leanlm.storage import QUANT_FILE, cache_root, exclusive_lock, quantized_weights_file, staged_directory

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user asked for
    path: Path  # the directory the float weights were read from
    table: ArchitectureTable
    weights_note: str | None = None  # what the "full-precision" weights really are, where that matters
    dtype: str = "float32"  # what it computes in, as the user is told it
    adapters: tuple[str, ...] = ()  # the names of the LoRA adapters it holds, in `adapter_rows`' order


COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32: how flags, JSON and messages spell a dtype."""
    return str(dtype).removeprefix("torch.")


def compute_dtype(choice: str) -> torch.dtype:
    """ "float32", "bfloat16", or "auto": bfloat16 where this CPU has native bf16 instructions, else float32 (without
    them PyTorch emulates bfloat16 and is slower than float32)."""
    if choice == "auto":
        return torch.bfloat16 if has_native_bf16() else torch.float32
    if choice not in COMPUTE_DTYPES:
        raise ConfigError(f"unknown dtype {choice!r}; choose auto, {' or '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[choice]


HEAD_FORMATS = ("float", "int8")


@dataclass(frozen=True)
class LoadSettings:
    dtype: str = option(
        "float32",
        "compute dtype: float32 (the reference), bfloat16, or auto "
        "(bfloat16 where this CPU has native bf16 instructions, AVX512-BF16 or AMX, and a "
        "probe product runs on them; float32 elsewhere). A quantized checkpoint computes in it too (norms, attention, "
        "its token embedding and output head), its quantized layers through their kernels",
        choices=("auto", *COMPUTE_DTYPES),
    )
    head: str = option(
        "float",
        "the output head: float (in the dtype above), or int8: 8-bit int blocks of 64 read "
        "with int8 activations at decode (llama.cpp's Q4_0 files hold theirs in Q8_0), "
        "faster decode for a small loss; a tied embedding keeps its float copy",
        choices=HEAD_FORMATS,
    )
    adapter: tuple[str, ...] = option(
        (),
        "a LoRA adapter directory (leanlm finetune's --out) applied over the model as it was trained: its base "
        "quantized as then, in float32. serve takes several (repeat the flag), over one base, each answering "
        "under its name (NAME=DIR, or the directory's name), the first also under the model's",
    )
    keep_freed_memory: bool = option(
        False,
        "let the C library keep freed memory for reuse: a faster prefill (no fresh, zeroed mapping for each large "
        "activation), but resident memory then holds freed activations and tiles, by an amount that varies from "
        "run to run",
        off="give freed memory back to the system at once: resident memory is the live tensors, as leanlm plan "
        "counts them, and a prefill is slower",
    )

    def __post_init__(self):
        compute_dtype(self.dtype)
        if self.head not in HEAD_FORMATS:
            raise ConfigError(f"unknown head format {self.head!r}; choose one of {', '.join(HEAD_FORMATS)}")
        adapter = self.adapter  # Python callers pass one directory, several, or None
        adapters = () if adapter is None else (adapter,) if isinstance(adapter, (str, os.PathLike)) else adapter
        object.__setattr__(self, "adapter", tuple(str(each) for each in adapters))

    def one_adapter(self, command: str) -> str | None:
        """The one adapter a command other than serve runs with (None: none)."""
        if len(self.adapter) > 1:
            raise ConfigError(f"{command} takes one --adapter ({len(self.adapter)} given); serve takes several")
        return self.adapter[0] if self.adapter else None


# `leanlm chat` and `leanlm serve` take the fastest float path this CPU has and keep freed memory for reuse (they
# read prompts again and again; benchmarks/serve.py); eval and stream keep the reference and the planned memory.
INTERACTIVE_LOADING = LoadSettings(dtype="auto", keep_freed_memory=True)


def load_model(
    source: str | os.PathLike, *, attn_implementation: str | None = None, dtype: str = "float32"
) -> LoadedModel:
    """Load `source` (registry name, HF directory or .gguf file) in eval mode, computing in `dtype` (float32,
    bfloat16, or auto: see `compute_dtype`); `attn_implementation` None is transformers' choice (PyTorch's fused
    attention where the family supports it, else eager)."""
    torch_dtype = compute_dtype(dtype)
    directory, weights_note = resolve_float_directory(source)
    model, tokenizer = _load_hf_directory(directory, attn_implementation, torch_dtype)
    return LoadedModel(
        model, tokenizer, str(source), directory, architecture_for(model), weights_note, dtype_name(torch_dtype)
    )


def resolve_float_directory(source: str | os.PathLike) -> tuple[Path, str | None]:
    """(the Hugging Face directory holding `source`'s float weights, converting a GGUF on first use, and what
    those weights really are where that matters)."""
    source_str = str(source)
    if source_str in REGISTRY:
        registered = REGISTRY[source_str]
        gguf = gguf_path_of(registered, cache_root() / "gguf")
        return _cached_float_checkpoint(gguf, expected_sha256=registered.sha256), registered.weights_note
    path = Path(source_str).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _cached_float_checkpoint(path, expected_sha256=None), None
    if path.is_dir():
        return path, None
    raise ModelNotFoundError(
        f"{source_str!r} is neither a registered model ({', '.join(sorted(REGISTRY))}), "
        "a local model directory, nor a .gguf file"
    )


def load_tokenizer(source: str | os.PathLike):
    """Only the tokenizer of `source`: seconds, where the model takes much longer, so that data can be checked
    against it before any slow work."""
    directory, _ = resolve_float_directory(source)
    read_model_config(directory)
    return read_tokenizer(directory)


def read_model_config(directory: Path, *, quantized: bool = False):
    """`directory`'s config.json, refusing unsupported families and, unless `quantized`, leanlm quantized
    weights (a quantized checkpoint is read by `leanlm.methods.load_quantized`, never as a float model)."""
    if not (directory / "config.json").is_file():
        raise ModelNotFoundError(f"{directory} is not a model directory: it has no config.json")
    check_contained(directory)
    try:
        config = from_pretrained(AutoConfig, directory)
    except Exception as error:  # transformers raises ValueError, OSError, TypeError, KeyError on a bad config.json
        raise CorruptModelError(f"{directory}/config.json cannot be read: {_readable(error)}") from None
    check_layer_count(directory, config, weight_files(directory))  # before any skeleton of that many layers
    architecture_for(config)  # refuse unsupported families before spending time on the weights
    # A quantization_config is another format's, or leanlm's as transformers' save_pretrained wrote it (no record
    # file, no leanlm marker in the weights): transformers' quantizer reads those. What leanlm wrote (its marker)
    # is a float model never: with its record it is a checkpoint, without it a checkpoint not written completely.
    carried = getattr(config, "quantization_config", None)
    if not quantized:
        marked = quantized_weights_file(directory, marker_only=carried is not None)
        if marked is not None:
            reason = (
                f"{QUANT_FILE} is there, so it is a quantized checkpoint: this needs a float model"
                if (directory / QUANT_FILE).exists()
                else f"it has no {QUANT_FILE}, so it was not written completely (or that file was removed); "
                "quantize again"
            )
            raise CorruptModelError(f"{directory} holds leanlm quantized weights ({marked.name}) but {reason}")
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them holds a vocabulary


def read_tokenizer(directory: Path):
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return from_pretrained(AutoTokenizer, directory)
    except Exception as error:  # tokenizers raises its own exception types for damaged files
        raise ModelNotFoundError(f"{directory} has no usable tokenizer files: {_readable(error)}") from None


def _readable(error: Exception) -> str:
    """A transformers error in a line; its request to trust a directory's code becomes what leanlm does instead."""
    if "custom code" in str(error) or "trust_remote_code" in str(error):
        return "it names Python code of its own (auto_map) to build it, and leanlm never runs code from a model"
    return first_line(error)


def _load_hf_directory(directory: Path, attn_implementation: str | None, dtype: torch.dtype = torch.float32):
    config = read_model_config(directory)
    if getattr(config, "quantization_config", None) is None:  # a quantizer's files hold its own tensors
        check_float_weights(directory, weight_files(directory), skeleton(config))
    tokenizer = read_tokenizer(directory)
    try:
        model, info = from_pretrained(
            AutoModelForCausalLM,
            directory,
            dtype=dtype,
            attn_implementation=attn_implementation,
            use_safetensors=True,
            output_loading_info=True,
        )
    except Exception as error:  # safetensors, torch and transformers each raise their own types here
        raise CorruptModelError(f"the weights in {directory} cannot be loaded: {error}") from None
    if info["missing_keys"]:
        # transformers would leave these randomly initialised: a model that runs and talks nonsense.
        missing = sorted(info["missing_keys"])
        raise CorruptModelError(
            f"the weights in {directory} lack {len(missing)} of the model's tensors "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    model.eval()
    use_gemv_(model)  # decode steps (at most 8 rows) through leanlm's multi-threaded GEMV
    return model, tokenizer


def _cached_float_checkpoint(gguf: Path, expected_sha256: str | None) -> Path:
    """The float checkpoint made from `gguf`, converting it on first use. Keyed by the file's checksum, so a
    changed file is converted anew; processes asking at once wait for one conversion."""
    checksum = sha256_of(gguf)
    if expected_sha256 is not None and checksum != expected_sha256:
        raise CorruptModelError(
            f"{gguf} fails its checksum (sha256 {checksum}, expected {expected_sha256}); reinstall the package"
        )
    directory = cached_float_directory(gguf, checksum)
    if (directory / "config.json").is_file():
        return directory
    with exclusive_lock(cache_root() / "locks" / directory.name):  # another process may be converting it
        if not (directory / "config.json").is_file():
            _convert_gguf(gguf, directory)
    return directory


# Raised whenever the conversion's output changes, so that a cache entry made by an older conversion is made anew.
CONVERSION_VERSION = 2


def cached_float_directory(gguf: Path, sha256: str) -> Path:
    """Where the float checkpoint converted from the GGUF of this checksum (by this CONVERSION_VERSION) is, or
    will be, cached."""
    return cache_root() / "models" / f"{gguf.stem}-{sha256[:16]}-c{CONVERSION_VERSION}"


def _convert_gguf(gguf: Path, directory: Path) -> None:
    log.warning("converting %s to a float checkpoint in %s (once, a tensor at a time)", gguf, directory)
    with staged_directory(directory) as staging:  # an interrupted conversion leaves no half-written cache entry
        convert_gguf(gguf, staging)
