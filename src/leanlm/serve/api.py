"""OpenAI's HTTP API over the engine: `/v1/chat/completions` and `/v1/completions` (streamed as server-sent events,
or whole), `/v1/models`, `/health`. Every bad request is an OpenAI-style JSON error with a 4xx status; nothing a
client sends reaches the engine unchecked.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from leanlm.chat import chat_prompt_ids
from leanlm.errors import ConfigError, first_line
from leanlm.evaluation.tokens import bos_prefix, encode
from leanlm.serve.engine import Engine, Sampling, asyncio_emitter
from leanlm.serve.engine import Request as EngineRequest
from leanlm.serve.tools import read_calls, template_tags_calls, template_takes_tools
from leanlm.settings import SEEDS

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(
    message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(error_body(message, param, code, kind), status)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return plain(
            self.content if isinstance(self.content, str) else "".join(part.text for part in self.content), "messages"
        )

    def for_template(self) -> dict:
        """The message as chat templates read it (a developer message is a system one; a call's arguments an
        object, not the JSON text OpenAI's clients send)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                function = call.get("function") if isinstance(call, dict) else None
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                    calls.append(
                        {"type": "function", "function": {"name": str(function["name"]), "arguments": arguments}}
                    )
                except (AttributeError, KeyError, TypeError, ValueError):
                    raise ApiError(
                        400, "messages: a tool call is {'function': {'name', 'arguments': JSON text}}", "messages"
                    ) from None
            message["tool_calls"] = calls
        return message


def plain(text: str, param: str) -> str:
    """`text`, refused unless it is Unicode text (JSON can carry lone surrogates, which no tokenizer reads)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(
            400, f"{param}: holds {text[error.start]!r}, a lone surrogate, which is not Unicode text", param
        ) from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# Fields a request may carry without leanlm acting on them: at these values they ask for nothing; any other value,
# and any field not listed, is refused by name rather than dropped in silence.
NEUTRAL = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
}
IGNORED = ("user", "metadata", "store", "service_tier")  # bookkeeping that changes no answer


def refuse_unsupported(extra: dict | None, neutral: dict) -> None:
    """Refuse by name every field of `extra` (what a request carried beyond the model's fields) that is neither
    IGNORED nor at a value of `neutral` that asks for nothing."""
    for name, value in (extra or {}).items():
        if name in IGNORED:
            continue
        if name not in neutral:
            raise ApiError(400, f"{name}: not a field this server knows", name)
        if value not in neutral[name]:
            raise ApiError(400, f"{name}: {value!r} is not supported by this server", name)


MAX_CHOICES = 8  # n: choices one request may ask for


class Sampled(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=SEEDS)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    response_format: dict | None = None

    def grammar(self, tokenizer=None) -> str | None:
        """llguidance's grammar for `response_format` (json_object: any JSON object; json_schema: its schema), or
        None for free text; a schema llguidance cannot compile is refused here, before any work."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format: json_schema needs {'schema': {...}}", "response_format")
        else:
            raise ApiError(
                400, f"response_format: type {kind!r} is not text, json_object or json_schema", "response_format"
            )
        import llguidance

        try:
            # Compact JSON: free whitespace lets a model pad without end instead of answering.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            problem = llguidance.LLMatcher.validate_grammar(grammar)
        except Exception as error:  # llguidance raises ValueError and its own types for what it cannot read
            problem = first_line(error)
        if problem:
            raise ApiError(400, f"response_format: the schema cannot be enforced: {problem}", "response_format")
        return grammar

    def refuse_unsupported(self) -> None:
        refuse_unsupported(self.model_extra, NEUTRAL)

    def wanted_logprobs(self) -> int | None:
        """None, or how many alternatives to report beside each token's log-probability."""
        return None

    def sampling(self, default_max_tokens: int, max_tokens_limit: int, vocabulary: int, tokenizer=None) -> Sampling:
        self.refuse_unsupported()
        stops = [plain(stop, "stop") for stop in ([self.stop] if isinstance(self.stop, str) else self.stop or [])]
        if len(stops) > 4 or any(not stop for stop in stops):
            raise ApiError(400, "stop takes up to 4 non-empty strings", "stop")
        if self.max_tokens == 0 and not getattr(self, "echo", False):
            raise ApiError(400, "max_tokens: 0 generates nothing; it is for scoring a prompt with echo", "max_tokens")
        if self.max_tokens is not None and self.max_tokens > max_tokens_limit:
            raise ApiError(400, f"max_tokens: at most {max_tokens_limit} on this server", "max_tokens")
        bias = []
        for token, value in (self.logit_bias or {}).items():
            if not token.isdigit() or int(token) >= vocabulary or not -100 <= value <= 100:
                raise ApiError(
                    400,
                    f"logit_bias: {token!r}: {value} (token ids below {vocabulary}, biases -100 to 100)",
                    "logit_bias",
                )
            bias.append((int(token), float(value)))
        return Sampling(
            default_max_tokens if self.max_tokens is None else self.max_tokens,
            self.temperature,
            self.top_p,
            tuple(stops),
            self.seed,
            self.frequency_penalty,
            self.presence_penalty,
            tuple(bias),
            self.wanted_logprobs(),
            getattr(self, "echo", False),
            self.grammar(tokenizer),
        )


class ChatCompletionRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = Field(None, max_length=128)
    tool_choice: str | dict | None = None

    def tool_list(self) -> list[dict]:
        """The tools the model may call (none with tool_choice "none"), checked: functions with a name and, if
        given, a JSON-schema object of parameters."""
        if not self.tools or self.tool_choice == "none":
            return []
        for tool in self.tools:
            function = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("parameters", {}), dict)
            ):
                raise ApiError(400, "tools: each is {'type': 'function', 'function': {'name', 'parameters'}}", "tools")
        return self.tools

    def required_calls(self) -> list[str] | None:
        """The functions one of which the answer must call (tool_choice "required" or a named one), or None."""
        names = [tool["function"]["name"] for tool in self.tool_list()]
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        if choice == "required":
            return names
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in names:
            raise ApiError(400, f"tool_choice: {choice!r} names no function of tools", "tool_choice")
        return [name]

    def grammar(self, tokenizer=None) -> str | None:
        required = self.required_calls()
        if required is None:
            return super().grammar(tokenizer)
        if self.response_format is not None:
            raise ApiError(400, "response_format: not together with a required tool call", "response_format")
        from leanlm.serve.tools import call_grammar

        return call_grammar(tokenizer, self.tool_list(), required)

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


