"""Bit-level scaling sweep (thesis ch. 3, Figs 3.2/3.3): WikiText-2 perplexity against total model bits for every
data type x bits 3..8 x block size {32, 64, 128, 256, per-row}, one model per run.

Each configuration quantizes every block linear with `quantize_kbit_` (so the bits are the measured storage of
the packed checkpoint) and is then evaluated with the de-quantized weights in plain float32 linears (the same
numbers the k-bit kernel computes, at FP32 speed, so the sweep's cost is the evaluation alone). Total model bits
count the quantized linears at their measured bits and everything else (embeddings, norms, lm_head) at 16 bits,
as the thesis does. Results are written after every configuration; `--resume` skips finished ones.

    python benchmarks/kbit_sweep.py                              # first 16384 WikiText-2 tokens per point
    python benchmarks/kbit_sweep.py --dtypes nf int --bits 3 4   # a slice
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from leanlm.bench import results_dir, write_results  # noqa: E402
from leanlm.evaluation import EvalSettings, evaluate  # noqa: E402
from leanlm.formats.codebooks import DTYPES  # noqa: E402
from leanlm.methods import KbitConfig, quantize_kbit_  # noqa: E402
from leanlm.models import DEFAULT_MODEL, iter_quantizable_linears, load_model  # noqa: E402
from leanlm.nn import KbitLinear  # noqa: E402
from leanlm.nn.lora import frozen_linear  # noqa: E402
from leanlm.report import save_figure  # noqa: E402

BLOCKS = ("32", "64", "128", "256", "row")


def dequantized_copy(model: nn.Module, config: KbitConfig) -> tuple[nn.Module, dict]:
    """`model` with every block linear quantized then de-quantized into a float32 nn.Linear."""
    quantized = copy.deepcopy(model)
    record = quantize_kbit_(quantized, config)
    for name, module in list(iter_quantizable_linears(quantized)):
        if isinstance(module, KbitLinear):
            linear = frozen_linear(module.dequantized_weight(), module.bias)
            quantized.set_submodule(name, linear)
    return quantized, record


def total_bits(model: nn.Module, avg_bits: float | None) -> float:
    linear_params = sum(m.weight.numel() for _, m in iter_quantizable_linears(model))
    other = sum(p.numel() for p in model.parameters()) - linear_params
    return linear_params * (avg_bits if avg_bits is not None else 16.0) + other * 16.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--bits", nargs="*", type=int, default=[3, 4, 5, 6, 7, 8])
    parser.add_argument("--blocks", nargs="*", default=list(BLOCKS), choices=BLOCKS)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)

    loaded = load_model(args.model)
    name = f"kbit_sweep_{args.model.replace('/', '_')}"
    settings = EvalSettings(tasks=("wikitext2",), max_tokens=args.max_tokens)
    path = results_dir() / f"{name}.json"
    payload = {"model": args.model, "weights_note": loaded.weights_note, "max_tokens": args.max_tokens, "points": {}}
    if args.resume and path.exists():
        previous = json.loads(path.read_text())
        if previous.get("max_tokens") == args.max_tokens:
            payload["points"] = previous["points"]

    def plot(png):
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for dtype in DTYPES:
            points = [p for p in payload["points"].values() if p["dtype"] == dtype and p["block"] == "64"]
            points.sort(key=lambda p: p["total_bits"])
            if points:
                axes[0].plot([p["total_bits"] for p in points], [p["perplexity"] for p in points], marker="o",
                             label=dtype)
        for block in BLOCKS:
            points = [p for p in payload["points"].values() if p["dtype"] == "nf" and p["block"] == block]
            points.sort(key=lambda p: p["total_bits"])
            if points:
                axes[1].plot([p["total_bits"] for p in points], [p["perplexity"] for p in points], marker="o",
                             label=f"block {block}")
        for ax, title in zip(axes, ("data types (block 64)", "block sizes (NF)")):
            if "fp32" in payload:
                ax.axhline(payload["fp32"]["perplexity"], color="black", linestyle=":", label="fp32")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("total model bits")
            ax.set_ylabel(f"WikiText-2 perplexity (first {args.max_tokens} tokens)")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=8)
        save_figure(fig, png, f"{args.model}" + (f" ({loaded.weights_note})" if loaded.weights_note else ""))

    if "fp32" not in payload:
        result = evaluate(loaded.model, loaded.tokenizer, settings)["results"]["wikitext2"]
        payload["fp32"] = {"perplexity": result["perplexity"], "total_bits": total_bits(loaded.model, None)}
    for dtype in args.dtypes:
        for bits in args.bits:
            for block in args.blocks:
                key = f"{dtype}{bits}-{block}"
                if key in payload["points"]:
                    continue
                started = time.perf_counter()
                config = KbitConfig(dtype=dtype, bits=bits, block_size=None if block == "row" else int(block))
                model, record = dequantized_copy(loaded.model, config)
                result = evaluate(model, loaded.tokenizer, settings)["results"]["wikitext2"]
                payload["points"][key] = {"dtype": dtype, "bits": bits, "block": block,
                                          "avg_bits": record["avg_bits"], "perplexity": result["perplexity"],
                                          "total_bits": total_bits(loaded.model, record["avg_bits"]),
                                          "seconds": time.perf_counter() - started}
                print(f"{key}: {result['perplexity']:.3f} at {record['avg_bits']:.3f} bits/weight", flush=True)
                write_results(name, payload, plot)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
