"""OpenAI's HTTP API over the engine: `/v1/chat/completions` and `/v1/completions` (streamed as server-sent events,
or whole), `/v1/models`, `/health`. Every bad request is an OpenAI-style JSON error with a 4xx status; nothing a
client sends reaches the engine unchecked.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from leanlm.evaluation.tokens import bos_prefix, encode
from leanlm.serve.engine import Engine, Sampling, asyncio_emitter
from leanlm.serve.engine import Request as EngineRequest
from leanlm.settings import SEEDS


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


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class Sampled(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=SEEDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)

    def sampling(self, default_max_tokens: int) -> Sampling:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not stop for stop in stops):
            raise ApiError(400, "stop takes up to 4 non-empty strings", "stop")
        return Sampling(self.max_tokens or default_max_tokens, self.temperature, self.top_p, tuple(stops), self.seed)


class ChatCompletionRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(Sampled):
    prompt: str


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(where) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid')}", param


def create_app(
    engine: Engine, model_name: str, *, default_max_tokens: int = 256, max_body_bytes: int = 1 << 20
) -> FastAPI:
    """The FastAPI application serving `engine` as the model `model_name`."""
    app = FastAPI(title="leanlm", docs_url=None, redoc_url=None)
    created = int(time.time())
    tokenizer = engine.tokenizer

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return error_response(413, f"the request body is larger than {max_body_bytes} bytes")
        return await call_next(request)

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

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "leanlm"}],
        }

    def check_model(body: Sampled) -> None:
        if body.model != model_name:
            raise ApiError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        check_model(body)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, f"{model_name} has no chat template; use /v1/completions", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        prompt = encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        return await _complete(body, prompt, http, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body)
        prompt = bos_prefix(tokenizer) + encode(tokenizer, body.prompt)
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        return await _complete(body, prompt, http, chat=False)

    async def _complete(body: Sampled, prompt: list[int], http: Request, *, chat: bool):
        sampling = body.sampling(default_max_tokens)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        request = EngineRequest(prompt, sampling, asyncio_emitter(loop, events))
        engine.submit(request)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _stream(request, events, ident, kind, chat, include_usage), media_type="text/event-stream"
            )
        pieces = []
        try:
            while True:
                event = await events.get()
                if event[0] == "text":
                    pieces.append(event[1])
                elif event[0] == "error":
                    raise ApiError(500, event[1], kind="server_error")
                else:
                    _, finish, usage = event
                    break
        finally:
            request.cancel()  # a client gone before the answer frees its slot (no-op once finished)
        text = "".join(pieces)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        )
        return {
            "id": ident,
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice],
            "usage": usage.as_dict(),
        }

    async def _stream(
        request: EngineRequest, events: asyncio.Queue, ident: str, kind: str, chat: bool, include_usage: bool
    ):
        created_at = int(time.time())

        def chunk(delta: dict | str | None, finish: str | None, usage=None) -> str:
            if chat:
                choices = [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if usage is None else []
            else:
                choices = (
                    [{"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}]
                    if usage is None
                    else []
                )
            payload = {
                "id": ident,
                "object": f"{kind}.chunk" if chat else kind,
                "created": created_at,
                "model": model_name,
                "choices": choices,
            }
            if usage is not None:
                payload["usage"] = usage.as_dict()
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while True:
                event = await events.get()
                if event[0] == "text":
                    yield chunk({"content": event[1]} if chat else event[1], None)
                elif event[0] == "error":
                    yield f"data: {json.dumps({'error': {'message': event[1], 'type': 'server_error'}})}\n\n"
                    break
                else:
                    _, finish, usage = event
                    yield chunk(None, finish)
                    if include_usage:
                        yield chunk(None, None, usage)
                    break
            yield "data: [DONE]\n\n"
        finally:
            request.cancel()  # the client went away (or the stream ended): the engine drops the request at once

    return app
