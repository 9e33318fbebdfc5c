"""Architecture tables: every fact about a model family that leanlm's methods need, in one place.

A method never asks "is this a Llama?". It asks the table: which norm feeds which linears (SmoothQuant folds
its scales there), which linears are attention q/k/v/o and MLP up/gate/down, how positions are encoded
(StreamingLLM re-assigns them inside the cache), and which modules are never quantized. Adding a model family
is adding one `ArchitectureTable` row to `TABLES`.

All module paths inside a block are relative to the block; `blocks`, `final_norm`, `never_quantize` and
`rotary_embedding` are relative to the model root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn

from leanlm.errors import UnsupportedArchitectureError

PositionEncoding = Literal["rope", "learned", "alibi"]


@dataclass(frozen=True)
class NormFeeds:
    """A norm whose output is the input of `linears` (and of nothing else that a scale change would break)."""

    norm: str
    linears: tuple[str, ...]


@dataclass(frozen=True)
class LinearFeeds:
    """`producer`'s output reaches `consumer`'s input through an op that commutes with a positive per-channel
    scale (attention's value path, ReLU, or the linear factor of a gated unit), so a scale can move across."""

    producer: str
    consumer: str


@dataclass(frozen=True)
class ArchitectureTable:
    family: str
    model_types: tuple[str, ...]  # values of `config.model_type` this row covers
    blocks: str  # the ModuleList of decoder blocks
    attention_inputs: tuple[str, ...]  # q, k, v projections, or the one fused projection
    attention_output: str
    mlp_inputs: tuple[str, ...]  # gate and up, or fc1
    mlp_output: str  # down, or fc2
    mlp_activation: Literal["swiglu", "geglu", "relu", "gelu"]
    norm_feeds: tuple[NormFeeds, ...]
    linear_feeds: tuple[LinearFeeds, ...]
    positions: PositionEncoding
    final_norm: str
    never_quantize: tuple[str, ...]  # embeddings and lm_head: quantizing them costs quality for little speed
    rotary_embedding: str | None = None
    fused_qkv: bool = False
    # GPT-2's Conv1D stores its weight as (in, out); every other family uses nn.Linear's (out, in).
    weight_layout: Literal["out_in", "in_out"] = "out_in"
    # Gemma's RMSNorm multiplies by (1 + weight): a scale folded into it must respect the offset.
    norm_weight_offset: float = 0.0
    # GGUF: the `general.architecture` llama.cpp knows this family by (None: no GGUF export), and whether q / k
    # rows are stored in llama.cpp's interleaved rotary order (Llama's converter permutes them; Gemma's does not).
    gguf_architecture: str | None = None
    gguf_interleaved_qk: bool = False
    # Whether leanlm's one-call C++ decode step (`leanlm.decoding.fused`) implements this family's block: RMSNorm,
    # rotary attention with grouped keys/values, a gated MLP, and what the two fields below add.
    fused_decode: bool = False
    # Norms applied to the attention and the MLP outputs before the residual add (Gemma 3), block-relative.
    output_norms: tuple[str, str] | None = None
    # Per-head norms of the queries and keys before the rotation (Gemma 3), block-relative.
    qk_norms: tuple[str, str] | None = None
    # Returns why a particular config of this family is unsupported, or None.
    config_problem: Callable[[object], str | None] = field(default=lambda config: None, compare=False)

    @property
    def attention_module(self) -> str:
        """Block-relative path of the module that runs attention (the parent of its output projection)."""
        return self.attention_output.rsplit(".", 1)[0]

    @property
    def quantizable_linears(self) -> tuple[str, ...]:
        """Block-relative paths of the linears that weight/activation quantization replaces."""
        return (*self.attention_inputs, self.attention_output, *self.mlp_inputs, self.mlp_output)


def _llama_like(
    family: str, model_types: tuple[str, ...], gguf_architecture: str = "llama", gguf_interleaved_qk: bool = True
) -> ArchitectureTable:
    return ArchitectureTable(
        family=family,
        model_types=model_types,
        blocks="model.layers",
        attention_inputs=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        attention_output="self_attn.o_proj",
        mlp_inputs=("mlp.gate_proj", "mlp.up_proj"),
        mlp_output="mlp.down_proj",
        mlp_activation="swiglu",
        norm_feeds=(
            NormFeeds("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            NormFeeds("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        linear_feeds=(
            LinearFeeds("self_attn.v_proj", "self_attn.o_proj"),
            LinearFeeds("mlp.up_proj", "mlp.down_proj"),
        ),
        positions="rope",
        final_norm="model.norm",
        never_quantize=("model.embed_tokens", "lm_head"),
        rotary_embedding="model.rotary_emb",
        gguf_architecture=gguf_architecture,
        gguf_interleaved_qk=gguf_interleaved_qk,
        fused_decode=True,
    )


def _opt_problem(config) -> str | None:
    if not getattr(config, "do_layer_norm_before", True):
        return "this OPT variant is post-LayerNorm (do_layer_norm_before=False, e.g. opt-350m); only pre-LN OPT is supported"
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        return "this OPT variant projects its embeddings (word_embed_proj_dim != hidden_size); it is not supported"
    return None


TABLES: tuple[ArchitectureTable, ...] = (
    # SmolLM and SmolLM2 are `llama` models.
    _llama_like("llama", ("llama",)),
    _llama_like("mistral", ("mistral",)),  # llama.cpp reads Mistral as a Llama
    _llama_like("qwen2", ("qwen2",), "qwen2", gguf_interleaved_qk=False),
    # Gemma 3 normalises both before and after each sub-block; the *pre* norms feed the linears.
    replace(
        _llama_like("gemma3", ("gemma3_text",), "gemma3", gguf_interleaved_qk=False),
        mlp_activation="geglu",
        norm_feeds=(
            NormFeeds("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            NormFeeds("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
        norm_weight_offset=1.0,
        output_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
    ),
    ArchitectureTable(
        family="opt",
        model_types=("opt",),
        blocks="model.decoder.layers",
        attention_inputs=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        attention_output="self_attn.out_proj",
        mlp_inputs=("fc1",),
        mlp_output="fc2",
        mlp_activation="relu",
        norm_feeds=(
            NormFeeds("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            NormFeeds("final_layer_norm", ("fc1",)),
        ),
        # ReLU(s * x) = s * ReLU(x) for s > 0, so fc1 -> fc2 is exact.
        linear_feeds=(LinearFeeds("self_attn.v_proj", "self_attn.out_proj"), LinearFeeds("fc1", "fc2")),
        positions="learned",
        final_norm="model.decoder.final_layer_norm",
        never_quantize=("model.decoder.embed_tokens", "model.decoder.embed_positions", "lm_head"),
        config_problem=_opt_problem,
    ),
    ArchitectureTable(
        family="gpt2",
        model_types=("gpt2",),
        blocks="transformer.h",
        attention_inputs=("attn.c_attn",),
        attention_output="attn.c_proj",
        mlp_inputs=("mlp.c_fc",),
        mlp_output="mlp.c_proj",
        mlp_activation="gelu",
        norm_feeds=(NormFeeds("ln_1", ("attn.c_attn",)), NormFeeds("ln_2", ("mlp.c_fc",))),
        # The value slice of a fused qkv projection is not a module of its own, and GELU is not homogeneous.
        linear_feeds=(),
        positions="learned",
        final_norm="transformer.ln_f",
        never_quantize=("transformer.wte", "transformer.wpe", "lm_head"),
        fused_qkv=True,
        weight_layout="in_out",
    ),
    ArchitectureTable(
        family="gpt_neox",
        model_types=("gpt_neox",),
        blocks="gpt_neox.layers",
        attention_inputs=("attention.query_key_value",),
        attention_output="attention.dense",
        mlp_inputs=("mlp.dense_h_to_4h",),
        mlp_output="mlp.dense_4h_to_h",
        mlp_activation="gelu",
        # With the parallel residual both norms read the block input; either way each feeds only its linears.
        norm_feeds=(
            NormFeeds("input_layernorm", ("attention.query_key_value",)),
            NormFeeds("post_attention_layernorm", ("mlp.dense_h_to_4h",)),
        ),
        linear_feeds=(),
        positions="rope",  # partial: only a fraction of each head's dimensions rotates
        final_norm="gpt_neox.final_layer_norm",
        never_quantize=("gpt_neox.embed_in", "lm_head"),
        rotary_embedding="gpt_neox.rotary_emb",
        fused_qkv=True,
    ),
)

_BY_MODEL_TYPE = {model_type: table for table in TABLES for model_type in table.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def architecture_for(model_or_config: nn.Module | object) -> ArchitectureTable:
    """The table for a model (or its config); raises UnsupportedArchitectureError naming the problem."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    table = _BY_MODEL_TYPE.get(model_type)
    if table is None:
        raise UnsupportedArchitectureError(
            f"leanlm has no architecture table for model_type {model_type!r}; "
            f"supported: {', '.join(supported_model_types())}"
        )
    problem = table.config_problem(config)
    if problem:
        raise UnsupportedArchitectureError(f"{table.family}: {problem}")
    return table


def decoder_blocks(model: nn.Module, table: ArchitectureTable | None = None) -> nn.ModuleList:
    table = table or architecture_for(model)
    return model.get_submodule(table.blocks)


def iter_quantizable_linears(
    model: nn.Module, table: ArchitectureTable | None = None
) -> Iterator[tuple[str, nn.Module]]:
    """(full name, module) for every linear that quantization methods replace, block by block."""
    table = table or architecture_for(model)
    for index, block in enumerate(decoder_blocks(model, table)):
        for path in table.quantizable_linears:
            yield f"{table.blocks}.{index}.{path}", block.get_submodule(path)


def linear_weight_out_in(module: nn.Module, table: ArchitectureTable) -> torch.Tensor:
    """The weight of a linear as (out_features, in_features), whatever the family stores."""
    return module.weight.t() if table.weight_layout == "in_out" else module.weight


def rotary_fraction(config) -> float:
    """Fraction of each head's dimensions that RoPE rotates (GPT-NeoX rotates only part of them)."""
    rope = getattr(config, "rope_parameters", None) or {}
    for source in (rope, vars(config)):
        for key in ("partial_rotary_factor", "rotary_pct"):
            if key in source and source[key] is not None:
                return float(source[key])
    return 1.0


def proxy_source_weights(model: nn.Module, table: ArchitectureTable | None = None) -> dict[str, torch.Tensor]:
    """For proxy quantization (Dettmers' thesis section 3.3): for each quantizable linear (full name), the (out, in) weight
    of the layer whose output units are that linear's input dimensions.

    Linears reading the residual stream get the last layer that wrote to it: the previous block's MLP output for
    attention inputs (the token embedding, transposed, for block 0), the same block's attention output for MLP
    inputs. Attention's output gets the value projection and the MLP's output its up projection, where the table
    has them as `linear_feeds` producers (else the last MLP input, whose units pass through the activation)."""
    table = table or architecture_for(model)
    blocks = decoder_blocks(model, table)
    producers = {feed.consumer: feed.producer for feed in table.linear_feeds}
    producers.setdefault(table.mlp_output, table.mlp_inputs[-1])
    sources: dict[str, torch.Tensor] = {}
    residual_writer = model.get_input_embeddings().weight.t()  # (hidden, vocab): its rows are the hidden units
    for index, block in enumerate(blocks):
        prefix = f"{table.blocks}.{index}."
        for path in table.attention_inputs:
            sources[prefix + path] = residual_writer
        attention_output = linear_weight_out_in(block.get_submodule(table.attention_output), table)
        for path in table.mlp_inputs:
            sources[prefix + path] = attention_output
        for consumer, producer in producers.items():
            weight = linear_weight_out_in(block.get_submodule(producer), table)
            inputs = linear_weight_out_in(block.get_submodule(consumer), table).shape[1]
            if inputs != weight.shape[0] and inputs % weight.shape[0] == 0:
                weight = _repeat_kv_heads(weight, inputs // weight.shape[0], model.config)
            if weight.shape[0] == inputs:
                sources[prefix + consumer] = weight
        residual_writer = linear_weight_out_in(block.get_submodule(table.mlp_output), table)
    return sources


def _repeat_kv_heads(value_weight: torch.Tensor, groups: int, config) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves `groups` query heads, so the value projection's rows,
    head by head, repeated `groups` times line up with the output projection's input dimensions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = value_weight.reshape(-1, head_dim, value_weight.shape[1])
    return heads.repeat_interleave(groups, dim=0).reshape(-1, value_weight.shape[1])
