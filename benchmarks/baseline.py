"""Float baseline of a model (float32, or bfloat16 with --dtype): full-test-set perplexity (WikiText-2, PTB) at the papers' window, zero-shot
accuracy on the six tasks, and evaluation throughput. Writes benchmarks/results/baseline_<model>.json + .png.

    python benchmarks/baseline.py [--model smollm2-135m] [--limit 500] [--seq-len 2048]
    python benchmarks/baseline.py --model qwen2.5-coder-1.5b --dtype bfloat16 --limit 200 --resume
    python benchmarks/baseline.py --only throughput   # re-measure only the forward speed, on a quiet machine
    python benchmarks/baseline.py --only piqa         # one task again (each task is a row of the study)
    python benchmarks/baseline.py --report            # the saved table

The evaluation's own tokens/s depends on whatever else the machine runs; `throughput` is measured apart:
warm-up, then the median of repeated forward passes of one window, and merged into the same JSON.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, time_call, titled  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

TASK_NAMES = {
    "lambada": "LAMBADA (OpenAI)",
    "piqa": "PIQA",
    "hellaswag": "HellaSwag",
    "arc_easy": "ARC-easy",
    "arc_challenge": "ARC-challenge",
    "winogrande": "WinoGrande",
}


def measure_throughput(model, seq_len: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    timing = time_call(lambda: model(input_ids=ids, use_cache=False), warmup=1, repeats=5)
    return {"seq_len": seq_len, "tokens_per_second": seq_len / timing.median, **timing.as_dict()}


def report(payload: dict) -> str:
    results, rows = payload.get("results", {}), []
    for task, label in (("wikitext2", "WikiText-2 (test)"), ("ptb", "PTB (test)")):
        if task in results:
            r = results[task]
            rows.append(
                [
                    label,
                    "perplexity",
                    f"{r['perplexity']:.2f}",
                    f"{r['tokens']:,} tokens, {r['windows']} x {r['seq_len']}",
                ]
            )
    for task, label in TASK_NAMES.items():
        if task in results:
            r = results[task]
            second = (
                ("perplexity", f"{r['perplexity']:.1f}")
                if task == "lambada"
                else (("acc_norm", f"{r['acc_norm']:.3f}") if "acc_norm" in r else None)
            )
            rows.append(
                [
                    label,
                    "acc" + (f" / {second[0]}" if second else ""),
                    f"{r['acc']:.3f}" + (f" / {second[1]}" if second else ""),
                    f"{r['n']} items",
                ]
            )
    if payload.get("zero_shot_average") is not None:
        rows.append(["zero-shot average", "acc", f"{payload['zero_shot_average']:.3f}", "six tasks"])
    if "throughput" in payload:
        t = payload["throughput"]
        rows.append(
            [
                "forward throughput",
                "tokens/s",
                f"{t['tokens_per_second']:.0f}",
                f"one {t['seq_len']}-token window, median of {t['repeats']}, 2 threads",
            ]
        )
    return format_table(["task", "metric", "value", "on"], rows, markdown=True)


def plot_baseline(payload: dict, path) -> None:
    results = payload.get("results", {})
    if not {"wikitext2", "ptb", *ZERO_SHOT_TASKS} <= set(results):
        return  # drawn once every task is in
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 3]})
    left.bar(["WikiText-2", "PTB"], [results["wikitext2"]["perplexity"], results["ptb"]["perplexity"]])
    settings = payload["settings"]
    left.set_title(f"perplexity (seq-len {settings['seq_len']}, full test sets)")
    names = list(ZERO_SHOT_TASKS)
    left_pos = range(len(names))
    right.bar([p - 0.2 for p in left_pos], [results[t]["acc"] for t in names], width=0.4, label="acc")
    right.bar([p + 0.2 for p in left_pos], [results[t].get("acc_norm", 0) for t in names], width=0.4, label="acc_norm")
    right.set_xticks(list(left_pos), names)
    right.set_title(f"zero-shot, first {settings['limit']} items per task")
    right.legend()
    save_figure(fig, path, titled(payload, payload.get("dtype", "float32")))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--limit", type=int, default=500, help="items per zero-shot task (None: full sets)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute dtype (bfloat16: the best float path of a CPU with native bf16 products)",
    )
    args = parser.parse_args()
    name = results_name("baseline", args.model)
    if args.report:
        return print_report(name, report)

    settings = EvalSettings(
        tasks=("wikitext2", "ptb", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens, seq_len=args.seq_len
    )
    extra = {"dtype": args.dtype} if args.dtype != "float32" else {}  # float32 runs keep their saved settings
    study = Study(name, {**vars(settings), **extra}, args, plot=plot_baseline)
    loaded = study.load_model(args.model, args.dtype)
    # One row per task, so that a run stopped half-way keeps the tasks it finished.
    for task in study.todo("results", settings.tasks):
        result = evaluate(loaded.model, loaded.tokenizer, replace(settings, tasks=(task,)))
        study.payload["weights_bytes"] = result["weights_bytes"]
        study.payload["seconds"] = study.payload.get("seconds", 0.0) + result["seconds"]
        study.record(
            "results",
            task,
            result["results"][task],
            summary=lambda metrics: ", ".join(
                f"{key} {value:.4f}" for key, value in metrics.items() if key in ("perplexity", "acc", "acc_norm")
            ),
        )
        finished = study.rows("results")
        if all(t in finished for t in ZERO_SHOT_TASKS):
            study.set("zero_shot_average", sum(finished[t]["acc"] for t in ZERO_SHOT_TASKS) / len(ZERO_SHOT_TASKS))
    if study.pending("throughput"):
        study.set("throughput", measure_throughput(loaded.model, args.seq_len))
        print(
            f"forward throughput at {args.seq_len} tokens: {study.payload['throughput']['tokens_per_second']:.0f} tok/s"
        )
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
