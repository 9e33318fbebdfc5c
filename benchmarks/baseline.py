"""FP32 baseline of a model: full-test-set perplexity (WikiText-2, PTB) at the papers' window, zero-shot
accuracy on the six tasks, and evaluation throughput. Writes benchmarks/results/baseline_<model>.json + .png.

    python benchmarks/baseline.py [--model smollm2-135m] [--limit 500] [--seq-len 2048]
    python benchmarks/baseline.py --throughput-only   # re-measure only the forward speed, on a quiet machine

The evaluation's own tokens/s depends on whatever else the machine runs; `throughput` is measured apart:
warm-up, then the median of repeated forward passes of one window, and merged into the same JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import results_dir, results_name, time_call, write_results  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.models import DEFAULT_MODEL, load_model  # noqa: E402
from leanlm.report import save_figure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--limit", type=int, default=500, help="items per zero-shot task (None: full sets)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--throughput-only", action="store_true")
    args = parser.parse_args()

    loaded = load_model(args.model)
    name = results_name("baseline", args.model)
    if args.throughput_only:
        payload = json.loads((results_dir() / f"{name}.json").read_text())
        payload.pop("environment", None)
        payload["throughput"] = measure_throughput(loaded.model, args.seq_len)
        print(f"forward throughput at {args.seq_len} tokens: {payload['throughput']['tokens_per_second']:.0f} tok/s")
        print(f"wrote {write_results(name, payload, plot_baseline(payload, args, loaded))}")
        return
    settings = EvalSettings(
        tasks=("wikitext2", "ptb", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens, seq_len=args.seq_len
    )
    payload = {"model": args.model, "weights_note": loaded.weights_note, "settings": vars(settings)}
    payload |= evaluate(loaded.model, loaded.tokenizer, settings)
    payload["throughput"] = measure_throughput(loaded.model, args.seq_len)
    path = write_results(name, payload, plot_baseline(payload, args, loaded))
    print(f"wrote {path}")


def measure_throughput(model, seq_len: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    timing = time_call(lambda: model(input_ids=ids, use_cache=False), warmup=1, repeats=5)
    return {"seq_len": seq_len, "tokens_per_second": seq_len / timing.median, **timing.as_dict()}


def plot_baseline(payload: dict, args, loaded):
    def plot(path):
        results = payload["results"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 3]})
        left.bar(["WikiText-2", "PTB"], [results["wikitext2"]["perplexity"], results["ptb"]["perplexity"]])
        settings = payload["settings"]
        left.set_title(f"perplexity (seq-len {settings['seq_len']}, full test sets)")
        names = list(ZERO_SHOT_TASKS)
        left_pos = range(len(names))
        right.bar([p - 0.2 for p in left_pos], [results[t]["acc"] for t in names], width=0.4, label="acc")
        right.bar([p + 0.2 for p in left_pos], [results[t].get("acc_norm", 0) for t in names], width=0.4,
                  label="acc_norm")
        right.set_xticks(list(left_pos), names)
        right.set_title(f"zero-shot, first {settings['limit']} items per task")
        right.legend()
        save_figure(fig, path, f"{args.model} FP32" + (f" ({loaded.weights_note})" if loaded.weights_note else ""))

    return plot


if __name__ == "__main__":
    main()
