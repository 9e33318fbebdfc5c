"""The caches of idle conversations, so that a request which extends one (chat front ends resend the whole
history every turn) reads only its new tokens.

A conversation is known by the token ids its cache has read: a new prompt that starts like them continues it
(its cache cut back to the part they share). Only the part a fresh read would compute the same way is shared: the
engine reads prompts in chunks at fixed multiples of `chunk` tokens from the start, and a conversation records how
many of its tokens were read as such whole chunks (`exact`); its answer's tokens, read one at a time, and a last
partial chunk are read again; and a conversation whose cache has evicted tokens (it ran past the window) is not
continued, since a fresh read would evict at other points. So an answer never depends on what the store held, in
any dtype. With `exact=False` a conversation is continued from any shared token, past the window too: faster for
long chats, but an answer may then differ in its last bits, or its tokens, from a fresh read's.
Each cache is a sink cache, bounded by its sinks + window tokens however long the conversation gets; the store
as a whole is bounded by a byte budget, the least recently used conversations leaving first.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

from leanlm.cache.sink_cache import SinkCache


@dataclass
class Conversation:
    ids: list[int]  # every token the cache has read, in order (evicted ones included: they identify it)
    cache: SinkCache
    exact: int = 0  # leading ids read as whole prompt chunks: what a fresh read of them computes, bit for bit
    adapter: int = 0  # the LoRA adapter its cache was computed through


def cache_bytes(cache: SinkCache) -> int:
    """Bytes the cache's keys and values hold."""
    return sum(
        tensor.numel() * tensor.element_size()
        for layer in cache.layers
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if tensor is not None and tensor.device.type != "meta"
    )


def _shared_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


class ConversationStore:
    """Idle conversations, least recently used first out. `take` hands one out (it leaves the store while a request
    extends it, so two requests never write one cache); `put` brings it back."""

    def __init__(self, budget_bytes: int, chunk: int = 1, exact: bool = True):
        self.budget_bytes, self.chunk, self.exact = budget_bytes, chunk, exact
        self._idle: OrderedDict[int, tuple[Conversation, int]] = OrderedDict()
        self._next_key = 0
        self._lock = threading.Lock()

    def take(self, prompt: list[int], adapter: int = 0) -> Conversation | None:
        """The idle conversation of `adapter` sharing the longest start with `prompt`, cut back to that shared start
        (so at least one token of `prompt` is left to read, which gives the logits to continue from); None if none
        shares a token. A conversation that `prompt` continues exactly leaves the store; one that must be cut is copied,
        so that it stays whole for its own next turn (front ends resend a model's answer as text, whose tokens
        need not be the ones generated, and several chats share a system prompt)."""
        with self._lock:
            best_key, best_shared = None, 0
            for key, (conversation, _) in self._idle.items():
                if conversation.adapter != adapter:
                    continue
                shared = min(_shared_length(conversation.ids, prompt), len(prompt) - 1)
                if self.exact:
                    capacity = conversation.cache.get_max_length()
                    if 0 <= capacity < len(conversation.ids):
                        continue
                    shared = min(shared, conversation.exact)
                    shared -= shared % self.chunk
                if shared > best_shared and len(conversation.ids) - shared <= conversation.cache.droppable():
                    best_key, best_shared = key, shared
            if best_key is None:
                return None
            stored = self._idle[best_key][0]
            if best_shared == len(stored.ids):
                return self._idle.pop(best_key)[0]
            cut = Conversation(stored.ids[:best_shared], copy.deepcopy(stored.cache), best_shared, adapter)
        cut.cache.drop_last(len(stored.ids) - best_shared)
        return cut

    def put(self, conversation: Conversation) -> None:
        """Keep `conversation` as the most recently used, then drop the least recently used ones beyond the budget
        (`conversation` itself too, if it alone exceeds it)."""
        with self._lock:
            self._idle[self._next_key] = (conversation, cache_bytes(conversation.cache))
            self._next_key += 1
            while self._idle and self.bytes() > self.budget_bytes:
                self._idle.popitem(last=False)

    def bytes(self) -> int:
        return sum(size for _, size in self._idle.values())

    def __len__(self) -> int:
        return len(self._idle)
