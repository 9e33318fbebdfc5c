"""Architecture tables: every fact about a model family that leanlm's methods need, in one place.

A method never asks "is this a Llama?". It asks the table: which norm feeds which linears (SmoothQuant folds
its scales there), which linears are attention q/k/v/o and MLP up/gate/down, how positions are encoded
(StreamingLLM re-assigns them inside the cache), and which modules are never quantized.

A table is derived from the model's transformers config, not written by hand: `architecture_for` builds the
model's skeleton on the meta device (no memory, no weights, never a file's code), reads its module tree, and
runs one forward pass of two tokens on it with hooks on the first block. The pass shows what names cannot:
which module's output is which linear's input (a norm feeding q/k/v; one norm feeding attention and MLP alike;
a norm after a sub-block) and the order the linears run in. Each norm's kind (RMS or layer norm) and weight
offset (Gemma's `1 + w`) are read from how a copy of it behaves on a known input. Only what a model cannot show
is written by hand, in `FAMILY_FACTS`: the name llama.cpp knows a family by, which families the fused decode
step is checked against, and configs a family's code builds but leanlm refuses.

All module paths inside a block are relative to the block; `blocks`, `final_norm`, `never_quantize` and
`rotary_embedding` are relative to the model root.
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from leanlm.errors import UnsupportedArchitectureError, first_line

PositionEncoding = Literal["rope", "learned", "none"]


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
    family: str  # the config's model_type
    blocks: str  # the ModuleList of decoder blocks
    attention_inputs: tuple[str, ...]  # q, k, v projections, or the one fused projection
    attention_output: str
    mlp_inputs: tuple[str, ...]  # gate and up, the one fused gate_up, or fc1
    mlp_output: str  # down, or fc2
    mlp_activation: str  # "swiglu" / "geglu" (gated), "relu" / "gelu", or the config's name for anything else
    norm_feeds: tuple[NormFeeds, ...]  # empty when no norm's output is a linear's input (norms after sub-blocks)
    linear_feeds: tuple[LinearFeeds, ...]
    positions: PositionEncoding
    final_norm: str
    never_quantize: tuple[str, ...]  # embeddings and lm_head: quantizing them costs quality for little speed
    rotary_embedding: str | None = None  # the model-level module holding the rotary frequencies
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # GPT-2's Conv1D stores its weight as (in, out); every other family uses nn.Linear's (out, in).
    weight_layout: Literal["out_in", "in_out"] = "out_in"
    norm_kind: Literal["rms", "layer"] | None = None  # None: a norm leanlm does not recognise
    # Gemma's RMSNorm multiplies by (1 + weight): a scale folded into it must respect the offset.
    norm_weight_offset: float = 0.0
    # GGUF: the `general.architecture` llama.cpp knows this family by (None: no GGUF export), and whether q / k
    # rows are stored in llama.cpp's interleaved rotary order (Llama's converter permutes them; Gemma's does not).
    gguf_architecture: str | None = None
    gguf_interleaved_qk: bool = False
    # Whether leanlm's one-call C++ decode step (`leanlm.decoding.fused`) is checked against this family's eager
    # forward (tests/decoding/test_fused.py); the step checks the block's structure itself as well.
    fused_decode: bool = False
    # Norms applied to the attention and the MLP outputs before the residual add (Gemma 2 / 3), block-relative.
    output_norms: tuple[str, str] | None = None
    # Norms of the queries and keys before the rotation (Qwen3, Gemma 3), block-relative.
    qk_norms: tuple[str, str] | None = None

    @property
    def attention_module(self) -> str:
        """Block-relative path of the module that runs attention (the parent of its output projection)."""
        return self.attention_output.rsplit(".", 1)[0]

    @property
    def quantizable_linears(self) -> tuple[str, ...]:
        """Block-relative paths of the linears that weight/activation quantization replaces."""
        return (*self.attention_inputs, self.attention_output, *self.mlp_inputs, self.mlp_output)


def _opt_problem(config) -> str | None:
    if not getattr(config, "do_layer_norm_before", True):
        return "this OPT variant is post-LayerNorm (do_layer_norm_before=False, e.g. opt-350m); only pre-LN OPT is supported"
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        return "this OPT variant projects its embeddings (word_embed_proj_dim != hidden_size); it is not supported"
    return None


@dataclass(frozen=True)
class FamilyFacts:
    """What a family's config and modules cannot show, written by hand."""

    gguf_architecture: str | None = None
    gguf_interleaved_qk: bool = False
    fused_decode: bool = False
    # Returns why a particular config of this family is unsupported, or None.
    config_problem: Callable[[object], str | None] = field(default=lambda config: None, compare=False)


