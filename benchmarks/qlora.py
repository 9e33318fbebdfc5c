"""QLoRA Dettmers' thesis Tables 5.2/5.3 at small scale: LoRA fine-tuning over a float32 base vs QLoRA over NF4 + double
quantization, NF4, FP4 (e2m1) and Int4 bases (blocks of 64), same seed, data, steps and adapters. Trains on the
LAMBADA development text, evaluates perplexity on held-out LAMBADA test text and the zero-shot average on a
stated --limit; records each run's peak memory (RSS during training, in its own process), model bytes and training
tokens/s. Writes
benchmarks/results/qlora_<model>.json + .png; results are saved after every run and `--resume` skips finished runs.

    python benchmarks/qlora.py                                  # 5 runs x 100 steps of 4 x 128 tokens
    python benchmarks/qlora.py --steps 20 --bases float nf4-dq  # a quick look
    python benchmarks/qlora.py --report                         # the saved table
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.data import plain_text, verified_path  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.evaluation.perplexity import perplexity  # noqa: E402
from leanlm.methods import LORA_BASES, LoRAConfig, add_lora_, load_adapters_  # noqa: E402
from leanlm.methods.qlora import lora_layers  # noqa: E402
from leanlm.nn import KbitLinear  # noqa: E402
from leanlm.nn.lora import frozen_linear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

TRAIN_TEXT = "lambada/lambada_development_plain_text.txt"


def held_out_and_zero_shot(model, tokenizer, args) -> dict:
    held_out = perplexity(
        model,
        tokenizer,
        plain_text("lambada-test"),
        seq_len=args.seq_len,
        max_tokens=args.eval_tokens,
        desc="lambada-test",
    )
    zero_shot = evaluate(model, tokenizer, EvalSettings(tasks=ZERO_SHOT_TASKS, limit=args.limit))
    return {
        "lambada_test_perplexity": held_out.perplexity,
        "lambada_test_tokens": held_out.tokens,
        "zero_shot_average": zero_shot["zero_shot_average"],
        "zero_shot": zero_shot["results"],
    }


def run(loaded, base: str, args) -> dict:
    """Train in a fresh `leanlm finetune` process (so its peak memory is its own), then evaluate the adapter here
    over the same base format (quantization is deterministic, so the base is rebuilt exactly)."""
    lora = LoRAConfig(base=base, rank=args.rank, alpha=args.lora_alpha, dropout=args.dropout)
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "leanlm.cli.main",
            "finetune",
            args.model,
            "--method",
            lora.method,
            "--data",
            str(verified_path(TRAIN_TEXT)),
            "--out",
            out,
            "--max-steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--seq-len",
            str(args.seq_len),
            "--lr",
            str(args.lr),
            "--rank",
            str(args.rank),
            "--lora-alpha",
            str(args.lora_alpha),
            "--dropout",
            str(args.dropout),
            "--seed",
            str(args.seed),
            "--save-every",
            str(args.steps),
            "--json",
            str(Path(out) / "run.json"),
        ] + (["--base", base] if base != "float" else [])
        subprocess.run(command, check=True)
        record = json.loads((Path(out) / "run.json").read_text())
        model = copy.deepcopy(loaded.model)
        add_lora_(model, lora)
        load_adapters_(model, out)
    # Evaluated with each k-bit base de-quantized into a float32 linear: the numbers the k-bit kernel computes, at
    # float speed (the evaluation would otherwise take longer than the training).
    for layer in lora_layers(model).values():
        if isinstance(layer.base, KbitLinear):
            layer.base = frozen_linear(layer.base.dequantized_weight(), layer.base.bias)
    model.eval()
    return {**record, **held_out_and_zero_shot(model, loaded.tokenizer, args)}


def plot_results(payload: dict, path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    runs = payload.get("runs", {})
    for name, row in runs.items():
        losses = torch.tensor(row["losses"])
        window = max(1, len(losses) // 15)
        smooth = losses.unfold(0, window, 1).mean(dim=1) if len(losses) >= window else losses
        left.plot(range(window, len(losses) + 1), smooth, label=name)
    left.set_xlabel("step")
    left.set_ylabel("training loss (moving mean)")
    left.legend()
    names = list(runs)
    right.bar(names, [runs[n]["lambada_test_perplexity"] for n in names], color="tab:blue")
    if payload.get("before"):
        right.axhline(
            payload["before"]["lambada_test_perplexity"],
            color="black",
            linestyle="--",
            linewidth=0.8,
            label="before fine-tuning",
        )
        right.legend()
    right.set_ylabel("held-out LAMBADA test perplexity")
    low = min(runs[n]["lambada_test_perplexity"] for n in names) if names else 0
    right.set_ylim(bottom=0.95 * low)
    settings = payload["settings"]
    save_figure(
        fig,
        path,
        titled(
            payload,
            f"LoRA / QLoRA, {settings['steps']} steps x {settings['batch_size']} x "
            f"{settings['seq_len']} tokens of LAMBADA dev",
        ),
    )


def report(payload: dict) -> str:
    """Thesis Tables 5.2/5.3 as the README shows them: a row per run, losses as the mean of the first and last
    five steps, held-out perplexity against LoRA's."""
    runs, settings = payload.get("runs", {}), payload["settings"]
    lora = runs.get("LoRA (float32 base)", {}).get("lambada_test_perplexity")

    def mean5(losses: list[float]) -> float:
        return sum(losses) / len(losses)

    rows = (
        [
            [
                "before fine-tuning (float32)",
                None,
                None,
                payload["before"]["lambada_test_perplexity"],
                None,
                payload["before"]["zero_shot_average"],
                None,
                None,
                None,
                None,
                None,
            ]
        ]
        if payload.get("before")
        else []
    )
    for name, row in runs.items():
        bits = row["base_quantization"].get("avg_bits") if row.get("base_quantization") else None
        rows.append(
            [
                name,
                f"{bits:.3f}" if bits else "32",
                f"{mean5(row['losses'][:5]):.3f} -> {mean5(row['losses'][-5:]):.3f}",
                row["lambada_test_perplexity"],
                f"{100 * (row['lambada_test_perplexity'] / lora - 1):+.2f}%" if lora else None,
                row["zero_shot_average"],
                f"{row['peak_memory_bytes'] / 2**20:.0f}",
                f"{row['model_bytes'] / 2**20:.0f}",
                f"{row['optimizer_state_bytes'] / 2**20:.1f}",
                f"{row['tokens_per_second']:.0f}",
                training_memory(row["settings"]),
            ]
        )
    return format_table(
        [
            "run",
            "base bits/weight (measured)",
            "train loss first -> last (mean of 5)",
            "held-out LAMBADA-test ppl",
            "vs LoRA",
            f"zero-shot avg ({settings['limit']}/task)",
            "peak RSS MiB",
            "model MiB",
            "optimizer state MiB",
            "tokens/s",
            "training memory",
        ],
        rows,
        markdown=True,
    )


