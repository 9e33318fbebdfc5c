"""Batch-1 decode in one C++ call per token: `FusedDecoder(model)` walks the model through its
architecture table once, hands every weight (float32 / bfloat16, or 4-bit k-bit codes with their block
constants) to the C++ decoder (`kernels/csrc/fused_decode.inc`), and then each `step(token)` runs the whole
decoder block stack, final norm and head without returning to Python.

Why: transformers' eager forward dispatches hundreds of small ops and a Python call per linear for every token,
which at batch 1 of a small model costs more than the arithmetic (benchmarks/decode.py). The prompt still goes through transformers'
forward (a batched prefill is what PyTorch does well); its keys and values are copied into the decoder's float32
cache, after which every token is one call. The results are the eager path's: the same kernels per linear (the
4-bit kernel with int8 activations, the float GEMV), activations in float32; `greedy_tokens` is the test's
bridge between the two.

Supported: the families whose `FAMILY_FACTS` say `fused_decode` (Llama, Mistral, Qwen2, Qwen3, Gemma 3), float linears,
4-bit k-bit linears (NF4 / FP4 / int4, double-quantized or not) and 8-bit int ones, in blocks of a multiple of 64;
W8A8 linears of every SmoothQuant level (static or dynamic scales, per-tensor / per-channel / per-group weights)
and LLM.int8()'s outlier decomposition, with SmoothQuant's int8 attention matmuls where the model runs them;
4-bit GPTQ / SpQR layers (act-order permutation, group offsets, quantized statistics, sparse outliers) whose kernel
blocks are a multiple of 64. A W8A8 layer hands the step a plain int8 copy of its weight: fbgemm's packed copy,
which transformers' prefill runs, stays too. Anything else gets None from `FusedDecoder.build`, with
`fused_decoder_problem` saying why, and decodes through transformers.

Caches (`FusedCache`, one per sequence, so one decoder serves many): dense (a fixed capacity), or StreamingLLM's sink
cache (`streaming`), which the step keeps as a ring that never moves a key (see `step` in fused_decode.inc), so a
stream of any length decodes in bounded memory; a CushionCache prefix is read before the prompt in either.
`adopt` takes transformers' cache after a prompt into the step's layout and `release` gives it back (the ring's
keys re-rotated to their cache positions), so prompts keep going through the batched forward and generated tokens
through the step: `leanlm chat` and `leanlm serve` decode this way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import astuple, dataclass

import torch
from torch import nn
from transformers import DynamicCache

from leanlm.cache.prefix import attached_cushion, prefix_cache
from leanlm.errors import ConfigError, LeanLMError
from leanlm.kernels.kbit_gemm import compiled_kernels
from leanlm.methods.streaming import StreamingConfig, sink_cache
from leanlm.models.architectures import FAMILY_FACTS, architecture_for, attention_shape, decoder_blocks
from leanlm.nn.attention import ATTENTION_NAME
from leanlm.nn.base import QuantizedModule
from leanlm.nn.kbit_linear import KbitEmbedding

# The float weights the step reads, by the name of their kind in the extension's `LINEAR_KINDS`
_FLOAT_KINDS = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# The table's MLP kind (a name of the extension's `ACTIVATIONS`) -> the config's activation name it implements
_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}
# Rotary kinds whose frequencies transformers computes once (rotary_emb's buffers), not per sequence length
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _linear_problem(name: str, module: nn.Module) -> str | None:
    if isinstance(module, QuantizedModule):  # each quantized module says what of it the step runs
        problem = module.fused_problem()
        return None if problem is None else f"{name}: {problem}"
    if type(module).__name__ in ("Linear", "GemvLinear") and module.weight.dtype in _FLOAT_KINDS:
        return None
    return f"{name} is a {type(module).__name__}; the fused step runs float and quantized linears"


def fused_decoder_problem(model: nn.Module, streaming: StreamingConfig | None = None) -> str | None:
    """Why `model` cannot decode through the fused step (with StreamingLLM's cache if `streaming` is given), or
    None if it can."""
    if streaming is not None:
        try:
            sink_cache(model, streaming)  # the architecture and sizes the eager sink cache accepts
        except LeanLMError as error:
            return str(error)
        table = architecture_for(model)
        for index, block in enumerate(decoder_blocks(model, table)):
            if _layer_rotary(model, table, index, block)[2] or _bmm_quantization(model, block, table):
                return (
                    "a sink cache in the fused step runs full-attention layers whose attention matmuls are "
                    "float (not sliding windows, not SmoothQuant's int8 attention)"
                )
    if compiled_kernels() is None:
        return "leanlm's CPU kernels are not available on this machine"
    table = architecture_for(model)
    if not table.fused_decode:
        checked = ", ".join(family for family, facts in FAMILY_FACTS.items() if facts.fused_decode)
        return f"the fused decode step is checked against {checked}; {table.family} is not one of them"
    config = model.config
    expected = _ACTIVATIONS.get(table.mlp_activation)
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation != expected:
        return f"MLP activation {activation!r} in a {table.mlp_activation} MLP"
    for capping in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, capping, None) is not None:
            return f"{capping} = {getattr(config, capping)} (the fused step has no soft-capping)"
    rope = getattr(config, "rope_parameters", None) or {}
    for parameters in [value for value in rope.values() if isinstance(value, dict)] or [rope]:  # Gemma 3: per kind
        if parameters.get("rope_type", "default") not in _STATIC_ROPE:
            return f"rope type {parameters['rope_type']!r} (its frequencies change with the length)"
    for index, block in enumerate(decoder_blocks(model, table)):
        for path in table.quantizable_linears:
            problem = _linear_problem(f"{table.blocks}.{index}.{path}", block.get_submodule(path))
            if problem:
                return problem
    return _linear_problem("lm_head", model.get_output_embeddings())


@dataclass
class FusedCache:
    """One sequence's keys and values as the fused step keeps them, (layers, kv_heads, capacity, head_dim) float32:
    dense (`window` 0: the token at position p in slot p, `capacity` tokens at most) or StreamingLLM's ring
    (`sinks` slots, then a ring of `window` + 1). `position` counts the tokens read (in a ring, since it was built:
    only differences of positions matter there)."""

    keys: torch.Tensor
    values: torch.Tensor
    position: int
    sinks: int = 0
    window: int = 0
    dtype: torch.dtype = torch.float32  # transformers' cache's, for the way back (`FusedDecoder.release`)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]


def _check_room(cache: FusedCache) -> None:
    """A dense cache must have a free slot for the next token (a ring always has)."""
    if not cache.window and cache.position >= cache.capacity:
        raise ConfigError(f"the fused cache is full ({cache.capacity} tokens)")


class FusedDecoder:
    """`prefill(ids)` then `step(token)` per new token (or `read(ids)`); each returns the last logits. A model with
    a CushionCache prefix reads it first, as its eager forward does. With `streaming`, the cache is StreamingLLM's
    (sinks + a window of recent tokens, any number of tokens in bounded memory); without, a dense cache of
    `capacity` tokens. `prefill` keeps its cache in `self.cache`; `adopt` makes others, for many sequences (a
    server's conversations), which `step` and `read` take as `cache`.

    Double-quantized block constants are decoded to float32 once, here, for the step (`compact_constants=False`):
    the kernel then reads 4.5 bits a weight instead of 4.13, but skips decoding a constant per 64 weights, which
    costs more time than the fewer bytes save (benchmarks/decode.py, the prefetch rows). The values are the ones
    the kernel decodes, bit for bit, so the logits do not change; the model keeps its 8-bit constants for prefill,
    and the float32 copy adds 0.5 bits a weight to resident memory. `compact_constants=True` keeps only the
    8-bit ones."""

    def __init__(
        self,
        model: nn.Module,
        capacity: int = 4096,
        streaming: StreamingConfig | None = None,
        compact_constants: bool = False,
    ):
        problem = fused_decoder_problem(model, streaming)
        if problem:
            raise ConfigError(f"this model cannot use the fused decode step: {problem}")
        cushion = attached_cushion(model)
        self.streaming, self.prefix = streaming, cushion.length if cushion is not None else 0
        # the sink slots hold the cushion too (as `sink_cache` builds them)
        self.sinks, self.window = (streaming.sinks + self.prefix, streaming.window) if streaming else (0, 0)
        self.model, self.capacity, self.compact_constants = model, capacity, compact_constants
        table, config = architecture_for(model), model.config
        blocks = decoder_blocks(model, table)
        attention = blocks[0].get_submodule(table.attention_module)
        heads, kv_heads, head_dim = astuple(attention_shape(config))
        embedding = model.get_input_embeddings()
        if isinstance(embedding, KbitEmbedding):  # rows read from the 8-bit head's codes (`--head int8`)
            table_rows = embedding.head.packed.reshape(embedding.num_embeddings, -1)
            row_codes = {
                "embedding_absmax": embedding.head._kernel_state()[0].dense(),
                "embedding_values": embedding.head.codebook.values.float(),
            }
            embedding_scale = embedding.scale or 1.0
        else:
            table_rows, row_codes = embedding.weight.detach(), {}
            embedding_scale = getattr(embedding, "embed_scale", None)  # Gemma: sqrt(hidden), in the weight's dtype
            embedding_scale = 1.0 if embedding_scale is None else float(embedding_scale.to(embedding.weight.dtype))
        self._norm_offset = table.norm_weight_offset
        self._decoder = compiled_kernels().FusedDecoder(
            config.hidden_size,
            heads,
            kv_heads,
            head_dim,
            config.rms_norm_eps,
            attention.scaling,
            compiled_kernels().ACTIVATIONS[table.mlp_activation],
            table_rows,
            embedding_scale,
            self._norm(model.get_submodule(table.final_norm)),
            **row_codes,
        )
        attention_norm, mlp_norm = (feed.norm for feed in table.norm_feeds)
        for index, block in enumerate(blocks):
            ids = [self._add_linear(block.get_submodule(path)) for path in table.quantizable_linears]
            frequencies, rope_scale, window = _layer_rotary(model, table, index, block)
            optional = {}
            if table.output_norms:
                optional["attention_output_norm"], optional["mlp_output_norm"] = (
                    self._norm(block.get_submodule(path)) for path in table.output_norms
                )
            if table.qk_norms:
                optional["q_norm"], optional["k_norm"] = (
                    self._norm(block.get_submodule(path)) for path in table.qk_norms
                )
            self._decoder.add_layer(
                self._norm(block.get_submodule(attention_norm)),
                self._norm(block.get_submodule(mlp_norm)),
                *ids,
                frequencies,
                rope_scale,
                window,
                **optional,
                **_bmm_quantization(model, block, table),
            )
        self._decoder.set_head(self._add_linear(model.get_output_embeddings()))
        self._cache_shape = (len(blocks), kv_heads, head_dim)
        self.cache: FusedCache | None = None  # prefill's

    def _norm(self, module: nn.Module) -> torch.Tensor:
        """A norm's weight as the factor it multiplies by (Gemma's RMSNorm: 1 + weight, in float32 as it computes)."""
        return module.weight.detach().float() + self._norm_offset

    @classmethod
    def build(
        cls,
        model: nn.Module,
        capacity: int = 4096,
        streaming: StreamingConfig | None = None,
        compact_constants: bool = False,
    ) -> FusedDecoder | None:
        return None if fused_decoder_problem(model, streaming) else cls(model, capacity, streaming, compact_constants)

    def _add_linear(self, module: nn.Module) -> int:
        if isinstance(module, QuantizedModule):
            return module.add_to_fused(self._decoder, self.compact_constants)
        weight = module.weight.detach()
        bias = None if module.bias is None else module.bias.detach()
        kind = compiled_kernels().LINEAR_KINDS[_FLOAT_KINDS[weight.dtype]]
        return self._decoder.add_linear(kind, weight, module.in_features, module.out_features, bias)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Reads `ids` from the start of the sequence through transformers' forward (a batched prefill; in chunks of
        the window with a sink cache, as `leanlm chat` reads), then hands its cache to the fused step (`self.cache`);
        the last position's logits."""
        if not ids or (not self.streaming and self.prefix + len(ids) >= self.capacity):
            raise ConfigError(f"a prompt of {len(ids)} tokens does not fit a fused cache of {self.capacity}")
        cache = new_cache(self.model, self.streaming)
        logits = read_in_chunks(self.model, cache, ids, self.window or len(ids)).float()
        self.cache = self.adopt(cache)
        return logits

    def adopt(self, cache, room: int | None = None) -> FusedCache:
        """`cache` (transformers' after a prompt, as `new_cache` makes it) in the step's layout, with room for
        `room` more tokens (None: the decoder's capacity, or for ever with a sink cache). A sink cache that these
        tokens cannot overflow is kept dense (the same attention; no ring of sinks + window + 1 slots)."""
        if self.streaming:
            cache.settle()  # the eviction a sink cache defers to its next update
        length = cache.get_seq_length()
        ring = self.streaming is not None and (room is None or length + room > self.sinks + self.window + 1)
        if ring:
            capacity = self.sinks + self.window + 1
        else:
            capacity = self.capacity if room is None else length + room
            if length >= capacity:
                raise ConfigError(f"{length} cached tokens do not fit a fused cache of {capacity}")
        layers, kv_heads, head_dim = self._cache_shape
        # Unread slots are never attended to, so they need no zeros (and take no memory until written).
        keys, values = (torch.empty(layers, kv_heads, capacity, head_dim) for _ in range(2))
        for index, layer in enumerate(cache.layers):  # slot j: the key rotated at position j
            keys[index, :, :length] = layer.keys[0].float()
            values[index, :, :length] = layer.values[0].float()
        dtype = cache.layers[0].keys.dtype if cache.layers else torch.float32
        return FusedCache(keys, values, length, self.sinks if ring else 0, self.window if ring else 0, dtype)

    def release(self, cache: FusedCache):
        """`cache` back in transformers' layout (a fresh `new_cache`'s kind holding what `cache` holds), to read more
        through the forward: a ring's recent tokens in stream order, their keys rotated to their cache positions
        sinks, sinks + 1, ... as the eager sink cache keeps them."""
        sinks, window, position = cache.sinks, cache.window, cache.position
        slots, shift = list(range(position)), 0
        if window and position > sinks + window:  # the ring went round: the window's tokens, oldest first
            first = position - window
            slots = list(range(sinks)) + [sinks + (t - sinks) % (window + 1) for t in range(first, position)]
            shift = sinks - first
        order = torch.tensor(slots)
        eager = DynamicCache() if self.streaming is None else sink_cache(self.model, self.streaming)
        keys, values = [], []
        for layer in range(cache.keys.shape[0]):
            layer_keys = cache.keys[layer][:, order]
            if shift:  # in float32, before any rounding to the model's dtype
                layer_keys[:, sinks:] = eager.key_shift(layer_keys[None, :, sinks:], shift)[0]
            keys.append(layer_keys[None].to(cache.dtype))
            values.append(cache.values[layer][None][:, :, order].to(cache.dtype))
        if self.streaming is None:
            for layer, (layer_keys, layer_values) in enumerate(zip(keys, values)):
                eager.update(layer_keys, layer_values, layer)
            return eager
        return eager.hold(keys, values)

    def step(self, token: int, cache: FusedCache | None = None) -> torch.Tensor:
        """The logits (vocab,) after reading `token` at the next position of `cache` (prefill's by default)."""
        cache = cache or self.cache
        if cache is None:
            raise ConfigError("nothing read yet: prefill a prompt first")
        _check_room(cache)
        logits = self._decoder.step(int(token), cache.position, cache.keys, cache.values, cache.sinks, cache.window)
        cache.position += 1
        return logits

    def step_batch(self, tokens: list[int], caches: list[FusedCache]) -> torch.Tensor:
        """The logits (len(tokens), vocab) after reading each token at the next position of its own cache: what
        `step` gives for each, with every weight read once for all of them (a server's requests in flight)."""
        if len(tokens) != len(caches) or len({id(cache) for cache in caches}) != len(caches):
            raise ConfigError("one token per cache, each cache once")
        for cache in caches:
            _check_room(cache)
        logits = self._decoder.step_batch(
            [int(token) for token in tokens],
            [cache.position for cache in caches],
            [cache.keys for cache in caches],
            [cache.values for cache in caches],
            [cache.sinks for cache in caches],
            [cache.window for cache in caches],
        )
        for cache in caches:
            cache.position += 1
        return logits

    def read(self, ids: list[int], cache: FusedCache | None = None) -> torch.Tensor:
        """`step` through `ids` (a chat turn after the first prompt); the last logits."""
        if not ids:
            raise ConfigError("nothing to read")
        for token in ids:
            logits = self.step(token, cache)
        return logits


def _layer_rotary(model: nn.Module, table, index: int, block: nn.Module) -> tuple[torch.Tensor, float, int]:
    """(inverse frequencies, output scale, sliding window or 0) of `block` (number `index`)'s rotary attention:
    Gemma 3 keeps one set of frequencies per layer type (local and global layers), the others one for all; a window
    is the attention module's own (Qwen2, Gemma 3: sliding layers only) or the config's (Mistral: every layer)."""
    rotary = model.get_submodule(table.rotary_embedding)
    layer_types = getattr(model.config, "layer_types", None)
    kind = layer_types[index] if layer_types else None
    if kind is not None and hasattr(rotary, f"{kind}_inv_freq"):
        frequencies, scale = getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling")
    else:
        frequencies, scale = rotary.inv_freq, rotary.attention_scaling
    attention = block.get_submodule(table.attention_module)
    window = (
        attention.sliding_window
        if hasattr(attention, "sliding_window")
        else getattr(model.config, "sliding_window", None)
    )
    return frequencies.float(), float(scale), int(window or 0)


def _bmm_quantization(model: nn.Module, block: nn.Module, table) -> dict:
    """The C++ step's arguments for SmoothQuant's int8 attention matmuls in `block` (nn/attention.py), if the model
    runs them: the mode, the static scales (as BmmQuantizer computes them) and whether probabilities are rounded."""
    quantizer = getattr(block.get_submodule(table.attention_module), "bmm_quantizer", None)
    if quantizer is None or model.config._attn_implementation != ATTENTION_NAME:
        return {}
    modes = compiled_kernels().BMM_MODES
    if not quantizer.static:
        return {"bmm_mode": modes[quantizer.activation], "bmm_probabilities": quantizer.quantize_probs}
    scales = {f"bmm_{which}_scale": scale.item() for which, scale in quantizer.static_scales().items()}
    return {"bmm_mode": modes["static"], **scales, "bmm_probabilities": quantizer.quantize_probs}


def new_cache(model: nn.Module, streaming: StreamingConfig | None = None):
    """The cache transformers' forward decodes `model` with: StreamingLLM's, or a dense one that starts with the
    model's CushionCache prefix, if it has one."""
    if streaming is not None:
        return sink_cache(model, streaming)
    return prefix_cache(model, attached_cushion(model), 1) or DynamicCache()


def read_in_chunks(model: nn.Module, cache, ids: list[int], chunk: int) -> torch.Tensor:
    """`ids` through transformers' forward into `cache`, `chunk` tokens per forward (a sink cache's window, so that
    no forward reads more than the cache keeps); the last position's logits."""
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            logits = model(
                input_ids=torch.tensor([ids[start : start + chunk]]),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[0, -1]
    return logits


def greedy_stream(
    model: nn.Module, prompt: list[int], new_tokens: int, fused: bool, streaming: StreamingConfig | None = None
) -> Iterator[int]:
    """Greedy decode of up to `new_tokens` tokens after `prompt`, yielded as they come (the caller may stop early),
    through the fused step or transformers' forward, with a dense cache or StreamingLLM's (`streaming`)."""
    if fused:
        cushion = attached_cushion(model)
        capacity = (cushion.length if cushion is not None else 0) + len(prompt) + new_tokens + 1
        decoder = FusedDecoder(model, capacity, streaming)
        logits = decoder.prefill(prompt)
        for _ in range(new_tokens):
            token = int(logits.argmax())
            yield token
            logits = decoder.step(token)
        return
    cache = new_cache(model, streaming)
    logits = read_in_chunks(model, cache, prompt, streaming.window if streaming is not None else len(prompt))
    for _ in range(new_tokens):
        token = int(logits.argmax())
        yield token
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


def greedy_tokens(
    model: nn.Module, prompt: list[int], new_tokens: int, fused: bool, streaming: StreamingConfig | None = None
) -> list[int]:
    """All `new_tokens` tokens of `greedy_stream`."""
    return list(greedy_stream(model, prompt, new_tokens, fused, streaming))
