"""Streaming evaluation (Xiao's thesis Figs 4.1/4.3, Tables 4.1/4.2/4.6, Fig 4.8): perplexity, latency and memory of a
model reading one long text under four attention strategies.

* dense       a growing KV cache; run until the text reaches the model's trained context (beyond it RoPE models
              meet positions they were never trained on), and reported as stopped there.
* window      a rolling cache of the last L = sinks + window tokens (a sink cache with no sinks).
* recompute   sliding window with re-computation: each target token gets a fresh forward over the L tokens
              before it at positions 0..L-1. O(T L^2): the quality oracle, scored on `recompute_tokens`
              targets only (batched, since the windows are independent).
* streaming   StreamingLLM: the `sinks` first tokens + the last `window` tokens, positions in the cache.

Cache strategies are fed `chunk` tokens per forward (1 is Xiao's thesis' token-by-token protocol). With a chunk of
c a token attends to the cache plus the up to c - 1 chunk tokens before it, so its window is between
L and L + c - 1 tokens: a stated, small superset that makes 100K-token streams affordable on
a CPU. Latency is always measured token by token.

Perplexity = exp(mean NLL) over every predicted token (the first token is never scored).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

from leanlm import data
from leanlm.bench.harness import peak_memory
from leanlm.errors import ConfigError
from leanlm.evaluation.tokens import bos_prefix, encode
from leanlm.methods.streaming import StreamingConfig, sink_cache
from leanlm.nn.softmax_one import SOFTMAX_ONE
from leanlm.report import save_figure
from leanlm.settings import option

STRATEGIES = ("dense", "window", "recompute", "streaming")


@dataclass(frozen=True)
class StreamSettings:
    sinks: int = option(4, "StreamingLLM's attention sinks (initial tokens kept)")
    window: int = option(
        1020, "recent tokens StreamingLLM keeps; window attention and re-computation get sinks + window tokens"
    )
    max_tokens: int = option(100_000, "stream length: WikiText-2 test then LAMBADA test text")
    chunk: int = option(32, "tokens per forward for the cache strategies; 1 = token by token")
    recompute_tokens: int = option(64, "targets scored by sliding window with re-computation (O(T L^2))")
    latency_steps: int = option(2048, "single-token decode steps timed for the latency curve")
    strategies: tuple[str, ...] = option(STRATEGIES, "run only this setting (repeatable)", flag="--setting")

    def __post_init__(self):
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ConfigError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
        for name in ("window", "max_tokens", "chunk", "recompute_tokens", "latency_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.sinks < 0:
            raise ConfigError(f"sinks must be 0 or more, got {self.sinks}")

    @property
    def cache_size(self) -> int:
        """Tokens every cached strategy holds, and the re-computation window L."""
        return self.sinks + self.window

    def streaming_config(self, with_sinks: bool = True) -> StreamingConfig:
        """StreamingLLM's cache, or (without sinks) window attention's cache of the same size."""
        if with_sinks:
            return StreamingConfig(sinks=self.sinks, window=self.window)
        return StreamingConfig(sinks=0, window=self.cache_size)


def long_text_tokens(tokenizer, max_tokens: int) -> list[int]:
    """The WikiText-2 test set followed by the LAMBADA test passages: about 400K SmolLM2 tokens in all."""
    tokens = bos_prefix(tokenizer) + encode(tokenizer, data.wikitext2_test_text())
    if len(tokens) < max_tokens:
        tokens += encode(tokenizer, "\n\n" + data.plain_text("lambada-test"))
    if len(tokens) < max_tokens:
        raise ConfigError(f"the shipped texts have {len(tokens)} tokens, fewer than max_tokens {max_tokens}")
    return tokens[:max_tokens]


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


def cached_nll(model, tokens: torch.Tensor, cache, chunk: int, desc: str) -> torch.Tensor:
    """NLL of tokens[1:] reading `tokens` (1-D) through `cache`, `chunk` tokens per forward."""
    nll = torch.empty(tokens.numel() - 1)
    with torch.inference_mode():
        for start in tqdm(range(0, tokens.numel() - 1, chunk), desc=desc, unit="chunk", leave=False):
            end = min(start + chunk, tokens.numel() - 1)
            logits = model(input_ids=tokens[None, start:end], past_key_values=cache, use_cache=True).logits[0]
            nll[start:end] = _token_nll(logits, tokens[start + 1 : end + 1])
    return nll


def recompute_nll(model, tokens: torch.Tensor, window: int, targets: range, batch: int = 4) -> torch.Tensor:
    """NLL of each target token t from a fresh forward over tokens[t - window : t] (positions 0..window-1)."""
    if targets.start < window:
        raise ConfigError(f"re-computation targets must start at or after the window ({window})")
    nll = []
    with torch.inference_mode():
        for first in tqdm(range(0, len(targets), batch), desc="recompute", unit="batch", leave=False):
            chosen = targets[first : first + batch]
            windows = torch.stack([tokens[t - window : t] for t in chosen])
            logits = model(input_ids=windows, use_cache=False, logits_to_keep=1).logits[:, -1]
            nll.append(_token_nll(logits, tokens[list(chosen)]))
    return torch.cat(nll)


def decode_latency(model, tokens: torch.Tensor, cache, steps: int, samples: int = 32) -> list[list[float]]:
    """Single-token forwards through `cache` for `steps` tokens of the stream: [position, mean ms per token over
    the last segment, KV cache bytes] at `samples` evenly spaced positions."""
    every = max(1, steps // samples)
    curve = []
    with torch.inference_mode():
        started = time.perf_counter()
        for step in range(min(steps, tokens.numel())):
            model(input_ids=tokens[None, step : step + 1], past_key_values=cache, use_cache=True)
            if step % every == every - 1:
                now = time.perf_counter()
                curve.append([step + 1, 1000 * (now - started) / every, cache_bytes(cache)])
                started = time.perf_counter()
    return curve


def recompute_latency(model, tokens: torch.Tensor, window: int, repeats: int = 3) -> float:
    """ms per generated token of sliding window with re-computation: one forward over `window` tokens."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids=tokens[None, :window], use_cache=False, logits_to_keep=1)
            times.append(1000 * (time.perf_counter() - started))
    return sorted(times)[len(times) // 2]


def cache_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )


