"""Text to token ids, with the tokenization of a long text kept per process: a whole test set or the calibration
novels take a second or more to tokenize, and every row of a study, every calibrated quantization and every
evaluation in one process reads the same few texts."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# Texts at least this long are cached; the cache holds the last _CACHE_ENTRIES of them (keyed by the tokenizer's
# whole definition, the text and whether special tokens are added).
_CACHED_CHARACTERS = 100_000
_CACHE: OrderedDict[tuple[str, bool, str], tuple[int, ...]] = OrderedDict()
_CACHE_ENTRIES = 8


def token_ids(tokenizer, text: str, *, special_tokens: bool = False) -> list[int]:
    """`tokenizer(text, add_special_tokens=special_tokens)["input_ids"]`, a new list on every call."""
    if len(text) < _CACHED_CHARACTERS:
        return tokenizer(text, add_special_tokens=special_tokens)["input_ids"]
    key = (_fingerprint(tokenizer), special_tokens, hashlib.blake2b(text.encode()).hexdigest())
    if key not in _CACHE:
        _CACHE[key] = tuple(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])
        while len(_CACHE) > _CACHE_ENTRIES:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return list(_CACHE[key])


def _fingerprint(tokenizer) -> str:
    """The tokenizer's whole definition (vocabulary, merges, normalizer, added tokens), hashed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else repr((type(tokenizer), tokenizer.get_vocab()))
    return hashlib.blake2b(definition.encode()).hexdigest()
