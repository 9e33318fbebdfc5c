"""Batch-1 decode in one C++ call per token (issue 27): `FusedDecoder(model)` walks the model through its
architecture table once, hands every weight (float32 / bfloat16, or 4-bit k-bit codes with their block
constants) to the C++ decoder (`kernels/csrc/fused_decode.inc`), and then each `step(token)` runs the whole
decoder block stack, final norm and head without returning to Python.

Why: transformers' eager forward dispatches ~600 small ops and ~210 Python linear calls per SmolLM2 token, about
8 ms of a 20 ms step, while the arithmetic is a few megaflops. The prompt still goes through transformers'
forward (a batched prefill is what PyTorch does well); its keys and values are copied into the decoder's float32
cache, after which every token is one call. The results are the eager path's: the same kernels per linear (the
4-bit kernel with int8 activations, the float GEMV), activations in float32; `greedy_tokens` is the test's
bridge between the two.

Supported: the families whose table says `fused_decode` (Llama, Mistral, Qwen2, Gemma 3), float linears,
4-bit k-bit linears (NF4 / FP4 / int4, double-quantized or not) and 8-bit int ones, in blocks of a multiple of 64.
Anything else gets None from `FusedDecoder.build`, with `fused_decoder_problem` saying why, and decodes through
transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from leanlm.errors import ConfigError
from leanlm.kernels.kbit_gemm import compiled_kernels, int8_kernel_table, supports_int8_activations
from leanlm.models.architectures import architecture_for, decoder_blocks
from leanlm.nn.kbit_linear import KbitEmbedding, KbitLinear

_FLOAT_KINDS = {torch.float32: 0, torch.bfloat16: 1}
# The table's MLP kind -> (the C++ step's activation code, the config's activation name it implements)
_ACTIVATIONS = {"swiglu": (0, "silu"), "geglu": (1, "gelu_pytorch_tanh")}
# Rotary kinds whose frequencies transformers computes once (rotary_emb's buffers), not per sequence length
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_KBIT_KINDS = {4: 2, 8: 3}


def _linear_problem(name: str, module: nn.Module) -> str | None:
    if isinstance(module, KbitLinear):
        runs = (module.bits == 4 and supports_int8_activations(module.block_size, module.in_features)
                and module.proxy_columns is None) or module._runs_int8_codes()
        if not runs or module.backend == "reference":
            return (f"{name}: {module.extra_repr()} (the fused step runs 4-bit codes and 8-bit int codes in blocks of "
                    "a multiple of 64, without proxy columns)")
        return None
    if type(module).__name__ in ("Linear", "GemvLinear") and module.weight.dtype in _FLOAT_KINDS:
        return None
    return f"{name} is a {type(module).__name__}; the fused step runs float and 4-bit k-bit linears"


def fused_decoder_problem(model: nn.Module) -> str | None:
    """Why `model` cannot decode through the fused step, or None if it can."""
    if compiled_kernels() is None:
        return "leanlm's CPU kernels are not available on this machine"
    table = architecture_for(model)
    if not table.fused_decode:
        return f"the fused decode step does not implement {table.family} blocks yet"
    config = model.config
    expected = _ACTIVATIONS[table.mlp_activation][1] if table.mlp_activation in _ACTIVATIONS else None
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


class FusedDecoder:
    """One sequence at a time: `prefill(ids)` then `step(token)` per new token; both return the last logits."""

    def __init__(self, model: nn.Module, capacity: int = 4096):
        problem = fused_decoder_problem(model)
        if problem:
            raise ConfigError(f"this model cannot use the fused decode step: {problem}")
        self.model, self.capacity = model, capacity
        table, config = architecture_for(model), model.config
        blocks = decoder_blocks(model, table)
        attention = blocks[0].get_submodule(table.attention_module)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        embedding = model.get_input_embeddings()
        if isinstance(embedding, KbitEmbedding):  # rows read from the 8-bit head's codes (`--head int8`)
            table_rows = embedding.head.packed.reshape(embedding.num_embeddings, -1)
            row_codes = {"embedding_absmax": embedding.head._kernel_state()[0].dense(),
                         "embedding_values": embedding.head.codebook.values.float()}
            embedding_scale = embedding.scale or 1.0
        else:
            table_rows, row_codes = embedding.weight.detach(), {}
            embedding_scale = getattr(embedding, "embed_scale", None)  # Gemma: sqrt(hidden), in the weight's dtype
            embedding_scale = 1.0 if embedding_scale is None else float(embedding_scale.to(embedding.weight.dtype))
        self._norm_offset = table.norm_weight_offset
        self._decoder = compiled_kernels().FusedDecoder(
            config.hidden_size, heads, kv_heads, head_dim, config.rms_norm_eps, attention.scaling,
            _ACTIVATIONS[table.mlp_activation][0], table_rows, embedding_scale,
            self._norm(model.get_submodule(table.final_norm)), **row_codes)
        attention_norm, mlp_norm = (feed.norm for feed in table.norm_feeds)
        for index, block in enumerate(blocks):
            ids = [self._add_linear(block.get_submodule(path)) for path in table.quantizable_linears]
            frequencies, rope_scale, window = _layer_rotary(model, table, index, block)
            optional = {}
            if table.output_norms:
                optional["attention_output_norm"], optional["mlp_output_norm"] = (
                    self._norm(block.get_submodule(path)) for path in table.output_norms)
            if table.qk_norms:
                optional["q_norm"], optional["k_norm"] = (self._norm(block.get_submodule(path))
                                                          for path in table.qk_norms)
            self._decoder.add_layer(self._norm(block.get_submodule(attention_norm)),
                                    self._norm(block.get_submodule(mlp_norm)), *ids, frequencies, rope_scale,
                                    window, **optional)
        self._decoder.set_head(self._add_linear(model.get_output_embeddings()))
        shape = (len(blocks), kv_heads, capacity, head_dim)
        self.keys, self.values = torch.zeros(shape), torch.zeros(shape)
        self.position = 0

    def _norm(self, module: nn.Module) -> torch.Tensor:
        """A norm's weight as the factor it multiplies by (Gemma's RMSNorm: 1 + weight, in float32 as it computes)."""
        return module.weight.detach().float() + self._norm_offset

    @classmethod
    def build(cls, model: nn.Module, capacity: int = 4096) -> "FusedDecoder | None":
        return None if fused_decoder_problem(model) else cls(model, capacity)

    def _add_linear(self, module: nn.Module) -> int:
        bias = None if module.bias is None else module.bias.detach()
        if not isinstance(module, KbitLinear):
            weight = module.weight.detach()
            return self._decoder.add_linear(_FLOAT_KINDS[weight.dtype], weight, module.in_features,
                                            module.out_features, bias)
        constants, table = module._kernel_state()
        values, inverse = int8_kernel_table(table, module.bits)
        return self._decoder.add_linear(_KBIT_KINDS[module.bits], module.packed, module.in_features,
                                        module.out_features, bias, constants.absmax, values, inverse,
                                        module.block_size, **constants.kernel_arguments())

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Reads `ids` from the start of the sequence through transformers' forward; the last position's logits."""
        if not 0 < len(ids) < self.capacity:
            raise ConfigError(f"a prompt of {len(ids)} tokens does not fit a fused cache of {self.capacity}")
        cache = DynamicCache()
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                                logits_to_keep=1).logits[0, -1].float()
        for index, layer in enumerate(cache.layers):
            self.keys[index, :, : len(ids)] = layer.keys[0].float()
            self.values[index, :, : len(ids)] = layer.values[0].float()
        self.position = len(ids)
        return logits

    def step(self, token: int) -> torch.Tensor:
        """The logits (vocab,) after reading `token` at the next position."""
        if self.position >= self.capacity:
            raise ConfigError(f"the fused cache is full ({self.capacity} tokens)")
        logits = self._decoder.step(int(token), self.position, self.keys, self.values)
        self.position += 1
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
    window = (attention.sliding_window if hasattr(attention, "sliding_window")
              else getattr(model.config, "sliding_window", None))
    return frequencies.float(), float(scale), int(window or 0)


def greedy_tokens(model: nn.Module, prompt: list[int], new_tokens: int, fused: bool) -> list[int]:
    """Greedy decode of `new_tokens` tokens after `prompt`, through the fused step or transformers' forward."""
    if fused:
        decoder = FusedDecoder(model, capacity=len(prompt) + new_tokens)
        logits, tokens = decoder.prefill(prompt), []
        for _ in range(new_tokens):
            tokens.append(int(logits.argmax()))
            logits = decoder.step(tokens[-1])
        return tokens
    cache, tokens = DynamicCache(), []
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[0, -1]
        for _ in range(new_tokens):
            tokens.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return tokens
