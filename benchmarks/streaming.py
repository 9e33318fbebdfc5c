"""StreamingLLM on one model, everything of thesis chapter 4 that fits a CPU, in one run:

* the four strategies on a long stream (Figs 4.1/4.3; `leanlm stream`'s measurement): perplexity, per-token
  decode latency and memory, and the speed-up of StreamingLLM over sliding window with re-computation (Fig 4.8);
* Table 4.2: number of attention sinks 0/1/2/4/8 at a fixed cache;
* Table 4.6: cache sizes 256/512/1024/2048 with 4 sinks;
* the attention-sink evidence: average attention probability on the first token, per layer (Fig 1.4's probe).

Writes benchmarks/results/streaming_<model>.json + .png (and stream_<model>.png: the stream curves).

    python benchmarks/streaming.py                                  # 100K-token stream, 20K-token ablations
    python benchmarks/streaming.py --max-tokens 20000 --ablation-tokens 4096   # a quick look
"""

from __future__ import annotations

import argparse
import json
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leanlm import data  # noqa: E402
from leanlm.bench import results_dir, write_results  # noqa: E402
from leanlm.evaluation.streaming import (  # noqa: E402
    StreamSettings,
    attention_sink_mass,
    cached_nll,
    long_text_tokens,
    plot_stream,
    strategy_latency,
    stream_evaluate,
)
from leanlm.methods.streaming import StreamingConfig, sink_cache  # noqa: E402
from leanlm.models import DEFAULT_MODEL, load_model  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

SINKS = (0, 1, 2, 4, 8)
PARTS = ("probe", "stream", "latency", "sinks", "sizes")  # latency: re-time the stream's strategies only
CACHE_SIZES = (256, 512, 1024, 2048)


def ablation(model, tokens: torch.Tensor, configs: dict[str, StreamingConfig], chunk: int) -> dict:
    out = {}
    for name, config in configs.items():
        nll = cached_nll(model, tokens, sink_cache(model, config), chunk, name)
        out[name] = {"sinks": config.sinks, "window": config.window, "perplexity": float(nll.mean().exp())}
        print(f"{name}: {out[name]['perplexity']:.3f}", flush=True)
    return out


def plot_ablations(payload: dict, title: str):
    def draw(path):
        fig, (sinks, sizes, mass) = plt.subplots(1, 3, figsize=(15, 4.2))
        rows = payload.get("sinks_ablation", {})
        if rows:
            sinks.bar(list(rows), [r["perplexity"] for r in rows.values()], color="tab:blue")
            sinks.set_yscale("log")
            sinks.set_ylabel("perplexity")
            cache = payload["settings"]["sinks"] + payload["settings"]["window"]
            sinks.set_title(f"attention sinks (cache {cache})", fontsize=9)
        rows = payload.get("cache_size_ablation", {})
        if rows:
            sizes.plot(list(rows), [r["perplexity"] for r in rows.values()], marker="o")
            sizes.set_ylabel("perplexity")
            sizes.set_title("cache size (4 sinks)", fontsize=9)
        if payload.get("first_token_attention"):
            values = payload["first_token_attention"]
            mass.bar(range(len(values)), values, color="tab:red")
            mass.set_xlabel("layer")
            mass.set_ylabel("mean attention probability on token 0")
            mass.set_ylim(0, 1)
            mass.set_title(f"attention sink ({payload['sink_probe']})", fontsize=9)
        save_figure(fig, path, title)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020, help="recent tokens; the cache is sinks + window")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--recompute-tokens", type=int, default=64)
    parser.add_argument("--latency-steps", type=int, default=2048)
    parser.add_argument("--ablation-tokens", type=int, default=20_000)
    parser.add_argument("--probe-texts", type=int, default=256)
    parser.add_argument("--probe-length", type=int, default=16)
    parser.add_argument("--only", nargs="*", choices=PARTS, default=list(PARTS),
                        help="run only these parts; the others keep their results from the previous run")
    args = parser.parse_args()
    torch.set_num_threads(2)

    started = time.perf_counter()
    loaded = load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    settings = StreamSettings(sinks=args.sinks, window=args.window, max_tokens=args.max_tokens, chunk=args.chunk,
                              recompute_tokens=args.recompute_tokens, latency_steps=args.latency_steps)
    name = args.model.replace("/", "_")
    note = f" ({loaded.weights_note})" if loaded.weights_note else ""
    title = f"{args.model}{note}: StreamingLLM"
    payload: dict = {"model": args.model, "weights_note": loaded.weights_note, "settings": vars(args)}
    previous_path = results_dir() / f"streaming_{name}.json"
    if previous_path.exists():
        previous = json.loads(previous_path.read_text())
        payload.update({key: value for key, value in previous.items() if key not in ("settings", "environment")})

    def save():
        payload["seconds"] = time.perf_counter() - started
        write_results(f"streaming_{name}", payload, plot_ablations(payload, title))

    if "probe" in args.only:
        texts = [t for t in data.lambada_test_texts()][: args.probe_texts]
        payload["sink_probe"] = f"{len(texts)} LAMBADA passages x {args.probe_length} tokens"
        payload["first_token_attention"] = attention_sink_mass(model, tokenizer, texts, args.probe_length)
        save()

    trained = getattr(model.config, "max_position_embeddings", None)
    if "stream" in args.only:
        payload["stream"] = stream_evaluate(model, tokenizer, settings)
    elif "latency" in args.only:
        stream_tokens = torch.tensor(long_text_tokens(tokenizer, args.max_tokens))
        for strategy, entry in payload["stream"]["settings"].items():
            entry.update(strategy_latency(model, stream_tokens, strategy, settings, trained))
    stream = payload["stream"]["settings"]
    stream["streaming"]["speedup_vs_recompute"] = stream["recompute"]["ms_per_token"] / stream["streaming"]["ms_per_token"]
    plot_stream(payload["stream"], results_dir() / f"stream_{name}.png",
                f"{args.model}{note}: {args.max_tokens}-token stream, cache {settings.cache_size}, chunk {args.chunk}")
    save()

    tokens = torch.tensor(long_text_tokens(tokenizer, args.ablation_tokens))
    cache = settings.cache_size
    if "sinks" in args.only:
        payload["sinks_ablation"] = ablation(model, tokens, {
            f"{s}+{cache - s}": StreamingConfig(sinks=s, window=cache - s) for s in SINKS}, args.chunk)
        save()
    if "sizes" in args.only:
        sizes = [c for c in CACHE_SIZES if trained is None or c < trained]
        payload["cache_size_ablation"] = ablation(model, tokens, {
            f"4+{c - 4}": StreamingConfig(sinks=4, window=c - 4) for c in sizes}, args.chunk)
        save()

    rows = [[s, stream[s]["perplexity"], stream[s]["tokens"], stream[s].get("perplexity_on_recompute_targets"),
             stream[s]["ms_per_token"], stream[s]["peak_memory_bytes"] / 2**20] for s in settings.strategies]
    print(format_table(["strategy", "perplexity", "tokens", "ppl on re-computation targets", "ms/token", "peak MiB"],
                       rows, markdown=True))
    print(f"StreamingLLM vs re-computation: {stream['streaming']['speedup_vs_recompute']:.1f}x per token")
    print(f"wrote {results_dir() / f'streaming_{name}.json'} in {payload['seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