def training_memory(settings: dict) -> str:
    """How the run spent memory: gradient checkpointing, and whether freed memory went back to the system at once
    (runs from before that setting existed left glibc to keep it)."""
    checkpointing = "checkpointing" if settings.get("gradient_checkpointing") else "no checkpointing"
    freed = "freed memory kept" if settings.get("keep_freed_memory", True) else "freed memory returned"
    chunked = ", chunked loss" if "keep_freed_memory" in settings else ""  # both came in together
    return f"{checkpointing}, {freed}{chunked}"


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--bases", nargs="*", default=list(LORA_BASES), choices=list(LORA_BASES))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tokens", type=int, default=16384, help="first N tokens of LAMBADA test text")
    parser.add_argument("--limit", type=int, default=50, help="items per zero-shot task")
    args = parser.parse_args()
    name = results_name("qlora", args.model)
    if args.report:
        return print_report(name, report)

    study_flags = ("bases", "resume", "only", "skip", "report")
    study = Study(name, {k: v for k, v in vars(args).items() if k not in study_flags}, args, plot=plot_results)
    loaded = study.load_model(args.model)
    if study.pending("before"):
        study.set("before", held_out_and_zero_shot(loaded.model, loaded.tokenizer, args))
        print(
            f"before fine-tuning: lambada-test ppl {study.payload['before']['lambada_test_perplexity']:.3f}, "
            f"zero-shot {study.payload['before']['zero_shot_average']:.4f}",
            flush=True,
        )
    labels = {"LoRA (float32 base)" if base == "float" else f"QLoRA ({base})": base for base in args.bases}
    for label in study.todo("runs", labels):
        study.record(
            "runs",
            label,
            run(loaded, labels[label], args),
            summary=lambda row: (
                f"loss {row['train_loss_first']:.3f} -> {row['train_loss_last']:.3f}, lambada-test ppl "
                f"{row['lambada_test_perplexity']:.3f}, zero-shot {row['zero_shot_average']:.4f}, peak "
                f"{row['peak_memory_bytes'] / 2**20:.0f} MiB, {row['tokens_per_second']:.0f} tok/s"
            ),
        )
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
