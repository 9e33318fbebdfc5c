"""`GET /metrics`: the server's counters in Prometheus's text format (prometheus-client), one registry per app.

Requests by endpoint and status; prompt, cached and generated tokens; time to first token and seconds per output
token after it (histograms); and, read when scraped, the requests being generated, those waiting for a slot and
the bytes of idle conversations' caches.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("leanlm_requests", "HTTP requests answered", ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("leanlm_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.cached_tokens = Counter(
            "leanlm_cached_prompt_tokens", "prompt tokens a stored conversation had already read", registry=registry
        )
        self.generated_tokens = Counter("leanlm_generated_tokens", "tokens generated", registry=registry)
        self.first_token = Histogram(
            "leanlm_time_to_first_token_seconds",
            "from a request's arrival to its first text",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.per_token = Histogram(
            "leanlm_seconds_per_output_token",
            "a request's time after its first text, over the tokens that followed",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        Gauge("leanlm_active_requests", "requests being generated", registry=registry).set_function(
            lambda: engine.active
        )
        Gauge("leanlm_waiting_requests", "requests waiting for a slot", registry=registry).set_function(
            lambda: engine.waiting
        )
        Gauge("leanlm_conversation_cache_bytes", "bytes of idle conversations' caches", registry=registry).set_function(
            lambda: engine.conversations.bytes()
        )

    def finished(self, usage, arrived: float, first_text: float | None, done: float) -> None:
        """Count a finished request: its usage, and its latencies (times from time.monotonic())."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        if first_text is not None:
            self.first_token.observe(first_text - arrived)
            if usage.completion_tokens > 1:
                self.per_token.observe((done - first_text) / (usage.completion_tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)