MAX_PROMPTS = 32  # prompts one completions request may batch


class CompletionRequest(Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_ids(self, tokenizer, vocabulary: int) -> list[list[int]]:
        """Each prompt as token ids (see `token_ids`)."""
        ids = token_ids(self.prompt, "prompt", tokenizer, vocabulary)
        if self.stream and len(ids) > 1:
            raise ApiError(400, "stream: one prompt at a time", "stream")
        return ids


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    def refuse_unsupported(self) -> None:
        refuse_unsupported(self.model_extra, {})


def token_ids(value, param: str, tokenizer, vocabulary: int) -> list[list[int]]:
    """One text or token-id list, or a list of up to MAX_PROMPTS of them, as token ids: text is tokenized (after
    the BOS the model expects), token ids are taken as they are (lm-evaluation-harness sends them)."""
    prompts = [value] if isinstance(value, str) or _is_ids(value) else value
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"{param}: 1 to {MAX_PROMPTS} prompts", param)
    ids = []
    for prompt in prompts:
        tokens = prompt if _is_ids(prompt) else bos_prefix(tokenizer) + encode(tokenizer, plain(prompt, param))
        if not tokens:
            raise ApiError(400, f"{param}: empty", param)
        if not all(0 <= token < vocabulary for token in tokens):
            raise ApiError(400, f"{param}: token ids are 0 to {vocabulary - 1}", param)
        ids.append(tokens)
    return ids


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(token, int) for token in prompt)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(where) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid')}", param


