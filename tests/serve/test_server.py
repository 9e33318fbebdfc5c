"""`leanlm serve` through the official `openai` client, against a server on a free loopback port (tiny random
Llama with SmolLM2's tokenizer and chat template)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import leanlm_process
from tiny import tiny_model

from leanlm.kernels.kbit_gemm import avx2_available
from leanlm.methods.streaming import StreamingConfig
from leanlm.nn import use_gemv_
from leanlm.serve import ServeSettings, build_app
from leanlm.serve.conversations import cache_bytes
from leanlm.serve.server import uvicorn_config

MODEL = "tiny-llama"
WINDOW = 48  # the tiny model's context is 256: a 50-turn conversation runs far past both


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", params=[True, False], ids=["fused", "transformers"])
def server(smollm2_tokenizer, request):
    """The server generating through the fused step (the default), then through transformers' batched forward; its
    float linears leanlm's, as its loaders leave them, so prompts are read packed where the kernels are built."""
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer), seed=1)
    use_gemv_(model)
    settings = ServeSettings(
        streaming=StreamingConfig(sinks=4, window=WINDOW),
        max_batch=8,
        max_tokens=16,
        cache_budget_mb=64,
        max_body_kb=64,
        fused=request.param,
        exact_reuse=False,  # conversations are continued past the window (the 50-turn test); exactness: test_engine
    )
    app = build_app(model, smollm2_tokenizer, MODEL, settings)
    assert (app.state.engine.fused is not None) == (request.param and avx2_available())
    assert app.state.engine.packs
    with running(app) as url:
        yield url, app


@contextlib.contextmanager
def running(app):
    """`app` served by uvicorn on a free loopback port for the block; yields its base URL."""
    port = free_port()
    instance = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "error"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not instance.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        instance.should_exit = True
        instance.force_exit = True  # no wait for the clients' idle keep-alive connections to close
        thread.join(timeout=10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_models_and_health(server, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert get(server[0] + "/health")["status"] == "ok"


def test_chat_completion_whole_and_streamed_give_the_same_greedy_answer(client):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    answer = whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == answer
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_seed_and_stop(client):
    first = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=0.9, seed=7
    )
    again = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, top_p=0.9, seed=7
    )
    assert first.choices[0].text == again.choices[0].text  # a seed makes sampling repeatable
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    text = greedy.choices[0].text
    assert len(text) > 2
    stop = text[1:3]  # a stop string the greedy answer contains: the answer ends before it
    stopped = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.find(stop)]


def test_a_conversation_continues_its_cache_and_outlives_the_context(server, client):
    """50 turns, each resending the whole history as front ends do: every turn after the first reads only its new
    tokens from the stored conversation, the history grows far past the model's 256 positions and the window, and
    the cache stays at sinks + window tokens."""
    messages, read = [], []
    for turn in range(50):
        messages.append({"role": "user", "content": f"Turn {turn}: what comes next?"})
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        read.append(reply.usage.prompt_tokens - reply.usage.prompt_tokens_details.cached_tokens)
    assert reply.usage.prompt_tokens > 4 * 256
    # A turn adds about 20 tokens (the answer as text, the template's markers, the new question); the answer's
    # tokens as resent may differ from those generated, and the cache takes back that tail.
    assert max(read[1:]) <= 30, read
    health = get(server[0] + "/health")
    assert health["idle_conversations"] >= 1
    # Each idle conversation's cache holds at most sinks + window tokens, plus the chunk it read last (evicted at
    # its next step): keys + values x 2 KV heads x head_dim 16 x float32 per token and layer, 2 layers.
    per_conversation = (4 + WINDOW + WINDOW) * (2 * 2 * 16 * 4) * 2
    assert health["conversation_cache_bytes"] <= health["idle_conversations"] * per_conversation


def test_eight_concurrent_streams_all_finish(client):
    results: dict[int, str] = {}

    def talk(index: int) -> None:
        stream = client.chat.completions.create(
            model=MODEL,
            stream=True,
            max_tokens=8,
            temperature=0,
            messages=[{"role": "user", "content": f"client {index}"}],
        )
        results[index] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == list(range(8))
    # Greedy answers do not depend on what else ran in the same rounds.
    alone = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "client 3"}]
    )
    assert results[3] == alone.choices[0].message.content


