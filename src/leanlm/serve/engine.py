"""The generation engine behind `leanlm serve`: one thread owns the model and advances every request in flight.

Each round reads at most one chunk's worth of prompt tokens (prompts are read in pieces that end at multiples of
the chunk), oldest request first, and gives every request whose prompt is read one new token. So prompts are
read first come, first served (the first of many long prompts starts answering after its own prefill, not after
everyone's), a later request's short prompt may fill what an older one's piece leaves of the round, and a
request that is generating waits at most one chunk's prefill between two tokens. The new tokens of a round go
through the model together, as one batch (continuous batching): each
request's cache is left-padded to the longest, the padding masked out, each token placed at its own cache
position, and each request's new keys and values go back into its own cache. Requests join at the next round
and leave when they finish or their client goes away; at most `max_batch` are active, the rest wait in order.

Every request reads its prompt into a sink cache, so a conversation of any length is answered in bounded memory
(the middle is evicted, the sinks stay). A prompt that extends an idle conversation's tokens continues that
conversation's cache (`ConversationStore`) and reads only the new tokens; `cached_tokens` in the usage says how
many it was spared.

Where the model allows it (`leanlm.decoding.fused_decoder_problem`), a round's new tokens go through the fused C++
decode step instead (`FusedDecoder.step_batch`: every weight read once for the whole batch, each row attending
to its own cache, without the GIL): a request's cache moves into the step's layout once its prompt is read
(`FusedDecoder.adopt`) and back when it finishes (`release`), so prompts are still read by the batched forward
and the conversation store keeps transformers' caches.

The prompt pieces a round reads are read together, packed into one forward (`leanlm.decoding.packed`), where the
model allows it (`packing_problem`): every weight is read once for all of them, and each piece computes exactly
what it computes read alone. So a request's answer never depends on what arrives beside it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from leanlm.cache.prefix import attached_cushion
from leanlm.cache.sink_cache import SinkCache
from leanlm.chat import sample_token, stop_token_ids
from leanlm.decoding import FusedCache, FusedDecoder, packing_problem, read_pieces
from leanlm.methods.streaming import StreamingConfig, sink_cache
from leanlm.nn.lora import adapter_rows
from leanlm.serve.conversations import Conversation, ConversationStore

# Tokens a prompt is read in at most (a quarter of the window at most, so that a conversation inside the window
# can be continued from a chunk boundary), at multiples of which a stored conversation is shared.
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    frequency_penalty: float = 0.0  # OpenAI's: each logit less this times its token's count in the answer so far
    presence_penalty: float = 0.0  # ... and less this once if the token is in the answer at all
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely beside it
    echo: bool = False  # the prompt's tokens' log-probabilities too (from its first token's successor on)
    grammar: str | None = None  # llguidance's grammar the answer must follow (a JSON schema, compiled), or None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a stored conversation's cache had already read

    def plus(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.cached_tokens + other.cached_tokens,
        )

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    best = logprobs.topk(top) if top else None
    return TokenLogprob(
        token,
        float(logprobs[token]),
        tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else (),
    )


def adjusted_logits(logits: torch.Tensor, generated: list[int], sampling: Sampling) -> torch.Tensor:
    """`logits` with the request's logit bias and its frequency and presence penalties over the tokens it has
    generated (OpenAI's definitions); the same tensor where the request sets none."""
    penalised = generated and (sampling.frequency_penalty or sampling.presence_penalty)
    if not sampling.logit_bias and not penalised:
        return logits
    logits = logits.float().clone()
    for token, bias in sampling.logit_bias:
        logits[token] += bias
    if penalised:
        counts = torch.bincount(torch.tensor(generated), minlength=len(logits))[: len(logits)].float()
        logits -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).float()
    return logits


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (its logits before any sampling setting), and the
    most likely tokens at that step with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# ("prompt", [TokenLogprob | None per prompt token], with echo) / ("text", piece, [TokenLogprob of the tokens it
# completes]) / ("done", finish_reason, usage) / ("error", message)
Emit = Callable[[tuple], None]


