"""Attention of a long prompt read the way `leanlm serve` reads prompts: chunks of 512 tokens, each chunk's queries
against the keys before it and its own causally (`leanlm.decoding.packed.piece_attention`). One masked attention
(PyTorch's scaled_dot_product_attention, which computes every masked score too) against blocks of 512, 256, 128 and
64 queries, each block's earlier keys and own keys apart, merged by their log-sum-exps. Per model shape (its
heads, key-value heads and head size, from its config) and float dtype: the attention time of one layer over the
whole prompt, median of interleaved rounds. Writes benchmarks/results/attention.json + .png.

    python benchmarks/attention.py [--models smollm2-135m qwen2.5-coder-1.5b DIR ...] [--prompt 1546]
    python benchmarks/attention.py --report
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, study_arguments, titled  # noqa: E402
from leanlm.decoding.packed import QUERY_BLOCK, piece_attention  # noqa: E402
from leanlm.plan import PREFILL_CHUNK, model_facts  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

NAME = "attention"
BLOCKS = (None, 512, 256, 128, 64)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def block_name(block: int | None) -> str:
    return "masked" if block is None else f"blocks of {block}"


def measure(shape: tuple[int, int, int], dtype: torch.dtype, prompt: int, rounds: int) -> dict:
    """One layer's attention over a `prompt`-token read in chunks of PREFILL_CHUNK, every way, interleaved."""
    heads, kv_heads, dim = shape
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, prompt, dim, generator=generator).to(dtype)
    key, value = (torch.randn(1, kv_heads, prompt, dim, generator=generator).to(dtype) for _ in range(2))
    chunks = []
    for start in range(0, prompt, PREFILL_CHUNK):
        end = min(prompt, start + PREFILL_CHUNK)
        mask = torch.ones(end - start, end, dtype=torch.bool).tril(start)
        chunks.append((query[:, :, start:end], key[:, :, :end], value[:, :, :end], mask))
    times: dict[str, list[float]] = {block_name(block): [] for block in BLOCKS}
    with torch.inference_mode():
        for round_index in range(rounds + 1):  # the first round warms up
            for block in BLOCKS:
                started = time.perf_counter()
                for q, k, v, mask in chunks:
                    piece_attention(q, k, v, mask, dim**-0.5, block)
                if round_index:
                    times[block_name(block)].append(time.perf_counter() - started)
    return {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "ms": {name: statistics.median(samples) * 1e3 for name, samples in times.items()},
    }


def report(payload: dict) -> str:
    names = [block_name(block) for block in BLOCKS]
    rows = []
    for key, r in payload.get("shapes", {}).items():
        masked = r["ms"]["masked"]
        cells = [
            f"{r['ms'][n]:.1f}" if n == "masked" else f"{r['ms'][n]:.1f} ({r['ms'][n] / masked:.2f})" for n in names
        ]
        rows.append([key, f"{r['heads']} / {r['kv_heads']} / {r['head_dim']}", *cells])
    return format_table(["model, dtype", "heads / kv heads / dim", *(f"{n}, ms" for n in names)], rows, markdown=True)


def plot(payload: dict, path) -> None:
    shapes = payload.get("shapes", {})
    if not shapes:
        return
    fig, axis = plt.subplots(figsize=(8, 3.8))
    names = [block_name(block) for block in BLOCKS]
    width = 0.8 / len(shapes)
    for index, (key, r) in enumerate(shapes.items()):
        xs = [i + index * width for i in range(len(names))]
        axis.bar(xs, [r["ms"][n] / r["ms"]["masked"] for n in names], width=width, label=key)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    axis.set_ylabel("time / one masked attention")
    axis.legend(fontsize=7)
    save_figure(fig, path, titled(payload, f"attention of a {payload['settings']['prompt']}-token prompt"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model=False)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    parser.add_argument("--prompt", type=int, default=1546, help="prompt tokens (the serve benchmark's long prompt)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.report:
        return print_report(NAME, report)
    settings = {"prompt": args.prompt, "chunk": PREFILL_CHUNK, "rounds": args.rounds, "default_block": QUERY_BLOCK}
    study = Study(NAME, settings, args, plot=plot)
    keys = {f"{Path(model).name}, {dtype}": (model, dtype) for model in args.models for dtype in DTYPES}
    for key in study.todo("shapes", keys):
        model, dtype = keys[key]
        facts = model_facts(model)
        study.record(
            "shapes",
            key,
            measure((facts.heads, facts.kv_heads, facts.head_dim), DTYPES[dtype], args.prompt, args.rounds),
            summary=lambda r: ", ".join(f"{name} {ms:.1f} ms" for name, ms in r["ms"].items()),
        )
    study.save()


if __name__ == "__main__":
    main()
