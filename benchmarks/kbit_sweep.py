"""Bit-level scaling sweep (Dettmers' thesis ch. 3, Figs 3.2/3.3): WikiText-2 perplexity against total model bits for every
data type x bits 3..8 x block size {32, 64, 128, 256, per-row}, one model per run.

Each configuration quantizes every block linear with `quantize_(model, KbitConfig(...))` (so the bits are the
measured storage of the packed checkpoint) and is then evaluated with the de-quantized weights in plain float32
linears (the same numbers the k-bit kernel computes, at FP32 speed, so the sweep's cost is the evaluation alone).
Total model bits count the quantized linears at their measured bits and everything else (embeddings, norms,
lm_head) at 16 bits, as Dettmers' thesis does. Results are written after every configuration; `--resume` skips finished
ones.

    python benchmarks/kbit_sweep.py --resume                     # first 16384 WikiText-2 tokens per point
    python benchmarks/kbit_sweep.py --zero-shot-limit 10 --resume   # then zero-shot at block 64, keeping the rest
    python benchmarks/kbit_sweep.py --zero-shot-limit 10 --zero-shot-blocks 32 128 256 row --resume  # other blocks
    python benchmarks/kbit_sweep.py --dtypes nf int --bits 3 4   # a slice
"""

from __future__ import annotations

import argparse
import copy
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.formats.codebooks import DTYPES  # noqa: E402
from leanlm.methods import KbitConfig, quantize_  # noqa: E402
from leanlm.models import iter_quantizable_linears  # noqa: E402
from leanlm.nn import KbitLinear  # noqa: E402
from leanlm.nn.lora import frozen_linear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

BLOCKS = ("32", "64", "128", "256", "row")


def dequantized_copy(model: nn.Module, config: KbitConfig) -> tuple[nn.Module, dict]:
    """`model` with every block linear quantized then de-quantized into a float32 nn.Linear."""
    quantized = copy.deepcopy(model)
    record = quantize_(quantized, config)
    for name, module in list(iter_quantizable_linears(quantized)):
        if isinstance(module, KbitLinear):
            linear = frozen_linear(module.dequantized_weight(), module.bias)
            quantized.set_submodule(name, linear)
    return quantized, record


def total_bits(model: nn.Module, avg_bits: float | None) -> float:
    linear_params = sum(m.weight.numel() for _, m in iter_quantizable_linears(model))
    other = sum(p.numel() for p in model.parameters()) - linear_params
    return linear_params * (avg_bits if avg_bits is not None else 16.0) + other * 16.0


def type_by_bits_table(cells: dict[tuple[str, int], str]) -> str:
    """A markdown table with a row per data type and a column per width, of the (dtype, bits) cells given."""
    bits = sorted({b for _, b in cells})
    rows = [
        [dtype, *(cells.get((dtype, b), "-") for b in bits)]
        for dtype in DTYPES
        if any((dtype, b) in cells for b in bits)
    ]
    return format_table(["data type", *(f"{b}-bit" for b in bits)], rows, markdown=True)


def report(payload: dict) -> str:
    """Markdown tables of the saved points by data type x bits at each block size: perplexity (and bits per
    weight), then the zero-shot average where the block has any."""
    points, out = payload.get("points", {}), []
    fp32 = payload.get("fp32", {})
    fp32_zero_shot = fp32.get("zero_shot", {})
    limit = fp32_zero_shot.get("limit")

    def zero_shot_cell(point: dict) -> str:  # a point measured at another limit says so
        entry = point["zero_shot"]
        return f"{entry['average']:.4f}" + (f" ({entry['limit']} items)" if entry["limit"] != limit else "")

    tables = [
        (
            "perplexity @ bits per weight",
            fp32.get("perplexity"),
            ".3f",
            "perplexity",
            lambda p: f"{p['perplexity']:.2f} @ {p['avg_bits']:.2f}",
        ),
        (
            f"zero-shot average, {limit} items per task",
            fp32_zero_shot.get("average"),
            ".4f",
            "zero_shot",
            zero_shot_cell,
        ),
    ]
    for block in BLOCKS:
        for title, reference, style, field, cell in tables:
            cells = {(p["dtype"], p["bits"]): cell(p) for p in points.values() if p["block"] == block and field in p}
            if cells:
                out += [
                    f"block {block}" + (f" (FP32 {reference:{style}})" if reference else "") + f": {title}",
                    "",
                    type_by_bits_table(cells),
                    "",
                ]
    # Ten items per task make one block's zero-shot cell noisy (one item is 1.7 points); the mean over the block
    # sizes pools five such measurements per data type and width.
    pooled = {}
    for p in points.values():
        if "zero_shot" in p and p["zero_shot"]["limit"] == limit:
            pooled.setdefault((p["dtype"], p["bits"]), []).append(p["zero_shot"]["average"])
    if pooled:
        out += [
            f"mean over block sizes (FP32 {fp32_zero_shot['average']:.4f}): zero-shot average, {limit} items "
            "per task (number of block sizes)",
            "",
            type_by_bits_table({key: f"{sum(v) / len(v):.4f} ({len(v)})" for key, v in pooled.items()}),
            "",
        ]
    return "\n".join(out)


def measured(point: dict, metric: str, zero_shot_limit: int) -> float | None:
    """A point's perplexity, or its zero-shot average at `zero_shot_limit` items per task."""
    if metric == "perplexity":
        return point.get("perplexity")
    entry = point.get("zero_shot", {})
    return entry.get("average") if entry.get("limit") == zero_shot_limit else None