@dataclass
class Request:
    prompt: list[int]
    sampling: Sampling
    emit: Emit
    adapter: int = 0  # which of the model's LoRA adapters answers (`leanlm.nn.lora.adapter_rows`)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Filled in by the engine:
    conversation: Conversation | None = None
    fed: int = 0  # prompt tokens read so far (a reused conversation's count from the start)
    generated: list[int] = field(default_factory=list)
    shown: str = ""  # text already emitted
    logits: torch.Tensor | None = None
    fused: FusedCache | None = None  # the conversation's cache while the fused step generates
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reported: int = 0  # logprobs already emitted
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # with echo: None for the first
    matcher: object | None = None  # with a grammar: llguidance's matcher, which masks every token it forbids
    usage: Usage = field(default_factory=Usage)

    def cancel(self) -> None:
        self.cancelled.set()


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string (not to be shown yet)."""
    return max(
        (n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:n])), default=0
    )


class Engine:
    """Owns the model; `submit` queues a request, whose events `emit` receives from the engine's thread: its own
    (`thread=True`) or the one that calls `run`.

    `leanlm serve` runs the engine in the thread that loaded the model, the HTTP server beside it: PyTorch's OpenMP
    (libgomp) keeps its idle workers spinning only while the process has no more OpenMP threads than CPUs, and a
    second thread running parallel regions (each thread that does gets its own team) makes every region wait for
    its workers to wake, which slows every small op and the fused step several times (benchmarks/serve.py)."""

    def __init__(
        self,
        model,
        tokenizer,
        streaming: StreamingConfig,
        *,
        max_batch: int = 8,
        cache_budget_bytes: int = 1 << 30,
        fused: bool = True,
        thread: bool = True,
        exact_reuse: bool = True,
    ):
        self.model, self.tokenizer, self.streaming = model, tokenizer, streaming
        self.max_batch = max_batch
        # Prompts are read in chunks at multiples of this from the start, so a stored conversation's chunks are
        # what a fresh read computes (ConversationStore shares only those).
        self.chunk = max(1, min(PREFILL_CHUNK, streaming.window // 4))
        self.conversations = ConversationStore(cache_budget_bytes, self.chunk, exact_reuse)
        self.stop_ids = stop_token_ids(tokenizer)
        sink_cache(model, streaming)  # refuses a model or sizes the sink cache cannot serve, before any request
        self.fused = FusedDecoder.build(model, streaming=streaming) if fused else None
        cushion = attached_cushion(model)
        longest = streaming.cache_size + self.chunk + (cushion.length if cushion is not None else 0)
        self.packs = packing_problem(model, longest) is None  # prompt pieces read together (module docstring)
        self._reads: list[tuple[Request, int]] = []  # the round's prompt pieces, read after its requests' steps
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._calls: queue.Queue[tuple[Callable, Callable]] = queue.Queue()
        self._grammar_tokenizer = self._grammar_mask = None
        self._active: list[Request] = []
        if thread:
            threading.Thread(target=self.run, name="leanlm-engine", daemon=True).start()

    def submit(self, request: Request) -> None:
        self._waiting.put(request)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return self._waiting.qsize()

    def call(self, work: Callable[[], object], reply: Callable[[object, Exception | None], None]) -> None:
        """Run `work()` in the engine's thread between two rounds (the model is only ever used from that thread);
        `reply(result, error)` receives its outcome there."""
        self._calls.put((work, reply))

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Generate in the calling thread until `until()` (asked at least every 0.2 s while idle)."""
        while not until():
            while not self._calls.empty():
                work, reply = self._calls.get()
                try:
                    reply(work(), None)
                except Exception as error:  # the caller hears it; the engine goes on
                    reply(None, error)
            self._admit()
            decoding: list[tuple[Request, int]] = []
            budget = self.chunk  # prompt tokens this round still reads; the oldest reader's piece always fits
            for request in list(self._active):
                piece = 0 if request.cancelled.is_set() else self._piece_end(request) - request.fed
                read = piece <= budget
                if read:
                    budget -= piece
                try:
                    step = self._step(request, read)
                except Exception as error:  # one request's failure ends it, never the engine or the others
                    step = self._fail(request, error)
                if isinstance(step, str):
                    self._end(request, step)
                elif step is not None:
                    decoding.append((request, step))
            self._read_packed()
            if not decoding:
                continue
            if self.fused is not None:
                self._step_fused(decoding)
                continue
            try:
                self._feed_tokens(decoding)
            except Exception:  # a batch that fails in the model is retried one by one, so only the culprit ends
                for request, token in decoding:
                    try:
                        self._feed(request, [token])
                    except Exception as single_error:
                        self._end(request, self._fail(request, single_error))

    def embed(self, prompts: list[list[int]], adapter: int = 0) -> list[list[float]]:
        """Each prompt's embedding: the mean over its tokens of the model's last hidden state (after the final
        norm), read through a fresh conversation cache (a CushionCache prefix included) and the LoRA adapter asked
        for, so that the model sees what it sees when it generates."""
        vectors = []
        with torch.inference_mode(), adapter_rows((adapter,)):
            for ids in prompts:
                out = self.model(
                    input_ids=torch.tensor([ids]),
                    past_key_values=sink_cache(self.model, self.streaming),
                    use_cache=True,
                    output_hidden_states=True,
                    logits_to_keep=1,
                )
                vectors.append(out.hidden_states[-1][0].float().mean(0).tolist())
        return vectors

    def _fail(self, request: Request, error: Exception) -> str:
        request.emit(("error", f"generation failed: {error}"))
        return "error"

    def _end(self, request: Request, finish: str) -> None:
        self._active.remove(request)
        self._retire(request, finish)

    def _admit(self) -> None:
        """Move waiting requests in (waiting a moment while there is nothing to do)."""
        while len(self._active) < self.max_batch:
            try:
                request = self._waiting.get(block=not self._active, timeout=0.2)
            except queue.Empty:
                return
            if not request.cancelled.is_set():
                self._start(request)
                self._active.append(request)

    def _start(self, request: Request) -> None:
        # An echoed prompt is read whole: a stored conversation's cache has no logits for what it already read.
        conversation = None if request.sampling.echo else self.conversations.take(request.prompt, request.adapter)
        if conversation is None:
            conversation = Conversation([], sink_cache(self.model, self.streaming), adapter=request.adapter)
        request.conversation = conversation
        request.fed = len(conversation.ids)
        request.usage = Usage(prompt_tokens=len(request.prompt), cached_tokens=len(conversation.ids))
        seed = request.sampling.seed
        request.generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        if request.sampling.grammar is not None:
            import llguidance

            request.matcher = llguidance.LLMatcher(self.grammar_tokenizer(), request.sampling.grammar)

    def _feed(self, request: Request, ids: list[int]) -> None:
        """Read `ids` into the request's cache (alone: with a LoRA adapter, or after a packed read failed)."""
        echo = request.sampling.echo
        with torch.inference_mode(), adapter_rows((request.adapter,)):
            out = self.model(
                input_ids=torch.tensor([ids]),
                past_key_values=request.conversation.cache,
                use_cache=True,
                logits_to_keep=0 if echo else 1,
            )
        self._read(request, ids, out.logits[0] if echo else out.logits[0, -1])

    def _read(self, request: Request, ids: list[int], logits: torch.Tensor) -> None:
        """`ids` are in the request's cache, `logits` after its last token (with echo: after each of them, and
        each token's log-probability given what precedes it is kept)."""
        request.conversation.ids.extend(ids)
        if request.sampling.echo:
            predictors = [request.logits, *logits[:-1]]
            request.prompt_logprobs += [
                None if before is None else token_logprob(before, token, request.sampling.logprobs or 0)
                for before, token in zip(predictors, ids, strict=True)
            ]
            logits = logits[-1]
        request.logits = logits.float()

    def _read_packed(self) -> None:
        """The round's prompt pieces, read together; if that fails, each alone, so that only the culprit ends."""
        reads, self._reads = self._reads, []
        if not reads:
            return
        pieces = [request.prompt[request.fed : end] for request, end in reads]
        try:
            logits = read_pieces(
                self.model,
                [request.conversation.cache for request, _ in reads],
                pieces,
                [request.sampling.echo for request, _ in reads],
            )
        except Exception:
            logits = None
        for index, (request, end) in enumerate(reads):
            try:
                if logits is None:
                    part = read_pieces(
                        self.model, [request.conversation.cache], [pieces[index]], [request.sampling.echo]
                    )[0]
                else:
                    part = logits[index]
                self._read(request, pieces[index], part)
                self._piece_read(request, end)
            except Exception as error:
                self._end(request, self._fail(request, error))

    def _step_fused(self, decoding: list[tuple[Request, int]]) -> None:
        """One new token for each request through the fused step, as one batch (each row its own sequence: its
        answer does not depend on what runs beside it). A request's cache moves into the step's layout at its first
        token, with room for every token it may still generate."""
        for request, token in list(decoding):
            if request.fused is None:
                try:
                    request.fused = self.fused.adopt(request.conversation.cache, room=request.sampling.max_tokens)
                except Exception as error:
                    decoding.remove((request, token))
                    self._end(request, self._fail(request, error))
                    continue
                request.conversation.cache = None  # the fused copy is the conversation's until `_retire`
        if not decoding:
            return
        try:
            logits = self.fused.step_batch([token for _, token in decoding], [request.fused for request, _ in decoding])
        except Exception:  # one by one, so that only the culprit ends
            for request, token in decoding:
                try:
                    request.logits = self.fused.step(token, request.fused)
                    request.conversation.ids.append(token)
                except Exception as error:
                    self._end(request, self._fail(request, error))
            return
        for row, (request, token) in enumerate(decoding):
            request.logits = logits[row]
            request.conversation.ids.append(token)

    def _feed_tokens(self, decoding: list[tuple[Request, int]]) -> None:
        """One new token for each request, through the model as one batch."""
        if len(decoding) == 1:  # no padding needed: the request's own sink cache
            request, token = decoding[0]
            return self._feed(request, [token])
        with adapter_rows([request.adapter for request, _ in decoding]):
            logits = forward_batch(
                self.model, [request.conversation.cache for request, _ in decoding], [token for _, token in decoding]
            )
        for row, (request, token) in enumerate(decoding):
            request.conversation.ids.append(token)
            request.logits = logits[row]

    def _piece_end(self, request: Request) -> int:
        """Where the request's next prompt piece ends: the next multiple of the chunk, or the prompt's end (its
        `fed` once the prompt is read)."""
        return min(len(request.prompt), (request.fed // self.chunk + 1) * self.chunk)

    def _step(self, request: Request, read: bool) -> str | int | None:
        """One step of `request`: its next prompt piece if `read` (None), or its next token (to be fed with the
        round's batch), or its finish reason when it is done."""
        if request.cancelled.is_set():
            return "cancelled"
        if request.fed < len(request.prompt):
            if not read:
                return None
            end = self._piece_end(request)
            if self.packs:
                self._reads.append((request, end))  # read with the round's other pieces (`_read_packed`)
                return None
            self._feed(request, request.prompt[request.fed : end])
            self._piece_read(request, end)
            return None
        if request.sampling.max_tokens == 0:  # the prompt scored, nothing generated
            return "length"
        token = self._pick(request)
        if token in self.stop_ids:
            return "stop"
        request.generated.append(token)
        if request.sampling.logprobs is not None:
            request.logprobs.append(token_logprob(request.logits, token, request.sampling.logprobs))
        request.usage.completion_tokens = len(request.generated)
        text = self.tokenizer.decode(request.generated, skip_special_tokens=True)
        stops = request.sampling.stop
        hits = [text.find(stop) for stop in stops if stop in text]
        if hits:
            self._show(request, text[: min(hits)])
            return "stop"
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            self._show(request, text[: len(text) - held_back(text, stops)])
        if request.matcher is not None and request.matcher.is_stopped():  # the grammar's answer is complete
            self._show(request, text)
            return "stop"
        if len(request.generated) >= request.sampling.max_tokens:
            self._show(request, text)
            return "length"
        return token

    def _piece_read(self, request: Request, end: int) -> None:
        request.fed = end
        if end % self.chunk == 0:
            request.conversation.exact = end
        if request.fed == len(request.prompt) and request.sampling.echo:
            request.emit(("prompt", request.prompt_logprobs))

    def _show(self, request: Request, text: str) -> None:
        if len(text) > len(request.shown):
            request.emit(("text", text[len(request.shown) :], request.logprobs[request.reported :]))
            request.shown, request.reported = text, len(request.logprobs)

    def grammar_tokenizer(self):
        """llguidance's view of the tokenizer (built once: it reads the whole vocabulary)."""
        if self._grammar_tokenizer is None:
            import llguidance.hf

            self._grammar_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer)
        return self._grammar_tokenizer

    def _pick(self, request: Request) -> int:
        sampling = request.sampling
        logits = adjusted_logits(request.logits, request.generated, sampling)
        if request.matcher is not None:  # only what the grammar allows next (the end token once it is complete)
            import llguidance.torch

            vocabulary = self.grammar_tokenizer().vocab_size
            if self._grammar_mask is None:  # one buffer for every step: the engine picks one token at a time
                self._grammar_mask = llguidance.torch.allocate_token_bitmask(1, vocabulary)
            llguidance.torch.fill_next_token_bitmask(request.matcher, self._grammar_mask, 0)
            logits = logits.float().clone()
            width = min(len(logits), vocabulary)
            llguidance.torch.apply_token_bitmask_inplace(logits[:width], self._grammar_mask[0])
            logits[width:] = -torch.inf
        token = sample_token(logits, sampling.temperature, sampling.top_p, request.generator)
        if request.matcher is not None and not request.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {request.matcher.get_error()}")
        return token

    def _retire(self, request: Request, finish: str) -> None:
        """A finished request's conversation goes back to the store (what its cache read identifies it), and its
        client hears the end."""
        conversation = request.conversation
        if conversation is not None and finish in ("stop", "length") and conversation.ids:
            if request.fused is not None:
                conversation.cache, request.fused = self.fused.release(request.fused), None
            self.conversations.put(conversation)
        if finish in ("stop", "length"):
            request.emit(("done", finish, request.usage))


def forward_batch(model, caches: list[SinkCache], tokens: list[int]) -> torch.Tensor:
    """One token per cache through `model` as one batch: the caches (of any lengths) are left-padded to the
    longest, the padding masked out, each token placed at its own cache position; each cache then receives its
    own new keys and values (evicting as it would alone). Returns the float32 logits, one row per cache."""
    for cache in caches:
        cache.settle()
    lengths = [cache.get_seq_length() for cache in caches]
    longest = max(lengths)
    batch = DynamicCache()
    for layer in range(len(caches[0].layers)):
        batch.update(
            torch.cat([_left_pad(cache.layers[layer].keys, longest) for cache in caches]),
            torch.cat([_left_pad(cache.layers[layer].values, longest) for cache in caches]),
            layer,
        )
    mask = torch.zeros(len(caches), longest + 1, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, longest - length :] = 1
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([[token] for token in tokens]),
            attention_mask=mask,
            position_ids=torch.tensor(lengths)[:, None],
            past_key_values=batch,
            use_cache=True,
            logits_to_keep=1,
        )
        for row, cache in enumerate(caches):
            for layer, stored in enumerate(batch.layers):
                cache.update(stored.keys[row : row + 1, :, -1:], stored.values[row : row + 1, :, -1:], layer)
    return out.logits[:, -1].float()


def _left_pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """(1, heads, n, dim) -> (1, heads, length, dim), zeros in front (masked out)."""
    missing = length - tensor.shape[-2]
    return tensor if missing == 0 else torch.nn.functional.pad(tensor, (0, 0, missing, 0))


def asyncio_emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Emit:
    """An `emit` that hands the engine thread's events to a coroutine waiting on `events` in `loop`."""
    return lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
