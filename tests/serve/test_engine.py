"""The engine's batched decode step against each conversation fed alone."""

import copy
import queue

import pytest
import torch
from tiny import tiny_model

from leanlm.kernels.kbit_gemm import avx2_available
from leanlm.methods import KbitConfig, quantize_
from leanlm.methods.streaming import StreamingConfig, sink_cache
from leanlm.nn import use_gemv_
from leanlm.serve.conversations import Conversation, ConversationStore, cache_bytes
from leanlm.serve.engine import Engine, Request, Sampling, forward_batch, held_back


@pytest.mark.parametrize(
    "family, dtype",
    [("llama", torch.float32), ("qwen2", torch.float32), ("mistral", torch.float32), ("llama", torch.bfloat16)],
)
def test_a_batched_step_equals_each_cache_fed_alone(family, dtype):
    """Caches of different lengths, one of them past its window (evicting, keys re-rotated): the batched step's
    logits and the caches it leaves equal a one-token forward of each alone (in bfloat16 too, as `leanlm serve`
    computes on a CPU with bf16 instructions: to bfloat16's precision)."""
    model = tiny_model(family).to(dtype)
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    config = StreamingConfig(sinks=2, window=12)
    generator = torch.Generator().manual_seed(0)
    caches = []
    with torch.inference_mode():
        for length in (3, 9, 30):
            cache = sink_cache(model, config)
            for start in range(0, length, 6):
                ids = torch.randint(0, 128, (1, min(6, length - start)), generator=generator)
                model(input_ids=ids, past_key_values=cache, use_cache=True)
            caches.append(cache)
    alone = copy.deepcopy(caches)
    tokens = [5, 17, 99]
    batched = forward_batch(model, caches, tokens)
    with torch.inference_mode():
        for row, (cache, token) in enumerate(zip(alone, tokens)):
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
            torch.testing.assert_close(batched[row], logits.float(), **(tolerance or {"rtol": 1e-4, "atol": 1e-5}))
    for together, single in zip(caches, alone):
        together.settle()
        single.settle()
        for a, b in zip(together.layers, single.layers):
            torch.testing.assert_close(a.keys, b.keys, **(tolerance or {"rtol": 1e-5, "atol": 1e-6}))
            torch.testing.assert_close(a.values, b.values, **(tolerance or {"rtol": 1e-5, "atol": 1e-6}))


def test_the_store_continues_the_longest_prefix_and_keeps_to_its_budget():
    model = tiny_model("llama")
    with torch.inference_mode():
        filled = []
        for ids in ([1, 2, 3], [1, 2, 3, 4, 5], [7, 8]):
            cache = sink_cache(model, StreamingConfig(sinks=2, window=16))
            model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
            filled.append(Conversation(list(ids), cache))
    size = cache_bytes(filled[0].cache)
    store = ConversationStore(budget_bytes=10 * size, exact=False)  # any shared token (exactness: below)
    for conversation in filled:
        store.put(conversation)
    assert store.take([1, 2, 3, 4, 5, 6]) is filled[1]  # continued exactly: it leaves the store
    # Sharing only [1, 2] with [1, 2, 3]: a copy cut back to them, the original stays for its own next turn.
    cut = store.take([1, 2, 9, 9])
    assert cut.ids == [1, 2] and cut.cache.get_seq_length() == 2 and len(store) == 2
    with torch.inference_mode():
        fresh = sink_cache(model, StreamingConfig(sinks=2, window=16))
        model(input_ids=torch.tensor([[1, 2]]), past_key_values=fresh, use_cache=True)
    torch.testing.assert_close(cut.cache.layers[0].keys, fresh.layers[0].keys)
    assert filled[0].cache.get_seq_length() == 3
    assert store.take([9]) is None
    small = ConversationStore(budget_bytes=int(size * 2.5), exact=False)  # room for two of these: the oldest leaves
    for conversation in filled:
        small.put(conversation)
    assert len(small) == 2
    taken = small.take([1, 2, 3, 9])  # [1, 2, 3] itself left; what matches now is [1, .., 5] cut back (a copy)
    assert taken is not filled[0] and taken.ids == [1, 2, 3] and len(small) == 2


def test_held_back_text_is_the_part_a_stop_string_could_still_begin():
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello", ("xyz",)) == 0
    assert held_back("ab", ("b!", "ab?")) == 2


