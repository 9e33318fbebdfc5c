"""StreamingLLM (Xiao's thesis chapter 4): attention sinks + a rolling KV window, with positions assigned in the cache.

    cache = sink_cache(model, StreamingConfig(sinks=4, window=1020))
    model.generate(input_ids, past_key_values=cache, max_new_tokens=10_000)      # or a manual token loop

`sink_cache` checks that the model's positions can be re-assigned (RoPE: the keys are re-rotated on eviction;
learned absolute positions cannot be, ALiBi families have no table yet), and installs, once per model, a forward
pre-hook that gives the new tokens their *cache* positions (cache length .. cache length + n - 1) whenever a
SinkCache is passed. transformers' `generate` would otherwise pass text positions, which grow without bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from leanlm.cache.prefix import attached_cushion, put_cushion
from leanlm.cache.sink_cache import SinkCache, cache_positions_hook, rope_key_shift
from leanlm.errors import ConfigError, UnsupportedArchitectureError
from leanlm.models.architectures import architecture_for, mixes_attention_kinds
from leanlm.settings import option

# RoPE variants whose rotation is linear in the position (so a shift composes); "dynamic" rescales with length.
SHIFTABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_HOOK_ATTRIBUTE = "_leanlm_cache_positions_hook"


@dataclass(frozen=True)
class StreamingConfig:
    sinks: int = option(4, "attention sinks: initial tokens kept forever (Xiao's thesis' default; Table 4.2)")
    window: int = option(
        1020,
        "most recent tokens kept; the cache holds sinks + window tokens (Xiao's thesis uses a cache of 1024 for "
        "models of 2K context)",
    )

    def __post_init__(self):
        if self.sinks < 0:
            raise ConfigError(f"sinks must be 0 or more, got {self.sinks}")
        if self.window < 1:
            raise ConfigError(f"window must be >= 1, got {self.window}")

    @property
    def cache_size(self) -> int:
        return self.sinks + self.window


def sink_cache(model: nn.Module, config: StreamingConfig = StreamingConfig()) -> SinkCache:
    """A fresh SinkCache for one stream through `model`. A model with a CushionCache prefix gets it in front of
    the sinks, kept like them (without it the prefix hook would give the stream a cache that never evicts)."""
    key_shift = _key_shift(model)
    cushion = attached_cushion(model)
    prefix = cushion.length if cushion is not None else 0
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and config.cache_size + prefix >= limit:
        raise ConfigError(
            f"cache of {config.cache_size + prefix} tokens (sinks {config.sinks} + window {config.window}"
            f"{f' + a cushion of {prefix}' if prefix else ''}) reaches the model's trained context of {limit}; "
            "StreamingLLM keeps the cache inside it (Xiao's thesis uses half of it)"
        )
    _install_position_hook(model)
    cache = SinkCache(config.sinks + prefix, config.window, key_shift)
    return put_cushion(cache, cushion) if prefix else cache


def _key_shift(model: nn.Module):
    table = architecture_for(model)
    if table.positions == "learned":
        raise UnsupportedArchitectureError(
            f"{table.family} encodes positions as 'learned': a token's absolute position is baked into its "
            "embedding, so StreamingLLM cannot re-assign positions inside the cache (it needs RoPE or ALiBi)"
        )
    if table.positions != "rope" or table.rotary_embedding is None:
        raise UnsupportedArchitectureError(
            f"{table.family} has no model-level rotary embedding (positions: {table.positions!r}); the sink cache "
            "re-rotates cached keys with it"
        )
    if mixes_attention_kinds(model.config):
        raise UnsupportedArchitectureError(
            f"{table.family} mixes sliding-window and full-attention layers (config.layer_types); the sink cache "
            "supports models whose layers all use full attention"
        )
    rotary = model.get_submodule(table.rotary_embedding)
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in SHIFTABLE_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"RoPE type {rope_type!r} changes its frequencies with the sequence length, so cached keys cannot be "
            f"shifted; supported: {', '.join(SHIFTABLE_ROPE_TYPES)}"
        )
    return rope_key_shift(rotary.inv_freq)


def _install_position_hook(model: nn.Module) -> None:
    if getattr(model, _HOOK_ATTRIBUTE, None) is None:
        setattr(model, _HOOK_ATTRIBUTE, model.register_forward_pre_hook(cache_positions_hook, with_kwargs=True))
