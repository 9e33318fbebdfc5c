"""W8A8 accuracy table (thesis Table 3.2 settings) and the alpha sweep (thesis Fig. 3.8), on one model.

Rows: FP32, naive W8A8 (per-tensor dynamic), ZeroQuant-style (per-token dynamic, group-wise weights),
SmoothQuant O1 / O2 / O3 with per-tensor weights (the paper's setting) and with per-channel weights, the
latter with and without the v->o / up->down extension. One calibration pass (on the float model) serves every row.
Writes benchmarks/results/w8a8_accuracy_<model>.json + .png (`_first<N>` appended for a --max-tokens subset);
rows are saved as they finish and `--resume` keeps the finished ones of a run with the same settings.

    python benchmarks/w8a8_accuracy.py --limit 50 --resume              # full WikiText-2 (about 4 h here)
    python benchmarks/w8a8_accuracy.py --max-tokens 16384 --limit 10    # a quick subset
"""

from __future__ import annotations

import argparse
import copy
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import previous_results, results_name, write_results  # noqa: E402
from leanlm.data import calibration_batches  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.methods import ZEROQUANT, Calibration, SmoothQuantConfig, W8A8Config, calibrate, quantize_  # noqa: E402
from leanlm.models import DEFAULT_MODEL, load_model  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402


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
            table[name] = [SmoothQuantConfig(alpha_by_level[level], extension, extension),
                           W8A8Config(level=level, weight_granularity=weights)]
    return table


def fp32_perplexity(payload: dict) -> float | None:
    return payload["rows"].get("FP32", {}).get("results", {}).get("wikitext2", {}).get("perplexity")


def table_rows(payload: dict) -> list[list]:
    fp32, rows_out = fp32_perplexity(payload), []
    for name, row in payload["rows"].items():
        ppl = row["results"]["wikitext2"]["perplexity"]
        rows_out.append([name, ppl, f"{100 * (ppl / fp32 - 1):+.1f}%" if fp32 else "-", row["zero_shot_average"]])
    return rows_out


def plot_accuracy(payload: dict, sweep_tokens: int, title: str):
    def draw(path):
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
        for level, points in payload["alpha_sweep"].items():
            right.plot([float(a) for a in points], list(points.values()), marker="o", label=f"SmoothQuant-{level}")
        if payload.get("alpha_sweep_fp32"):
            right.axhline(payload["alpha_sweep_fp32"], color="black", linewidth=0.8, label="FP32")
        right.set_yscale("log")
        right.set_xlabel("migration strength alpha (per-channel weights)")
        right.set_ylabel(f"WikiText-2 perplexity (first {sweep_tokens} tokens)")
        right.legend()
        save_figure(fig, path, title)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=None, help="first N WikiText-2 tokens (default: all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=500, help="items per zero-shot task")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--alpha", type=float, nargs=3, default=(0.5, 0.7, 0.7), metavar=("O1", "O2", "O3"),
                        help="migration strength per level (from the sweep)")
    parser.add_argument("--sweep-tokens", type=int, default=8192, help="WikiText-2 tokens per alpha of the sweep")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only the rows whose name contains one of these (e.g. 'SmoothQuant-O3')")
    parser.add_argument("--resume", action="store_true", help="keep rows a previous run with the same settings finished")
    args = parser.parse_args()

    loaded = load_model(args.model)
    settings = EvalSettings(tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens,
                            seq_len=args.seq_len)
    alpha_by_level = dict(zip(("O1", "O2", "O3"), args.alpha))
    payload = {"model": args.model, "weights_note": loaded.weights_note,
               "settings": {**vars(settings), "calibration_samples": args.calib_samples, "calibration_seq_len": 512,
                            "alpha_by_level": alpha_by_level, "sweep_tokens": args.sweep_tokens},
               "rows": {}, "alpha_sweep": {}}
    name = results_name("w8a8_accuracy", args.model) + (f"_first{args.max_tokens}" if args.max_tokens else "")
    if args.resume:
        previous = previous_results(name, payload["settings"])
        payload.update({key: previous[key] for key in ("rows", "alpha_sweep", "alpha_sweep_fp32", "calibration") if key in previous})
    title = f"{args.model} W8A8" + (f" ({loaded.weights_note})" if loaded.weights_note else "")

    def save() -> None:
        """Results so far, written after every row: a long run stopped early still leaves its table."""
        write_results(name, payload, plot_accuracy(payload, args.sweep_tokens, title))

    started = time.perf_counter()
    stats = calibrate(loaded.model, calibration_batches(loaded.tokenizer, n_samples=args.calib_samples, seq_len=512))
    payload.setdefault("calibration", {"seconds": time.perf_counter() - started})

    calibration = Calibration(loaded.tokenizer, samples=args.calib_samples, int8_stats=stats)
    for row, steps in rows(alpha_by_level).items():
        if row in payload["rows"] or (args.only and not any(text in row for text in args.only)):
            continue
        model = copy.deepcopy(loaded.model)
        record = quantize_(model, steps, calibration=calibration) if steps else None
        result = evaluate(model, loaded.tokenizer, settings)
        payload["rows"][row] = {"config": record, **result}
        print(f"{row}: wikitext2 {result['results']['wikitext2']['perplexity']:.3f}, "
              f"zero-shot {result['zero_shot_average']:.4f}", flush=True)
        save()

    if not args.no_sweep:
        sweep_settings = EvalSettings(tasks=("wikitext2",), max_tokens=args.sweep_tokens, seq_len=args.seq_len)
        if "alpha_sweep_fp32" not in payload:  # the sweep's own FP32 reference, on its tokens
            result = evaluate(loaded.model, loaded.tokenizer, sweep_settings)
            payload["alpha_sweep_fp32"] = result["results"]["wikitext2"]["perplexity"]
        for level in ("O1", "O3"):
            for alpha in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
                if str(alpha) in payload["alpha_sweep"].get(level, {}):
                    continue
                model = copy.deepcopy(loaded.model)
                quantize_(model, [SmoothQuantConfig(alpha), W8A8Config(level=level, weight_granularity="per_channel")],
                          calibration=calibration)
                ppl = evaluate(model, loaded.tokenizer, sweep_settings)["results"]["wikitext2"]["perplexity"]
                payload["alpha_sweep"].setdefault(level, {})[str(alpha)] = ppl
                print(f"sweep {level} alpha {alpha}: {ppl:.3f}", flush=True)
                save()

    print(format_table(["setting", "wikitext2 ppl", "vs FP32", "zero-shot avg"], table_rows(payload), markdown=True))


if __name__ == "__main__":
    main()
