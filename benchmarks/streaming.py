"""StreamingLLM on one model, everything of Xiao's thesis chapter 4 that fits a CPU, in one run:

* the four strategies on a long stream (Figs 4.1/4.3; `leanlm stream`'s measurement): perplexity, per-token
  decode latency and memory, and the speed-up of StreamingLLM over sliding window with re-computation (Fig 4.8);
* Table 4.2: number of attention sinks 0/1/2/4/8 at a fixed cache;
* Table 4.6: cache sizes 256/512/1024/2048 with 4 sinks;
* the attention-sink evidence: average attention probability on the first token, per layer (Fig 1.4's probe).

Writes benchmarks/results/streaming_<model>.json + .png (and stream_<model>.png: the stream curves).

    python benchmarks/streaming.py                                  # 100K-token stream, 20K-token ablations
    python benchmarks/streaming.py --max-tokens 20000 --ablation-tokens 4096   # a quick look
    python benchmarks/streaming.py --only latency --latency-steps 1536        # re-time the strategies alone
    python benchmarks/streaming.py --report                                   # the saved tables
"""

from __future__ import annotations

import argparse
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leanlm import data  # noqa: E402
from leanlm.bench import Study, print_report, results_dir, study_arguments, titled  # noqa: E402
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
from leanlm.report import format_table, save_figure  # noqa: E402

SINKS = (0, 1, 2, 4, 8)
CACHE_SIZES = (256, 512, 1024, 2048)


def plot_ablations(payload: dict, path) -> None:
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
    save_figure(fig, path, titled(payload, "StreamingLLM"))


STRATEGY_LABELS = {
    "dense": "dense",
    "window": "window ({cache})",
    "recompute": "sliding window + re-computation (L = {cache})",
    "streaming": "StreamingLLM ({sinks} + {window})",
}


def report(payload: dict) -> str:
    """The four strategies on the long stream, then Tables 4.2 and 4.6, as the README shows them."""
    out, settings = [], payload["settings"]
    if "stream" in payload:
        stream, (start, stop) = payload["stream"]["settings"], payload["stream"]["recompute_targets"]
        cache = settings["sinks"] + settings["window"]
        rows = []
        for name, entry in stream.items():
            label = STRATEGY_LABELS[name].format(cache=cache, sinks=settings["sinks"], window=settings["window"])
            tokens = f"{entry['tokens']:,}" + (
                f" (stopped at the trained context, {payload['stream']['trained_context']})"
                if entry.get("stopped")
                else ""
            )
            kv = f"{entry['cache_bytes'] / 2**20:.0f}" + (
                f" at {entry['tokens'] + 1} tokens" if entry.get("stopped") else ""
            )
            rows.append(
                [
                    label,
                    f"{entry['perplexity']:.2f}",
                    tokens,
                    f"{entry['perplexity_on_recompute_targets']:.2f}",
                    f"{entry['ms_per_token']:.1f}",
                    f"{entry['peak_memory_bytes'] / 2**20:.0f}",
                    kv,
                ]
            )
        out += [
            format_table(
                [
                    "strategy",
                    "perplexity",
                    "tokens scored",
                    f"ppl on tokens {start}-{stop - 1}",
                    "ms per token (decode)",
                    "peak RSS MiB",
                    "KV cache MiB",
                ],
                rows,
                markdown=True,
            ),
            "",
            f"StreamingLLM vs re-computation: {stream['streaming']['speedup_vs_recompute']:.1f}x per token",
        ]
    for key in ("sinks_ablation", "cache_size_ablation"):
        if payload.get(key):
            out += [
                "",
                format_table(
                    ["cache", *payload[key]],
                    [[payload.get("model"), *(f"{r['perplexity']:.2f}" for r in payload[key].values())]],
                    markdown=True,
                ),
            ]
    return "\n".join(out)


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--max-tokens", type=int, default=100_000)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020, help="recent tokens; the cache is sinks + window")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--recompute-tokens", type=int, default=64)
    parser.add_argument("--latency-steps", type=int, default=2048)
    parser.add_argument("--ablation-tokens", type=int, default=20_000)
    parser.add_argument("--probe-texts", type=int, default=256)
    parser.add_argument("--probe-length", type=int, default=16)
    args = parser.parse_args()
    name = f"streaming_{args.model.replace('/', '_')}"
    if args.report:
        return print_report(name, report)
    torch.set_num_threads(2)

    started = time.perf_counter()
    # Parts: probe, stream (with its latencies; "latency" re-times those alone), sinks, sizes. The latency steps are
    # not a setting of the file: a re-timing keeps the perplexities.
    study = Study(
        name,
        {k: v for k, v in vars(args).items() if k not in ("resume", "only", "skip", "report", "latency_steps")},
        args,
        plot=plot_ablations,
    )
    loaded = study.load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer
    settings = StreamSettings(
        sinks=args.sinks,
        window=args.window,
        max_tokens=args.max_tokens,
        chunk=args.chunk,
        recompute_tokens=args.recompute_tokens,
        latency_steps=args.latency_steps,
    )

    def save():
        study.payload["seconds"] = time.perf_counter() - started
        study.save()

    if study.pending("first_token_attention", "probe"):
        texts = [t for t in data.lambada_test_texts()][: args.probe_texts]
        study.payload["sink_probe"] = f"{len(texts)} LAMBADA passages x {args.probe_length} tokens"
        study.payload["first_token_attention"] = attention_sink_mass(model, tokenizer, texts, args.probe_length)
        save()

    trained = getattr(model.config, "max_position_embeddings", None)
    if study.pending("stream"):
        study.payload["stream"] = stream_evaluate(model, tokenizer, settings)
    elif study.runs("latency") and "stream" in study.payload:
        stream_tokens = torch.tensor(long_text_tokens(tokenizer, args.max_tokens))
        for strategy, entry in study.payload["stream"]["settings"].items():
            entry.update(strategy_latency(model, stream_tokens, strategy, settings, trained))
    if "stream" in study.payload:
        study.payload["latency_steps"] = args.latency_steps
        stream = study.payload["stream"]["settings"]
        stream["streaming"]["speedup_vs_recompute"] = (
            stream["recompute"]["ms_per_token"] / stream["streaming"]["ms_per_token"]
        )
        plot_stream(
            study.payload["stream"],
            results_dir() / f"stream_{args.model.replace('/', '_')}.png",
            f"{titled(study.payload, '')}: {args.max_tokens}-token stream, cache {settings.cache_size}, "
            f"chunk {args.chunk}",
        )
        save()

    tokens = torch.tensor(long_text_tokens(tokenizer, args.ablation_tokens))
    cache = settings.cache_size
    ablations = {
        "sinks_ablation": {f"{s}+{cache - s}": StreamingConfig(sinks=s, window=cache - s) for s in SINKS},
        "cache_size_ablation": {
            f"4+{c - 4}": StreamingConfig(sinks=4, window=c - 4) for c in CACHE_SIZES if trained is None or c < trained
        },
    }
    for part, configs in ablations.items():
        for row in study.todo(part, configs):
            nll = cached_nll(model, tokens, sink_cache(model, configs[row]), args.chunk, row)
            study.record(
                part,
                row,
                {"sinks": configs[row].sinks, "window": configs[row].window, "perplexity": float(nll.mean().exp())},
                summary=lambda r: f"{r['perplexity']:.3f}",
            )
    save()
    print(report(study.payload))
    print(f"wrote {study.path} in {study.payload['seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
