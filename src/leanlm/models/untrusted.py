"""Reading a model directory a stranger wrote.

- **No code from a model ever runs.** Every transformers call that reads a user's directory goes through
  `from_pretrained` / `model_from_config` here, which pass `trust_remote_code=False` (transformers then neither
  imports an `auto_map` module nor asks at a prompt) and never reach the network; a test fails on any other call.
- **No path read from a model's files leads out of it.** File names from an index map, and every file the
  loaders open, are resolved (symlinks included) and must lie inside the model's directory (`inside`). A
  directory of the Hugging Face cache (`models--org--name/snapshots/REV`, whose files link to `../../blobs`) is
  contained by its `models--org--name` folder.
- **Headers before memory.** The weights' safetensors headers are read (the safetensors library checks their
  offsets against the file) and held against the config before a tensor is allocated: the layer count, then each
  tensor's name, shape and a float dtype (`check_float_weights`), so that a config claiming a hundred thousand
  layers, a tensor relabelled as integers, or a missing block is one line, never a random initialisation.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from leanlm.errors import CorruptModelError, ModelNotFoundError, NeedsWholeModelError

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")  # the block number in model.layers.3.mlp... / transformer.h.3...


def from_pretrained(loader, path: str | os.PathLike, **kwargs):
    """`loader.from_pretrained(path, ...)` (a transformers Auto class) that runs no code from `path` and reads
    nothing but local files."""
    return loader.from_pretrained(path, trust_remote_code=False, local_files_only=True, **kwargs)


def model_from_config(config, **kwargs):
    """The causal LM of `config` (weights uninitialised unless the caller's context says otherwise), built from
    transformers' own classes only."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, trust_remote_code=False, **kwargs)


def model_root(directory: Path) -> Path:
    """The folder a model's files must lie in: `directory` itself, or a Hugging Face cache entry's own folder."""
    directory = Path(directory).resolve()
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent
    return directory


def inside(directory: Path, name: str, what: str) -> Path:
    """`directory / name`, refused unless it lies inside the model (after resolving every symlink); `what` says
    where the name came from."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CorruptModelError(f"{directory}: {what} names {name!r}, which is no file name")
    path = Path(directory) / name
    root = model_root(directory)
    if not path.resolve().is_relative_to(root):
        raise CorruptModelError(f"{directory}: {what} names {name!r}, which lies outside the model's directory")
    return path


def check_contained(directory: Path) -> None:
    """Refuse a model directory holding a file (a tokenizer, a config) that is a symlink out of the model."""
    for path in Path(directory).iterdir():
        if path.is_symlink():
            inside(directory, path.name, "a symlink")


def weight_files(directory: Path) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file holding it: `model.safetensors`, or the files the directory's
    index map lists, each checked to lie inside the model. Reads headers only."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        inside(directory, INDEX_FILE, "the index file")
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            items = list(weight_map.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptModelError(f"{index} cannot be read: {error}") from None
        files = {name: inside(directory, file, f"{INDEX_FILE} ({name})") for name, file in items}
        missing = sorted({path.name for path in files.values() if not path.is_file()})
        if missing:
            raise CorruptModelError(f"{directory} lacks {', '.join(missing[:3])}, which its {INDEX_FILE} lists")
        return files
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ModelNotFoundError(f"{directory} has no safetensors weights ({WEIGHTS_FILE} or {INDEX_FILE})")
    return dict.fromkeys(stored_tensors(inside(directory, WEIGHTS_FILE, "the weights file")), weights)


def stored_tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in the safetensors file `path`, from its header."""
    try:
        with safe_open(str(path), "pt") as handle:
            return {
                name: (handle.get_slice(name).get_dtype(), handle.get_slice(name).get_shape()) for name in handle.keys()
            }
    except (SafetensorError, OSError, ValueError) as error:
        raise CorruptModelError(f"{path} is not a readable safetensors file: {error}") from None


def check_layer_count(directory: Path, config, names) -> None:
    """The config's layer count must be the blocks the weights hold: checked on tensor names, before a skeleton
    of that many layers is built."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise CorruptModelError(f"{directory}/config.json: num_hidden_layers {layers!r} is not a positive integer")
    held = {int(match.group(1)) for name in names if (match := _LAYER_INDEX.search(name))}
    if held and layers > max(held) + 1:
        raise CorruptModelError(
            f"{directory}/config.json says {layers} layers, but the weights hold tensors of {max(held) + 1}"
        )


def check_float_weights(directory: Path, files: dict[str, Path], skeleton) -> None:
    """Every tensor the model (`skeleton`, on the meta device) needs is stored, in a float dtype, with its shape:
    checked on the headers, so that nothing is allocated for a model its files do not fill."""
    stored: dict[str, tuple[str, list[int]]] = {}
    for path in dict.fromkeys(files.values()):
        stored.update(stored_tensors(path))
    renamed = stored_names(skeleton, list(stored))
    present = {id(tensor) for name, tensor in skeleton.state_dict(keep_vars=True).items() if name in renamed}
    missing, problems = [], []
    for name, tensor in skeleton.state_dict(keep_vars=True).items():
        if name not in renamed:
            if id(tensor) not in present:  # a tied weight is stored once
                missing.append(name)
            continue
        dtype, shape = stored[renamed[name]]
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{renamed[name]} is stored as {dtype}, not a float type")
        elif shape != list(tensor.shape):
            problems.append(f"{renamed[name]} is {shape}, the config makes it {list(tensor.shape)}")
    if problems:
        raise CorruptModelError(f"the weights in {directory} do not fit its config.json: {'; '.join(problems[:2])}")
    if missing:
        raise CorruptModelError(
            f"the weights in {directory} lack {len(missing)} of the model's tensors "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )


def stored_names(model, stored: list[str]) -> dict[str, str]:
    """{name in `model`: name stored}, by transformers' renaming rules for the model's family (GPT-NeoX's
    `embed_out` is `lm_head`, GPT-2 stores `h.0...` without its prefix)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [transform for transform in transforms if isinstance(transform, WeightRenaming)]
    converters = [transform for transform in transforms if not isinstance(transform, WeightRenaming)]
    expected = model.state_dict()
    names = {}
    for name in stored:
        renamed, converted = rename_source_key(name, renamings, converters, model.base_model_prefix, expected)
        if converted is not None:
            raise NeedsWholeModelError(
                f"{name} is converted by transformers as it loads ({converted}); leanlm reads "
                "only tensors stored as the model uses them"
            )
        names[renamed] = name
    return names