def test_a_client_that_leaves_mid_stream_frees_its_slot(server, client):
    stream = client.chat.completions.create(
        model=MODEL,
        stream=True,
        max_tokens=4000,
        temperature=0,
        messages=[{"role": "user", "content": "a long answer please"}],
    )
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while get(server[0] + "/health")["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert get(server[0] + "/health")["active_requests"] == 0


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_slot(server):
    impatient = openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4000, temperature=0)
    deadline = time.monotonic() + 20
    while get(server[0] + "/health")["active_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert get(server[0] + "/health")["active_requests"] == 0


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        (
            json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "does not exist",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}).encode(),
            400,
            "max_tokens",
        ),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "role"),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode(),
            400,
            "temperature",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}).encode(),
            400,
            "stop",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 100_000}]}).encode(),
            413,
            "larger",
        ),
        (json.dumps([1, 2, 3]).encode(), 400, ""),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}).encode(),
            400,
            "seed",
        ),
        (
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1}
            ).encode(),
            400,
            "seed",
        ),
        (
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}
            ).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode(),
            400,
            "lone surrogate",
        ),
        (
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]}).encode(),
            400,
            "lone surrogate",
        ),
    ],
)
def test_bad_requests_get_openai_style_errors_and_the_server_lives_on(server, client, body, status, fragment):
    code, payload = post(server[0] + "/v1/chat/completions", body)
    assert code == status
    assert fragment in payload["error"]["message"]
    assert payload["error"]["type"]
    assert client.models.list().data[0].id == MODEL  # still serving


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)


def test_a_cushion_model_keeps_its_prefix_in_a_bounded_cache():
    from leanlm.cache.prefix import Cushion, attach_cushion
    from leanlm.methods.streaming import sink_cache

    model = tiny_model("llama")
    keys = [torch.randn(1, 2, 3, 16) for _ in range(2)]
    attach_cushion(model, Cushion([1, 2, 3], keys, [k.clone() for k in keys]))
    cache = sink_cache(model, StreamingConfig(sinks=2, window=8))
    with torch.inference_mode():
        for _ in range(5):
            model(input_ids=torch.randint(0, 128, (1, 6)), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 3 + 2 + 8
    assert torch.equal(cache.layers[0].keys[:, :, :3], keys[0])  # the cushion is never evicted
    assert cache_bytes(cache) > 0


def test_a_busy_port_is_one_line_before_the_model_loads(capsys):
    from leanlm.cli.main import main

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        started = time.monotonic()
        code = main(["serve", "smollm2-135m", "--port", str(port)])
    assert code == 2 and time.monotonic() - started < 5
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_the_leanlm_serve_command_answers_and_stops_cleanly(tiny_llama_dir, stop):
    """The command itself, as a process: it answers, and Ctrl-C (SIGINT) or SIGTERM stops it without a traceback."""
    import os
    import signal
    import subprocess

    port = free_port()
    process = leanlm_process(
        "serve",
        str(tiny_llama_dir),
        "--port",
        str(port),
        "--window",
        "48",
        "--max-tokens",
        "4",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                assert get(f"http://127.0.0.1:{port}/health")["status"] == "ok"
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        answer = client.completions.create(
            model=str(tiny_llama_dir), prompt="Once upon a time", max_tokens=4, temperature=0
        )
        assert answer.usage.completion_tokens == 4
        process.send_signal(getattr(signal, stop))
        assert process.wait(timeout=30) in (0, 130, -signal.SIGTERM)
        output = process.stdout.read().decode()
        assert "Traceback" not in output
        # a line per request, without its text
        assert "127.0.0.1 POST /v1/completions 200" in output and "Once upon" not in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    "extra, status, fragment",
    [
        ({"frobnicate": 1}, 400, "frobnicate: not a field this server knows"),
        ({"top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, 400, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
            400,
            "cannot be enforced",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"logit_bias": {"999999999": 5}}, 400, "logit_bias"),
        ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"frequency_penalty": 3}, 400, "frequency_penalty"),
        ({"logprobs": False, "tools": [], "user": "u-1", "response_format": {"type": "text"}, "n": 1}, 200, ""),
    ],
)
def test_fields_are_honoured_or_refused_by_name(server, extra, status, fragment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    code, payload = post(server[0] + "/v1/chat/completions", json.dumps(body).encode())
    assert code == status
    assert fragment in (payload["error"]["message"] if code != 200 else "")


def test_logprobs_of_each_token_whole_and_streamed(client):
    asked = {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    whole = client.chat.completions.create(**asked, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(**asked, logprobs=True, top_logprobs=3, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert client.chat.completions.create(**asked).choices[0].logprobs is None

    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == completion.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def _lm_eval_scores(response: dict, context_lengths: list[int]) -> list[tuple[float, bool]]:
    """What lm-evaluation-harness's local-completions model reads from an echo response (its parse_logprobs): the
    continuation's summed logprobs (the prompt's tokens after the context, the generated one left out) and whether
    each was the most likely."""
    scores = []
    for choice, context in zip(sorted(response["choices"], key=lambda c: c["index"]), context_lengths, strict=True):
        logprobs = choice["logprobs"]["token_logprobs"][context:-1]
        tops = choice["logprobs"]["top_logprobs"][context:-1]
        scores.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))))
    return scores


