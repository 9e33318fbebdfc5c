"""LLM.int8() on one model: Dettmers' thesis Table 2.1's quantizers, the outlier-threshold sweep, and speed against
bitsandbytes' Linear8bitLt (threshold 6.0, eval mode), side by side in one process.
Writes benchmarks/results/llm_int8.json + .png.

    python benchmarks/llm_int8.py                                   # full WikiText-2, --limit 100
    python benchmarks/llm_int8.py --max-tokens 16384 --limit 20     # a quick subset
    python benchmarks/llm_int8.py --report                          # the saved table

Table rows (attention's matmuls stay float, as in the chapter): absmax (per-tensor), zeropoint (per-tensor
asymmetric), row-wise (per-token x per-tensor weights), vector-wise (per-token x per-output-channel) and
vector-wise + decomposition (LLM.int8(), threshold 6.0).
"""

from __future__ import annotations

import argparse
import copy
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from leanlm.bench import Study, print_report, study_arguments, time_modules, time_prefill, titled  # noqa: E402
from leanlm.bench.harness import cpu_description, float_paths, speed_table  # noqa: E402
from leanlm.bench.peers import bitsandbytes_int8_linear  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.methods import LLMInt8Config, W8A8Config, quantize_  # noqa: E402
from leanlm.models import iter_quantizable_linears  # noqa: E402
from leanlm.nn import W8A8Linear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

warnings.filterwarnings("ignore")

QUANTIZERS: dict[str, W8A8Config | None] = {
    "FP32": None,
    "absmax (per-tensor)": W8A8Config(level="O2", quantize_bmm=False),
    "zeropoint (per-tensor)": W8A8Config(level="O2", quantize_bmm=False, asymmetric=True),  # asymmetric, both operands
    "row-wise": W8A8Config(level="O1", quantize_bmm=False),  # per-token x per-tensor weights
    "vector-wise": LLMInt8Config(None).w8a8(),  # per-token x per-output-channel
    "vector-wise + decomposition (LLM.int8())": LLMInt8Config(6.0).w8a8(),  # threshold 6
}
THRESHOLDS = {str(t): LLMInt8Config(t) for t in (1.0, 2.0, 4.0, 6.0, 8.0)} | {"inf": LLMInt8Config(None)}


def float_dims_share(model: nn.Module) -> float:
    counts = [m.decomposition_counts for m in model.modules() if isinstance(m, W8A8Linear)]
    dims = sum(c["dims"] for c in counts)
    return sum(c["outlier_dims"] for c in counts) / dims if dims else 0.0


