"""The attention-sink KV cache of StreamingLLM (Xiao's thesis section 4.2), on transformers' public cache API.

The cache keeps the first `sinks` tokens of the stream forever and a rolling window of the `window` most
recent ones; everything in between is evicted. Positions live *inside the cache*: the cached keys always sit
at positions 0..n-1 and the next token gets position n, however long the stream has been. Two pieces make it so:

* transformers hands each layer's `update` keys that are already rotated (RoPE) at the position the model was
  given. When tokens are evicted from the middle, the recent keys move down by `shift` slots, so they are
  rotated by -shift positions (RoPE rotations compose: R(p - shift) = R(-shift) R(p)). A key lives at most
  `window` steps in the cache, so at most `window` such float32 rotations touch it: the error stays ~1e-6
  relative and does not grow with the stream. The sinks never move.
* the model must be given the cache position n (not the text position) for the new tokens: a forward pre-hook,
  `cache_positions_hook`, does that (installed by `leanlm.methods.streaming`), since transformers' `generate`
  counts text positions.

Eviction is deferred like the reference implementation's: after a forward the cache may hold sinks + window +
the tokens just added; the next `update` trims it before appending, and `get_seq_length` already reports the
trimmed length (it is what the next tokens' positions and the attention mask are built from). So at steady
state a token attends to sinks + window cached tokens plus itself.

Until the cache first overflows nothing is evicted or re-rotated, and the keys returned are bit-for-bit those
of transformers' DynamicCache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from leanlm.errors import ConfigError

# Rotates keys (batch, heads, length, head_dim) by `shift` positions (negative: towards position 0).
KeyShift = Callable[[torch.Tensor, int], torch.Tensor]


def rope_key_shift(inverse_frequencies: torch.Tensor) -> KeyShift:
    """A KeyShift for rotate-half RoPE (Llama, Mistral, Qwen2, GPT-NeoX, ...): the first 2 x len(inverse_frequencies)
    dimensions of each head rotate, the rest (GPT-NeoX's partial rotary) pass through."""
    inverse_frequencies = inverse_frequencies.detach().double().cpu()
    rotary_dims = 2 * inverse_frequencies.numel()
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def shift_keys(keys: torch.Tensor, shift: int) -> torch.Tensor:
        if shift not in tables:  # a stream shifts by the same few amounts over and over
            angles = shift * inverse_frequencies  # float64: exact for any shift a stream produces
            angles = torch.cat([angles, angles])
            tables[shift] = (angles.cos().to(keys.dtype), angles.sin().to(keys.dtype))
        cos, sin = (t.to(keys.device) for t in tables[shift])
        rotating, passing = keys[..., :rotary_dims], keys[..., rotary_dims:]
        half = rotary_dims // 2
        rotated_half = torch.cat([-rotating[..., half:], rotating[..., :half]], dim=-1)
        rotated = rotating * cos + rotated_half * sin
        return torch.cat([rotated, passing], dim=-1) if passing.shape[-1] else rotated

    return shift_keys


class SinkCacheLayer(DynamicLayer):
    """One layer's sinks + rolling window. `window=None` never evicts (a fixed prefix followed by dense
    attention: CushionCache's cushion uses the sink slots this way)."""

    def __init__(self, sinks: int, window: int | None, key_shift: KeyShift | None):
        super().__init__()
        self.sinks, self.window, self.key_shift = sinks, window, key_shift
        self.evicted = 0  # tokens dropped so far

    @property
    def capacity(self) -> int | None:
        return None if self.window is None else self.sinks + self.window

    def _stored_length(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def _evict_overflow(self) -> None:
        excess = 0 if self.capacity is None else self._stored_length() - self.capacity
        if excess <= 0:
            return
        recent_keys = self.keys[..., self.sinks + excess :, :]
        if self.key_shift is not None:
            recent_keys = self.key_shift(recent_keys, -excess)
        self.keys = torch.cat([self.keys[..., : self.sinks, :], recent_keys], dim=-2)
        self.values = torch.cat([self.values[..., : self.sinks, :], self.values[..., self.sinks + excess :, :]], dim=-2)
        self.evicted += excess

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.keys.dtype != key_states.dtype:  # what was read in first (a stored cushion) meets the layer's dtype
            self.keys, self.values = self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        self._evict_overflow()
        return super().update(key_states, value_states)

    def get_seq_length(self) -> int:
        """The length the cache will have once the pending eviction is done: where the next tokens go."""
        stored = self._stored_length()
        return stored if self.capacity is None else min(stored, self.capacity)

    def get_max_length(self) -> int:
        return -1 if self.capacity is None else self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        raise ConfigError("a sink cache cannot be cropped (it already evicts); start a new cache instead")


class SinkCache(Cache):
    """StreamingLLM's cache for a whole model: one SinkCacheLayer per decoder layer, built as layers are used.

    Prefer `leanlm.methods.streaming.sink_cache(model, ...)`, which reads the sizes' defaults from the paper,
    checks the architecture and wires the model's positions to the cache."""

    def __init__(self, sinks: int = 4, window: int | None = 1020, key_shift: KeyShift | None = None):
        if sinks < 0 or (window is not None and window < 1):
            raise ConfigError(f"a sink cache needs sinks >= 0 and window >= 1, got sinks={sinks}, window={window}")
        self.sinks, self.window, self.key_shift = sinks, window, key_shift
        super().__init__(layers=[])
        self._make_layer = lambda: SinkCacheLayer(sinks, window, key_shift)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(self._make_layer())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def evicted(self) -> int:
        return self.layers[0].evicted if self.layers else 0

    def droppable(self) -> int:
        """How many of the latest tokens `drop_last` can take back: the window's (the sinks stay)."""
        self.settle()
        return max(0, self.get_seq_length() - self.sinks) if self.layers else 0

    def drop_last(self, count: int) -> None:
        """Forget the latest `count` tokens, as if they had not been read (tokens they pushed out of the window
        stay out). A conversation whose last turn is rewritten continues from the part both share."""
        if not 0 <= count <= self.droppable():
            raise ConfigError(f"cannot drop {count} tokens: only the window's {self.droppable()} can be dropped")
        if count:
            for layer in self.layers:
                layer.keys, layer.values = layer.keys[..., :-count, :], layer.values[..., :-count, :]

    def hold(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> SinkCache:
        """Hold exactly these keys and values, one (batch, heads, n, head_dim) pair per layer in cache order, keys
        rotated at their cache positions (a cache handed over from another layout: the fused step's ring)."""
        self.layers = []
        for index, (layer_keys, layer_values) in enumerate(zip(keys, values)):
            self.update(layer_keys, layer_values, index)
        return self

    def settle(self) -> None:
        """Carry out the eviction pending since the last update (a layer evicts lazily, before it next grows), so
        that every layer's keys and values are exactly what the next token will attend to."""
        for layer in self.layers:
            if layer.is_initialized:
                layer._evict_overflow()

    @property
    def capacity(self) -> int | None:
        return None if self.window is None else self.sinks + self.window

    def __repr__(self) -> str:
        return f"SinkCache(sinks={self.sinks}, window={self.window}, length={self.get_seq_length()}, evicted={self.evicted})"


def cache_positions_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: with a SinkCache, the new tokens get positions cache_length .. cache_length + n - 1."""
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, SinkCache):
        return None
    inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if inputs is None and args:
        inputs = args[0]
    if inputs is None:
        raise ConfigError("a forward with a SinkCache needs input_ids or inputs_embeds")
    batch, length = inputs.shape[:2]
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.ndim != 2 or not bool(mask.all()):
            raise ConfigError(
                "a SinkCache streams equal-length sequences: the attention mask must be all ones (no padding); "
                "its sink slots would otherwise hold padding"
            )
        # generate's mask covers every token of the stream; the cache's own length is what the model must see.
        kwargs["attention_mask"] = None
    start = cache.get_seq_length()
    kwargs["position_ids"] = torch.arange(start, start + length, device=inputs.device).expand(batch, length)
    return args, kwargs
