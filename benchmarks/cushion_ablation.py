"""CushionCache ablations on top of benchmarks/cushion.py (run that first: this reuses its searched and tuned
cushions): the per-block activation magnitudes without and with the cushion (section 6.1, Fig. 2), the prefix
length (the greedy search forced on past its stopping rule), and lambda, the weight of the quantization error
in the tuning loss (Table 3's "prefix tuning" is lambda = 0, its "+ quantization-aware loss" lambda > 0).

Every ablation row is naive W8A8 (per-tensor static O3; lambda also per-tensor dynamic O2) scored on the first
--max-tokens WikiText-2 tokens only (no zero-shot tasks, to keep the run near 40 minutes on 2 cores).
Writes benchmarks/results/cushion_ablation_<model>.json + .png and cushion_layers_<model>.png; parts are saved
as they finish and `--resume` skips finished ones.

    python benchmarks/cushion_ablation.py
    python benchmarks/cushion_ablation.py --lambdas 0 10 --tune-steps 10 --max-tokens 4096   # a quick look
    python benchmarks/cushion_ablation.py --report                  # the saved tables
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_dir, results_name, study_arguments, titled  # noqa: E402
from leanlm.cache.prefix import Cushion, cushion_keys_values, load_cushion  # noqa: E402
from leanlm.data import calibration_batches  # noqa: E402
from leanlm.evaluation import EvalSettings, evaluate  # noqa: E402
from leanlm.evaluation.outliers import block_input_magnitudes  # noqa: E402
from leanlm.methods import Calibration, W8A8Config  # noqa: E402
from leanlm.methods.cushion import CushionConfig, cushioned_copy, search_cushion, tune_cushion  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402


def plot_layers(layers: dict, path, title: str) -> None:
    """Fig. 2: top-1/2/3 and median |x| entering each block, one panel per cushion."""
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.6), sharey=True, squeeze=False)
    for axis, (kind, statistics) in zip(axes[0], layers.items()):
        blocks = range(len(statistics))
        for rank in range(len(statistics[0]["top"])):
            axis.plot(blocks, [s["top"][rank] for s in statistics], marker=".", label=f"top-{rank + 1}")
        axis.plot(blocks, [s["median"] for s in statistics], color="black", linestyle="--", label="median")
        axis.set_yscale("log")
        axis.set_xlabel("decoder block (input)")
        axis.set_title(f"cushion: {kind}", fontsize=9)
    axes[0][0].set_ylabel("|activation|")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path, title)


def plot_ablations(payload: dict, path) -> None:
    if not (payload.get("length") and payload.get("lambda") and "fp32" in payload):
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    lengths = sorted(payload["length"], key=int)
    left.plot([int(n) for n in lengths], [payload["length"][n]["O3"] for n in lengths], marker="o")
    left.set_xlabel("cushion length (tokens, greedy order)")
    left.set_ylabel("WikiText-2 ppl, naive per-tensor static W8A8")
    lambdas = list(payload["lambda"])
    for level in ("O3", "O2"):
        right.plot(range(len(lambdas)), [payload["lambda"][x][level] for x in lambdas], marker="o", label=level)
    right.set_xticks(range(len(lambdas)), lambdas)
    right.set_xlabel("lambda (tuning loss = CE + lambda x quantization error)")
    right.set_ylabel("WikiText-2 ppl, naive W8A8")
    for axis in (left, right):
        axis.axhline(payload["fp32"], color="black", linestyle="--", linewidth=0.8, label="FP32")
        axis.legend(fontsize=8)
    save_figure(fig, path, titled(payload, "CushionCache ablations"))


def report(payload: dict) -> str:
    """The prefix-length and lambda ablations, as the README shows them."""
    out = []
    if payload.get("length"):
        out.append(
            format_table(
                ["cushion length", "text", "O3 wikitext2"],
                [[n, repr(r["text"]), r["O3"]] for n, r in payload["length"].items()],
                markdown=True,
            )
        )
    if payload.get("lambda"):
        out.append(
            format_table(
                ["tuning", "O3 ppl", "O2 ppl", "quantization error", "cross-entropy"],
                [
                    [
                        f"lambda = {key}",
                        r["O3"],
                        r["O2"],
                        "{:.4f} -> {:.4f}".format(*r["quantization_error_first_last10"]),
                        "{:.3f} -> {:.3f}".format(*r["cross_entropy_first_last10"]),
                    ]
                    for key, r in payload["lambda"].items()
                ],
                markdown=True,
            )
        )
    if "fp32" in payload:
        out.append(f"FP32 {payload['fp32']:.3f}")
    return "\n\n".join(out)


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--max-tokens", type=int, default=32768, help="first N WikiText-2 tokens")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-length", type=int, default=3, help="longest cushion of the length ablation")
    parser.add_argument("--candidates", type=int, default=256, help="candidate pool of the extra search steps")
    # The main table's tuned cushion has lambda = 1e-3, where the error term (~0.1 summed over linears) weighs
    # 1e-4 against a cross-entropy of ~4: in effect CE only, like lambda = 0; 10 and 100 make it count.
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 10.0, 100.0])
    parser.add_argument("--tune-steps", type=int, default=50)
    parser.add_argument("--calib-samples", type=int, default=64)
    args = parser.parse_args()
    name = results_name("cushion_ablation", args.model)
    if args.report:
        return print_report(name, report)

    main_name = results_name("cushion", args.model)
    saved = {kind: results_dir() / f"{main_name}_{kind}" for kind in ("search", "search_tune")}
    missing = [str(path) for path in saved.values() if not (path / "cushion.safetensors").is_file()]
    if missing:
        raise SystemExit(f"no saved cushion in {', '.join(missing)}: run `python benchmarks/cushion.py` first")
    searched, tuned = load_cushion(saved["search"]), load_cushion(saved["search_tune"])
    base_config = CushionConfig(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in searched.record["config"].items()}
    )
    settings = EvalSettings(tasks=("wikitext2",), max_tokens=args.max_tokens, seq_len=args.seq_len)
    study = Study(
        name,
        {
            **vars(settings),
            "max_length": args.max_length,
            "candidates": args.candidates,
            "tune_steps": args.tune_steps,
            "calibration_samples": args.calib_samples,
            "searched_tokens": searched.tokens,
        },
        args,
        plot=plot_ablations,
    )
    loaded = study.load_model(args.model)
    calibration = Calibration(loaded.tokenizer, samples=args.calib_samples, seq_len=512)

    def wikitext(cushion: Cushion | None, level: str | None) -> float:
        steps = None if level is None else [W8A8Config(level=level, quantize_bmm=False)]
        model, _ = cushioned_copy(loaded.model, cushion, steps, calibration)
        return evaluate(model, loaded.tokenizer, settings)["results"]["wikitext2"]["perplexity"]

    if study.pending("fp32"):
        study.set("fp32", wikitext(None, None))

    probe = calibration_batches(loaded.tokenizer, 8, 512, seed=7)
    kinds = {"none": None, "search": searched, "search+tune": tuned}
    for kind in study.todo("layers", kinds):
        model, _ = cushioned_copy(loaded.model, kinds[kind])
        study.record("layers", kind, block_input_magnitudes(model, probe))
    if len(study.rows("layers")) == len(kinds):
        plot_layers(
            study.payload["layers"],
            results_dir() / f"{results_name('cushion_layers', args.model)}.png",
            titled(study.payload, "CushionCache ablations: |x| entering each block"),
        )

    if "longer_search" not in study.payload or study.pending("longer_search"):
        config = replace(
            base_config,
            initial=tuple(searched.tokens),
            max_length=args.max_length,
            candidates=args.candidates,
            min_improvement=float("-inf"),
        )  # lengths forced
        longer = search_cushion(loaded.model, loaded.tokenizer, config)
        study.set(
            "longer_search",
            {
                "tokens": longer.tokens,
                "text": longer.record["text"],
                "seconds": longer.record["search_seconds"],
                "history": longer.record["history"],
            },
        )
    longer_tokens = study.payload.get("longer_search", {}).get("tokens", [])
    for length in study.todo("length", [str(n) for n in range(len(longer_tokens) + 1)]):
        prefix = longer_tokens[: int(length)]
        cushion = Cushion(prefix, *cushion_keys_values(loaded.model, prefix)) if prefix else None
        study.record(
            "length",
            length,
            {"O3": wikitext(cushion, "O3"), "text": loaded.tokenizer.decode(prefix)},
            summary=lambda r: f"O3 {r['O3']:.3f}",
        )

    for key in study.todo("lambda", [f"{weight:g}" for weight in args.lambdas]):
        cushion = tune_cushion(
            loaded.model,
            loaded.tokenizer,
            searched,
            replace(base_config, tune_steps=args.tune_steps, tune_lambda=float(key)),
        )
        curve = cushion.record["tuning"]["curve"]
        tail = curve[-10:]
        study.record(
            "lambda",
            key,
            {
                "O3": wikitext(cushion, "O3"),
                "O2": wikitext(cushion, "O2"),
                "tuning_seconds": cushion.record["tuning"]["seconds"],
                "cross_entropy_first_last10": [
                    curve[0]["cross_entropy"],
                    sum(p["cross_entropy"] for p in tail) / len(tail),
                ],
                "quantization_error_first_last10": [
                    curve[0]["quantization_error"],
                    sum(p["quantization_error"] for p in tail) / len(tail),
                ],
            },
            summary=lambda r: f"O3 {r['O3']:.3f}, O2 {r['O2']:.3f}",
        )

    study.save()  # again, so that a --resume with nothing left to run still redraws the plots
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