def bench_linear(rows: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(4096, 4096, bias=False)
    modules = {
        **float_paths(linear),
        "leanlm llm-int8": W8A8Linear.from_float(
            linear.weight, None, "per_channel", activation="per_token", outlier_threshold=6.0
        ),
        "bitsandbytes llm-int8": bitsandbytes_int8_linear(linear, threshold=6.0),
    }
    results = {"cpu": cpu_description()}
    for m in rows:
        x = torch.randn(m, 4096)
        x[:, [11, 1000, 2047]] *= 20  # a few outlier features, so both take the decomposition path
        exact = linear(x).detach()
        entry = time_modules(modules, x, exact, repeats)
        entry["leanlm llm-int8"]["speedup_vs_bitsandbytes"] = (
            entry["bitsandbytes llm-int8"]["median_ms"] / entry["leanlm llm-int8"]["median_ms"]
        )
        results[str(m)] = entry
        print(
            f"4096x4096 M={m}: "
            + ", ".join(f"{n} {v['median_ms']:.2f} ms err {v['relative_error']:.4f}" for n, v in entry.items()),
            flush=True,
        )
    return results


def bench_model(loaded, length: int, repeats: int) -> dict:
    variants = {"fp32": loaded.model, "bf16": copy.deepcopy(loaded.model).to(torch.bfloat16)}
    ours = copy.deepcopy(loaded.model)
    quantize_(ours, LLMInt8Config(6.0))
    variants["leanlm llm-int8"] = ours
    theirs = copy.deepcopy(loaded.model)
    for name, module in list(iter_quantizable_linears(theirs)):
        theirs.set_submodule(name, bitsandbytes_int8_linear(module, threshold=6.0))
    variants["bitsandbytes llm-int8"] = theirs
    ids = torch.randint(0, loaded.tokenizer.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    results = time_prefill(variants, ids, repeats)
    print(f"prefill {length}: " + ", ".join(f"{n} {v['tokens_per_second']:.0f} tok/s" for n, v in results.items()))
    return results


def plot_results(payload: dict, path) -> None:
    """Draws whatever parts of the payload exist so far."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    sweep = payload.get("threshold_sweep", {})
    keys = list(sweep)
    if keys:
        left.plot(range(len(keys)), [sweep[k]["perplexity"] for k in keys], marker="o")
        left.set_xticks(range(len(keys)), keys)
        twin = left.twinx()
        twin.bar(range(len(keys)), [100 * sweep[k]["float_dims_share"] for k in keys], alpha=0.3, color="gray")
        twin.set_ylabel("% of input dimensions in float")
    left.set_xlabel("outlier threshold")
    left.set_ylabel(f"WikiText-2 perplexity (first {payload['settings']['sweep_tokens']} tokens)")
    speed = {m: row for m, row in payload.get("speed_linear_4096", {}).items() if m != "cpu"}
    ms = list(speed)
    for name in ("leanlm llm-int8", "bitsandbytes llm-int8"):
        if ms:
            right.plot(ms, [speed[m][name]["speedup_vs_best_float"] for m in ms], marker="o", label=name)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_yscale("log")
    right.set_xlabel("M (rows)")
    right.set_ylabel("speed-up over the best float path, 4096x4096 linear")
    if ms:
        right.legend()
    save_figure(fig, path, titled(payload, "LLM.int8()"))


def report(payload: dict) -> str:
    """The quantizer table, the threshold sweep and the linear's speed, as the README shows them."""
    out, table = [], payload.get("table", {})
    fp32 = table.get("FP32", {}).get("results", {}).get("wikitext2", {}).get("perplexity")
    if table:
        out.append(
            format_table(
                [
                    "quantizer (Dettmers' thesis Table 2.1)",
                    "WikiText-2 ppl",
                    "vs FP32",
                    "zero-shot avg",
                    "input dims in float",
                ],
                [
                    [
                        name,
                        row["results"]["wikitext2"]["perplexity"],
                        f"{100 * (row['results']['wikitext2']['perplexity'] / fp32 - 1):+.1f}%" if fp32 else None,
                        row["zero_shot_average"],
                        f"{100 * row['float_dims_share']:.2f}%" if row["float_dims_share"] else "-",
                    ]
                    for name, row in table.items()
                ],
                markdown=True,
            )
        )
    sweep = payload.get("threshold_sweep", {})
    if sweep:
        labels = [f"{float(key):g}" if key != "inf" else "inf (no decomposition)" for key in sweep]
        out.append(
            format_table(
                ["threshold", *labels],
                [
                    ["perplexity", *(row["perplexity"] for row in sweep.values())],
                    [
                        "dims in float",
                        *(
                            f"{100 * row['float_dims_share']:.1f}%" if row["float_dims_share"] else "0"
                            for row in sweep.values()
                        ),
                    ],
                ],
                markdown=True,
            )
        )
    speed = {m: row for m, row in payload.get("speed_linear_4096", {}).items() if m != "cpu"}
    if speed:
        ours, theirs = "leanlm llm-int8", "bitsandbytes llm-int8"
        out.append(
            speed_table(
                speed,
                extra={
                    "leanlm vs bitsandbytes": lambda row: f"{row[ours]['speedup_vs_bitsandbytes']:.2f}x",
                    "rel. error leanlm / bnb": lambda row: (
                        f"{row[ours]['relative_error']:.4f} / {row[theirs]['relative_error']:.4f}"
                    ),
                },
            )
        )
    prefill = payload.get("speed_model_prefill_512", {})
    if "bf16" in prefill:
        out.append(
            format_table(
                ["prefill 512 tokens", *prefill],
                [
                    [
                        "tokens/s",
                        *(
                            f"{row['tokens_per_second']:.0f}"
                            + ("" if name in ("fp32", "bf16") else f" ({row['speedup_vs_best_float']:.2f}x)")
                            for name, row in prefill.items()
                        ),
                    ]
                ],
                markdown=True,
            )
        )
    return "\n\n".join(out)


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--max-tokens", type=int, default=None, help="first N WikiText-2 tokens (default: all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=100, help="items per zero-shot task")
    parser.add_argument("--sweep-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.report:
        return print_report("llm_int8", report)

    settings = EvalSettings(
        tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens, seq_len=args.seq_len
    )
    study = Study(
        "llm_int8",
        {**vars(settings), "sweep_tokens": args.sweep_tokens},
        args,
        plot=plot_results,
        independent=("speed_linear_4096",),
    )
    loaded = study.load_model(args.model)
    model, tokenizer = loaded.model, loaded.tokenizer

    study.quantized_rows(
        "table",
        model,
        QUANTIZERS,
        lambda quantized, record: {
            "config": record,
            "float_dims_share": float_dims_share(quantized),
            **evaluate(quantized, tokenizer, settings),
        },
        summary=lambda row: (
            f"wikitext2 {row['results']['wikitext2']['perplexity']:.3f}, zero-shot {row['zero_shot_average']:.4f}"
        ),
    )
    sweep = EvalSettings(tasks=("wikitext2",), max_tokens=args.sweep_tokens, seq_len=args.seq_len)
    study.quantized_rows(
        "threshold_sweep",
        model,
        THRESHOLDS,
        lambda quantized, record: {
            "perplexity": evaluate(quantized, tokenizer, sweep)["results"]["wikitext2"]["perplexity"],
            "float_dims_share": float_dims_share(quantized),
        },
        summary=lambda row: f"{row['perplexity']:.3f}, {100 * row['float_dims_share']:.2f}% of dims in float",
    )
    if study.pending("speed_linear_4096"):
        study.set("speed_linear_4096", bench_linear([1, 16, 64, 512], args.repeats))
    if study.pending("speed_model_prefill_512"):
        study.set("speed_model_prefill_512", bench_model(loaded, 512, args.repeats))
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
