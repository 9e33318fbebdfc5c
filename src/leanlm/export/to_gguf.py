"""A leanlm model as a GGUF file that llama.cpp runs alone: `export_gguf(source, out, file_type)`.

Float models are written as F32, F16, BF16 or llama.cpp's own Q8_0 rounding. A leanlm checkpoint whose
weights lie exactly on a GGUF block grid is written as those blocks, value for value: RTN / GPTQ on the
symmetric grid (`--grid symmetric`) with groups of 32 consecutive columns (`--no-act-order`, or act-order with
`--static-groups`) become Q4_0 (4 bits) or Q8_0 (8 bits); the other tensors (embeddings, norms) take the float
type asked for. Every other stored form is
refused with the reason (`gguf_blocks`): nothing is re-rounded silently.

What a family's GGUF layout needs is in its architecture table (`gguf_architecture`, `gguf_interleaved_qk`,
`norm_weight_offset`): Llama / SmolLM (q and k rows put back in the interleaved order llama.cpp's rotary
embedding reads, the order transformers undoes when it loads a GGUF) and Gemma 3 (norm weights stored as
1 + weight, as its RMSNorm multiplies by them). The metadata (tokenizer, chat template, hyper-parameters) is
carried over from the GGUF the model came from, so the file needs nothing beside it. Tensor names follow the
`gguf` package's name map.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.formats.packing import unpack
from leanlm.nn import QUANTIZED_MODULES, SpQRLinear
from leanlm.storage import QUANT_FILE

FILE_TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# Keys the writer sets itself or that describe the source file's own encoding, not the model.
_NOT_CARRIED = {"general.file_type", "general.quantization_version", "general.architecture"}


BLOCK = 32  # weights per Q4_0 / Q8_0 block
_BLOCK_TYPES = {4: gguf.GGMLQuantizationType.Q4_0, 8: gguf.GGMLQuantizationType.Q8_0}  # code bits -> block type


def source_gguf(source: str | os.PathLike) -> Path:
    """The GGUF file `source` came from: the registry model's file, `source` itself, or (for a leanlm checkpoint)
    the GGUF of the model it was quantized from."""
    from leanlm.methods.checkpoint import read_record
    from leanlm.models.loading import cache_root
    from leanlm.models.registry import REGISTRY, gguf_path_of

    name = str(source)
    if name in REGISTRY:
        return gguf_path_of(REGISTRY[name], cache_root() / "gguf")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / QUANT_FILE).is_file():
        return source_gguf(read_record(path).get("source_model", ""))
    raise ConfigError(f"{name}: GGUF export needs the GGUF the model came from (a registry model or a .gguf file) "
                      "for its tokenizer and metadata")


def gguf_tensor_names(model: nn.Module) -> gguf.TensorNameMap:
    """The `gguf` package's map from the model's module names to GGUF tensor names."""
    from leanlm.models.architectures import architecture_for

    architecture = architecture_for(model).gguf_architecture
    enum = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    return gguf.get_tensor_name_map(enum, model.config.num_hidden_layers)


def _gguf_order(weights: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows from transformers' half-split rotary order into llama.cpp's interleaved pairs."""
    head_dim = weights.shape[0] // heads
    return weights.reshape(heads, 2, head_dim // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_blocks(module: nn.Module) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A quantized module's weight as GGUF blocks (rows, bytes per row) holding exactly its values, or a
    ConfigError naming why no block type does."""
    kind = type(module).__name__
    if not isinstance(module, SpQRLinear):
        raise ConfigError(f"{kind} has no GGUF block type (NF4 / FP4 / dynamic codebooks are not uniform grids; "
                          "k-bit int blocks keep a float32 absmax, not Q4_0's float16 scale; int8 W8A8 is per "
                          "channel): quantize with rtn or gptq --grid symmetric --group-size 32")
    problems = []
    if module.statistic_bits is not None or module.outlier_count:
        problems.append("SpQR's quantized statistics and outliers")
    if module.bits not in _BLOCK_TYPES:
        problems.append(f"{module.bits}-bit codes (Q4_0 holds 4, Q8_0 8)")
    if module.per_row or module.group_size != BLOCK:
        problems.append(f"groups of {module.in_features if module.per_row else module.group_size} (blocks are "
                        f"{BLOCK}: --group-size {BLOCK})")
    if module.permutation is not None:
        problems.append("act-order columns (a block is 32 consecutive columns: --static-groups or --no-act-order)")
    half = 2 ** (module.bits - 1)
    if not problems and not bool((module.zero == half).all()):
        problems.append(f"the min-max grid's fractional zeros (Q4_0 / Q8_0 put zero at {half}: --grid symmetric)")
    if problems:
        raise ConfigError(f"this {kind} has no exact GGUF block type: {'; '.join(problems)}")
    rows, columns = module.out_features, module.in_features
    codes = unpack(module.codes, module.bits, rows * columns, module.code_layout).reshape(rows, columns // BLOCK, BLOCK)
    scales = module.scale.numpy().astype(np.float16).view(np.uint8).reshape(rows, columns // BLOCK, 2)
    if module.bits == 4:  # 16 bytes: weight j in the low nibble of byte j, weight j + 16 in its high nibble
        values = (codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)).numpy()
    else:  # 32 signed bytes: code - 128
        values = (codes.to(torch.int16) - half).to(torch.int8).numpy().view(np.uint8)
    blocks = np.concatenate([scales, values], axis=-1).reshape(rows, -1)
    return np.ascontiguousarray(blocks), _BLOCK_TYPES[module.bits]


def export_gguf(source: str | os.PathLike, out: str | os.PathLike, file_type: str = "f32") -> dict:
    """Write `source` (a float model or a leanlm checkpoint) to `out` as one GGUF: quantized modules as their
    exact GGUF blocks, other matrices as `file_type` (see FILE_TYPES), with the metadata of the GGUF it came from.
    Returns {"path", "file_type", "tensors", "block_types", "bytes"}."""
    from leanlm.cache.prefix import attached_cushion
    from leanlm.methods.checkpoint import load_any
    from leanlm.storage import writable_directory

    if file_type not in FILE_TYPES:
        raise ConfigError(f"file type {file_type!r}: choose from {', '.join(FILE_TYPES)}")
    original = gguf.GGUFReader(source_gguf(source))
    architecture = original.fields["general.architecture"].contents()
    out = Path(out)
    writable_directory(out.parent)
    loaded = load_any(source)
    if attached_cushion(loaded.model) is not None:
        raise ConfigError("this checkpoint carries a CushionCache prefix; a GGUF file has no place for a prefix "
                          "KV cache, and without it the int8 activations it protects break")
    config = loaded.model.config
    table = loaded.table
    if table.gguf_architecture != architecture:
        raise ConfigError(f"GGUF export knows the layout of {table.family} as {table.gguf_architecture!r}, not the "
                          f"source file's {architecture!r}" if table.gguf_architecture else
                          f"GGUF export does not know the {table.family} layout")
    names = gguf_tensor_names(loaded.model)
    tensor_type, llama_file_type = FILE_TYPES[file_type]
    quantized = {name: gguf_blocks(module) for name, module in loaded.model.named_modules()
                 if type(module).__name__ in QUANTIZED_MODULES}  # every refusal before anything is written
    block_types = sorted({kind.name for _, kind in quantized.values()})
    if len(block_types) == 1:  # the file type llama.cpp reports: the blocks' own where they are all one kind
        llama_file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{block_types[0]}")

    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    writer = gguf.GGUFWriter(partial, architecture)
    for key, field in original.fields.items():
        if key.startswith("GGUF.") or key in _NOT_CARRIED:
            continue
        value = field.contents()
        kind = field.types[0]
        writer.add_key_value(key, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(llama_file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    count = 0
    tied = getattr(config, "tie_word_embeddings", False)
    for name, tensor in _tensors(loaded.model, quantized):
        if tied and name == "lm_head.weight":
            continue  # llama.cpp reads the tied output matrix from token_embd
        base, _, suffix = name.rpartition(".")
        target = names.get_name(base)
        if target is None:
            raise ConfigError(f"{name}: no GGUF name for this tensor in the {architecture} layout")
        if isinstance(tensor, tuple):  # exact blocks of a quantized module
            data, kind = tensor
        else:
            data = tensor.detach().to(torch.float32).numpy()
            # Norms and other vectors stay F32, as llama.cpp's own converter keeps them.
            kind = tensor_type if data.ndim == 2 else gguf.GGMLQuantizationType.F32
            if kind != gguf.GGMLQuantizationType.F32:
                data = gguf.quants.quantize(data, kind)
        if table.norm_weight_offset and "norm" in target:  # the file holds what the norm multiplies by
            data = data + np.float32(table.norm_weight_offset)
        if table.gguf_interleaved_qk and target.endswith("attn_q"):  # whole rows move, blocks with them
            data = _gguf_order(data, config.num_attention_heads)
        elif table.gguf_interleaved_qk and target.endswith("attn_k"):
            data = _gguf_order(data, config.num_key_value_heads)
        writer.add_tensor(f"{target}.{suffix}", np.ascontiguousarray(data),
                          raw_dtype=None if kind == gguf.GGMLQuantizationType.F32 else kind)
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out)  # the file appears only when complete
    return {"path": str(out), "file_type": file_type, "tensors": count, "block_types": block_types,
            "bytes": out.stat().st_size}


def _tensors(model: nn.Module, quantized: dict):
    """(name, tensor) for every float tensor of `model` and (name.weight, (blocks, type)) for every quantized
    module's weight (its bias, if any, as a float tensor), in the model's own order."""
    for name, tensor in model.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if module not in quantized:
            yield name, tensor
        elif suffix == "codes":  # once per module
            yield f"{module}.weight", quantized[module]
        elif suffix == "bias":
            yield name, tensor