def test_lm_evaluation_harness_scores_through_echo_equal_leanlms_own(server, smollm2_tokenizer):
    """lm-eval's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1, as `local-completions` sends it)
    gives the scores leanlm's own evaluator gives the same model."""
    from leanlm.evaluation.loglikelihood import Request, encode_pair, score_requests

    pairs = [Request("The capital of France is", " Paris"), Request("Two plus two is", " four, of course")]
    encoded = [encode_pair(smollm2_tokenizer, pair) for pair in pairs]
    body = {
        "model": MODEL,
        "prompt": [context + continuation for context, continuation in encoded],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    code, response = post(server[0] + "/v1/completions", json.dumps(body).encode())
    assert code == 200
    served = _lm_eval_scores(response, [len(context) for context, _ in encoded])
    own = score_requests(server[1].state.engine.model, smollm2_tokenizer, pairs)
    for (loglikelihood, greedy), score in zip(served, own, strict=True):
        assert loglikelihood == pytest.approx(score.loglikelihood, abs=1e-4) and greedy == score.is_greedy
    text = response["choices"][0]["text"]
    assert (
        text.startswith("The capital of France is Paris")
        and response["choices"][0]["logprobs"]["token_logprobs"][0] is None
    )

    scored_only = {**body, "prompt": "The capital of France is Paris", "max_tokens": 0}
    code, response = post(server[0] + "/v1/completions", json.dumps(scored_only).encode())
    assert code == 200 and response["choices"][0]["text"] == "The capital of France is Paris"
    assert response["usage"]["completion_tokens"] == 0
    code, response = post(server[0] + "/v1/completions", json.dumps({**scored_only, "echo": False}).encode())
    assert code == 400 and "max_tokens" in response["error"]["message"]
    streamed = list(
        openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0).completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=2, echo=True, logprobs=1, stream=True
        )
    )
    assert streamed[0].choices[0].text == "The capital of France is"


def test_logit_bias_and_penalties_steer_the_answer(client, smollm2_tokenizer):
    token = smollm2_tokenizer.encode(" the")[0]
    biased = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == " the" * 4
    penalised = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=4,
        temperature=0,
        logit_bias={str(token): 5},
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    assert penalised.choices[0].text.count(" the") < 4


@pytest.mark.parametrize(
    "sampling", [{"temperature": 1e-40}, {"top_p": 1e-300}, {"temperature": 5e-324, "top_p": 1e-300}]
)
def test_tiny_but_valid_temperature_and_top_p_answer(client, sampling):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **sampling
    )
    greedy = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert answer.choices[0].message.content == greedy.choices[0].message.content