def create_app(
    engine: Engine,
    model_name: str,
    *,
    default_max_tokens: int = 256,
    max_tokens_limit: int = 4096,
    max_body_bytes: int = 1 << 20,
    stall_seconds: float = 30.0,
    api_key: str | None = None,
    adapters: tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI application serving `engine` as the model `model_name`, and as each of `adapters`, the names of
    the model's LoRA adapters in their order (the first is also the model's own name). A request may ask for at most
    `max_tokens_limit` tokens; its body is at most `max_body_bytes` however it is sent; a streaming client that
    reads nothing for `stall_seconds` loses its request; with `api_key`, every route but /health needs it as a
    bearer token."""
    from leanlm.serve.metrics import CONTENT_TYPE, Metrics

    app = FastAPI(title="leanlm", docs_url=None, redoc_url=None)
    metrics = Metrics(engine)
    app.add_middleware(_Gate, max_body_bytes=max_body_bytes, api_key=api_key, metrics=metrics)
    created = int(time.time())
    tokenizer = engine.tokenizer
    vocabulary = engine.model.config.vocab_size
    served = {model_name: 0}
    for index, name in enumerate(adapters):
        if served.setdefault(name, index) != index:
            raise ConfigError(f"the adapter name {name!r} is the model's own: name it with NAME=DIR")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(ApiError)
    async def refused(request: Request, error: ApiError):
        return error_response(error.status, error.message, error.param, error.code, error.kind)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception):
        return error_response(500, f"internal error: {error}", kind="server_error")

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": model_name,
            "active_requests": engine.active,
            "idle_conversations": len(engine.conversations),
            "conversation_cache_bytes": engine.conversations.bytes(),
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "leanlm"} for name in served],
        }

    def check_model(body: Sampled | EmbeddingRequest) -> int:
        """The adapter the request's model name selects."""
        if body.model not in served:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                "model",
                "model_not_found",
            )
        return served[body.model]

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        adapter = check_model(body)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, f"{model_name} has no chat template; use /v1/completions", "messages")
        messages = [message.for_template() for message in body.messages]
        tools = body.tool_list()
        if tools and not template_takes_tools(tokenizer):
            raise ApiError(400, f"tools: {model_name}'s chat template has no place for tools", "tools")
        if body.required_calls() is not None and not template_tags_calls(tokenizer):
            raise ApiError(
                400, f"tool_choice: a required call needs a <tool_call> template; {model_name}'s is not", "tool_choice"
            )
        try:
            prompt = chat_prompt_ids(tokenizer, messages, tools or None)
        except (ConfigError, TemplateError) as error:
            raise ApiError(400, f"the model's chat template refuses these messages: {error}", "messages") from None
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        return await _complete(body, [prompt], http, chat=True, tools=bool(tools), adapter=adapter)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        adapter = check_model(body)
        body.refuse_unsupported()
        hidden = engine.model.config.hidden_size
        if body.dimensions not in (None, hidden):
            raise ApiError(400, f"dimensions: this model's embeddings have {hidden}", "dimensions")
        prompts = token_ids(body.input, "input", tokenizer, vocabulary)
        window = engine.streaming.window
        if any(len(ids) > window for ids in prompts):
            raise ApiError(400, f"input: at most {window} tokens (the server's --window)", "input")
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def reply(result, error):
            loop.call_soon_threadsafe(
                lambda: done.done() or (done.set_exception(error) if error else done.set_result(result))
            )

        engine.call(lambda: engine.embed(prompts, adapter), reply)
        try:
            vectors = await done
        except Exception as error:
            raise ApiError(500, f"embedding failed: {error}", kind="server_error") from None
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": vector
                if body.encoding_format == "float"
                else base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode(),
            }
            for index, vector in enumerate(vectors)
        ]
        tokens = sum(len(ids) for ids in prompts)
        return {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        adapter = check_model(body)
        return await _complete(body, body.prompt_ids(tokenizer, vocabulary), http, chat=False, adapter=adapter)

    async def _complete(
        body: Sampled, prompts: list[list[int]], http: Request, *, chat: bool, tools: bool = False, adapter: int = 0
    ):
        sampling = body.sampling(default_max_tokens, max_tokens_limit, vocabulary, tokenizer)
        arrived = time.monotonic()
        loop = asyncio.get_running_loop()
        if body.n > 1 and body.stream:
            raise ApiError(400, "n: streams carry one choice; ask for n > 1 without stream", "n")
        prompts = [prompt for prompt in prompts for _ in range(body.n)]  # n choices of each prompt, in order
        seeds = [None if sampling.seed is None else sampling.seed + index % body.n for index in range(len(prompts))]
        queues = [asyncio.Queue() for _ in prompts]
        requests = [
            EngineRequest(prompt, replace(sampling, seed=seed), asyncio_emitter(loop, events), adapter)
            for prompt, seed, events in zip(prompts, seeds, queues, strict=True)
        ]
        for request in requests:
            engine.submit(request)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _stream(requests[0], queues[0], ident, kind, chat, include_usage, arrived, body.model, tools),
                media_type="text/event-stream",
            )
        watchers = [asyncio.create_task(_call_when(http.is_disconnected, request.cancel)) for request in requests]
        try:
            answers = await asyncio.gather(*(_answer(events, arrived) for events in queues))
        finally:
            for watcher, request in zip(watchers, requests, strict=True):
                watcher.cancel()
                request.cancel()  # a client gone before the answer frees its slot (no-op once finished)
        choices = []
        for index, (prompt, (text, logprobs, prompt_logprobs, finish, _)) in enumerate(
            zip(prompts, answers, strict=True)
        ):
            if chat:
                reported = _logprobs(logprobs, True, sampling.logprobs is not None)
                message = {"role": "assistant", "content": text}
                if tools:
                    message["content"], calls = read_calls(text)
                    if calls:
                        message["tool_calls"], finish = calls, "tool_calls"
                choices.append({"index": index, "message": message, "logprobs": reported, "finish_reason": finish})
                continue
            if sampling.echo:
                text = tokenizer.decode(prompt) + text
                logprobs = prompt_logprobs + logprobs
                tokens = prompt + [entry.token for entry in logprobs[len(prompt) :]]
            else:
                tokens = [entry.token for entry in logprobs]
            reported = _logprobs(logprobs, False, sampling.logprobs is not None, tokens)
            choices.append({"index": index, "text": text, "finish_reason": finish, "logprobs": reported})
        usage = answers[0][4]
        for answer in answers[1:]:
            usage = usage.plus(answer[4])
        return {
            "id": ident,
            "object": kind,
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": usage.as_dict(),
        }

    async def _answer(events: asyncio.Queue, arrived: float):
        """(text, generated tokens' logprobs, the prompt's (with echo), finish reason, usage) of one request."""
        pieces, logprobs, prompt_logprobs, first_text = [], [], [], None
        while True:
            event = await events.get()
            if event[0] == "text":
                first_text = first_text or time.monotonic()
                pieces.append(event[1])
                logprobs += event[2]
            elif event[0] == "prompt":
                prompt_logprobs = event[1]
            elif event[0] == "error":
                raise ApiError(500, event[1], kind="server_error")
            else:
                metrics.finished(event[2], arrived, first_text, time.monotonic())
                return "".join(pieces), logprobs, prompt_logprobs, event[1], event[2]

    def _logprobs(entries: list, chat: bool, wanted: bool, tokens: list[int] | None = None) -> dict | None:
        """OpenAI's logprobs object of a choice (or a chunk): chat's `content` list, or completions' parallel lists
        (`tokens`: the tokens, where an echoed prompt's first has no entry: None)."""
        if not wanted:
            return None
        tokens = [entry.token for entry in entries] if tokens is None else tokens
        text = [tokenizer.decode([token]) for token in tokens]
        if chat:
            return {
                "content": [
                    {
                        "token": piece,
                        "logprob": entry.logprob,
                        "bytes": list(piece.encode("utf-8", errors="replace")),
                        "top_logprobs": [
                            {
                                "token": tokenizer.decode([token]),
                                "logprob": logprob,
                                "bytes": list(tokenizer.decode([token]).encode("utf-8", errors="replace")),
                            }
                            for token, logprob in entry.top
                        ],
                    }
                    for piece, entry in zip(text, entries, strict=True)
                ]
            }
        offsets = [sum(len(piece) for piece in text[:index]) for index in range(len(text))]
        return {
            "tokens": text,
            "token_logprobs": [None if entry is None else entry.logprob for entry in entries],
            "top_logprobs": [
                None if entry is None else {tokenizer.decode([t]): lp for t, lp in entry.top} for entry in entries
            ],
            "text_offset": offsets,
        }

    async def _stream(
        request: EngineRequest,
        events: asyncio.Queue,
        ident: str,
        kind: str,
        chat: bool,
        include_usage: bool,
        arrived: float,
        name: str,
        tools: bool = False,
    ):
        created_at = int(time.time())

        wanted = request.sampling.logprobs is not None

        def chunk(delta: dict | str | None, finish: str | None, usage=None, logprobs=(), tokens=None) -> str:
            reported = _logprobs(list(logprobs), chat, wanted, tokens)
            if chat:
                choices = (
                    [{"index": 0, "delta": delta or {}, "logprobs": reported, "finish_reason": finish}]
                    if usage is None
                    else []
                )
            else:
                choices = (
                    [{"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": reported}]
                    if usage is None
                    else []
                )
            payload = {
                "id": ident,
                "object": f"{kind}.chunk" if chat else kind,
                "created": created_at,
                "model": name,
                "choices": choices,
            }
            if usage is not None:
                payload["usage"] = usage.as_dict()
            return f"data: {json.dumps(payload)}\n\n"

        async def pieces():
            first_text, held = None, []
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while True:
                event = await events.get()
                if event[0] == "text":
                    first_text = first_text or time.monotonic()
                    if tools:  # whether the answer is a call is known at its end
                        held.append(event[1])
                        continue
                    yield chunk({"content": event[1]} if chat else event[1], None, logprobs=event[2])
                elif event[0] == "prompt":  # echo: the prompt comes back first, with its tokens' logprobs
                    yield chunk(tokenizer.decode(request.prompt), None, logprobs=event[1], tokens=request.prompt)
                elif event[0] == "error":
                    yield f"data: {json.dumps({'error': {'message': event[1], 'type': 'server_error'}})}\n\n"
                    break
                else:
                    _, finish, usage = event
                    metrics.finished(usage, arrived, first_text, time.monotonic())
                    if tools:
                        content, calls = read_calls("".join(held))
                        if content:
                            yield chunk({"content": content}, None)
                        if calls:
                            deltas = [{"index": index, **call} for index, call in enumerate(calls)]
                            yield chunk({"tool_calls": deltas}, None)
                            finish = "tool_calls"
                    yield chunk(None, finish)
                    if include_usage:
                        yield chunk(None, None, usage)
                    break
            yield "data: [DONE]\n\n"

        # A stall is time spent waiting for the client to take a chunk, never time spent computing the next one
        # (a long prompt's prefill sends nothing for as long as it takes).
        waiting = [None]  # since when the chunk being sent has waited for the client

        async def stalled() -> bool:
            await asyncio.sleep(1.0)
            return waiting[0] is not None and time.monotonic() - waiting[0] > stall_seconds

        def drop() -> None:
            request.cancel()
            events.put_nowait(("error", f"the client read nothing for {stall_seconds:g} s: its request was dropped"))

        watcher = asyncio.create_task(_call_when(stalled, drop))
        try:
            async for piece in pieces():
                waiting[0] = time.monotonic()
                yield piece
                waiting[0] = None
        finally:
            watcher.cancel()
            request.cancel()  # the client went away (or the stream ended): the engine drops the request at once

    return app