def _serve_turns(engine: Engine, conversations: list[list[int]], max_tokens: int, requests_out=None) -> list[list[int]]:
    """Every conversation's prompt as a request at once; each one's generated ids (`requests_out` gets the
    requests)."""
    events: queue.Queue = queue.Queue()
    requests = [
        Request(
            prompt,
            Sampling(max_tokens=max_tokens, temperature=0.0, logprobs=0),
            lambda event, i=i: events.put((i, event)),
        )
        for i, prompt in enumerate(conversations)
    ]
    for request in requests:
        engine.submit(request)
    finished = 0
    while finished < len(requests):
        index, event = events.get(timeout=60)
        assert event[0] != "error", event
        finished += event[0] == "done"
    if requests_out is not None:
        requests_out.extend(requests)
    return [request.generated for request in requests]


@pytest.mark.skipif(not avx2_available(), reason="leanlm's kernels cannot be built here")
def test_the_fused_engine_answers_as_the_batched_forward_does_over_turns_past_the_window(smollm2_tokenizer):
    """Four conversations at once, three turns each, each turn resending the history (the store continues it): the
    fused step (caches moved into its layout and back every turn, rings going round) and transformers' batched
    forward generate the same greedy tokens."""
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer), seed=1)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)  # decisive logits: no near-ties between the two paths
    streaming = StreamingConfig(sinks=2, window=24)
    engines = [
        Engine(model, smollm2_tokenizer, streaming, max_batch=4, fused=fused, exact_reuse=False)
        for fused in (True, False)
    ]
    assert engines[0].fused is not None and engines[1].fused is None
    histories = [[[7 * i + j + 3 for j in range(5 + 3 * i)]] * 2 for i in range(4)]
    for turn in range(3):
        answers = [
            _serve_turns(engine, [history[e] for history in histories], max_tokens=12)
            for e, engine in enumerate(engines)
        ]
        assert answers[0] == answers[1], f"turn {turn}"
        assert all(len(answer) == 12 for answer in answers[0])  # no early stop: every turn decodes 12 tokens
        histories = [
            [history[e] + answer + [40 + turn, 41 + turn] for e, answer in enumerate(answer_pair)]
            for history, answer_pair in zip(histories, zip(*answers))
        ]
    assert max(len(history[0]) for history in histories) > 2 + 24  # past the window: the rings went round
    assert len(engines[0].conversations) == 4  # every conversation back in the store, continued each turn


def test_penalties_and_bias_follow_openais_definitions():
    from leanlm.serve.engine import Sampling, adjusted_logits

    sampling = Sampling(max_tokens=1, frequency_penalty=0.5, presence_penalty=1.0, logit_bias=((3, 2.0),))
    adjusted = adjusted_logits(torch.zeros(5), [1, 1, 2], sampling)
    assert adjusted.tolist() == [0.0, -2.0, -1.5, 2.0, 0.0]
    plain = torch.zeros(5)
    assert adjusted_logits(plain, [1], Sampling(max_tokens=1)) is plain


def _served_model(tokenizer, seed: int, dtype: torch.dtype, packed: bool):
    """A tiny Llama as the engine gets it: transformers' linears, or (`packed`) leanlm's as its loaders leave them
    (NF4 block linears, the head a GemvLinear), whose prompt pieces the engine reads packed."""
    model = tiny_model("llama", vocab_size=len(tokenizer), seed=seed).to(dtype)
    if packed:
        quantize_(model, KbitConfig(double_quant=True))
        use_gemv_(model)
    return model


needs_kernels = pytest.mark.skipif(not avx2_available(), reason="leanlm's kernels cannot be built here")
PACKED = [pytest.param(False, id="alone"), pytest.param(True, id="packed", marks=needs_kernels)]


