"""FP32 baseline of a model: full-test-set perplexity (WikiText-2, PTB) at the papers' window, zero-shot
accuracy on the six tasks, and evaluation throughput. Writes benchmarks/results/baseline_<model>.json + .png.

    python benchmarks/baseline.py [--model smollm2-135m] [--limit 500] [--seq-len 2048]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import write_results  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.models import DEFAULT_MODEL, load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--limit", type=int, default=500, help="items per zero-shot task (None: full sets)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()

    loaded = load_model(args.model)
    settings = EvalSettings(
        tasks=("wikitext2", "ptb", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens, seq_len=args.seq_len
    )
    payload = {"model": args.model, "weights_note": loaded.weights_note, "settings": vars(settings)}
    payload |= evaluate(loaded.model, loaded.tokenizer, settings)

    def plot(path):
        results = payload["results"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 3]})
        left.bar(["WikiText-2", "PTB"], [results["wikitext2"]["perplexity"], results["ptb"]["perplexity"]])
        left.set_title(f"perplexity (seq-len {args.seq_len}, full test sets)")
        names = list(ZERO_SHOT_TASKS)
        left_pos = range(len(names))
        right.bar([p - 0.2 for p in left_pos], [results[t]["acc"] for t in names], width=0.4, label="acc")
        right.bar([p + 0.2 for p in left_pos], [results[t].get("acc_norm", 0) for t in names], width=0.4,
                  label="acc_norm")
        right.set_xticks(list(left_pos), names)
        right.set_title(f"zero-shot, first {args.limit} items per task")
        right.legend()
        fig.suptitle(f"{args.model} FP32" + (f" ({loaded.weights_note})" if loaded.weights_note else ""), fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    path = write_results(f"baseline_{args.model}", payload, plot)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
