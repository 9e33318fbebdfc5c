"""Tool calls: OpenAI's tools go through the model's own chat template, calls are read back from what the model
writes (Qwen 2.5's <tool_call> blocks, Llama 3.x's JSON), and a required call is enforced by a grammar."""

import json

import openai
import pytest
from tiny import tiny_model

from leanlm.methods.streaming import StreamingConfig
from leanlm.models import REGISTRY
from leanlm.models.registry import is_installed
from leanlm.serve import ServeSettings, build_app
from leanlm.serve.tools import read_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "metric": {"type": "boolean"}},
            "required": ["city", "metric"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_calls_are_read_in_both_written_forms():
    content, calls = read_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    content, calls = read_calls('{"name": "get_time", "parameters": {}}')
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert read_calls("No call here {not json}") == ("No call here {not json}", [])


def test_a_template_without_tools_refuses_them(smollm2_tokenizer):
    from fastapi.testclient import TestClient

    app = build_app(
        tiny_model("llama", vocab_size=len(smollm2_tokenizer)),
        smollm2_tokenizer,
        "m",
        ServeSettings(streaming=StreamingConfig(sinks=4, window=48)),
    )
    response = TestClient(app).post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
    )
    assert response.status_code == 400 and "no place for tools" in response.json()["error"]["message"]


QWEN = "qwen2.5-coder-1.5b"


@pytest.fixture(scope="module")
def qwen_client():
    """A tiny random Qwen2 with Qwen2.5-Coder's tokenizer and its tool-calling chat template."""
    import threading
    import time

    import uvicorn

    from leanlm.models import load_tokenizer

    model = REGISTRY[QWEN]
    if not is_installed(model):
        pytest.skip(f"not installed: {model.pip_install}")
    tokenizer = load_tokenizer(QWEN)
    app = build_app(
        tiny_model("qwen2", vocab_size=len(tokenizer), seed=2),
        tokenizer,
        "qwen",
        ServeSettings(streaming=StreamingConfig(sinks=4, window=120), max_tokens=60),
    )
    from test_server import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_call_is_made_whole_and_streamed(qwen_client, choice):
    asked = {
        "model": "qwen",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": choice,
        "temperature": 0,
    }
    answer = qwen_client.chat.completions.create(**asked)
    assert answer.choices[0].finish_reason == "tool_calls"
    call = answer.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "metric"} and isinstance(arguments["metric"], bool)
    chunks = list(qwen_client.chat.completions.create(**asked, stream=True))
    streamed = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert len(streamed) == 1 and streamed[0].function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(streamed[0].function.arguments), dict)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result go back through the template for the next turn
    follow_up = {
        **asked,
        "tool_choice": "auto",
        "max_tokens": 8,
        "messages": [
            *asked["messages"],
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 4}'},
        ],
    }
    assert qwen_client.chat.completions.create(**follow_up).choices[0].finish_reason in ("stop", "length", "tool_calls")