def test_a_request_http_cannot_parse_gets_the_apis_json_error(server):
    import socket
    from urllib.parse import urlparse

    address = urlparse(server[0])
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n{}")
        reply = b""
        while chunk := connection.recv(65536):
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["error"]["message"].startswith("malformed HTTP request")
    assert get(server[0] + "/health")["status"] == "ok"


def test_a_chunked_body_is_bounded_like_one_with_a_length(server):
    import http.client
    from urllib.parse import urlparse

    address = urlparse(server[0])
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    chunk = b"x" * (64 << 10)
    connection.request(
        "POST",
        "/v1/completions",
        body=iter([b'{"model": "tiny-llama", "prompt": "', *[chunk] * 48, b'"}']),
        headers={"Content-Type": "application/json"},
        encode_chunked=True,
    )
    response = connection.getresponse()
    assert response.status == 413 and "larger than" in json.loads(response.read())["error"]["message"]
    connection.close()
    assert get(server[0] + "/health")["status"] == "ok"


def test_a_stream_nobody_reads_loses_its_slot(smollm2_tokenizer):
    """A client that stops reading a stream (the server's sends block, as they do once the socket's buffers are
    full) holds its request only until the stall timeout: the request ends long before its max_tokens."""
    import asyncio

    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer), seed=1)
    settings = ServeSettings(
        streaming=StreamingConfig(sinks=4, window=WINDOW), max_tokens_limit=100_000, stall_seconds=1, max_batch=2
    )
    app = build_app(model, smollm2_tokenizer, MODEL, settings)
    requests = []
    submit = app.state.engine.submit
    app.state.engine.submit = lambda request: (requests.append(request), submit(request))[1]
    body = json.dumps({"model": MODEL, "prompt": "once upon", "stream": True, "max_tokens": 100_000}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }

    async def scenario():
        never = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await never.wait()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                await never.wait()  # the client reads nothing

        task = asyncio.create_task(app(scope, receive, send))
        started = time.monotonic()
        while not requests or app.state.engine.active:
            assert time.monotonic() - started < 30, "the unread stream kept its slot"
            await asyncio.sleep(0.1)
        task.cancel()
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 10
    assert len(requests[0].generated) < 100_000


def test_a_slow_first_token_is_not_a_stall(smollm2_tokenizer):
    """The stall timeout counts only time a chunk waits for its client: a stream whose first token takes longer
    (a long prompt's prefill, a request waiting for a slot) is answered in full."""
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer), seed=1)
    settings = ServeSettings(streaming=StreamingConfig(sinks=4, window=WINDOW), max_tokens=4, stall_seconds=1)
    app = build_app(model, smollm2_tokenizer, MODEL, settings)
    submit = app.state.engine.submit
    app.state.engine.submit = lambda request: threading.Timer(2.5, submit, (request,)).start()
    with running(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)
        chunks = list(client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, stream=True))
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_an_api_key_is_required_where_one_is_set(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer), seed=1)
    settings = ServeSettings(streaming=StreamingConfig(sinks=4, window=WINDOW), max_tokens=4, api_key="sesame")
    app = build_app(model, smollm2_tokenizer, MODEL, settings)
    with running(app) as base:
        assert get(base + "/health")["status"] == "ok"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0, timeout=30).models.list()
        with pytest.raises(urllib.error.HTTPError) as missing:
            get(base + "/v1/models")
        assert missing.value.code == 401 and "API key" in json.loads(missing.value.read())["error"]["message"]
        keyed = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0, timeout=30)
        assert keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


text = st.text(max_size=20) | st.sampled_from(["\ud800", "<|im_start|>system\n", "", "x" * 300])
number = (
    st.integers(-5, 64)
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e-40, 1e-300, 5e-324])
)
value = st.none() | st.booleans() | number | text | st.lists(text, max_size=5)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]), "content": text | value}
)
request_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, "other"])},
    optional={
        "messages": st.lists(message, max_size=3) | value,
        "prompt": text | value,
        "max_tokens": number,
        "max_completion_tokens": number,
        "temperature": number,
        "top_p": number,
        "seed": number,
        "stop": value,
        "stream": st.booleans() | value,
        "n": number,
    },
)


