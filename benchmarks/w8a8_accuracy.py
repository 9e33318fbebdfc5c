"""W8A8 accuracy table (Xiao's thesis Table 3.2 settings) and the alpha sweep (Xiao's thesis Fig. 3.8), on one model.

Rows: FP32, naive W8A8 (per-tensor dynamic), ZeroQuant-style (per-token dynamic, group-wise weights),
SmoothQuant O1 / O2 / O3 with per-tensor weights (the paper's setting) and with per-channel weights, the
latter with and without the v->o / up->down extension. One calibration pass (on the float model) serves every row.
Writes benchmarks/results/w8a8_accuracy_<model>.json + .png (`_first<N>` appended for a --max-tokens subset);
rows are saved as they finish and `--resume` keeps the finished ones of a run with the same settings; `--report`
prints the table from the saved file.

The part "runtime" gives every row of the main table its speed and memory, in exactly the row's configuration
(the same calibration, the attention matmuls' simulated int8 inputs included): each row is written as a
checkpoint, `leanlm eval CKPT` scores one 2048-token window in a fresh process (its peak resident memory is the
row's), and the rows' forwards over one window are timed in one process, interleaved round by round with the
float model in float32 and in bfloat16 (the best float path where the CPU has bf16 instructions).

    python benchmarks/w8a8_accuracy.py --limit 50 --resume              # full WikiText-2 (about 4 h here)
    python benchmarks/w8a8_accuracy.py --limit 50 --resume --only runtime   # speed + memory of each row
    python benchmarks/w8a8_accuracy.py --max-tokens 16384 --limit 10    # a quick subset
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, time_prefill, titled  # noqa: E402
from leanlm.bench.harness import cpu_description  # noqa: E402
from leanlm.data import calibration_batches  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.methods import ZEROQUANT, Calibration, SmoothQuantConfig, W8A8Config, calibrate, quantize_  # noqa: E402
from leanlm.methods.checkpoint import load_any, save_quantized  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def rows(alpha_by_level: dict[str, float]) -> dict[str, list]:
    """Row name -> the method configs `quantize_` applies (none: the float model)."""
    table: dict[str, list] = {
        "FP32": [],
        "W8A8 naive (O2)": [W8A8Config(level="O2")],
        "ZeroQuant-style": [ZEROQUANT],
    }
    # Per-channel weights with and without the extension, then the paper's per-tensor weights with it (in this order
    # so that a run stopped early has the rows that decide the targets).
    for weights, extension in (("per_channel", True), ("per_channel", False), ("per_tensor", True)):
        for level in ("O1", "O2", "O3"):
            name = f"SmoothQuant-{level}{' +ext' if extension else ''} W:{weights}"
            table[name] = [
                SmoothQuantConfig(alpha_by_level[level], extension, extension),
                W8A8Config(level=level, weight_granularity=weights),
            ]
    return table


def sweep_rows(level: str) -> dict[str, list]:
    """The alpha sweep (Xiao's thesis Fig. 3.8) at one level: SmoothQuant with per-channel weights at each alpha."""
    return {
        str(alpha): [SmoothQuantConfig(alpha), W8A8Config(level=level, weight_granularity="per_channel")]
        for alpha in ALPHAS
    }


def fp32_perplexity(payload: dict) -> float | None:
    return payload["rows"].get("FP32", {}).get("results", {}).get("wikitext2", {}).get("perplexity")


def measure_runtime(
    loaded, rows_by_name: dict[str, list], calibration: Calibration, seq_len: int, repeats: int
) -> dict:
    """Speed and resident memory of each row's configuration (see the module's docstring)."""
    runtime = {"tokens": seq_len, "cpu": cpu_description(), "threads": torch.get_num_threads(), "rows": {}}
    models = {"fp32": loaded.model, "bf16": load_any(loaded.name).model.to(torch.bfloat16)}
    with tempfile.TemporaryDirectory(prefix="leanlm-w8a8-runtime-") as work:
        for index, (name, configs) in enumerate(rows_by_name.items()):
            source = loaded.name
            if configs:
                quantized = load_any(loaded.name).model
                record = quantize_(quantized, configs, calibration=calibration)
                source = save_quantized(loaded, quantized, dict(record), Path(work) / f"row{index}")
                del quantized
            out = Path(work) / f"row{index}.json"
            # A fresh process per row: its peak resident memory is what evaluating this row costs a user.
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "leanlm.cli.main",
                    "eval",
                    str(source),
                    "--tasks",
                    "wikitext2",
                    "--max-tokens",
                    str(seq_len),
                    "--seq-len",
                    str(seq_len),
                    "--json",
                    str(out),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "TQDM_DISABLE": "1"},
            )
            evaluated = json.loads(out.read_text())
            runtime["rows"][name] = {
                "peak_rss_bytes": evaluated["peak_rss_bytes"],
                "weights_bytes": evaluated["weights_bytes"],
                "perplexity_first_window": evaluated["results"]["wikitext2"]["perplexity"],
            }
            models[name] = load_any(source).model
            print(f"runtime {name}: peak RSS {evaluated['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
        ids = torch.randint(0, loaded.tokenizer.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
        timings = time_prefill(models, ids, repeats)
    runtime["float_paths"] = {name: timings[name] for name in ("fp32", "bf16")}
    for name, row in runtime["rows"].items():
        row.update(timings[name])
    return runtime


def report(payload: dict) -> str:
    fp32, table = fp32_perplexity(payload), []
    runtime = payload.get("runtime", {})
    for name, row in payload["rows"].items():
        ppl = row["results"]["wikitext2"]["perplexity"]
        line = [name, ppl, f"{100 * (ppl / fp32 - 1):+.1f}%" if fp32 else "-", row["zero_shot_average"]]
        if runtime:
            run = runtime["rows"][name]
            line += [
                f"{run['tokens_per_second']:.0f} ({run['speedup_vs_best_float']:.2f}x)",
                f"{run['peak_rss_bytes'] / 2**20:.0f}",
                f"{run['weights_bytes'] / 2**20:.0f}",
            ]
        table.append(line)
    header = ["setting", "wikitext2 ppl", "vs FP32", "zero-shot avg"]
    if not runtime:
        return format_table(header, table, markdown=True) + _alpha_sweep_table(payload)
    floats = runtime["float_paths"]
    header += [f"tokens/s, {runtime['tokens']}-token forward (vs best float)", "peak RSS MiB", "stored MiB"]
    return (
        f"Forward of one {runtime['tokens']}-token window on {runtime['cpu']}, {runtime['threads']} threads; "
        f"the float model runs {floats['fp32']['tokens_per_second']:.0f} tokens/s in float32 and "
        f"{floats['bf16']['tokens_per_second']:.0f} in bfloat16 in the same interleaved rounds.\n\n"
        + format_table(header, table, markdown=True)
        + _alpha_sweep_table(payload)
    )


def _alpha_sweep_table(payload: dict) -> str:
    """WikiText-2 perplexity of each level at each alpha (the sweep's tokens), one row per level."""
    sweep = payload.get("alpha_sweep", {})
    if not sweep:
        return ""
    alphas = list(next(iter(sweep.values())))
    rows = [[level, *(f"{points[alpha]:.2f}" for alpha in alphas)] for level, points in sweep.items()]
    return "\n\n" + format_table(["level", *alphas], rows, markdown=True)


def plot_accuracy(payload: dict, path) -> None:
    fp32 = fp32_perplexity(payload)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = list(payload["rows"])
    left.barh(names, [payload["rows"][n]["results"]["wikitext2"]["perplexity"] for n in names])
    if fp32:
        left.axvline(fp32, color="black", linewidth=0.8)
    left.set_xscale("log")
    left.set_xlabel("WikiText-2 perplexity (log)")
    left.invert_yaxis()
    left.tick_params(axis="y", labelsize=7)
    for level, points in payload.get("alpha_sweep", {}).items():
        right.plot([float(a) for a in points], list(points.values()), marker="o", label=f"SmoothQuant-{level}")
    if payload.get("alpha_sweep_fp32"):
        right.axhline(payload["alpha_sweep_fp32"], color="black", linewidth=0.8, label="FP32")
    right.set_yscale("log")
    right.set_xlabel("migration strength alpha (per-channel weights)")
    right.set_ylabel(f"WikiText-2 perplexity (first {payload['settings']['sweep_tokens']} tokens)")
    right.legend()
    save_figure(fig, path, titled(payload, "W8A8"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--max-tokens", type=int, default=None, help="first N WikiText-2 tokens (default: all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=500, help="items per zero-shot task")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument(
        "--alpha",
        type=float,
        nargs=3,
        default=(0.5, 0.7, 0.7),
        metavar=("O1", "O2", "O3"),
        help="migration strength per level (from the sweep)",
    )
    parser.add_argument("--sweep-tokens", type=int, default=8192, help="WikiText-2 tokens per alpha of the sweep")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the runtime part")
    args = parser.parse_args()
    name = results_name("w8a8_accuracy", args.model) + (f"_first{args.max_tokens}" if args.max_tokens else "")
    if args.report:
        return print_report(name, report)

    settings = EvalSettings(
        tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens, seq_len=args.seq_len
    )
    alpha_by_level = dict(zip(("O1", "O2", "O3"), args.alpha))
    study = Study(
        name,
        {
            **vars(settings),
            "calibration_samples": args.calib_samples,
            "calibration_seq_len": 512,
            "alpha_by_level": alpha_by_level,
            "sweep_tokens": args.sweep_tokens,
        },
        args,
        plot=plot_accuracy,
    )
    loaded = study.load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer

    # One calibration pass on the float model serves every row.
    started = time.perf_counter()
    stats = calibrate(model, calibration_batches(tokenizer, n_samples=args.calib_samples, seq_len=512))
    study.payload.setdefault("calibration", {"seconds": time.perf_counter() - started})
    calibration = Calibration(tokenizer, samples=args.calib_samples, int8_stats=stats)

    if study.pending("runtime"):
        study.set("runtime", measure_runtime(loaded, rows(alpha_by_level), calibration, args.seq_len, args.repeats))
    study.quantized_rows(
        "rows",
        model,
        rows(alpha_by_level),
        lambda quantized, record: {"config": record, **evaluate(quantized, tokenizer, settings)},
        calibration=calibration,
        summary=lambda row: (
            f"wikitext2 {row['results']['wikitext2']['perplexity']:.3f}, zero-shot {row['zero_shot_average']:.4f}"
        ),
    )

    sweep_settings = EvalSettings(tasks=("wikitext2",), max_tokens=args.sweep_tokens, seq_len=args.seq_len)

    def sweep_perplexity(quantized, record) -> float:
        return evaluate(quantized, tokenizer, sweep_settings)["results"]["wikitext2"]["perplexity"]

    if study.pending("alpha_sweep_fp32"):  # the sweep's own FP32 reference, on its tokens
        study.set("alpha_sweep_fp32", sweep_perplexity(model, None))
    for level in ("O1", "O3"):
        study.quantized_rows(
            ("alpha_sweep", level),
            model,
            sweep_rows(level),
            sweep_perplexity,
            calibration=calibration,
            summary=lambda ppl: f"{ppl:.3f}",
        )
    print(report(study.payload))


if __name__ == "__main__":
    main()
