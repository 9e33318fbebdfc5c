"""A leanlm model as a GGUF file that llama.cpp runs alone: `export_gguf(source, out, file_type)`.

Float models are written as F32, F16, BF16 or llama.cpp's own Q8_0 rounding. A leanlm checkpoint whose
weights lie exactly on a GGUF block grid is written as those blocks, value for value: RTN / GPTQ with
`--gguf-type` (any of Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS) stores them already, and RTN / GPTQ on the
symmetric grid (`--grid symmetric`) with groups of 32 consecutive columns (`--no-act-order`, or act-order with
`--static-groups`) are Q4_0 (4 bits) or Q8_0 (8 bits); the other tensors (embeddings, norms) take the float type
asked for. Every other stored form is refused with the reason (each module's `gguf_problems`): nothing is
re-rounded silently.

What a family's GGUF layout needs is in its architecture table (`gguf_architecture`, `gguf_interleaved_qk`,
`norm_weight_offset`): Llama / SmolLM (q and k rows put back in the interleaved order llama.cpp's rotary
embedding reads, the order transformers undoes when it loads a GGUF) and Gemma 3 (norm weights stored as
1 + weight, as its RMSNorm multiplies by them). The metadata (tokenizer, chat template, hyper-parameters) is
carried over from the GGUF the model came from, so the file needs nothing beside it; a model that did not come
from a GGUF (a transformers directory, or a checkpoint quantized from one) has it written from its config and its
byte-level BPE tokenizer (`metadata_from_transformers`: Llama-layout families). Tensor names follow the `gguf`
package's name map. Tensors are written one at a time after the header (`GGUFWriter.add_tensor_info`, then
`write_tensor_data`), so an 8B export holds one matrix's blocks at a time beside the model, not the whole file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from leanlm.errors import ConfigError, CorruptModelError, first_line
from leanlm.export.exactness import require_exact
from leanlm.formats import gguf_blocks as blocks_format
from leanlm.formats.gguf_header import read_gguf_header
from leanlm.models.architectures import attention_shape, gguf_tensor_names
from leanlm.nn import QUANTIZED_MODULES
from leanlm.storage import QUANT_FILE, check_output_file, staged_file

FILE_TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# Keys the writer sets itself or that describe the source file's own encoding, not the model.
_NOT_CARRIED = {"general.file_type", "general.quantization_version", "general.architecture"}


def source_gguf(source: str | os.PathLike, *, follow: bool = True) -> Path | None:
    """The GGUF file `source` came from: the registry model's file, `source` itself, or (for a leanlm checkpoint)
    the GGUF of the model it was quantized from (its record's `source_model`, followed once: a record naming
    another checkpoint, or itself, leads nowhere); None for a model that came from a transformers directory."""
    from leanlm.methods.checkpoint import read_record
    from leanlm.models.registry import REGISTRY, gguf_path_of
    from leanlm.storage import cache_root

    name = str(source)
    if name in REGISTRY:
        return gguf_path_of(REGISTRY[name], cache_root() / "gguf")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if follow and path.is_dir() and (path / QUANT_FILE).is_file():
        named = read_record(path).get("source_model")
        return source_gguf(named, follow=False) if isinstance(named, str) and named else None
    return None


def _read_gguf(path: Path):
    """The `gguf` package's reader of `path`, after its header is checked (the reader allocates by its counts)."""
    read_gguf_header(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, struct and numpy errors for damaged files
        raise CorruptModelError(f"{path} cannot be read as a GGUF file: {first_line(error)}") from None


# The GGUF architectures whose hyper-parameters `metadata_from_transformers` writes from a transformers config:
# llama.cpp reads both with the same keys (Gemma 3 needs sliding-window and soft-capping keys besides).
_FROM_CONFIG = ("llama", "qwen2")


def _bpe_vocabulary(tokenizer, vocab_size: int) -> tuple[str, list[str], list[int], list[str]]:
    """(pre-tokenizer name, tokens, token types, merges) of a byte-level BPE tokenizer (GPT-2's kind, which
    SmolLM, Llama 3 and Qwen 2 use), read from its tokenizer.json; the token list is padded to the model's
    vocabulary size as llama.cpp's converter pads it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model = spec.get("model", {})
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    if model.get("type") != "BPE" or model.get("byte_fallback") or not byte_level:
        raise ConfigError(
            "GGUF export writes a tokenizer only for byte-level BPE (GPT-2's kind); this model's is "
            f"{model.get('type', type(tokenizer).__name__)}: export from the GGUF it came from"
        )
    ids = dict(model["vocab"])
    kinds = {}
    for added in spec.get("added_tokens", []):
        ids[added["content"]] = added["id"]
        kinds[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    tokens: list[str | None] = [None] * max(vocab_size, max(ids.values()) + 1)
    for text, index in ids.items():
        tokens[index] = text
    types = [
        int(kinds.get(index, gguf.TokenType.NORMAL if text is not None else gguf.TokenType.UNUSED))
        for index, text in enumerate(tokens)
    ]
    tokens = [text if text is not None else f"[PAD{index}]" for index, text in enumerate(tokens)]
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model.get("merges", [])]
    # A plain ByteLevel pre-tokenizer splits text with GPT-2's pattern, which llama.cpp calls "gpt-2"; any other
    # (a Split with its own pattern) is one llama.cpp knows only by a hash of its output: its default pattern.
    pre = spec.get("pre_tokenizer") or {}
    plain = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    return ("gpt-2" if plain else "default"), tokens, types, merges


def _config_metadata_problem(config, table) -> str | None:
    """Why `metadata_from_transformers` cannot describe this model to llama.cpp, or None."""
    if table.gguf_architecture not in _FROM_CONFIG:
        return (
            f"GGUF export writes {table.gguf_architecture or table.family} metadata only from the GGUF the model "
            f"came from (from a transformers config it knows {', '.join(_FROM_CONFIG)})"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return (
            f"rope type {rope['rope_type']!r}: llama.cpp reads its frequencies from a rope_freqs tensor this "
            "export does not write"
        )
    return None


def transformers_vocabulary(directory: Path):
    """(config, tokenizer, vocabulary) of a transformers model directory for `metadata_from_transformers`, or a
    ConfigError naming why llama.cpp could not be given its metadata: read before any weight is."""
    from leanlm.models.architectures import architecture_for
    from leanlm.models.loading import read_model_config, read_tokenizer

    config = read_model_config(directory, quantized=True)
    problem = _config_metadata_problem(config, architecture_for(config))
    if problem:
        raise ConfigError(problem)
    tokenizer = read_tokenizer(directory)
    return config, tokenizer, _bpe_vocabulary(tokenizer, config.vocab_size)


def metadata_from_transformers(writer: gguf.GGUFWriter, config, tokenizer, vocabulary, name: str) -> str:
    """Write the hyper-parameters, tokenizer and chat template llama.cpp needs, from a transformers config,
    tokenizer and its `_bpe_vocabulary` (what llama.cpp's convert_hf_to_gguf.py writes for these families).
    Returns the pre-tokenizer name written."""
    rope = getattr(config, "rope_parameters", None) or {}
    shape = attention_shape(config)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_dim != config.hidden_size // shape.heads:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    pre, tokens, types, merges = vocabulary
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, token_id in (
        (writer.add_bos_token_id, tokenizer.bos_token_id),
        (writer.add_eos_token_id, tokenizer.eos_token_id),
        (writer.add_unk_token_id, tokenizer.unk_token_id),
        (writer.add_pad_token_id, tokenizer.pad_token_id),
    ):
        if token_id is not None:
            setter(token_id)
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if isinstance(tokenizer.chat_template, str):
        writer.add_chat_template(tokenizer.chat_template)
    return pre


def _gguf_order(weights: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows from transformers' half-split rotary order into llama.cpp's interleaved pairs."""
    head_dim = weights.shape[0] // heads
    return weights.reshape(heads, 2, head_dim // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_problems(module: nn.Module) -> list[str]:
    """The `leanlm quantize` settings `module` would need to be a GGUF block type exactly (empty: none)."""
    return module.gguf_problems()


def gguf_blocks(module: nn.Module) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """A quantized module's weight as GGUF blocks (rows, bytes per row) holding exactly its values, and their
    type, or a ConfigError naming why no block type does."""
    require_exact("GGUF", [module], gguf_problems)
    return module.gguf_blocks()


def table_blocks(weight: torch.Tensor, name: str) -> tuple[np.ndarray, blocks_format.BlockType]:
    """A float table (token embedding, output head: rows, columns) as GGUF blocks of type `name` (llama.cpp's
    fallback where a row is no whole number of its blocks), each row rounded to nearest on statistics fitted with
    every column alike (leanlm's RTN for that type), and the type written."""
    kind = blocks_format.type_for_row(name, weight.shape[1])
    weight = weight.detach().float()
    statistics = blocks_format.fit_statistics(kind, weight)
    codes = blocks_format.codes_for(kind, weight, statistics)
    return blocks_format.pack(kind, codes, statistics).numpy(), kind


def _refuse_tied_output(tied: bool) -> None:
    if tied:
        raise ConfigError(
            "this model's output head is its token embedding (tied): the file holds one table, so give "
            "--token-embedding-type alone"
        )


def _recorded_table_types(source) -> dict[str, str]:
    """The table types a checkpoint quantized with --size-of keeps for its export ({} for any other source)."""
    from leanlm.methods.checkpoint import read_record

    directory = Path(str(source)).expanduser()
    if not (directory / QUANT_FILE).is_file():
        return {}
    recorded = read_record(directory).get("gguf_table_types") or {}
    return {name: kind for name, kind in recorded.items() if name in ("token_embd", "output") and isinstance(kind, str)}


def export_gguf(
    source: str | os.PathLike,
    out: str | os.PathLike,
    file_type: str = "f32",
    *,
    force: bool = False,
    token_embedding_type: str | None = None,
    output_tensor_type: str | None = None,
) -> dict:
    """Write `source` (a float model or a leanlm checkpoint) to `out` as one GGUF: quantized modules as their
    exact GGUF blocks, other matrices as `file_type` (see FILE_TYPES), with the metadata of the GGUF it came from
    (or, without one, written from its config and tokenizer). `token_embedding_type` / `output_tensor_type` (as
    llama-quantize's options): the token embedding / a float output head as blocks of that GGUF type instead
    (`table_blocks`); a tied head is the embedding, so it takes the embedding's. A table given no type
    takes, in a checkpoint quantized with --size-of, the type llama.cpp's file of that type gives it. An existing `out` is replaced only
    with `force`, and never when it is (or is inside) what the model is read from. Returns {"path", "file_type",
    "tensors", "block_types", "table_types" (GGUF name: type, for the tables given one), "bytes", "metadata"}."""
    from leanlm.cache.prefix import attached_cushion
    from leanlm.methods.checkpoint import load_any

    if file_type not in FILE_TYPES:
        raise ConfigError(f"file type {file_type!r}: choose from {', '.join(FILE_TYPES)}")
    recorded = _recorded_table_types(source)
    table_types = {
        "token_embd": token_embedding_type or recorded.get("token_embd"),
        "output": output_tensor_type or recorded.get("output"),
    }
    for name in filter(None, table_types.values()):
        blocks_format.block_type(name)
    origin = source_gguf(source)
    local = Path(str(source)).expanduser()
    out = check_output_file(out, force=force, inputs=tuple(p for p in (origin, local) if p is not None and p.exists()))
    original = _read_gguf(origin) if origin is not None else None
    if original is None:  # a model directory: what its metadata needs is read and checked before the weights
        _, tokenizer, vocabulary = transformers_vocabulary(Path(source))
    if output_tensor_type is not None and original is not None:  # a GGUF without output.weight is tied: said early
        _refuse_tied_output({tensor.name for tensor in original.tensors}.isdisjoint({"output.weight"}))
    loaded = load_any(source)
    if attached_cushion(loaded.model) is not None:
        raise ConfigError(
            "this checkpoint carries a CushionCache prefix; a GGUF file has no place for a prefix "
            "KV cache, and without it the int8 activations it protects break"
        )
    config = loaded.model.config
    table, attention = loaded.table, attention_shape(config)
    tied = getattr(config, "tie_word_embeddings", False)
    if output_tensor_type is not None:
        _refuse_tied_output(tied)
    architecture = original.fields["general.architecture"].contents() if original else table.gguf_architecture
    if table.gguf_architecture != architecture or architecture is None:
        raise ConfigError(
            f"GGUF export knows the layout of {table.family} as {table.gguf_architecture!r}, not the "
            f"source file's {architecture!r}"
            if table.gguf_architecture
            else f"GGUF export does not know the {table.family} layout"
        )
    names = gguf_tensor_names(loaded.model)
    tensor_type, llama_file_type = FILE_TYPES[file_type]
    modules = dict(loaded.model.named_modules())
    quantized = {name: module for name, module in modules.items() if type(module).__name__ in QUANTIZED_MODULES}
    require_exact("GGUF", quantized.values(), gguf_problems)  # every refusal before anything is written
    quantized = {name: module.gguf_type() for name, module in quantized.items()}
    block_types = sorted({kind.name for kind in quantized.values()})
    if quantized:  # the file type llama.cpp reports: that of the blocks most matrices are (K-quants: its "_S" mix)
        most = Counter(kind.name for kind in quantized.values()).most_common(1)[0][0]
        llama_file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{most}", None) or getattr(
            gguf.LlamaFileType, f"MOSTLY_{most}_S"
        )

    # The plan, every tensor's GGUF name, type and shape, also before anything is written.
    plan = []
    written_tables = {}  # GGUF name: the block type a table takes (token_embedding_type, output_tensor_type)
    for name, tensor in _tensors(loaded.model, quantized):
        if tied and name == "lm_head.weight":
            continue  # llama.cpp reads the tied output matrix from token_embd
        base, _, suffix = name.rpartition(".")
        target = names.get_name(base)
        if target is None:
            raise ConfigError(f"{name}: no GGUF name for this tensor in the {architecture} layout")
        if tensor is None:  # a quantized module's weight
            module = modules[base]
            kind, shape = quantized[base], (module.out_features, module.in_features)
        elif tensor.ndim == 2 and table_types.get(target) is not None:
            kind, shape = blocks_format.type_for_row(table_types[target], tensor.shape[1]).ggml, tuple(tensor.shape)
            written_tables[target] = kind.name
        else:
            # Norms and other vectors stay F32, as llama.cpp's own converter keeps them.
            kind, shape = (tensor_type if tensor.ndim == 2 else gguf.GGMLQuantizationType.F32), tuple(tensor.shape)
        plan.append((name, f"{target}.{suffix}", target, kind, shape))

    metadata = (
        f"carried over from {origin.name}"
        if original is not None
        else f"written from the config and tokenizer (pre-tokenizer {vocabulary[0]!r})"
    )
    with staged_file(out) as partial:  # the file appears only when complete
        writer = gguf.GGUFWriter(partial, architecture)
        try:
            if original is not None:
                for key, field in original.fields.items():
                    if key.startswith("GGUF.") or key in _NOT_CARRIED:
                        continue
                    kind = field.types[0]
                    writer.add_key_value(
                        key,
                        field.contents(),
                        kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None,
                    )
            else:
                metadata_from_transformers(writer, config, tokenizer, vocabulary, Path(str(source)).name)
            writer.add_file_type(llama_file_type)
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
            for _, gguf_name, _, kind, shape in plan:  # described by their bytes, so that every type takes one path
                byte_shape = gguf.quant_shape_to_byte_shape(shape, kind)
                writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), kind)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            state = loaded.model.state_dict()
            for name, _, target, kind, _ in plan:  # one tensor in memory at a time
                base = name.rpartition(".")[0]
                if base in quantized and name.endswith(".weight"):
                    data, _ = modules[base].gguf_blocks()
                elif state[name].ndim == 2 and table_types.get(target) is not None:
                    data, _ = table_blocks(state[name], table_types[target])
                else:
                    data = state[name].detach().to(torch.float32).numpy()
                    if kind != gguf.GGMLQuantizationType.F32:
                        data = gguf.quants.quantize(data, kind)
                if table.norm_weight_offset and "norm" in target:  # the file holds what the norm multiplies by
                    data = data + np.float32(table.norm_weight_offset)
                if table.gguf_interleaved_qk and target.endswith("attn_q"):  # whole rows move, blocks with them
                    data = _gguf_order(data, attention.heads)
                elif table.gguf_interleaved_qk and target.endswith("attn_k"):
                    data = _gguf_order(data, attention.kv_heads)
                writer.write_tensor_data(np.ascontiguousarray(data))
        finally:
            writer.close()
    return {
        "path": str(out),
        "file_type": file_type,
        "tensors": len(plan),
        "block_types": block_types,
        "table_types": written_tables,
        "bytes": out.stat().st_size,
        "metadata": metadata,
    }


def _tensors(model: nn.Module, quantized: dict):
    """(name, tensor) for every float tensor of `model` and (name.weight, None) for every quantized module's
    weight (its bias, if any, as a float tensor), in the model's own order."""
    written = set()
    for name, tensor in model.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if module not in quantized or suffix == "bias":
            yield name, tensor
        elif module not in written:  # once per module, where its first stored tensor is
            written.add(module)
            yield f"{module}.weight", None