@pytest.mark.timeout(600)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=request_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_no_request_of_the_schema_breaks_the_server(server, body, path):
    """Any request built from the API's fields, with values of any type and range: a 200 answer or a 4xx
    OpenAI-style error, and the server answers the next request."""
    request = urllib.request.Request(
        server[0] + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    if status == 200:
        assert raw.startswith(b"data: ") or "choices" in json.loads(raw)
    else:
        assert 400 <= status < 500 and json.loads(raw)["error"]["message"], (status, raw[:200])
    assert get(server[0] + "/health")["status"] == "ok"


def test_metrics_count_requests_tokens_and_latency(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        with urllib.request.urlopen(server[0] + "/metrics", timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            return {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(response.read().decode())
                for sample in family.samples
            }

    before = scrape()
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    post(server[0] + "/v1/chat/completions", b"{not json")
    after = scrape()

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("leanlm_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert grew("leanlm_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert grew("leanlm_generated_tokens_total") == reply.usage.completion_tokens
    assert grew("leanlm_prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew("leanlm_time_to_first_token_seconds_count") == 1
    assert after[("leanlm_active_requests", ())] == 0 and ("leanlm_conversation_cache_bytes", ()) in after


def test_embeddings_are_the_mean_last_hidden_state(server, client, smollm2_tokenizer):
    texts = ["hello there", "a second, longer text to embed"]
    response = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    model = server[1].state.engine.model
    assert [item.index for item in response.data] == [0, 1]
    for text, item in zip(texts, response.data, strict=True):
        ids = torch.tensor([smollm2_tokenizer.encode(text)])
        with torch.no_grad():
            expected = model(ids, output_hidden_states=True).hidden_states[-1][0].mean(0)
        assert len(item.embedding) == model.config.hidden_size
        torch.testing.assert_close(torch.tensor(item.embedding), expected, rtol=1e-4, atol=1e-5)
    as_floats = post(
        server[0] + "/v1/embeddings",
        json.dumps({"model": MODEL, "input": texts[0], "encoding_format": "float"}).encode(),
    )
    assert as_floats[0] == 200 and as_floats[1]["data"][0]["embedding"] == pytest.approx(response.data[0].embedding)
    for body, fragment in (
        ({"input": "hi", "dimensions": 3}, "dimensions"),
        ({"input": "word " * 200}, "at most"),
        ({"input": []}, "input"),
        ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ):
        code, payload = post(server[0] + "/v1/embeddings", json.dumps({"model": MODEL, **body}).encode())
        assert code == 400 and fragment in payload["error"]["message"]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "ok", "kind"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_always_parse_and_validate(client, temperature):
    """A random model, which left alone writes no JSON, answers in the schema's shape: constrained decoding
    (llguidance) masks every token the schema does not allow next."""
    asked = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a pet."}],
        "max_tokens": 80,
        "temperature": temperature,
        "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    }
    answer = client.chat.completions.create(**asked)
    assert answer.choices[0].finish_reason == "stop"
    value = json.loads(answer.choices[0].message.content)
    assert set(value) == {"name", "ok", "kind"} and isinstance(value["ok"], bool) and value["kind"] in ("cat", "dog")
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**asked, stream=True)
        if chunk.choices
    )
    assert streamed == answer.choices[0].message.content
    free = client.chat.completions.create(**{**asked, "response_format": {"type": "text"}})
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_n_choices_each_their_own_draw(client):
    asked = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "seed": 5, "n": 3}
    first = client.chat.completions.create(**asked, temperature=1.0)
    again = client.chat.completions.create(**asked, temperature=1.0)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]  # seeded
    assert len({c.message.content for c in first.choices}) > 1  # each choice draws with its own seed
    greedy = client.chat.completions.create(**asked, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1
    for extra in ({"n": 9}, {"n": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**{**asked, **extra})


def _adapter(model_dir, out, seed: int, rank: int):
    """A LoRA adapter over `model_dir`'s NF4 base with seeded, non-zero updates, saved as `leanlm finetune` does."""
    from leanlm.methods import LoRAConfig, add_lora_, load_any, save_adapters

    loaded, config = load_any(model_dir), LoRAConfig(base="nf4-dq", rank=rank, dropout=0.0)
    add_lora_(loaded.model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in loaded.model.modules():
            if hasattr(module, "lora_B"):
                module.lora_B.weight.normal_(0, 0.5)
    return save_adapters(loaded.model, config, out, str(model_dir))


def test_several_adapters_answer_each_under_its_name(tiny_llama_dir, tmp_path, capsys):
    """`--adapter` twice: each request runs the adapter its `model` names (the model's own name the first), alone
    or batched beside the other, with the answer the adapter gives when served alone; conversations are kept per
    adapter; an unknown name is 404; adapters over different bases are one line before the model loads."""
    from leanlm.errors import ConfigError
    from leanlm.methods import LoRAConfig, add_lora_, load_any, save_adapters
    from leanlm.nn.lora import adapter_rows

    first, second = _adapter(tiny_llama_dir, tmp_path / "first", 1, 4), _adapter(tiny_llama_dir, tmp_path / "two", 2, 2)
    both = load_any(tiny_llama_dir, adapter=[f"one={first}", str(second)])
    assert both.adapters == ("one", "two")
    ids = torch.tensor([[5, 17, 99, 250, 42, 7]] * 2)
    with torch.no_grad():
        alone = [load_any(tiny_llama_dir, adapter=directory).model(ids[:1]).logits for directory in (first, second)]
        with adapter_rows([1, 0]):
            mixed = both.model(ids).logits
    torch.testing.assert_close(mixed[1:], alone[0])
    torch.testing.assert_close(mixed[:1], alone[1])
    assert not torch.allclose(alone[0], alone[1], atol=1e-3)

    settings = ServeSettings(streaming=StreamingConfig(sinks=4, window=WINDOW), max_batch=8, max_tokens=8)
    tokenizer = both.tokenizer

    def answers(app, names, together: bool):
        with running(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            listed = [model.id for model in client.models.list().data]

            def ask(name):
                return client.completions.create(model=name, prompt="Once upon a time", max_tokens=8, temperature=0)

            if together:
                with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
                    replies = list(pool.map(ask, names))
            else:
                replies = [ask(name) for name in names]
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                ask("three")
        assert [reply.model for reply in replies] == list(names)
        return listed, [reply.choices[0].text for reply in replies]

    expected = []
    for directory in (first, second):
        single = load_any(tiny_llama_dir, adapter=directory)
        expected += answers(build_app(single.model, tokenizer, MODEL, settings), [MODEL], False)[1]
    assert expected[0] != expected[1]
    app = build_app(both.model, tokenizer, MODEL, settings, adapters=both.adapters)
    assert app.state.engine.fused is None  # LoRA layers decode through transformers' forward
    listed, texts = answers(app, [MODEL, "one", "two", "two", "one"], False)  # the cache of one is never two's
    assert listed == [MODEL, "one", "two"] and texts == [
        expected[0],
        expected[0],
        expected[1],
        expected[1],
        expected[0],
    ]
    assert answers(app, ["two", "one", "two", MODEL], True)[1] == [expected[1], expected[0], expected[1], expected[0]]

    loaded = load_any(tiny_llama_dir)
    add_lora_(loaded.model, LoRAConfig(base="float", rank=2))
    save_adapters(loaded.model, LoRAConfig(base="float", rank=2), tmp_path / "float", str(tiny_llama_dir))
    with pytest.raises(ConfigError, match="trained over a float base.*share their base"):
        load_any(tiny_llama_dir, adapter=[str(first), str(tmp_path / "float")])
    with pytest.raises(ConfigError, match="share a name"):
        load_any(tiny_llama_dir, adapter=[str(first), f"first={second}"])
    from leanlm.cli.main import main

    assert main(["eval", str(tiny_llama_dir), "--adapter", str(first), "--adapter", str(second)]) == 2
    assert "eval takes one --adapter (2 given); serve takes several" in capsys.readouterr().err