@pytest.mark.parametrize("packed", PACKED)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_answer_does_not_depend_on_what_the_store_held(smollm2_tokenizer, fused, dtype, packed):
    """The second turn of a conversation, continued from the stored first turn or read fresh by another engine:
    the same greedy tokens, in bfloat16 too (the store shares only whole prompt chunks, computed alike)."""
    if fused and not avx2_available():
        pytest.skip("leanlm's kernels cannot be built here")
    model = _served_model(smollm2_tokenizer, 4, dtype, packed)
    streaming = StreamingConfig(sinks=4, window=120)  # prompts read in chunks of 30
    first = [(7 * i) % 5000 + 3 for i in range(60)]
    stored = Engine(model, smollm2_tokenizer, streaming, max_batch=2, fused=fused)
    assert stored.packs == packed
    answer = _serve_turns(stored, [first], max_tokens=10)[0]
    second = first + answer + [11, 12, 13]
    requests = []
    _serve_turns(stored, [second], max_tokens=20, requests_out=requests)
    assert requests[0].usage.cached_tokens == 60  # the first turn's whole chunks
    _serve_turns(Engine(model, smollm2_tokenizer, streaming, max_batch=2, fused=fused), [second], 20, requests)
    continued, fresh = ([(e.token, e.logprob) for e in request.logprobs] for request in requests)
    assert continued == fresh  # the same tokens, and logits equal to the last bit


@needs_kernels
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_answer_does_not_depend_on_what_arrives_beside_it(smollm2_tokenizer, fused, dtype):
    """Prompts of 3, 17 and 45 tokens (pieces of 30 and 15) arriving together, their pieces read packed, or each
    alone: the same tokens, the first one's log-probabilities equal to the last bit (the prompt's read alone:
    tests/decoding/test_packed.py); the later ones come from decode steps of three rows or one, whose float
    kernels may sum in another order."""
    model = _served_model(smollm2_tokenizer, 5, dtype, packed=True)
    streaming = StreamingConfig(sinks=4, window=120)
    prompts = [[(11 * i + 7 * n) % 5000 + 3 for i in range(n)] for n in (3, 17, 45)]
    together: list[Request] = []
    engine = Engine(model, smollm2_tokenizer, streaming, max_batch=3, fused=fused)
    assert engine.packs
    _serve_turns(engine, prompts, max_tokens=8, requests_out=together)
    alone: list[Request] = []
    for prompt in prompts:
        _serve_turns(Engine(model, smollm2_tokenizer, streaming, max_batch=3, fused=fused), [prompt], 8, alone)
    for a, b in zip(together, alone):
        assert a.generated == b.generated
        assert (a.logprobs[0].token, a.logprobs[0].logprob) == (b.logprobs[0].token, b.logprobs[0].logprob)
        torch.testing.assert_close(
            [e.logprob for e in a.logprobs], [e.logprob for e in b.logprobs], rtol=1e-4, atol=1e-4
        )


def test_prompts_are_read_first_come_first_served_within_a_chunk_a_round(smollm2_tokenizer):
    """Three prompts at once, of 3 chunks, 3 chunks and 10 tokens: each round reads at most one chunk's worth of
    prompt tokens, oldest request first, so the first request is answering while the second is still reading, and
    the short prompt is read in the round where the second's last piece leaves room for it."""
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer), seed=2)
    streaming = StreamingConfig(sinks=4, window=120)
    engine = Engine(model, smollm2_tokenizer, streaming, max_batch=3, fused=False, thread=False)
    assert engine.chunk == 30
    prompts = [[(5 * i + j) % 4000 + 3 for j in range(n)] for i, n in enumerate((90, 80, 10))]
    done = []
    requests = [
        Request(prompt, Sampling(max_tokens=3, temperature=0.0), lambda e: done.append(e[0] == "done"))
        for prompt in prompts
    ]
    for request in requests:
        engine.submit(request)
    rounds = []  # before the first round and after each: (prompt tokens read, tokens generated) of each request

    def finished() -> bool:
        rounds.append([(request.fed, len(request.generated)) for request in requests])
        return sum(done) == len(requests) or len(rounds) > 20

    engine.run(until=finished)
    read = [[fed for fed, _ in state] for state in rounds]
    assert all(sum(b) - sum(a) <= 30 for a, b in zip(read, read[1:]))  # at most a chunk of prompt a round
    assert read[1:4] == [[30, 0, 0], [60, 0, 0], [90, 0, 0]]
    assert rounds[4] == [(90, 1), (30, 0), (0, 0)]  # answering while the next prompt is read
    assert read[6] == [90, 80, 10]  # the second's last piece of 20 and the short prompt share a round
    assert sum(done) == 3 and [len(request.generated) for request in requests] == [3, 3, 3]