def windowed_perplexity(nll: torch.Tensor, width: int = 1024) -> list[float]:
    """exp(mean NLL) over consecutive windows of `width` predicted tokens: the curve of Figs 4.1/4.3."""
    return [math.exp(chunk.mean().item()) for chunk in nll.split(width) if chunk.numel()]


def stream_evaluate(model, tokenizer, settings: StreamSettings) -> dict:
    """Every strategy in `settings` on one long text: {"settings": {strategy: results}, "config", ...}."""
    trained = getattr(model.config, "max_position_embeddings", None)
    if trained is not None and settings.cache_size >= trained:
        raise ConfigError(
            f"the cache (sinks + window = {settings.cache_size}) must stay below the trained context ({trained})"
        )
    tokens = torch.tensor(long_text_tokens(tokenizer, settings.max_tokens))
    targets = range(2 * settings.cache_size, 2 * settings.cache_size + settings.recompute_tokens)
    if targets.stop > tokens.numel():
        raise ConfigError(
            f"max_tokens {settings.max_tokens} is too short for the re-computation targets "
            f"({targets.start}..{targets.stop})"
        )
    results: dict = {
        "config": asdict(settings),
        "trained_context": trained,
        "recompute_targets": [targets.start, targets.stop],
        "settings": {},
    }
    nll_by_strategy = {}
    for strategy in settings.strategies:
        started = time.perf_counter()
        with peak_memory() as memory:
            entry = _run_strategy(model, tokens, strategy, settings, targets, trained)
        nll = entry.pop("nll")
        nll_by_strategy[strategy] = nll
        entry.update(
            perplexity=math.exp(nll.mean().item()),
            tokens=int(nll.numel()),
            peak_memory_bytes=memory.peak_bytes,
            added_memory_bytes=memory.added_bytes,
            seconds=time.perf_counter() - started,
            windowed_perplexity=windowed_perplexity(nll),
        )
        results["settings"][strategy] = entry
    # Every strategy on the re-computation baseline's targets: the like-for-like comparison.
    for strategy, nll in nll_by_strategy.items():
        chosen = nll if strategy == "recompute" else _slice_targets(nll, targets)
        if chosen is not None:
            results["settings"][strategy]["perplexity_on_recompute_targets"] = math.exp(chosen.mean().item())
    return results


def _slice_targets(nll: torch.Tensor, targets: range) -> torch.Tensor | None:
    # nll[i] is the NLL of token i + 1
    return nll[targets.start - 1 : targets.stop - 1] if nll.numel() >= targets.stop - 1 else None


def _dense_length(tokens: torch.Tensor, trained: int | None) -> int:
    return tokens.numel() if trained is None else min(tokens.numel(), trained)


def _make_cache(model, strategy: str, settings: StreamSettings):
    if strategy == "dense":
        return DynamicCache(config=model.config)
    return sink_cache(model, settings.streaming_config(with_sinks=strategy == "streaming"))


