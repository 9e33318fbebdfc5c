"""A GGUF file as a Hugging Face model directory, one tensor at a time.

The file is memory-mapped; each tensor is de-quantized on its own (the `gguf` package reads every block type,
K-quants included), given the name and layout transformers gives it (transformers' own GGUF name map and tensor
processors: llama.cpp's q / k row order, Gemma's norms), and added to the safetensors shard being filled, which
is written when full. Resident memory therefore holds one de-quantized tensor and one shard, never the model,
whatever the file's size. The config and the tokenizer (with its chat template) come from the file's metadata,
read by transformers.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import mmap
import os
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from leanlm.errors import CorruptModelError, UnsupportedArchitectureError, one_line
from leanlm.formats.gguf_header import read_gguf_header
from leanlm.models.architectures import architecture_for
from leanlm.models.untrusted import INDEX_FILE, from_pretrained, model_from_config

log = logging.getLogger(__name__)

SHARD_BYTES = 512 << 20  # a shard's tensors are held until it is written: this bounds that buffer
CHUNK_VALUES = 1 << 22  # values de-quantized at once


def gguf_config(gguf: Path):
    """The transformers config a GGUF's metadata describes (its header is checked first; no tensor is read)."""
    return _parsed_config(gguf)[0]


@contextlib.contextmanager
def _readers_kept():
    """The `gguf.GGUFReader`s made inside the block, in a list: transformers' metadata parse makes one that has
    read every field and knows every tensor, which the conversion then uses instead of parsing the file again."""
    import gguf as gguf_package

    made = []

    class KeptReader(gguf_package.GGUFReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    with mock.patch.object(gguf_package, "GGUFReader", KeptReader):
        yield made


def _parsed_config(gguf: Path, readers: list | None = None):
    """(config, transformers' parsed metadata); the reader transformers made is appended to `readers` if given."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    read_gguf_header(gguf)  # every count, length and offset checked before a reader allocates by them
    try:
        with _readers_kept() as made:
            parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
        if readers is not None:
            readers.extend(made)
    except Exception as error:  # the GGUF reader raises anything from ValueError to struct errors
        if "not supported" in str(error).lower():
            raise UnsupportedArchitectureError(f"{gguf}: {one_line(error)}") from None
        raise CorruptModelError(f"{gguf} cannot be read as a GGUF model: {one_line(error)}") from None
    try:
        config = AutoConfig.for_model(**parsed["config"])  # what AutoConfig makes of the file, without reading it again
    except Exception as error:
        raise CorruptModelError(
            f"{gguf}: its metadata does not describe a model transformers builds: {one_line(error)}"
        ) from None
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # what leanlm makes of the file is float weights
    return config, parsed


def _read_metadata(gguf: Path):
    """(config, parsed parameters, reader, the file's architecture name) from the file's metadata, or one error
    naming the problem. The file's metadata is parsed once, by transformers, whose reader then serves the
    tensors."""
    readers = []
    config, parsed = _parsed_config(gguf, readers)
    try:
        (reader,) = readers
        architecture = str(reader.fields["general.architecture"].contents())
    except Exception as error:
        raise CorruptModelError(f"{gguf} cannot be read as a GGUF model: {one_line(error)}") from None
    # The tensors are all that is read from here on: the metadata's parsed fields (a vocabulary and its merges,
    # a few hundred MB of small arrays for a large vocabulary) are dropped, and so is the tokenizer's raw copy.
    reader.fields.clear()
    parsed.pop("tokenizer", None)
    return config, parsed, reader, architecture


def _read_tokenizer(gguf: Path, model_config: dict | None = None):
    """The tokenizer (with its chat template) the file's metadata describes, built by transformers.
    `model_config`: the config transformers parsed from this file (`parsed["config"]`), handed to AutoTokenizer,
    which would otherwise parse every field of the file again to find the model type (transformers' fast
    metadata reader covers only some families); the vocabulary is read by transformers' fast reader either way."""
    from transformers import AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parse = gguf_utils.load_gguf_checkpoint

    def parsed_once(path, return_tensors=False, **kwargs):
        if model_config is not None and not return_tensors and Path(path).resolve() == gguf.resolve():
            return {"config": dict(model_config)}
        return parse(path, return_tensors=return_tensors, **kwargs)

    try:
        with mock.patch.object(gguf_utils, "load_gguf_checkpoint", parsed_once):
            return from_pretrained(AutoTokenizer, gguf.parent, gguf_file=gguf.name)
    except Exception as error:
        raise CorruptModelError(
            f"{gguf}: its metadata does not describe a tokenizer transformers builds: {error}"
        ) from None


def tensor_processor(architecture: str, parsed: dict):
    """transformers' tensor processor for a GGUF of `architecture` (the file's `general.architecture`, which is
    what transformers' own loader keys them by: a "gemma3" file's model type is "gemma3_text", and its processor
    takes the 1 off the norms' weights)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])


def _name_map(config, parsed: dict, architecture: str):
    """(GGUF tensor name -> transformers name, the architecture's tensor processor, the shape of every tensor
    the model needs, by transformers name)."""
    import gguf as gguf_package
    from accelerate import init_empty_weights
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with init_empty_weights():
        skeleton = model_from_config(config)
    config.architectures = [type(skeleton).__name__]
    processor = tensor_processor(architecture, parsed)
    needed = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        needed = {name: shape for name, shape in needed.items() if not name.startswith("lm_head.")}
    # transformers' map walks every submodule and builds gguf's name table (every layer's names) at each one: the
    # table is built once here and shared by the walk, which otherwise costs more than de-quantizing a small model.
    table_once = functools.lru_cache(maxsize=None)(gguf_package.get_tensor_name_map)
    with mock.patch.object(gguf_package, "get_tensor_name_map", table_once):
        return get_gguf_hf_weights_map(skeleton, processor), processor, needed


def _check_tensors(gguf: Path, reader, config, name_map: dict, needed: dict) -> None:
    """Refuse a file whose tensors disagree with its own metadata (a tensor of another size than the model the
    metadata describes, or one the model needs and the file lacks), before anything is de-quantized."""
    present = set()
    for tensor in reader.tensors:
        block = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else ""
        if block.isdigit() and int(block) >= config.num_hidden_layers:
            raise CorruptModelError(
                f"{gguf}: {tensor.name}: the file's metadata says {config.num_hidden_layers} layers, but it holds more"
            )
        name = name_map.get(tensor.name)
        if name is None or name not in needed:
            continue
        present.add(name)
        shape = needed[name]
        if int(tensor.n_elements) != int(np.prod(shape)):
            stored = " x ".join(str(int(n)) for n in reversed(tensor.shape.tolist()))  # fastest dimension last
            raise CorruptModelError(
                f"{gguf}: {tensor.name} is {stored}, but the file's metadata makes {name} {' x '.join(map(str, shape))}"
            )
    missing = sorted(set(needed) - present)
    if missing:
        raise CorruptModelError(
            f"{gguf} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})"
        )


def _dequantized(tensor) -> np.ndarray:
    """`tensor` in float32, de-quantized CHUNK_VALUES at a time into one array: the block decoders' temporaries
    are several times their input, so a whole embedding at once would multiply the peak."""
    from gguf import dequantize

    data = tensor.data
    if data.ndim != 2:
        return dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)
    rows, per_row = data.shape[0], int(tensor.shape[0])  # GGUF lists the fastest dimension first
    out = np.empty((rows, per_row), dtype=np.float32)
    step = max(1, CHUNK_VALUES // per_row)
    for start in range(0, rows, step):
        out[start : start + step] = dequantize(data[start : start + step], tensor.tensor_type)
    return out


def _converted(tensor, processor, name_map: dict, parsed: dict, dtype: torch.dtype):
    """(transformers' name, the tensor in `dtype` and transformers' layout), or None for a tensor the model has
    no place for. A function of its own, so that nothing but its result outlives it."""
    result = processor.process(
        weights=_dequantized(tensor), name=tensor.name, tensor_key_mapping=name_map, parsed_parameters=parsed
    )
    if result.name not in name_map:
        return None
    array = np.ascontiguousarray(result.weights, dtype=np.float32)
    if not array.flags.writeable:  # an F32 tensor is a view of the read-only memory map
        array = array.copy()
    return name_map[result.name], torch.from_numpy(array).to(dtype)


def _release(reader, tensor) -> None:
    """Drop the file pages `tensor` was read from out of this process's resident memory: the whole file is mapped,
    and pages read once would otherwise stay counted until the end, up to the file's size."""
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    end = tensor.data_offset + tensor.n_bytes
    end -= end % mmap.PAGESIZE  # the last partial page may hold the next tensor's start
    if end > start:
        reader.data._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)


def convert_gguf(
    gguf: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32, shard_bytes: int = SHARD_BYTES
) -> None:
    """Write `gguf` into the directory `out` (which must exist and be empty: the caller stages it) as a Hugging
    Face model: config, tokenizer and safetensors shards of `dtype` with their index."""
    gguf, out = Path(gguf), Path(out)

    config, parsed, reader, architecture = _read_metadata(gguf)
    model_config = dict(parsed["config"])
    architecture_for(config)  # an unsupported family is refused before any tensor is read
    name_map, processor, needed = _name_map(config, parsed, architecture)
    _check_tensors(gguf, reader, config, name_map, needed)
    element = torch.empty((), dtype=dtype).element_size()
    total = sum(int(tensor.n_elements) for tensor in reader.tensors) * element

    shard, shard_size, shards, index = {}, 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            shards.append(name)
            index.update(dict.fromkeys(shard, name))
            shard, shard_size = {}, 0

    started = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"converting {gguf.name}") as progress:
        for tensor in reader.tensors:
            size = int(tensor.n_elements) * element
            if shard_size + size > shard_bytes:
                flush()  # before the next tensor is de-quantized: the two are never held together
            converted = _converted(tensor, processor, name_map, parsed, dtype)
            _release(reader, tensor)
            progress.update(size)
            if converted is None:
                continue  # a tensor transformers' model has no place for (rope frequencies llama.cpp precomputed)
            name, value = converted
            shard[name] = value
            shard_size += value.nbytes
            del converted, value  # the shard holds it now, and is the only holder
        flush()
    missing = sorted(set(needed) - set(index))
    if missing:  # a tensor the processor renamed out of the model's reach
        raise CorruptModelError(
            f"{gguf} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})"
        )
    weight_map = {name: index[name] for name in sorted(index)}
    total_size = sum((out / name).stat().st_size for name in shards)
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2) + "\n"
    )
    config.dtype = dtype
    config.save_pretrained(out)
    _read_tokenizer(gguf, model_config).save_pretrained(out)
    log.info("converted %s in %.0f s", gguf, time.perf_counter() - started)
