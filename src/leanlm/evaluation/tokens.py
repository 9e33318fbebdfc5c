"""How evaluation turns text into model input, one rule for every task."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

# Texts at least this long (a whole test set) are tokenized once per process and tokenizer: every row of a study
# scores the same text, and tokenizing WikiText-2's test set takes seconds.
_CACHED_CHARACTERS = 100_000
_CACHE: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
_CACHE_ENTRIES = 4


def encode(tokenizer, text: str) -> list[int]:
    if len(text) < _CACHED_CHARACTERS:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    key = (_fingerprint(tokenizer), hashlib.blake2b(text.encode()).hexdigest())
    if key not in _CACHE:
        _CACHE[key] = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        while len(_CACHE) > _CACHE_ENTRIES:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return list(_CACHE[key])


def _fingerprint(tokenizer) -> str:
    """The tokenizer's whole definition (vocabulary, merges, normalizer, added tokens), hashed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else repr((type(tokenizer), tokenizer.get_vocab()))
    return hashlib.blake2b(definition.encode()).hexdigest()


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] for tokenizers that add it by default (Gemma's sink sits on it), else nothing (SmolLM2, GPT-2).

    This is lm-evaluation-harness' behaviour: it adds special tokens only where the model expects them."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    default = tokenizer("a")["input_ids"]
    return [bos] if default and default[0] == bos else []


def max_input_length(model, cap: int = 2048) -> int:
    """The longest input a model is run on: its trained context, capped like lm-evaluation-harness does."""
    trained = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", cap)
    return min(int(trained), cap)
