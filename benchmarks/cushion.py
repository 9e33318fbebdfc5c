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
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import previous_results, results_dir, results_name, write_results  # noqa: E402
from leanlm.data import calibration_batches  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.evaluation.outliers import block_input_magnitudes  # noqa: E402
from leanlm.methods import Calibration, SmoothQuantConfig, W8A8Config  # noqa: E402
from leanlm.cache.prefix import load_cushion, save_cushion  # noqa: E402
from leanlm.methods.cushion import CushionConfig, cushioned_copy, search_cushion, tune_cushion  # noqa: E402
from leanlm.models import DEFAULT_MODEL, load_model  # noqa: E402
from leanlm.report import format_table, plot_training_curves, save_figure  # noqa: E402

LEVELS = {"per-tensor static": "O3", "per-tensor dynamic": "O2", "per-token dynamic": "O1"}
CUSHIONS = ("none", "search", "search+tune")


def plot_results(payload: dict, title: str):
    def draw(path):
        fig, axis = plt.subplots(figsize=(9, 4.2))
        groups = [f"{base} {level}" for base in ("naive", "SmoothQuant") for level in LEVELS]
        for offset, cushion in enumerate(CUSHIONS):
            heights = [payload["rows"].get(f"{group} / {cushion}", {}).get("wikitext2", float("nan")) for group in groups]
            axis.bar([i + 0.27 * (offset - 1) for i in range(len(groups))], heights, width=0.27, label=f"cushion: {cushion}")
        fp32 = payload["rows"].get("FP32 / none", {}).get("wikitext2")
        if fp32:
            axis.axhline(fp32, color="black", linestyle="--", linewidth=0.8, label="FP32")
        axis.set_xticks(range(len(groups)), groups, rotation=20, fontsize=8)
        axis.set_ylabel("WikiText-2 perplexity")
        axis.legend(fontsize=8)
        save_figure(fig, path, title)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=32768, help="first N WikiText-2 tokens")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=50, help="items per zero-shot task")
    parser.add_argument("--candidates", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=4)
    parser.add_argument("--min-improvement", type=float, default=0.1, help="tau of the greedy search")
    parser.add_argument("--tune-steps", type=int, default=100)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    loaded = load_model(args.model)
    settings = EvalSettings(tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens,
                            seq_len=args.seq_len)
    config = CushionConfig(candidates=args.candidates, max_length=args.max_length, min_improvement=args.min_improvement,
                           tune_steps=args.tune_steps)
    calibration = Calibration(loaded.tokenizer, samples=args.calib_samples, seq_len=512)
    name = results_name("cushion", args.model)
    out = results_dir()
    payload: dict = {"model": args.model, "weights_note": loaded.weights_note,
                     "settings": {**vars(settings), "cushion": {k: list(v) if isinstance(v, tuple) else v
                                                                for k, v in vars(config).items()},
                                  "calibration_samples": args.calib_samples},
                     "rows": {}, "cushions": {}, "last_block_input": {}}
    previous = previous_results(name, payload["settings"]) if args.resume else {}
    payload.update({k: previous.get(k, {}) for k in ("rows", "cushions", "last_block_input")})
    resumable = bool(previous)
    title = f"{args.model} W8A8 with CushionCache" + (f" ({loaded.weights_note})" if loaded.weights_note else "")

    def save() -> None:
        write_results(name, payload, plot_results(payload, title))

    cushions = {"none": None}
    for kind in CUSHIONS[1:]:
        directory = out / f"{name}_{kind.replace('+', '_')}"
        if resumable and (directory / "cushion.safetensors").is_file():
            cushions[kind] = load_cushion(directory)
            continue
        if kind == "search+tune" and cushions["search"].length == 0:
            raise SystemExit("the search found no token that cuts the error by --min-improvement; nothing to tune")
        cushions[kind] = (search_cushion(loaded.model, loaded.tokenizer, config) if kind == "search"
                          else tune_cushion(loaded.model, loaded.tokenizer, cushions["search"], config))
        directory.mkdir(parents=True, exist_ok=True)
        save_cushion(cushions[kind], directory)
        if "tuning" in cushions[kind].record:
            curve = cushions[kind].record["tuning"]["curve"]
            plot_training_curves({name: [point[name] for point in curve] for name in curve[0]},
                                 out / f"{name}_tuning.png", f"{title}: prefix tuning")
        payload["cushions"][kind] = {k: v for k, v in cushions[kind].record.items() if k != "config"}
        print(f"cushion ({kind}): {cushions[kind].record['text']!r}, search {cushions[kind].record['search_seconds']:.0f} s"
              + (f", tuning {cushions[kind].record['tuning']['seconds']:.0f} s" if "tuning" in cushions[kind].record else ""),
              flush=True)
        save()

    probe = calibration_batches(loaded.tokenizer, 8, 512, seed=7)
    for kind, cushion in cushions.items():
        if kind in payload["last_block_input"]:
            continue
        model, _ = cushioned_copy(loaded.model, cushion)
        payload["last_block_input"][kind] = block_input_magnitudes(model, probe)[-1]
        save()

    plans = [("FP32", None, None)] + [(f"{base} {level_name}", base, level) for base in ("naive", "SmoothQuant")
                                      for level_name, level in LEVELS.items()]
    for group, base, level in plans:
        for kind, cushion in cushions.items():
            row = f"{group} / {kind}"
            if row in payload["rows"]:
                continue
            model, record = cushioned_copy(loaded.model, cushion, None if base is None else _int8(base, level),
                                           calibration)
            result = evaluate(model, loaded.tokenizer, settings)
            payload["rows"][row] = {"wikitext2": result["results"]["wikitext2"]["perplexity"],
                                    "zero_shot_average": result["zero_shot_average"], "results": result["results"],
                                    "level": level, "base": base, "cushion": kind,
                                    "quantization": {k: v for k, v in record.items() if k != "cushion"}}
            print(f"{row}: wikitext2 {payload['rows'][row]['wikitext2']:.3f}, zero-shot "
                  f"{payload['rows'][row]['zero_shot_average']:.4f}", flush=True)
            save()

    table = [[row, r["wikitext2"], r["zero_shot_average"]] for row, r in payload["rows"].items()]
    print(format_table(["setting / cushion", "wikitext2 ppl", "zero-shot avg"], table, markdown=True))
    print(f"wrote {results_dir() / name}.json")


def _int8(base: str, level: str) -> list:
    return [*([SmoothQuantConfig(0.5)] if base == "SmoothQuant" else []), W8A8Config(level=level, quantize_bmm=False)]


if __name__ == "__main__":
    main()