def plot_sweep(payload: dict, png) -> None:
    """Thesis Fig 3.2 (data types at one block size) and Fig 3.3 (block sizes for one data type), for each metric."""
    limit = payload["zero_shot_limit"]
    metrics = ["perplexity"] + (["zero_shot_average"] if limit else [])
    fig, axes = plt.subplots(len(metrics), 2, figsize=(13, 4.5 * len(metrics)), squeeze=False)
    panels = [
        (metric, f"{label}: {view}", keep, series)
        for metric, label in zip(metrics, ["perplexity", f"zero-shot ({limit} items per task)"])
        for view, keep, series in [
            ("data types (block 64)", lambda p: p["block"] == "64", "dtype"),
            ("block sizes (NF)", lambda p: p["dtype"] == "nf", "block"),
        ]
    ]
    for ax, (metric, title, keep, series) in zip(axes.flat, panels):
        for value in DTYPES if series == "dtype" else BLOCKS:
            points = sorted(
                (
                    p
                    for p in payload.get("points", {}).values()
                    if keep(p) and p[series] == value and measured(p, metric, limit) is not None
                ),
                key=lambda p: p["total_bits"],
            )
            if points:
                ax.plot(
                    [p["total_bits"] for p in points],
                    [measured(p, metric, limit) for p in points],
                    marker="o",
                    label=value if series == "dtype" else f"block {value}",
                )
        if measured(payload.get("fp32", {}), metric, limit) is not None:
            ax.axhline(measured(payload["fp32"], metric, limit), color="black", linestyle=":", label="fp32")
        ax.set_xscale("log")
        ax.set_xlabel("total model bits")
        if metric == "perplexity":
            ax.set_yscale("log")
            ax.set_ylabel(f"WikiText-2 perplexity (first {payload['settings']['max_tokens']} tokens)")
        else:
            ax.set_ylabel(f"zero-shot average ({limit} items per task)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, png, titled(payload, ""))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--bits", nargs="*", type=int, default=[3, 4, 5, 6, 7, 8])
    parser.add_argument("--blocks", nargs="*", default=list(BLOCKS), choices=BLOCKS)
    parser.add_argument(
        "--zero-shot-limit",
        type=int,
        default=0,
        help="items per zero-shot task for the points of --zero-shot-blocks (0: perplexity only)",
    )
    parser.add_argument("--zero-shot-blocks", nargs="*", default=["64"], choices=BLOCKS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    name = results_name("kbit_sweep", args.model)
    if args.report:
        return print_report(name, report)

    # Zero-shot results carry their own limit (in each point), so a later run with another --zero-shot-limit adds
    # them without discarding the perplexities.
    study = Study(name, {"max_tokens": args.max_tokens}, args, plot=plot_sweep)
    study.payload["zero_shot_limit"] = args.zero_shot_limit
    loaded = study.load_model(args.model)
    settings = EvalSettings(tasks=("wikitext2",), max_tokens=args.max_tokens)
    zero_shot = EvalSettings(tasks=ZERO_SHOT_TASKS, limit=args.zero_shot_limit) if args.zero_shot_limit else None

    def evaluate_point(model: nn.Module, point: dict, with_zero_shot: bool) -> dict:
        if "perplexity" not in point:
            point["perplexity"] = evaluate(model, loaded.tokenizer, settings)["results"]["wikitext2"]["perplexity"]
        if with_zero_shot and measured(point, "zero_shot_average", args.zero_shot_limit) is None:
            average = evaluate(model, loaded.tokenizer, zero_shot)["zero_shot_average"]
            point["zero_shot"] = {"limit": args.zero_shot_limit, "average": average}
        return point

    fp32 = dict(study.payload.get("fp32", {})) if study.resume else {}
    fp32["total_bits"] = total_bits(loaded.model, None)
    study.set("fp32", evaluate_point(loaded.model, fp32, zero_shot is not None))
    # Block 64 first (the data-type comparison), so that a run stopped early has the most telling points.
    plans = {
        f"{dtype}{bits}-{block}": (dtype, bits, block)
        for block in sorted(args.blocks, key=lambda b: b != "64")
        for dtype in args.dtypes
        for bits in args.bits
    }
    order = list(study.rows("points")) + [key for key in plans if key not in study.rows("points")]

    def done(point: dict) -> bool:  # a point needs its zero-shot average too where this run measures it
        wants_zero_shot = zero_shot is not None and point["block"] in args.zero_shot_blocks
        return "perplexity" in point and (
            not wants_zero_shot or measured(point, "zero_shot_average", args.zero_shot_limit) is not None
        )

    for key in study.todo("points", order, done):
        if key not in plans:
            continue
        dtype, bits, block = plans[key]
        point = dict(study.rows("points").get(key, {})) if study.resume else {}
        started = time.perf_counter()
        config = KbitConfig(dtype=dtype, bits=bits, block_size=None if block == "row" else int(block))
        model, record = dequantized_copy(loaded.model, config)
        point.update(
            {
                "dtype": dtype,
                "bits": bits,
                "block": block,
                "avg_bits": record["avg_bits"],
                "total_bits": total_bits(loaded.model, record["avg_bits"]),
            }
        )
        evaluate_point(model, point, zero_shot is not None and block in args.zero_shot_blocks)
        point["seconds"] = point.get("seconds", 0.0) + time.perf_counter() - started
        study.record(
            "points",
            key,
            point,
            summary=lambda p: (
                f"{p['perplexity']:.3f} at {p['avg_bits']:.3f} bits/weight"
                + (f", zero-shot {p['zero_shot']['average']:.4f}" if "zero_shot" in p else "")
            ),
        )
    study.save()
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
