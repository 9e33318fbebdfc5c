"""Thesis Table 4.1 at small scale: WikiText-2 and PTB perplexity of FP32, RTN, GPTQ and SpQR at about 3 and
about 4 average bits, with the measured average bits of each row (every stored tensor counted), the outlier rate
and the quantization wall time; then the SpQRLinear inference path against FP32 at M = 1 and 512 on a
4096x4096 layer. Writes benchmarks/results/gptq_spqr_<model>.json + .png; rows are saved as they finish and
`--resume` skips finished ones.

    python benchmarks/gptq_spqr.py                                   # full test sets (about 25 min a row)
    python benchmarks/gptq_spqr.py --max-tokens 16384 --skip speed_4096   # a quick look
    python benchmarks/gptq_spqr.py --report                            # the saved table

Note for SmolLM2: its weights are de-quantized Q4_1 (4-bit, groups of 32 input columns, a scale and a minimum
each), so 4-bit min-max groups aligned to 32 columns reproduce them exactly; the rows use groups of 128
(RTN/GPTQ) and 16 (SpQR) as the chapter does, and the numbers should be read with that in mind. The `grid` part
measures it: the relative weight error of plain 4-bit min-max rounding at groups of 32, 64 and 128 (seconds).

The `held_out` part asks whether GPTQ's error feedback carries over from the calibration text to other text: for
every linear of four decoder blocks spread over the depth, the input Hessians of the float model on the
calibration windows, on other windows of the same text, on LAMBADA test passages and on WikiText-2 test; RTN,
GPTQ and GPTQ with Hessian shrinkage 0.5 (4-bit g128, each solved on the calibration Hessian), and each one's
relative output error on every text, tr(dW H dW^T) / tr(W H W^T). Without the table:

    python benchmarks/gptq_spqr.py --model qwen2.5-coder-1.5b --only held_out
"""

from __future__ import annotations

import argparse
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, time_modules, titled  # noqa: E402
from leanlm.bench.harness import cpu_description, float_paths, speed_table  # noqa: E402
from leanlm.data.datasets import wikitext2_test_text  # noqa: E402
from leanlm.evaluation import EvalSettings, evaluate  # noqa: E402
from leanlm.evaluation.perplexity import perplexity_windows  # noqa: E402
from leanlm.formats.gptq import SolverSettings, solve  # noqa: E402
from leanlm.formats.minmax import round_trip_minmax  # noqa: E402
from leanlm.methods import Calibration, GPTQConfig, RTNConfig, SpQRConfig  # noqa: E402
from leanlm.methods.gptq import input_hessians  # noqa: E402
from leanlm.models import architecture_for, iter_quantizable_linears  # noqa: E402
from leanlm.models.architectures import decoder_blocks, linear_weight_out_in  # noqa: E402
from leanlm.nn import SpQRLinear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402


def rows(calibration: dict) -> dict[str, RTNConfig | GPTQConfig | SpQRConfig | None]:
    return {
        "FP32": None,
        "RTN 4-bit g128": RTNConfig(4, 128),
        "GPTQ 4-bit g128": GPTQConfig(4, 128, **calibration),
        "SpQR 4-bit base": SpQRConfig(bits=4, beta1=16, beta2=16, outlier_threshold=0.2, **calibration),
        "RTN 3-bit g128": RTNConfig(3, 128),
        "GPTQ 3-bit g128": GPTQConfig(3, 128, **calibration),
        "SpQR 3-bit base": SpQRConfig(bits=3, beta1=16, beta2=16, outlier_threshold=0.2, **calibration),
        # The same at fewer bits: fewer outliers (tau 0.3 kept about 1.1% on four probed blocks, against 2.4% at
        # tau 0.2: about 4.06 bits, below GPTQ 4-bit's 4.34), and larger groups with almost no outliers (about
        # 3.4 bits, beside GPTQ 3-bit's 3.34).
        "SpQR 3-bit base, tau 0.3": SpQRConfig(bits=3, beta1=16, beta2=16, outlier_threshold=0.3, **calibration),
        "SpQR 3-bit base, beta 32, tau 1": SpQRConfig(bits=3, beta1=32, beta2=32, outlier_threshold=1.0, **calibration),
        # SmolLM2's weights are de-quantized Q4_1: 4-bit min-max codes in blocks of 32 consecutive inputs, so a
        # 4-bit base in groups of 32 taken in column order sits on their own grid, and 8-bit statistics keep the
        # grid almost exactly (about 4.6 bits). The act-order row beside it separates that grid from the
        # statistics' extra bits; Gemma (mostly Q5_0, plus Q4_K with searched scales and Q6_K) is the control.
        "SpQR 4-bit base, beta 32, 8-bit statistics, tau 1": SpQRConfig(
            bits=4, beta1=32, beta2=32, outlier_threshold=1.0, statistic_bits=8, **calibration
        ),
        "SpQR 4-bit base, beta 32, 8-bit statistics, tau 1, column order": SpQRConfig(
            bits=4, beta1=32, beta2=32, outlier_threshold=1.0, statistic_bits=8, act_order=False, **calibration
        ),
    }


