"""LLM.int8() on one model: thesis Table 2.1's quantizers, the outlier-threshold sweep, and speed against
bitsandbytes' Linear8bitLt (threshold 6.0, eval mode), side by side in one process.
Writes benchmarks/results/llm_int8.json + .png.

    python benchmarks/llm_int8.py                                   # full WikiText-2, --limit 100
    python benchmarks/llm_int8.py --max-tokens 16384 --limit 20     # a quick subset

Table rows (attention's matmuls stay float, as in the chapter): absmax (per-tensor), zeropoint (per-tensor
asymmetric), row-wise (per-token x per-tensor weights), vector-wise (per-token x per-output-channel) and
vector-wise + decomposition (LLM.int8(), threshold 6.0).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import asdict
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from leanlm.bench import previous_results, results_dir, time_modules, time_prefill, write_results  # noqa: E402
from leanlm.bench.peers import bitsandbytes_int8_linear  # noqa: E402
from leanlm.evaluation import ZERO_SHOT_TASKS, EvalSettings, evaluate  # noqa: E402
from leanlm.methods import LLMInt8Config, W8A8Config, quantize_  # noqa: E402
from leanlm.models import DEFAULT_MODEL, iter_quantizable_linears, load_model  # noqa: E402
from leanlm.nn import W8A8Linear  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

warnings.filterwarnings("ignore")

QUANTIZERS: dict[str, W8A8Config | None] = {
    "FP32": None,
    "absmax (per-tensor)": W8A8Config(level="O2", quantize_bmm=False),
    "zeropoint (per-tensor)": W8A8Config(level="O2", quantize_bmm=False, asymmetric=True),
    "row-wise": W8A8Config(level="O1", quantize_bmm=False),
    "vector-wise": LLMInt8Config(None).w8a8(),
    "vector-wise + decomposition (LLM.int8())": LLMInt8Config(6.0).w8a8(),
}
PARTS = {"table": ("table",), "sweep": ("threshold_sweep",),
         "speed": ("speed_linear_4096", "speed_model_prefill_512")}
THRESHOLDS = (1.0, 2.0, 4.0, 6.0, 8.0, None)  # None: no decomposition (infinite threshold)


def float_dims_share(model: nn.Module) -> float:
    counts = [m.decomposition_counts for m in model.modules() if isinstance(m, W8A8Linear)]
    dims = sum(c["dims"] for c in counts)
    return sum(c["outlier_dims"] for c in counts) / dims if dims else 0.0


def bench_linear(rows: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(4096, 4096, bias=False)
    modules = {"fp32": linear, "leanlm llm-int8": W8A8Linear.from_float(
        linear.weight, None, "per_channel", activation="per_token", outlier_threshold=6.0),
        "bitsandbytes llm-int8": bitsandbytes_int8_linear(linear, threshold=6.0)}
    results = {}
    for m in rows:
        x = torch.randn(m, 4096)
        x[:, [11, 1000, 2047]] *= 20  # a few outlier features, so both take the decomposition path
        exact = linear(x).detach()
        entry = time_modules(modules, x, exact, repeats, slow=lambda name: name.startswith("bitsandbytes") and m >= 64)
        entry["leanlm llm-int8"]["speedup_vs_bitsandbytes"] = (
            entry["bitsandbytes llm-int8"]["median_ms"] / entry["leanlm llm-int8"]["median_ms"])
        results[str(m)] = entry
        print(f"4096x4096 M={m}: " + ", ".join(
            f"{n} {v['median_ms']:.2f} ms err {v['relative_error']:.4f}" for n, v in entry.items()), flush=True)
    return results


def bench_model(loaded, length: int, repeats: int) -> dict:
    variants = {"fp32": loaded.model}
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


def plot_results(payload: dict, sweep_tokens: int, title: str):
    """A drawing function for write_results; draws whatever parts of the payload exist so far."""

    def draw(path):
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
        sweep = payload["threshold_sweep"]
        keys = list(sweep)
        if keys:
            left.plot(range(len(keys)), [sweep[k]["perplexity"] for k in keys], marker="o")
            left.set_xticks(range(len(keys)), keys)
            twin = left.twinx()
            twin.bar(range(len(keys)), [100 * sweep[k]["float_dims_share"] for k in keys], alpha=0.3, color="gray")
            twin.set_ylabel("% of input dimensions in float")
        left.set_xlabel("outlier threshold")
        left.set_ylabel(f"WikiText-2 perplexity (first {sweep_tokens} tokens)")
        speed = payload.get("speed_linear_4096", {})
        ms = list(speed)
        for name in ("leanlm llm-int8", "bitsandbytes llm-int8"):
            if ms:
                right.plot(ms, [speed[m][name]["speedup_vs_fp32"] for m in ms], marker="o", label=name)
        right.axhline(1.0, color="black", linewidth=0.8)
        right.set_yscale("log")
        right.set_xlabel("M (rows)")
        right.set_ylabel("speed-up over FP32, 4096x4096 linear")
        if ms:
            right.legend()
        save_figure(fig, path, title)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=None, help="first N WikiText-2 tokens (default: all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=100, help="items per zero-shot task")
    parser.add_argument("--sweep-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip", nargs="*", default=[], choices=["table", "sweep", "speed"],
                        help="parts to leave out; their results from the previous run are kept")
    parser.add_argument("--resume", action="store_true",
                        help="keep the table rows and sweep points a previous run with the same settings finished")
    args = parser.parse_args()

    loaded = load_model(args.model)
    settings = EvalSettings(tasks=("wikitext2", *ZERO_SHOT_TASKS), limit=args.limit, max_tokens=args.max_tokens,
                            seq_len=args.seq_len)
    payload: dict = {"model": args.model, "weights_note": loaded.weights_note, "settings": vars(settings),
                     "table": {}, "threshold_sweep": {}}
    previous = previous_results("llm_int8")
    for part in args.skip:
        for key in PARTS[part]:
            if key in previous:
                payload[key] = previous[key]
    if args.resume and previous_results("llm_int8", payload["settings"]):
        payload["table"] = previous.get("table", {})
        payload["threshold_sweep"] = previous.get("threshold_sweep", {})
    title = f"{args.model} LLM.int8()" + (f" ({loaded.weights_note})" if loaded.weights_note else "")

    def save() -> None:
        write_results("llm_int8", payload, plot_results(payload, args.sweep_tokens, title))

    if "table" not in args.skip:
        for name, config in QUANTIZERS.items():
            if name in payload["table"]:
                continue
            model = copy.deepcopy(loaded.model)
            if config is not None:
                quantize_(model, config)
            result = evaluate(model, loaded.tokenizer, settings)
            payload["table"][name] = {"config": asdict(config) if config else None,
                                      "float_dims_share": float_dims_share(model), **result}
            print(f"{name}: wikitext2 {result['results']['wikitext2']['perplexity']:.3f}, "
                  f"zero-shot {result['zero_shot_average']:.4f}", flush=True)
            save()

    if "sweep" not in args.skip:
        sweep = EvalSettings(tasks=("wikitext2",), max_tokens=args.sweep_tokens, seq_len=args.seq_len)
        for threshold in THRESHOLDS:
            if ("inf" if threshold is None else str(threshold)) in payload["threshold_sweep"]:
                continue
            model = copy.deepcopy(loaded.model)
            quantize_(model, LLMInt8Config(threshold))
            ppl = evaluate(model, loaded.tokenizer, sweep)["results"]["wikitext2"]["perplexity"]
            key = "inf" if threshold is None else str(threshold)
            payload["threshold_sweep"][key] = {"perplexity": ppl, "float_dims_share": float_dims_share(model)}
            print(f"threshold {key}: {ppl:.3f}, {100 * float_dims_share(model):.2f}% of dims in float", flush=True)
            save()

    if "speed" not in args.skip:
        payload["speed_linear_4096"] = bench_linear([1, 16, 64, 512], args.repeats)
        payload["speed_model_prefill_512"] = bench_model(loaded, 512, args.repeats)
        save()

    rows = [[name, row["results"]["wikitext2"]["perplexity"], row["zero_shot_average"],
             f"{100 * row['float_dims_share']:.2f}%"] for name, row in payload["table"].items()]
    print(format_table(["quantizer", "wikitext2 ppl", "zero-shot avg", "dims in float"], rows, markdown=True))
    print(f"wrote {results_dir() / 'llm_int8.json'}")


if __name__ == "__main__":
    main()
