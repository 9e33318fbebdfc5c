"""CushionCache Tables 1/2/5 at small scale: WikiText-2 perplexity and zero-shot average for per-tensor static
(O3), per-tensor dynamic (O2) and per-token dynamic (O1) W8A8, each naive and SmoothQuant, each without a
cushion, with the searched cushion, and with the searched + tuned cushion; plus FP32 with and without the
cushions (the cushion changes float predictions too), and the activation order statistics of the last block's
input (Table 5: top-1, top 10%, median). Weights per-tensor int8, attention matmuls in float32.

The cushions are found once on the float model (greedy search over a stated candidate pool, then prefix tuning)
and reused by every row; each row calibrates its static ranges and SmoothQuant statistics with its cushion in
place. Writes benchmarks/results/cushion_<model>.json + .png; rows are saved as they finish, `--resume` skips
finished ones (and reuses the saved cushions).

    python benchmarks/cushion.py                                    # first 32768 WikiText-2 tokens, --limit 50
    python benchmarks/cushion.py --max-tokens 8192 --limit 10 --candidates 128 --tune-steps 20   # a quick look
    python benchmarks/cushion.py --report                           # the saved table
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_dir, results_name, study_arguments, titled  # noqa: E402
from leanlm.cache.prefix import load_cushion, save_cushion  # noqa: E402
from leanlm.data import calibration_batches  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.evaluation.outliers import block_input_magnitudes  # noqa: E402
from leanlm.methods import Calibration, SmoothQuantConfig, W8A8Config  # noqa: E402
from leanlm.methods.cushion import CushionConfig, cushioned_copy, search_cushion, tune_cushion  # noqa: E402
from leanlm.report import format_table, plot_training_curves, save_figure  # noqa: E402

LEVELS = {"per-tensor static": "O3", "per-tensor dynamic": "O2", "per-token dynamic": "O1"}
CUSHIONS = ("none", "search", "search+tune")


def plot_results(payload: dict, path) -> None:
    fig, axis = plt.subplots(figsize=(9, 4.2))
    rows = payload.get("rows", {})
    groups = [f"{base} {level}" for base in ("naive", "SmoothQuant") for level in LEVELS]
    for offset, cushion in enumerate(CUSHIONS):
        heights = [rows.get(f"{group} / {cushion}", {}).get("wikitext2", float("nan")) for group in groups]
        axis.bar(
            [i + 0.27 * (offset - 1) for i in range(len(groups))], heights, width=0.27, label=f"cushion: {cushion}"
        )
    fp32 = rows.get("FP32 / none", {}).get("wikitext2")
    if fp32:
        axis.axhline(fp32, color="black", linestyle="--", linewidth=0.8, label="FP32")
    axis.set_xticks(range(len(groups)), groups, rotation=20, fontsize=8)
    axis.set_ylabel("WikiText-2 perplexity")
    axis.legend(fontsize=8)
    save_figure(fig, path, titled(payload, "W8A8 with CushionCache"))


def report(payload: dict) -> str:
    """Tables 1/2 as the README shows them: a row per setting, "perplexity / zero-shot average" per cushion, and
    the share of the perplexity gap to FP32 (without a cushion) each cushion closes."""
    rows = payload.get("rows", {})
    fp32 = rows.get("FP32 / none", {}).get("wikitext2")
    groups = {"FP32": "FP32"} | {
        f"{base} {level_name}": f"{'naive W8A8' if base == 'naive' else base} {level_name} ({level})"
        for base in ("naive", "SmoothQuant")
        for level_name, level in LEVELS.items()
    }
    table = []
    for group, label in groups.items():
        cells = [rows.get(f"{group} / {kind}") for kind in CUSHIONS]
        if not any(cells):
            continue
        closed = ""
        if group != "FP32" and fp32 and all(cells):
            gap = cells[0]["wikitext2"] - fp32
            closed = " / ".join(f"{100 * (cells[0]['wikitext2'] - cell['wikitext2']) / gap:.0f}%" for cell in cells[1:])
        table.append(
            [
                label,
                *(f"{cell['wikitext2']:.3f} / {cell['zero_shot_average']:.3f}" if cell else None for cell in cells),
                closed,
            ]
        )
    return format_table(
        [
            "setting",
            "no cushion",
            "searched cushion",
            "searched + tuned",
            "perplexity gap to FP32 closed (searched / tuned)",
        ],
        table,
        markdown=True,
    )


def int8_steps(base: str | None, level: str | None) -> list | None:
    """The row's method configs: none for FP32, else (SmoothQuant then) W8A8 at `level`, attention in float."""
    if base is None:
        return None
    return [*([SmoothQuantConfig(0.5)] if base == "SmoothQuant" else []), W8A8Config(level=level, quantize_bmm=False)]


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--max-tokens", type=int, default=32768, help="first N WikiText-2 tokens")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=50, help="items per zero-shot task")
    parser.add_argument("--candidates", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=4)
    parser.add_argument("--min-improvement", type=float, default=0.1, help="tau of the greedy search")
    parser.add_argument("--tune-steps", type=int, default=100)
    parser.add_argument("--calib-samples", type=int, default=64)
    args = parser.parse_args()
    name = results_name("cushion", args.model)
    if args.report:
        return print_report(name, report)

    settings = EvalSettings(
        tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens, seq_len=args.seq_len
    )
    config = CushionConfig(
        candidates=args.candidates,
        max_length=args.max_length,
        min_improvement=args.min_improvement,
        tune_steps=args.tune_steps,
    )
    study = Study(
        name,
        {**vars(settings), "cushion": vars(config), "calibration_samples": args.calib_samples},
        args,
        plot=plot_results,
    )
    loaded = study.load_model(args.model)
    calibration = Calibration(loaded.tokenizer, samples=args.calib_samples, seq_len=512)
    title = titled(study.payload, "W8A8 with CushionCache")

    # The cushions: found once, when a row first needs one (saved beside the JSON and reused by later runs of the
    # same settings), and shared by every row.
    cushions: dict = {"none": None}

    def cushion(kind: str):
        if kind in cushions:
            return cushions[kind]
        directory = results_dir() / f"{name}_{kind.replace('+', '_')}"
        if kind in study.rows("cushions") and (directory / "cushion.safetensors").is_file():
            cushions[kind] = load_cushion(directory)
            return cushions[kind]
        if kind == "search+tune" and cushion("search").length == 0:
            raise SystemExit("the search found no token that cuts the error by --min-improvement; nothing to tune")
        found = (
            search_cushion(loaded.model, loaded.tokenizer, config)
            if kind == "search"
            else tune_cushion(loaded.model, loaded.tokenizer, cushion("search"), config)
        )
        directory.mkdir(parents=True, exist_ok=True)
        save_cushion(found, directory)
        if "tuning" in found.record:
            curve = found.record["tuning"]["curve"]
            plot_training_curves(
                {key: [point[key] for point in curve] for key in curve[0]},
                results_dir() / f"{name}_tuning.png",
                f"{title}: prefix tuning",
            )
        study.record(
            "cushions",
            kind,
            {k: v for k, v in found.record.items() if k != "config"},
            summary=lambda r: (
                f"{r['text']!r}, search {r['search_seconds']:.0f} s"
                + (f", tuning {r['tuning']['seconds']:.0f} s" if "tuning" in r else "")
            ),
        )
        cushions[kind] = found
        return found

    probe = calibration_batches(loaded.tokenizer, 8, 512, seed=7)
    for kind in study.todo("last_block_input", CUSHIONS):
        model, _ = cushioned_copy(loaded.model, cushion(kind))
        study.record("last_block_input", kind, block_input_magnitudes(model, probe)[-1])

    plans = {f"FP32 / {kind}": (None, None, kind) for kind in CUSHIONS} | {
        f"{base} {level_name} / {kind}": (base, level, kind)
        for base in ("naive", "SmoothQuant")
        for level_name, level in LEVELS.items()
        for kind in CUSHIONS
    }
    for row in study.todo("rows", plans):
        base, level, kind = plans[row]
        model, record = cushioned_copy(loaded.model, cushion(kind), int8_steps(base, level), calibration)
        result = evaluate(model, loaded.tokenizer, settings)
        study.record(
            "rows",
            row,
            {
                "wikitext2": result["results"]["wikitext2"]["perplexity"],
                "zero_shot_average": result["zero_shot_average"],
                "results": result["results"],
                "level": level,
                "base": base,
                "cushion": kind,
                "quantization": {k: v for k, v in record.items() if k != "cushion"},
            },
            summary=lambda r: f"wikitext2 {r['wikitext2']:.3f}, zero-shot {r['zero_shot_average']:.4f}",
        )
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
