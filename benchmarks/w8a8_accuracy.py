"""W8A8 accuracy table (thesis Table 3.2 settings) and the alpha sweep (thesis Fig. 3.8), on one model.

Rows: FP32, naive W8A8 (per-tensor dynamic), ZeroQuant-style (per-token dynamic, group-wise weights),
SmoothQuant O1 / O2 / O3 with per-tensor weights (the paper's setting) and with per-channel weights, the
latter with and without the v->o / up->down extension. One calibration pass (on the float model) serves every row.
Writes benchmarks/results/w8a8_accuracy.json + .png.

    python benchmarks/w8a8_accuracy.py                                  # full WikiText-2, --limit 500
    python benchmarks/w8a8_accuracy.py --max-tokens 16384 --limit 50    # a quick subset
"""

from __future__ import annotations

import argparse
import copy
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import write_results  # noqa: E402
from leanlm.data import calibration_batches  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.methods import ZEROQUANT, SmoothQuantConfig, W8A8Config, calibrate, quantize_w8a8_  # noqa: E402
from leanlm.models import DEFAULT_MODEL, load_model  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402


def rows(alpha_by_level: dict[str, float]) -> dict[str, W8A8Config | None]:
    table: dict[str, W8A8Config | None] = {
        "FP32": None,
        "W8A8 naive (O2)": W8A8Config(level="O2"),
        "ZeroQuant-style": ZEROQUANT,
    }
    # The paper's per-tensor weights with the extension, then per-channel weights without and with it.
    for weights, extension in (("per_tensor", True), ("per_channel", False), ("per_channel", True)):
        for level in ("O1", "O2", "O3"):
            name = f"SmoothQuant-{level}{' +ext' if extension else ''} W:{weights}"
            table[name] = W8A8Config(
                level=level,
                weight_granularity=weights,
                smoothquant=SmoothQuantConfig(alpha_by_level[level], extension, extension),
            )
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
        if fp32:
            right.axhline(fp32, color="black", linewidth=0.8, label="FP32")
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
    parser.add_argument("--only", nargs="*", help="run only these row names")
    args = parser.parse_args()

    loaded = load_model(args.model)
    started = time.perf_counter()
    stats = calibrate(loaded.model, calibration_batches(loaded.tokenizer, n_samples=args.calib_samples, seq_len=512))
    calibration_seconds = time.perf_counter() - started
    settings = EvalSettings(tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens,
                            seq_len=args.seq_len)
    payload = {"model": args.model, "weights_note": loaded.weights_note, "settings": vars(settings),
               "calibration": {"samples": args.calib_samples, "seq_len": 512, "seconds": calibration_seconds},
               "alpha_by_level": dict(zip(("O1", "O2", "O3"), args.alpha)), "rows": {}, "alpha_sweep": {}}
    title = f"{args.model} W8A8" + (f" ({loaded.weights_note})" if loaded.weights_note else "")

    def save() -> None:
        """Results so far, written after every row: a long run stopped early still leaves its table."""
        write_results("w8a8_accuracy", payload, plot_accuracy(payload, args.sweep_tokens, title))

    for name, config in rows(payload["alpha_by_level"]).items():
        if args.only and name not in args.only:
            continue
        model = copy.deepcopy(loaded.model)
        if config is not None:
            quantize_w8a8_(model, config, stats)
        result = evaluate(model, loaded.tokenizer, settings)
        payload["rows"][name] = {"config": config.as_record() if config else None, **result}
        print(f"{name}: wikitext2 {result['results']['wikitext2']['perplexity']:.3f}, "
              f"zero-shot {result['zero_shot_average']:.4f}", flush=True)
        save()

    if not args.no_sweep:
        sweep_settings = EvalSettings(tasks=("wikitext2",), max_tokens=args.sweep_tokens, seq_len=args.seq_len)
        for level in ("O1", "O3"):
            for alpha in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
                model = copy.deepcopy(loaded.model)
                quantize_w8a8_(model, W8A8Config(level=level, weight_granularity="per_channel",
                                                 smoothquant=SmoothQuantConfig(alpha)), stats)
                ppl = evaluate(model, loaded.tokenizer, sweep_settings)["results"]["wikitext2"]["perplexity"]
                payload["alpha_sweep"].setdefault(level, {})[str(alpha)] = ppl
                print(f"sweep {level} alpha {alpha}: {ppl:.3f}", flush=True)
            save()

    print(format_table(["setting", "wikitext2 ppl", "vs FP32", "zero-shot avg"], table_rows(payload), markdown=True))


if __name__ == "__main__":
    main()
