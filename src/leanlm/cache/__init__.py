"""KV caches on transformers' cache API: StreamingLLM's sink cache (and the prefix caches built on it)."""

from leanlm.cache.sink_cache import KeyShift, SinkCache, SinkCacheLayer, rope_key_shift

__all__ = ["KeyShift", "SinkCache", "SinkCacheLayer", "rope_key_shift"]
