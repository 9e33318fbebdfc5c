"""KV caches on transformers' cache API: StreamingLLM's sink cache (and the prefix caches built on it)."""

from leanlm.cache.prefix import Cushion, attach_cushion, attached_cushion, detach_cushion, prefix_cache
from leanlm.cache.sink_cache import KeyShift, SinkCache, SinkCacheLayer, cache_positions_hook, rope_key_shift

__all__ = [
    "Cushion",
    "attach_cushion",
    "attached_cushion",
    "detach_cushion",
    "prefix_cache",
    "KeyShift",
    "SinkCache",
    "SinkCacheLayer",
    "cache_positions_hook",
    "rope_key_shift",
]
