"""Settings and start-up of `leanlm serve`: load the model, build the engine and the app, run uvicorn."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
from dataclasses import dataclass

from leanlm.errors import ConfigError
from leanlm.methods.streaming import StreamingConfig
from leanlm.models.loading import INTERACTIVE_LOADING, LoadSettings
from leanlm.settings import option

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    host: str = option(
        "127.0.0.1", "address to listen on (loopback by default; anything else is reachable from other machines)"
    )
    port: int = option(8000, "TCP port")
    streaming: StreamingConfig = option(StreamingConfig(sinks=4, window=2000), "each conversation's cache", cli=False)
    max_batch: int = option(8, "requests generated at once; more wait in order")
    max_tokens: int = option(256, "tokens an answer takes when a request sets no max_tokens")
    max_tokens_limit: int = option(4096, "the most tokens a request may ask for (max_tokens); more is refused (400)")
    cache_budget_mb: int = option(
        1024, "MiB of idle conversations' caches kept for their next turn (least recently used dropped first)"
    )
    max_body_kb: int = option(1024, "largest request body accepted, KiB, however it is sent")
    exact_reuse: bool = option(
        True,
        "continue a stored conversation only where that computes what a fresh read would (whole prompt chunks, "
        "inside the window): an answer never depends on what the store held",
        off="continue stored conversations from any shared token, past the window too (faster for long chats; "
        "an answer may then differ from a fresh read's)",
    )
    log_requests: bool = option(
        True,
        "a line per request on stderr: client, method, endpoint, status, seconds (never a prompt or an answer)",
        off="no request lines",
    )
    stall_seconds: int = option(
        30, "a streaming client that reads nothing for this long loses its request (its slot is freed)"
    )
    api_key: str | None = option(
        None,
        "a key every request must carry (Authorization: Bearer KEY; /health excepted); default: the "
        "LEANLM_API_KEY environment variable, else none",
        none_word="none",
    )
    fused: bool = option(
        True,
        "generate through leanlm's fused C++ decode step where the model allows it (else through transformers' "
        "forward, the requests batched)",
        flag="--no-fused",
        off="generate through transformers' forward, the requests batched",
    )

    def __post_init__(self):
        for name in (
            "port",
            "max_batch",
            "max_tokens",
            "max_tokens_limit",
            "cache_budget_mb",
            "max_body_kb",
            "stall_seconds",
        ):
            if getattr(self, name) < (0 if name == "cache_budget_mb" else 1):
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.port > 65535:
            raise ConfigError(f"port must be at most 65535, got {self.port}")
        if self.max_tokens > self.max_tokens_limit:
            raise ConfigError(
                f"max_tokens ({self.max_tokens}) must be at most max_tokens_limit ({self.max_tokens_limit})"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key must not be empty")

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def build_app(
    model,
    tokenizer,
    model_name: str,
    settings: ServeSettings = ServeSettings(),
    *,
    engine_thread: bool = True,
    adapters: tuple[str, ...] = (),
):
    """The app serving `model` (any model leanlm loads; `adapters`: the names of its LoRA adapters, each served
    under its name), with its engine (`app.state.engine`), which runs in a thread of its own, or, with
    `engine_thread=False`, in the thread that calls its `run`."""
    from leanlm.serve.api import create_app
    from leanlm.serve.engine import Engine

    engine = Engine(
        model,
        tokenizer,
        settings.streaming,
        max_batch=settings.max_batch,
        cache_budget_bytes=settings.cache_budget_mb << 20,
        fused=settings.fused,
        thread=engine_thread,
        exact_reuse=settings.exact_reuse,
    )
    app = create_app(
        engine,
        model_name,
        default_max_tokens=settings.max_tokens,
        max_tokens_limit=settings.max_tokens_limit,
        max_body_bytes=settings.max_body_kb << 10,
        stall_seconds=settings.stall_seconds,
        api_key=settings.api_key if settings.api_key is not None else os.environ.get("LEANLM_API_KEY") or None,
        adapters=adapters,
    )
    app.state.engine = engine
    return app


def _check_address(host: str, port: int) -> None:
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise ConfigError(
            f"cannot listen on {host}:{port}: {error.strerror or error}; choose another --port or --host"
        ) from None


def serve(
    model_name: str, settings: ServeSettings = ServeSettings(), loading: LoadSettings = INTERACTIVE_LOADING
) -> None:
    """Load `model_name` (computing in `loading.dtype`) and serve it until interrupted."""
    import uvicorn

    from leanlm.decoding import fused_decoder_problem
    from leanlm.methods import load_any

    _check_address(settings.host, settings.port)  # before the model loads, which takes a while
    if not settings.loopback and settings.api_key is None and not os.environ.get("LEANLM_API_KEY"):
        log.warning(
            "listening on %s: the API has no authentication and anyone who can reach this address can use it",
            settings.host,
        )
    loaded = load_any(model_name, loading.dtype, loading.head, loading.adapter, loading.keep_freed_memory)
    if settings.log_requests:
        logging.getLogger("leanlm.serve.api").setLevel(logging.INFO)
    app = build_app(loaded.model, loaded.tokenizer, model_name, settings, engine_thread=False, adapters=loaded.adapters)
    decoder = "transformers' forward"
    if app.state.engine.fused is not None:
        decoder = "leanlm's fused decode step"
    elif settings.fused:  # wanted but not possible: say why
        decoder += f" ({fused_decoder_problem(loaded.model, settings.streaming)})"
    # The engine runs here, in the thread that loaded the model (see Engine), and the HTTP server beside it; so
    # uvicorn installs no signal handlers: Ctrl-C reaches this thread as KeyboardInterrupt, and SIGTERM is made one.
    server = uvicorn.Server(uvicorn_config(app, settings.host, settings.port, "warning"))
    http = threading.Thread(target=server.run, name="leanlm-http", daemon=True)
    signal.signal(signal.SIGTERM, _interrupt)
    http.start()
    names = ", ".join(dict.fromkeys((model_name, *loaded.adapters)))  # the model's name also runs the first adapter
    print(
        f"serving {names} ({loaded.dtype}, tokens through {decoder}) on http://{settings.host}:"
        f"{settings.port}/v1 (OpenAI API; cache per conversation: {settings.streaming.sinks} sinks + "
        f"{settings.streaming.window} recent tokens); Ctrl-C stops",
        flush=True,
    )
    try:
        app.state.engine.run(until=lambda: not http.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
    if not server.started:
        raise ConfigError(f"the HTTP server on {settings.host}:{settings.port} did not start (its error is above)")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def uvicorn_config(app, host: str, port: int, log_level: str):
    """uvicorn serving `app` over HTTP/1.1 (h11), with a request it cannot even parse (a Content-Length that is
    not a number, a malformed request line) answered by the API's JSON error rather than uvicorn's plain text."""
    import json

    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from leanlm.serve.api import error_body

    class JsonErrors(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(f"malformed HTTP request: {msg}")).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=JsonErrors)
