"""Opening a GGUF: leanlm's conversion, a tensor at a time, against transformers' loader, which holds the whole model.

Each row runs in a fresh process on the model's GGUF file (a registry name or a .gguf path) and records its
seconds and peak resident memory. "leanlm" is the conversion every first use of a GGUF runs (`convert_gguf`:
de-quantize one tensor, rename it, add it to a safetensors shard written when full) into a scratch directory
that is deleted after; "transformers" is `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` in float32,
how a transformers user opens a GGUF. Peak RSS counts the imports. The float32 bytes are the model's weights as
each row holds them (the conversion's shards, the loaded model's tensors).

    python benchmarks/gguf_conversion.py --model qwen2.5-coder-1.5b
    python benchmarks/gguf_conversion.py --model qwen2.5-coder-1.5b --report
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import checkpoint_bytes, process_peak_rss_bytes, weight_bytes, worker_result  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

ROWS = {
    "leanlm": "convert_gguf: a tensor at a time into float32 safetensors shards",
    "transformers": "from_pretrained(gguf_file=...): the whole model in float32",
}


def worker(row: str, gguf: str, scratch: str) -> dict:
    import torch

    started = time.perf_counter()
    if row == "leanlm":
        from leanlm.models.gguf_conversion import convert_gguf

        out = Path(scratch) / "converted"
        out.mkdir()
        convert_gguf(gguf, out)
        float_bytes = checkpoint_bytes(out)
    else:
        from transformers import AutoModelForCausalLM

        path = Path(gguf)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        float_bytes = weight_bytes(model)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_rss_bytes": process_peak_rss_bytes(), "float_bytes": float_bytes}


def summary(value: dict) -> str:
    return f"{value['seconds']:.0f} s, peak RSS {value['peak_rss_bytes'] / 2**20:,.0f} MiB"


def report(payload: dict) -> str:
    mib = 2**20
    gguf_bytes = payload["gguf_bytes"]
    table = [
        [
            row,
            f"{gguf_bytes / mib:,.0f}",
            f"{value['float_bytes'] / mib:,.0f}",
            f"{value['seconds']:.0f}",
            f"{value['peak_rss_bytes'] / mib:,.0f}",
            f"{value['peak_rss_bytes'] / value['float_bytes']:.2f}",
            ROWS[row],
        ]
        for row, value in payload.get("rows", {}).items()
    ]
    headers = ["loader", "GGUF MiB", "float32 MiB", "seconds", "peak RSS MiB", "peak / float32", "what"]
    return f"{payload.get('model')}\n{format_table(headers, table, markdown=True)}"


def plot(payload: dict, path: Path) -> None:
    rows = payload.get("rows", {})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(rows)
    ax.barh(names, [rows[name]["peak_rss_bytes"] / 2**20 for name in names], label="peak RSS")
    if rows:
        ax.axvline(next(iter(rows.values()))["float_bytes"] / 2**20, color="k", ls="--", label="float32 weights")
    ax.set_xlabel("MiB")
    ax.legend()
    save_figure(fig, path, titled(payload, "opening a GGUF"))
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(*sys.argv[2:])))
        return
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    args = parser.parse_args()
    name = results_name("gguf_conversion", args.model)
    if args.report:
        return print_report(name, report)
    from leanlm.export.to_gguf import source_gguf
    from leanlm.models.registry import REGISTRY

    gguf = source_gguf(args.model, follow=False)
    if gguf is None:
        raise SystemExit(f"{args.model!r} is neither a registered model nor a .gguf file")
    study = Study(name, {"gguf": gguf.name}, args, plot=plot)
    registered = REGISTRY.get(args.model)
    study.payload.update(
        model=args.model, gguf_bytes=gguf.stat().st_size, weights_note=registered and registered.weights_note
    )
    os.environ["HF_HUB_OFFLINE"] = "1"  # the workers inherit it: nothing is fetched
    for row in study.todo("rows", ROWS):
        scratch = tempfile.mkdtemp(prefix="leanlm-gguf-conversion-")
        try:
            study.record("rows", row, worker_result(__file__, row, str(gguf), scratch), summary=summary)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