FAMILY_FACTS: dict[str, FamilyFacts] = {
    # SmolLM and SmolLM2 are `llama` models; llama.cpp reads Mistral as a Llama.
    "llama": FamilyFacts("llama", gguf_interleaved_qk=True, fused_decode=True),
    "mistral": FamilyFacts("llama", gguf_interleaved_qk=True, fused_decode=True),
    "qwen2": FamilyFacts("qwen2", fused_decode=True),
    "qwen3": FamilyFacts(fused_decode=True),
    "gemma3_text": FamilyFacts("gemma3", fused_decode=True),
    "opt": FamilyFacts(config_problem=_opt_problem),
}

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_ACTIVATION_NAMES = ("hidden_activation", "hidden_act", "activation_function")
_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu": "geglu", "gelu_new": "geglu"}
_UNGATED = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
_QK_NORM = re.compile(r"(^|\.)(q|k)_(norm|layernorm)$")
_VALUE = re.compile(r"(^|\.)(v_proj|value|v)$")
_UP = re.compile(r"(^|\.)(up_proj|w3)$")


def _refuse(config, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"model_type {getattr(config, 'model_type', None)!r}: {why}")


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _out_in(module: nn.Module) -> torch.Size:
    """A linear's weight shape as (out, in): GPT-2's Conv1D stores (in, out)."""
    return module.weight.shape if isinstance(module, nn.Linear) else module.weight.shape[::-1]


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def skeleton(config) -> nn.Module:
    """The causal LM of `config` on the meta device: its modules, no memory, never a file's code."""
    from leanlm.models.untrusted import model_from_config

    try:
        with torch.device("meta"):
            return model_from_config(copy.deepcopy(config))
    except Exception as error:  # transformers raises ValueError, KeyError, ... for configs it cannot build
        raise _refuse(config, f"transformers cannot build it as a causal language model: {first_line(error)}") from None


def _find_blocks(skeleton: nn.Module, config) -> str:
    layers = getattr(config, "num_hidden_layers", None)
    candidates = [
        (sum(p.numel() for p in module.parameters()), name)
        for name, module in skeleton.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == layers and len(module) > 0
    ]
    if not candidates:
        raise _refuse(config, f"no list of num_hidden_layers={layers} decoder blocks among its modules")
    return max(candidates)[1]


@dataclass
class _Trace:
    """Leaf modules of one block in the order they ran, and which module's output was which module's input."""

    order: list[str]
    feeds: dict[str, list[str]]  # producer -> consumers, in call order


