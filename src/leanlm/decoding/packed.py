"""Several sequences' prompt pieces read in one forward: packed one after another into a single row of the batch,
each at its own positions, attending to its own cache alone.

A server's new requests arrive together; read one at a time, each prompt decodes every quantized weight again
and runs every layer's Python once more. Packed, the weights are read (and de-quantized, for the large-M path)
once for all pieces. What each piece computes is what it computes read alone, bit for bit:

* every linear computes each piece's rows as a call of their own would (`leanlm.nn.rows.row_groups`: the kernel
  its row count selects, and every GEMM per piece);
* attention is per piece (`piece_attention`): its queries against its own cache's keys and its own, in a
  causal mask aligned to the end, few masked scores computed;
* everything else (norms, rotary embeddings, activations, residual adds) works row by row.

So a piece read alone is a pack of one, and a server that reads every prompt this way gives each request the
answer it would give it alone, whatever arrives beside it (tests/decoding/test_packed.py). `packing_problem` says
why a model cannot be read this way (a layer that computes over all rows at once, such as a per-tensor dynamic
activation scale, or an attention this module does not reproduce)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface

from leanlm.models.architectures import iter_quantizable_linears, mixes_attention_kinds
from leanlm.nn import GemvLinear, KbitLinear, SpQRLinear
from leanlm.nn.rows import row_groups

ATTENTION = "leanlm_packed"
# PyTorch's CPU flash attention that also returns the log-sum-exp (None where this PyTorch has none).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Queries per block of `piece_attention`: smaller blocks compute fewer masked scores in more calls
# (benchmarks/attention.py).
QUERY_BLOCK = 128
# The layer's pieces: their query lengths, their keys' lengths and their causal masks (aligned to the end).
_PIECES: ContextVar[tuple[tuple[int, ...], tuple[int, ...], list[torch.Tensor]] | None] = ContextVar(
    "leanlm_packed_pieces", default=None
)


class PackedCache(Cache):
    """The caches of the packed pieces, one per piece: a layer's new keys and values are split by piece and each
    part goes to its piece's cache; the keys returned are the caches' whole keys one after another. The pieces'
    masks are made once for the layers whose caches hold as many keys as the last one's."""

    def __init__(self, caches: Sequence[Cache], pieces: Sequence[int]):
        super().__init__(layers=[])
        self.caches, self.pieces = list(caches), tuple(pieces)
        self._key_lengths: tuple[int, ...] = ()
        self._masks: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = [], []
        for cache, new_keys, new_values in zip(
            self.caches, key_states.split(self.pieces, -2), value_states.split(self.pieces, -2), strict=True
        ):
            layer_keys, layer_values = cache.update(new_keys, new_values, layer_idx)
            keys.append(layer_keys), values.append(layer_values)
        key_lengths = tuple(k.shape[-2] for k in keys)
        if key_lengths != self._key_lengths:
            self._key_lengths = key_lengths
            self._masks = [
                torch.ones(new, length, dtype=torch.bool).tril(length - new)
                for new, length in zip(self.pieces, key_lengths, strict=True)
            ]
        _PIECES.set((self.pieces, key_lengths, self._masks))
        return torch.cat(keys, -2), torch.cat(values, -2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come with the pieces (position_ids); no mask is built (`_no_mask`)

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return 0, 0


def _packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """(1, heads, pieces' tokens, dim) queries against each piece's keys: per piece, bottom-right causal."""
    pieces, key_lengths, masks = _PIECES.get()
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    outputs = []
    for q, k, v, mask in zip(
        query.split(pieces, 2), key.split(key_lengths, 2), value.split(key_lengths, 2), masks, strict=True
    ):
        outputs.append(piece_attention(q, k, v, mask, scale))
    return torch.cat(outputs, 2).transpose(1, 2).contiguous(), None


def piece_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    block: int | None = QUERY_BLOCK,
) -> torch.Tensor:
    """A piece's (1, heads, new, dim) queries against its (1, kv heads, length, dim) keys and values, the last `new`
    of them its own: every earlier key, and its own keys causally (`mask`: that pattern, aligned to the end).

    With `block` (and PyTorch's CPU flash attention with log-sum-exp), the queries go in blocks of `block`, each
    against the keys before the block in full (every query head of a key head as one block of queries) and its own
    keys causally, the two merged by their log-sum-exps: few masked scores are computed (PyTorch's kernel computes
    a masked attention's every score, and a causal one's in blocks of hundreds of keys). With None (or without
    that kernel), one masked attention over all the keys. The result depends on the piece alone;
    `attention_oracle` is its reference."""
    new, length = query.shape[2], key.shape[2]
    heads, kv_heads = query.shape[1], key.shape[1]
    if block is None or _FLASH is None or query.shape[0] != 1 or length < new or heads % kv_heads:
        return F.scaled_dot_product_attention(
            query.contiguous(), key.contiguous(), value.contiguous(), attn_mask=mask, scale=scale, enable_gqa=True
        )
    group, earlier = heads // kv_heads, length - new
    outputs = []
    for start in range(0, new, block):
        end = min(new, start + block)
        before = earlier + start
        queries = query[:, :, start:end]
        own_keys, own_values = (t[:, :, before : earlier + end].repeat_interleave(group, 1) for t in (key, value))
        own, own_lse = _FLASH(queries.contiguous(), own_keys, own_values, is_causal=True, scale=scale)
        if before == 0:
            outputs.append(own)
            continue
        # Query head h reads key head h // group: a key head's query heads are one block of queries.
        grouped = queries.reshape(1, kv_heads, group * (end - start), queries.shape[-1])
        prior, prior_lse = _FLASH(
            grouped, key[:, :, :before].contiguous(), value[:, :, :before].contiguous(), scale=scale
        )
        prior, prior_lse = prior.reshape(own.shape), prior_lse.reshape(own_lse.shape)
        top = torch.maximum(prior_lse, own_lse)
        prior_weight, own_weight = ((lse - top).exp().unsqueeze(-1) for lse in (prior_lse, own_lse))
        merged = (prior.float() * prior_weight + own.float() * own_weight) / (prior_weight + own_weight)
        outputs.append(merged.to(query.dtype))
    return torch.cat(outputs, 2)