async def _call_when(happened, action) -> None:
    """Call `action()` once `happened()` (awaited over and over: it paces itself) says so."""
    while not await happened():
        await asyncio.sleep(0.25)
    action()


_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics")


class _Gate:
    """ASGI middleware in front of every route: the API key (where one is set) and the body's size, counted as it
    arrives (a chunked body has no Content-Length to check), before any route reads it."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None, metrics):
        self.app, self.max_body_bytes, self.api_key, self.metrics = app, max_body_bytes, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
        started, status = time.monotonic(), [None]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                self.metrics.requests.labels(endpoint, str(status[0])).inc()
            await send(message)

        try:
            return await self._gate(scope, receive, counted)
        finally:  # what was asked and how it went; never what a prompt or an answer said
            client = (scope.get("client") or ("-",))[0]
            log.info("%s %s %s %s %.2f s", client, scope["method"], endpoint, status[0], time.monotonic() - started)

    async def _gate(self, scope, receive, send):
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if self.api_key is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get("authorization", ""), f"Bearer {self.api_key}"):
                return await _send(
                    send,
                    error_response(
                        401, "a valid API key is needed (Authorization: Bearer KEY)", code="invalid_api_key"
                    ),
                )
        too_large = error_response(413, f"the request body is larger than {self.max_body_bytes} bytes")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await _send(send, too_large)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _send(send, too_large)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        return await self.app(scope, replay, send)


async def _send(send, response: JSONResponse) -> None:
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
