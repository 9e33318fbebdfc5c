"""A leanlm model as a GGUF file that llama.cpp runs alone: `export_gguf(source, out, file_type)`.

This first step writes float models (F32, F16, BF16) and llama.cpp's own Q8_0 rounding of them, for the
architectures whose GGUF layout leanlm knows (Llama / SmolLM). The metadata (tokenizer, chat template,
hyper-parameters) is carried over from the GGUF the model came from, so the file needs nothing beside it.
Tensor names follow the `gguf` package's name map; the rows of q and k are put back in the interleaved order
llama.cpp's rotary embedding reads (the order transformers undoes when it loads a GGUF).

Quantized leanlm checkpoints (RTN / k-bit int / GPTQ on GGUF's own grids -> Q4_0 / Q4_1 / Q8_0) are the next
step of issue 25; they are refused here with that reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import torch

from leanlm.errors import ConfigError
from leanlm.storage import QUANT_FILE

FILE_TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA}  # GGUF architecture name -> the gguf package's enum
# Keys the writer sets itself or that describe the source file's own encoding, not the model.
_NOT_CARRIED = {"general.file_type", "general.quantization_version", "general.architecture"}


def source_gguf(source: str | os.PathLike) -> Path:
    """The GGUF file `source` came from: the registry model's file, or `source` itself."""
    from leanlm.models.loading import cache_root
    from leanlm.models.registry import REGISTRY, gguf_path_of

    name = str(source)
    if name in REGISTRY:
        return gguf_path_of(REGISTRY[name], cache_root() / "gguf")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / QUANT_FILE).is_file():
        raise ConfigError(f"{path} is a leanlm quantized checkpoint; exporting those to GGUF block types is not "
                          "implemented yet (float models only: export the model it was quantized from)")
    raise ConfigError(f"{name}: GGUF export needs the GGUF the model came from (a registry model or a .gguf file) "
                      "for its tokenizer and metadata")


def _gguf_order(weights: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows from transformers' half-split rotary order into llama.cpp's interleaved pairs."""
    head_dim = weights.shape[0] // heads
    return weights.reshape(heads, 2, head_dim // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def export_gguf(source: str | os.PathLike, out: str | os.PathLike, file_type: str = "f32") -> dict:
    """Write `source`'s float weights to `out` as one GGUF of `file_type` (see FILE_TYPES), with the metadata of
    the GGUF it came from. Returns {"path", "file_type", "tensors", "bytes"}."""
    from leanlm.models import load_model
    from leanlm.storage import writable_directory

    if file_type not in FILE_TYPES:
        raise ConfigError(f"file type {file_type!r}: choose from {', '.join(FILE_TYPES)}")
    original = gguf.GGUFReader(source_gguf(source))
    architecture = original.fields["general.architecture"].contents()
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"GGUF export knows the {', '.join(ARCHITECTURES)} layout, not {architecture!r}")
    out = Path(out)
    writable_directory(out.parent)
    loaded = load_model(source)
    config = loaded.model.config
    names = gguf.get_tensor_name_map(ARCHITECTURES[architecture], config.num_hidden_layers)
    tensor_type, llama_file_type = FILE_TYPES[file_type]

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
    state = loaded.model.state_dict()
    tied = getattr(config, "tie_word_embeddings", False)
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue  # llama.cpp reads the tied output matrix from token_embd
        base, _, suffix = name.rpartition(".")
        target = names.get_name(base)
        if target is None:
            raise ConfigError(f"{name}: no GGUF name for this tensor in the {architecture} layout")
        weights = tensor.detach().to(torch.float32).numpy()
        if target.endswith("attn_q"):
            weights = _gguf_order(weights, config.num_attention_heads)
        elif target.endswith("attn_k"):
            weights = _gguf_order(weights, config.num_key_value_heads)
        # Norms and other vectors stay F32, as llama.cpp's own converter keeps them.
        kind = tensor_type if weights.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.F32:
            data = np.ascontiguousarray(weights)
        else:
            data = gguf.quants.quantize(weights, kind)
        writer.add_tensor(f"{target}.{suffix}", data, raw_dtype=kind if kind != gguf.GGMLQuantizationType.F32 else None)
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out)  # the file appears only when complete
    return {"path": str(out), "file_type": file_type, "tensors": count, "bytes": out.stat().st_size}