def _trace_block(skeleton: nn.Module, block: nn.Module) -> _Trace | None:
    """One forward pass of two tokens on the meta device with hooks on `block`'s modules; None if the model
    cannot run on meta tensors (then the table keeps what the names show)."""
    names = {module: name for name, module in block.named_modules() if name}
    kept: list[object] = []  # every hooked tensor stays alive, so no id is reused within the pass
    produced: dict[int, str] = {}
    order: list[str] = []
    feeds: dict[str, list[str]] = {}

    def before(module, args, kwargs):
        tensor = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        kept.append(tensor)
        producer = produced.get(id(tensor))
        if producer is not None and producer != names[module]:
            feeds.setdefault(producer, []).append(names[module])
        if next(module.children(), None) is None:  # a leaf
            order.append(names[module])

    def after(module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        kept.append(tensor)
        if torch.is_tensor(tensor):
            produced.setdefault(id(tensor), names[module])

    handles = [module.register_forward_pre_hook(before, with_kwargs=True) for module in names]
    handles += [module.register_forward_hook(after) for module in names]
    try:
        with torch.no_grad():
            skeleton(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"))
    except Exception:  # a model whose forward needs real values; the names still give the table
        return None
    finally:
        for handle in handles:
            handle.remove()
    return _Trace(order, feeds)


def _norm_behaviour(norm: nn.Module) -> tuple[Literal["rms", "layer"] | None, float]:
    """(kind, weight offset) of a norm module, from a CPU copy run on a known input: an offset of 1 means the
    output is not zero when the weight is (Gemma's `x_hat * (1 + w)`)."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.ndim != 1:
        return None, 0.0
    probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    x = torch.linspace(1.0, 3.0, weight.numel()).reshape(1, -1)
    with torch.no_grad():
        for parameter in probe.parameters():
            parameter.zero_()
        zero_weight = probe(x)
        offset = 0.0 if torch.allclose(zero_weight, torch.zeros_like(zero_weight)) else 1.0
        probe.weight.fill_(1.0 - offset)
        unit = probe(x)
    rms = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    centred = x - x.mean(-1, keepdim=True)
    layer = centred / centred.pow(2).mean(-1, keepdim=True).sqrt()
    for kind, expected in (("rms", rms), ("layer", layer)):
        if torch.allclose(unit, expected, atol=1e-3):
            return kind, offset
    return None, offset


def _activation(config, gated: bool) -> str:
    name = next((getattr(config, key) for key in _ACTIVATION_NAMES if getattr(config, key, None)), None)
    return (_GATED if gated else _UNGATED).get(name, str(name))


def _derive(config) -> ArchitectureTable:
    if any(getattr(config, key, None) for key in _EXPERT_COUNTS):
        raise _refuse(config, "a mixture-of-experts model; leanlm's methods quantize dense decoder blocks")
    meta = skeleton(config)
    blocks = _find_blocks(meta, config)
    block = meta.get_submodule(blocks)[0]
    linears = [name for name, module in block.named_modules() if _is_linear(module)]
    trace = _trace_block(meta, block)
    if trace is not None:
        ran = [name for name in trace.order if name in linears]
        linears = ran + [name for name in linears if name not in ran]
    feeds = trace.feeds if trace is not None else {}
    attention = next(
        (name for name, module in block.named_modules() if name and "attention" in type(module).__name__.lower()),
        None,
    )
    if attention is None:
        raise _refuse(config, f"no attention module in its decoder blocks ({type(block).__name__})")
    attention_linears = [name for name in linears if name.startswith(attention + ".")]
    mlp_linears = [name for name in linears if name not in attention_linears]
    if len(attention_linears) < 2 or len(mlp_linears) < 2:
        raise _refuse(
            config,
            f"its blocks' linears ({', '.join(linears) or 'none'}) are not an attention's input and output "
            "projections and an MLP's",
        )
    attention_inputs, attention_output = tuple(attention_linears[:-1]), attention_linears[-1]
    mlp_inputs, mlp_output = tuple(mlp_linears[:-1]), mlp_linears[-1]
    if len(attention_inputs) not in (1, 3) or len(mlp_inputs) not in (1, 2):
        raise _refuse(
            config,
            f"its attention ({', '.join(attention_linears)}) or MLP ({', '.join(mlp_linears)}) has an unknown layout",
        )
    modules = dict(block.named_modules())
    fused_gate_up = len(mlp_inputs) == 1 and _out_in(modules[mlp_inputs[0]])[0] == 2 * _out_in(modules[mlp_output])[1]
    gated = len(mlp_inputs) == 2 or fused_gate_up
    activation = _activation(config, gated)

    norm_feeds = tuple(
        NormFeeds(producer, tuple(c for c in consumers if c in attention_inputs or c in mlp_inputs))
        for producer, consumers in feeds.items()
        if _is_norm(modules[producer]) and any(c in attention_inputs or c in mlp_inputs for c in consumers)
    )
    after_output = {
        output: next((c for c in feeds.get(output, ()) if _is_norm(modules[c])), None)
        for output in (attention_output, mlp_output)
    }
    output_norms = tuple(after_output.values()) if all(after_output.values()) else None
    qk = {
        _QK_NORM.search(name)[2]: name for name in modules if name.startswith(attention + ".") and _QK_NORM.search(name)
    }
    qk_norms = (qk["q"], qk["k"]) if len(qk) == 2 else None

    linear_feeds = []
    value = [name for name in attention_inputs if _VALUE.search(name)]
    if len(attention_inputs) == 3 and len(value) == 1 and not feeds.get(value[0]):
        linear_feeds.append(LinearFeeds(value[0], attention_output))  # nothing between v and the softmax's mix
    if len(mlp_inputs) == 2 and activation in ("swiglu", "geglu"):
        # The gate's output runs through the activation module; no module reads the up projection's (a product does).
        up = [name for name in mlp_inputs if not feeds.get(name)] if any(map(feeds.get, mlp_inputs)) else []
        up = up or [name for name in mlp_inputs if _UP.search(name)]
        if len(up) == 1:
            linear_feeds.append(LinearFeeds(up[0], mlp_output))
    elif len(mlp_inputs) == 1 and not gated and activation == "relu":
        linear_feeds.append(LinearFeeds(mlp_inputs[0], mlp_output))  # ReLU(s * x) = s * ReLU(x) for s > 0

    outside = [
        (name, module)
        for name, module in meta.named_modules()
        if name and not name.startswith(blocks + ".") and name != blocks
    ]
    norms = [name for name, module in outside if _is_norm(module)]
    if not norms:
        raise _refuse(config, "no final norm after its decoder blocks")
    final_norm = norms[-1]
    output_embedding = meta.get_output_embeddings()
    head = next((name for name, module in outside if module is output_embedding), None)
    embeddings = [name for name, module in outside if isinstance(module, nn.Embedding)]
    rotary = next((name for name, module in outside if "rotary" in type(module).__name__.lower()), None)
    if rotary is not None or any("rotary" in type(m).__name__.lower() for m in block.modules()):
        positions: PositionEncoding = "rope"
    else:
        positions = "learned" if len(embeddings) > 1 else "none"
    kind, offset = _norm_behaviour(meta.get_submodule(final_norm))
    facts = FAMILY_FACTS.get(config.model_type, FamilyFacts())
    return ArchitectureTable(
        family=config.model_type,
        blocks=blocks,
        attention_inputs=attention_inputs,
        attention_output=attention_output,
        mlp_inputs=mlp_inputs,
        mlp_output=mlp_output,
        mlp_activation=activation,
        norm_feeds=norm_feeds,
        linear_feeds=tuple(linear_feeds),
        positions=positions,
        final_norm=final_norm,
        never_quantize=(*embeddings, *([head] if head else [])),
        rotary_embedding=rotary,
        fused_qkv=len(attention_inputs) == 1,
        fused_gate_up=fused_gate_up,
        weight_layout="in_out" if type(modules[mlp_output]).__name__ == "Conv1D" else "out_in",
        norm_kind=kind,
        norm_weight_offset=offset,
        gguf_architecture=facts.gguf_architecture,
        gguf_interleaved_qk=facts.gguf_interleaved_qk,
        fused_decode=facts.fused_decode,
        output_norms=output_norms,
        qk_norms=qk_norms,
    )


_TABLES: dict[tuple[type, str], ArchitectureTable] = {}  # by config class and JSON: one derivation per config
# A config's table while its attributes are what they were (a copy of them beside it): found again without
# serializing the config, which a server does for every request.
_BY_CONFIG: dict[int, tuple[weakref.ref, dict, ArchitectureTable]] = {}  # by id(config), while it lives


def architecture_for(model_or_config: nn.Module | object) -> ArchitectureTable:
    """The table of a model (or of its config); raises UnsupportedArchitectureError naming the problem."""
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "to_json_string"):
        raise UnsupportedArchitectureError(f"{type(config).__name__} is not a transformers model config")
    problem = FAMILY_FACTS.get(config.model_type, FamilyFacts()).config_problem(config)
    if problem:
        raise UnsupportedArchitectureError(f"{config.model_type}: {problem}")
    known = _BY_CONFIG.get(id(config))
    if known is not None and known[0]() is config and known[1] == vars(config):
        return known[2]
    key = (type(config), config.to_json_string(use_diff=False))
    if key not in _TABLES:
        _TABLES[key] = _derive(config)
    if known is None:
        weakref.finalize(config, _BY_CONFIG.pop, id(config), None)
    _BY_CONFIG[id(config)] = (weakref.ref(config), copy.deepcopy(vars(config)), _TABLES[key])
    return _TABLES[key]


def mixes_attention_kinds(config) -> bool:
    """Whether some layers attend through a sliding window while others see everything (`config.layer_types`:
    Gemma 2 / 3): a prefix or a sink cache needs every layer to attend to all it holds."""
    return any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())


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


def gguf_tensor_names(model: nn.Module):
    """The `gguf` package's map from the model's module names to GGUF tensor names (gguf.TensorNameMap)."""
    import gguf

    architecture = architecture_for(model).gguf_architecture
    if architecture is None:
        raise UnsupportedArchitectureError(
            f"leanlm does not know the GGUF layout of the {architecture_for(model).family} family"
        )
    enum = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    return gguf.get_tensor_name_map(enum, model.config.num_hidden_layers)


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


@dataclass(frozen=True)
class AttentionShape:
    heads: int  # query heads
    kv_heads: int  # key-value heads (fewer under grouped-query attention)
    head_dim: int


def attention_shape(config) -> AttentionShape:
    """A model config's attention heads, as transformers reads them: the text config's where the model has one;
    as many key-value heads as query heads and a head size of hidden / heads where the config leaves them out."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return AttentionShape(
        heads,
        getattr(text, "num_key_value_heads", None) or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
    )


def _repeat_kv_heads(value_weight: torch.Tensor, groups: int, config) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves `groups` query heads, so the value projection's rows,
    head by head, repeated `groups` times line up with the output projection's input dimensions."""
    heads = value_weight.reshape(-1, attention_shape(config).head_dim, value_weight.shape[1])
    return heads.repeat_interleave(groups, dim=0).reshape(-1, value_weight.shape[1])