def attention_oracle(query, key, value, mask, scale):
    """`piece_attention`'s reference: float64 scores, the mask applied, softmax, the values' weighted sum."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(group, 1) for t in (key, value))
    scores = (query.double() @ key.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ value).to(query.dtype)


def _no_mask(*args, **kwargs):
    return None


AttentionInterface.register(ATTENTION, _packed_attention)
AttentionMaskInterface.register(ATTENTION, _no_mask)


@contextlib.contextmanager
def _packed_attention_of(model: nn.Module) -> Iterator[None]:
    configs = {id(module.config): module.config for module in model.modules() if hasattr(module, "config")}
    before = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = ATTENTION
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]


def packing_problem(model: nn.Module, longest_span: int) -> str | None:
    """Why `model` cannot read packed pieces (attending over at most `longest_span` tokens), or None if it can."""
    config = model.config
    if not hasattr(model, "get_decoder") or model.get_output_embeddings() is None:
        return "it has no decoder and output head of transformers' kind"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"its attention is {config._attn_implementation!r}, not transformers' own"
    if mixes_attention_kinds(config):
        return "some layers attend through a sliding window"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < longest_span:
        return f"its sliding window of {window} tokens is shorter than the {longest_span} it would attend over"
    for capping in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, capping, None) is not None:
            return f"{capping} (packed attention has no soft-capping)"
    for name, layer in [*iter_quantizable_linears(model), ("lm_head", model.get_output_embeddings())]:
        if type(layer) not in (KbitLinear, SpQRLinear, GemvLinear) or getattr(layer, "proxy_columns", None) is not None:
            return f"{name} is a {type(layer).__name__}, which computes over all rows of a call at once"
    return None


def read_pieces(
    model: nn.Module, caches: Sequence[Cache], pieces: Sequence[Sequence[int]], every_logit: Sequence[bool] = ()
) -> list[torch.Tensor]:
    """Piece i read into `caches[i]` (each at its cache's next positions), all in one forward. Returns per piece
    the logits (float32) after its last token, (vocab,), or after each of its tokens, (len, vocab), where
    `every_logit[i]`. A read that fails leaves every cache as it was."""
    every_logit = list(every_logit) or [False] * len(pieces)
    lengths = [len(piece) for piece in pieces]
    starts = [cache.get_seq_length() for cache in caches]
    ids = torch.tensor([[token for piece in pieces for token in piece]])
    positions = torch.tensor([[start + j for start, length in zip(starts, lengths) for j in range(length)]])
    ends = torch.tensor(lengths).cumsum(0)
    kept = [
        range(end - length, end) if every else [end - 1]
        for end, length, every in zip(ends.tolist(), lengths, every_logit)
    ]
    staged = [_staged(cache) for cache in caches]
    with torch.inference_mode(), _packed_attention_of(model), row_groups(lengths):
        hidden = model.get_decoder()(
            input_ids=ids, position_ids=positions, past_key_values=PackedCache(staged, lengths), use_cache=True
        ).last_hidden_state
    rows = hidden[:, [row for rows in kept for row in rows]]
    with torch.inference_mode(), row_groups([len(rows) for rows in kept]):
        logits = model.get_output_embeddings()(rows)[0].float()
    for cache, read in zip(caches, staged):
        cache.__dict__.update(read.__dict__)
    return [part if every else part[0] for part, every in zip(logits.split([len(r) for r in kept]), every_logit)]


def _staged(cache: Cache) -> Cache:
    """A copy of `cache` that a read updates while `cache` stays as it was until the read has succeeded: its layers
    are copied, their tensors shared (an update replaces a layer's tensors, it never writes into them)."""
    staged = copy.copy(cache)
    staged.layers = [copy.copy(layer) for layer in cache.layers]
    return staged