def strategy_latency(model, tokens: torch.Tensor, strategy: str, settings: StreamSettings, trained) -> dict:
    """Per-token decode latency of one strategy: {"ms_per_token" (steady state: the median over the second half
    of the curve), "latency_curve" ([position, ms, KV bytes] ...)}; re-computation has one forward per token."""
    if strategy == "recompute":
        return {"ms_per_token": recompute_latency(model, tokens, settings.cache_size), "latency_curve": []}
    steps = (
        min(settings.latency_steps, _dense_length(tokens, trained)) if strategy == "dense" else settings.latency_steps
    )
    curve = decode_latency(model, tokens, _make_cache(model, strategy, settings), steps)
    steady = sorted(ms for _, ms, _ in curve[len(curve) // 2 :]) or [float("nan")]
    return {"ms_per_token": steady[len(steady) // 2], "latency_curve": curve}


def _run_strategy(model, tokens, strategy: str, settings: StreamSettings, targets: range, trained) -> dict:
    if strategy == "recompute":
        entry = {
            "nll": recompute_nll(model, tokens, settings.cache_size, targets),
            "scored": "re-computation targets only",
            "cache_bytes": 0,
        }
    else:
        length = _dense_length(tokens, trained) if strategy == "dense" else tokens.numel()
        cache = _make_cache(model, strategy, settings)
        entry = {
            "nll": cached_nll(model, tokens[:length], cache, settings.chunk, strategy),
            "cache_bytes": cache_bytes(cache),
        }
        if strategy == "dense":
            entry["stopped"] = (
                f"stopped at the trained context ({trained} tokens) of a {tokens.numel()}-token stream"
                if length < tokens.numel()
                else "whole stream"
            )
        else:
            entry.update(sinks=cache.sinks, window=cache.window)
    entry.update(strategy_latency(model, tokens, strategy, settings, trained))
    return entry


def attention_sink_mass(model, tokenizer, texts: list[str], length: int = 16) -> list[float]:
    """Per layer: the average attention probability that queries 1..length-1 put on the first token, over
    `texts` cut to `length` tokens (Xiao's thesis Fig 1.4's probe, on probabilities rather than logits)."""
    previous = model.config._attn_implementation
    if previous != SOFTMAX_ONE:  # SoftMax-off-by-one returns its weights; plain softmax needs eager to return them
        model.config._attn_implementation = "eager"
    sums, count = None, 0
    try:
        with torch.inference_mode():
            for text in texts:
                ids = (bos_prefix(tokenizer) + encode(tokenizer, text))[:length]
                if len(ids) < length:
                    continue
                attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
                mass = torch.stack([a[0, :, 1:, 0].mean() for a in attentions])
                sums = mass if sums is None else sums + mass
                count += 1
    finally:
        model.config._attn_implementation = previous
    if not count:
        raise ConfigError(f"no text has {length} tokens")
    return (sums / count).tolist()


def plot_stream(results: dict, path, title: str) -> None:
    """Windowed perplexity, per-token decode latency and KV-cache-bound memory along the stream, per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (quality, latency, memory) = plt.subplots(1, 3, figsize=(18, 4.5))
    for strategy in STRATEGIES:
        entry = results["settings"].get(strategy)
        if not entry:
            continue
        curve = entry["windowed_perplexity"]
        if strategy != "recompute":
            quality.plot([1024 * (i + 1) for i in range(len(curve))], curve, label=strategy, linewidth=1)
            if entry["latency_curve"]:
                positions, ms, kv_bytes = zip(*entry["latency_curve"])
                latency.plot(positions, ms, label=strategy)
                memory.plot(positions, [b / 2**20 for b in kv_bytes], label=strategy)
        else:
            start, stop = results["recompute_targets"]
            quality.scatter(
                [stop],
                [entry["perplexity"]],
                marker="*",
                s=120,
                color="black",
                label=f"recompute (tokens {start}-{stop})",
                zorder=3,
            )
            latency.axhline(
                entry["ms_per_token"],
                color="black",
                linestyle="--",
                label=f"recompute ({entry['ms_per_token']:.0f} ms)",
            )
    trained = results.get("trained_context")
    if trained:
        quality.axvline(trained, color="gray", linestyle=":", label=f"trained context {trained}")
    quality.set_yscale("log")
    quality.set_xlabel("tokens into the stream")
    quality.set_ylabel("perplexity per 1024-token window")
    quality.legend(fontsize=8)
    latency.set_yscale("log")
    latency.set_xlabel("tokens into the stream (decoded one at a time)")
    latency.set_ylabel("ms per token (mean over each segment)")
    latency.legend(fontsize=8)
    memory.set_xlabel("tokens into the stream (decoded one at a time)")
    memory.set_ylabel("KV cache MiB")
    memory.legend(fontsize=8)
    save_figure(fig, path, title)