def grid_alignment(model: nn.Module, bits: int = 4, groups: tuple[int, ...] = (32, 64, 128)) -> dict[str, float]:
    """Relative error, pooled over every block linear, of plain min-max rounding (no Hessian) to `bits` bits in
    groups of g consecutive input columns (the columns past the last whole group left out): how far a new grid
    lies from the one the weights may already sit on."""
    table, errors = architecture_for(model), {}
    for group in groups:
        error = norm = 0.0
        for _, module in iter_quantizable_linears(model, table):
            weight = linear_weight_out_in(module, table)
            usable = weight[:, : weight.shape[1] // group * group].detach().float()
            grouped = usable.reshape(usable.shape[0], -1, group)
            error += (round_trip_minmax(grouped, bits) - grouped).pow(2).sum().item()
            norm += grouped.pow(2).sum().item()
        errors[str(group)] = (error / norm) ** 0.5
    return errors


HELD_OUT_BASELINE = "RTN 4-bit g128"
HELD_OUT_SOLVERS = {
    HELD_OUT_BASELINE: RTNConfig(4, 128),
    "GPTQ 4-bit g128": GPTQConfig(4, 128),
    "GPTQ 4-bit g128, shrinkage 0.5": GPTQConfig(4, 128, hessian_shrinkage=0.5),
}
PROBED_BLOCKS = 4


def held_out_texts(tokenizer, calibration: Calibration, samples: int, windows: int) -> dict[str, torch.Tensor]:
    """The calibration windows the solvers fit, and `windows` windows of the same length from three other
    texts: other windows of the calibration text, LAMBADA test passages, and WikiText-2 test from its start (the
    windows its perplexity scores, cut to the calibration's length)."""
    seq_len = calibration.seq_len
    wikitext = perplexity_windows(tokenizer, wikitext2_test_text(), seq_len=seq_len, max_tokens=windows * seq_len)
    return {
        "calibration": calibration.batches(samples),
        "other calibration windows": calibration.held_out(windows),
        "LAMBADA test": Calibration(tokenizer, seq_len=seq_len, source="lambada-test").batches(windows),
        "WikiText-2 test": torch.tensor(wikitext[:windows]),
    }


def held_out(model: nn.Module, texts: dict[str, torch.Tensor]) -> dict:
    """Per linear of PROBED_BLOCKS blocks spread over the depth: each solver's relative output error on every
    text, the solvers fitted on the first text's Hessian."""
    table = architecture_for(model)
    count = len(decoder_blocks(model, table))
    blocks = sorted({round(i * (count - 1) / (PROBED_BLOCKS - 1)) for i in range(PROBED_BLOCKS)})
    hessians = {text: input_hessians(model, batches, blocks) for text, batches in texts.items()}
    fitted_on = next(iter(texts))
    linears = {}
    for name, per_text in hessians[fitted_on].items():
        weight = linear_weight_out_in(model.get_submodule(name), table).detach().float()
        scale = {text: (weight @ hessians[text][name] * weight).sum().item() for text in texts}
        errors = {}
        for solver, config in HELD_OUT_SOLVERS.items():
            delta = solve(weight, per_text, config.solver()).weight - weight
            errors[solver] = {text: (delta @ hessians[text][name] * delta).sum().item() / scale[text] for text in texts}
        linears[name] = errors
        print(f"{name}: " + "; ".join(f"{s} " + ", ".join(f"{e:.2e}" for e in v.values()) for s, v in errors.items()))
    return {"blocks": blocks, "windows": {text: list(b.shape) for text, b in texts.items()}, "linears": linears}


def held_out_ratios(part: dict, solver: str, text: str) -> list[float]:
    """`solver`'s output error over RTN's on `text`, one per probed linear."""
    return [errors[solver][text] / errors[HELD_OUT_BASELINE][text] for errors in part["linears"].values()]


def held_out_table(part: dict) -> str:
    texts = list(part["windows"])
    rows = []
    for solver in HELD_OUT_SOLVERS:
        cells = []
        for text in texts:
            errors = [linear[solver][text] for linear in part["linears"].values()]
            cell = f"{statistics.median(errors):.2e}"
            if solver != HELD_OUT_BASELINE:
                ratios = held_out_ratios(part, solver, text)
                cell += f" ({statistics.median(ratios):.2f}x; {sum(ratio > 1 for ratio in ratios)} worse)"
            cells.append(cell)
        rows.append([solver, *cells])
    windows = part["windows"]
    return format_table(
        ["solver (fitted on the calibration windows)", *(f"{t}, {windows[t][0]} x {windows[t][1]}" for t in texts)],
        rows,
        markdown=True,
    )


def bench_speed(repeats: int) -> dict:
    """SpQRLinear (4-bit base, 3-bit statistics, tau 0.2; its default path: the k-bit kernel + sparse outliers)
    against FP32 on a 4096x4096 layer whose Hessian comes
    from random inputs with uneven channel scales."""
    torch.manual_seed(0)
    linear = nn.Linear(4096, 4096, bias=False)
    with torch.no_grad():  # Gaussian weights with a sprinkle of large ones, so that the sparse part has work
        linear.weight.normal_(0, 0.02)
        linear.weight[torch.rand(4096, 4096) < 0.005] *= 10
    inputs = torch.randn(4096, 4096) * torch.linspace(0.2, 3.0, 4096)
    hessian = 2 * inputs.T @ inputs / len(inputs)
    settings = SolverSettings(bits=4, group_size=16, statistic_bits=3, outlier_threshold=0.2, damping=1.0)
    quantized = SpQRLinear.from_solved(solve(linear.weight, hessian, settings), settings, None)
    results = {
        "outlier_rate": quantized.outlier_count / linear.weight.numel(),
        "bits_per_weight": quantized.bits_per_weight(),
        "cpu": cpu_description(),
    }
    for m in (1, 512):
        x = torch.randn(m, 4096)
        exact = linear(x).detach()
        entry = time_modules({**float_paths(linear), "leanlm spqr": quantized}, x, exact, repeats)
        results[str(m)] = entry
        print(f"4096x4096 M={m}: " + ", ".join(f"{n} {v['median_ms']:.2f} ms" for n, v in entry.items()), flush=True)
    return results


def plot_held_out(part: dict, axis) -> None:
    texts = list(part["windows"])
    for offset, solver in enumerate(solver for solver in HELD_OUT_SOLVERS if solver != HELD_OUT_BASELINE):
        for index, text in enumerate(texts):
            ratios = held_out_ratios(part, solver, text)
            xs = [index + 0.2 * (2 * offset - 1)] * len(ratios)
            axis.scatter(xs, ratios, s=14, color=f"C{offset}", label=solver if index == 0 else None)
    axis.axhline(1.0, color="black", linestyle="--", linewidth=0.8, label=HELD_OUT_BASELINE)
    axis.set_xticks(range(len(texts)), texts, fontsize=7)
    axis.set_yscale("log")
    axis.set_ylabel("output error / RTN's, per linear")
    axis.legend(fontsize=7)


def plot_results(payload: dict, path) -> None:
    part = payload.get("held_out")
    if part and not payload.get("table"):
        fig, axis = plt.subplots(figsize=(7, 4.2))
        plot_held_out(part, axis)
        return save_figure(fig, path, titled(payload, "error feedback on text it was not fitted on"))
    fig, axes = plt.subplots(1, 2 if part else 1, figsize=(13 if part else 7, 4.2), squeeze=False)
    axis = axes[0][0]
    if part:
        plot_held_out(part, axes[0][1])
    for name, row in payload.get("table", {}).items():
        if row.get("avg_bits") is None:
            axis.axhline(row["wikitext2"], color="black", linestyle="--", linewidth=0.8, label=name)
            continue
        marker = {"RTN": "s", "GPTQ": "o", "SpQR": "*"}[name.split()[0]]
        axis.scatter(row["avg_bits"], row["wikitext2"], marker=marker, s=60, label=name)
    axis.set_xlabel("average bits per weight (measured storage)")
    axis.set_ylabel("WikiText-2 perplexity")
    axis.set_yscale("log")
    if payload.get("table"):
        axis.legend(fontsize=7)
    save_figure(fig, path, titled(payload, "RTN / GPTQ / SpQR"))


def report(payload: dict) -> str:
    tables = [table_report(payload)] if payload.get("table") else []
    if "held_out" in payload:
        part = payload["held_out"]
        tables.append(
            f"Relative output error, median over the {len(part['linears'])} linears of blocks "
            f"{', '.join(map(str, part['blocks']))} (in brackets: the median of each linear's ratio to RTN's, "
            "and how many linears are worse than RTN's)\n\n" + held_out_table(part)
        )
    return "\n\n".join(tables)


def table_report(payload: dict) -> str:
    rows = payload.get("table", {})
    fp32 = rows.get("FP32", {}).get("wikitext2")
    table = [
        [
            n,
            r["avg_bits"] or 32.0,
            None if r["outlier_rate"] is None else f"{100 * r['outlier_rate']:.2f}%",
            r["wikitext2"],
            f"{100 * (r['wikitext2'] / fp32 - 1):+.1f}%" if fp32 and r["avg_bits"] else None,
            r["ptb"],
            None if r["quantize_seconds"] is None else f"{r['quantize_seconds']:.0f} s",
        ]
        for n, r in rows.items()
    ]
    out = format_table(
        [
            "method",
            "avg bits (measured)",
            "outlier rate",
            "WikiText-2 ppl",
            "vs FP32",
            "PTB ppl",
            "quantization wall time",
        ],
        table,
        markdown=True,
    )
    speed = payload.get("speed_4096", {})
    if "bf16" in speed.get("1", {}):  # measured with the bf16 reference
        out += (
            f"\n\nSpQRLinear, 4096 x 4096, {speed['bits_per_weight']:.2f} bits per weight, on {speed['cpu']}: ms "
            "(speed-up over the best float path)\n\n"
            + speed_table(
                {m: speed[m] for m in ("1", "512")},
                extra={"rel. error": lambda row: f"{row['leanlm spqr']['relative_error']:.3f}"},
            )
        )
    return out


def table_row(result: dict, record) -> dict:
    record = record or {}
    return {
        "wikitext2": result["wikitext2"]["perplexity"],
        "ptb": result["ptb"]["perplexity"],
        "avg_bits": record.get("avg_bits"),
        "outlier_rate": record.get("outlier_rate"),
        "quantize_seconds": record.get("seconds"),
        "config": {k: v for k, v in record.items() if k not in ("avg_bits", "outlier_rate", "seconds")} or None,
        "results": result,
    }


def summary(row: dict) -> str:
    return f"wikitext2 {row['wikitext2']:.3f}, ptb {row['ptb']:.3f}" + (
        f", {row['avg_bits']:.3f} bits, {100 * row['outlier_rate']:.2f}% outliers, {row['quantize_seconds']:.0f} s"
        if row["avg_bits"] is not None
        else ""
    )


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--max-tokens", type=int, default=None, help="first N tokens of each test set (default all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--held-out-windows", type=int, default=16, help="windows of each other text (held_out)")
    args = parser.parse_args()
    name = results_name("gptq_spqr", args.model)
    if args.report:
        return print_report(name, report)

    settings = EvalSettings(tasks=("wikitext2", "ptb"), max_tokens=args.max_tokens, seq_len=args.seq_len)
    calibration = dict(calibration_samples=args.calib_samples)
    # The kernel's speed and the grid alignment do not depend on the evaluation settings.
    study = Study(
        name,
        {**vars(settings), **calibration, "calibration_seq_len": args.calib_seq_len},
        args,
        plot=plot_results,
        independent=("speed_4096", "grid_alignment"),
    )
    loaded = study.load_model(args.model)

    data = Calibration(loaded.tokenizer, samples=args.calib_samples, seq_len=args.calib_seq_len)
    study.quantized_rows(
        "table",
        loaded.model,
        rows(calibration),
        lambda model, record: table_row(evaluate(model, loaded.tokenizer, settings)["results"], record),
        calibration=data,
        summary=summary,
    )
    if study.pending("grid_alignment"):
        study.set("grid_alignment", {"bits": 4, "relative_error_by_group": grid_alignment(loaded.model)})
        print(
            f"4-bit min-max rounding, relative weight error by group size: "
            f"{study.payload['grid_alignment']['relative_error_by_group']}",
            flush=True,
        )
    if study.pending("held_out"):
        texts = held_out_texts(loaded.tokenizer, data, args.calib_samples, args.held_out_windows)
        study.set("held_out", held_out(loaded.model, texts))
    if study.pending("speed_4096"):
        study.set("speed_4096", bench_speed(args.repeats))
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
