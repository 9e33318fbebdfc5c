"""Resident memory of quantized checkpoints against their stored bytes.

Each checkpoint is written by `leanlm quantize` and then, in a fresh process per row, loaded with
`load_any` (a quantized checkpoint loads straight into quantized modules: no float model first) and used to
generate --new-tokens tokens greedily. Per row: the bytes stored on disk, resident memory (RSS) once the
imports are done, after loading, after generating, and the process's peak; "held" is RSS after generating
less RSS after imports, the memory the model and its cache take. The float32 row is the model as it loads.

The row "w8a8 O2, int8 copy kept" emulates the old behaviour (the plain int8 weight kept beside fbgemm's
packed copy) by turning the release off in its worker: the difference to the "w8a8 O2" row is what keeping one
copy of each int8 weight saves.

    python benchmarks/resident_memory.py            # about 5 minutes on 2 cores (SmoothQuant calibrates)
    python benchmarks/resident_memory.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import (  # noqa: E402
    _status_kib,
    checkpoint_bytes,
    process_peak_rss_bytes,
    weight_bytes,
    worker_result,
)
from leanlm.report import format_table, save_figure  # noqa: E402

PROMPT = "The history of the city begins with"
# row -> `leanlm quantize` flags (None: the float model itself); the calibration is small: memory, not accuracy
ROWS = {
    "float32": None,
    "nf4-dq": ["--method", "kbit", "--double-quant"],
    "nf4-dq, bf16 tables": ["--method", "kbit", "--double-quant", "--table-dtype", "bfloat16"],
    "gptq 4-bit": ["--method", "gptq", "--bits", "4", "--calib-samples", "16"],
    "w8a8 O2": ["--method", "w8a8", "--level", "O2"],
    "w8a8 O2, int8 copy kept": ["--method", "w8a8", "--level", "O2"],
    "smoothquant O3": ["--method", "smoothquant", "--level", "O3", "--calib-samples", "16"],
    "llm-int8": ["--method", "llm-int8"],
}
KEEPS_INT8_COPY = "w8a8 O2, int8 copy kept"


def _rss() -> int:
    return _status_kib("VmRSS") * 1024


def worker(model: str, new_tokens: int, keep_int8_copy: bool) -> dict:
    import torch

    from leanlm.methods import load_any

    if keep_int8_copy:
        from leanlm.nn import W8A8Linear

        W8A8Linear.release_int8_weight = lambda self: None
    torch.set_num_threads(2)
    imports = _rss()
    loaded = load_any(model)
    after_load = _rss()
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        started = time.perf_counter()
        loaded.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - started
    after = _rss()
    return {
        "rss_after_imports_bytes": imports,
        "rss_after_load_bytes": after_load,
        "rss_after_generate_bytes": after,
        "held_bytes": after - imports,
        "peak_rss_bytes": process_peak_rss_bytes(),
        "tokens_per_second": new_tokens / seconds,
    }


def measure(row: str, args, float_bytes: int) -> dict:
    flags = ROWS[row]
    target, stored = args.model, float_bytes
    if flags is not None:
        target = args.workdir / flags_name(flags)
        if not (target / "leanlm_quant.json").exists():
            subprocess.run(
                [sys.executable, "-m", "leanlm.cli.main", "quantize", args.model, *flags, "--out", str(target)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        stored = checkpoint_bytes(target)
    keep = ["keep"] if row == KEEPS_INT8_COPY else []
    measured = worker_result(__file__, str(target), str(args.new_tokens), *keep)
    return {**measured, "stored_bytes": stored, "quantize_flags": flags}


def flags_name(flags: list[str]) -> str:
    return "_".join(flag.lstrip("-") for flag in flags)


def summary(row: dict) -> str:
    return (
        f"stored {row['stored_bytes'] / 2**20:.0f} MiB, held {row['held_bytes'] / 2**20:.0f} MiB, peak "
        f"{row['peak_rss_bytes'] / 2**20:.0f} MiB"
    )


def report(payload: dict) -> str:
    mib = 2**20
    rows = [
        [
            name,
            f"{row['stored_bytes'] / mib:.0f}",
            f"{row['rss_after_imports_bytes'] / mib:.0f}",
            f"{row['rss_after_load_bytes'] / mib:.0f}",
            f"{row['rss_after_generate_bytes'] / mib:.0f}",
            f"{row['held_bytes'] / mib:.0f}",
            f"{row['held_bytes'] / row['stored_bytes']:.2f}",
            f"{row['peak_rss_bytes'] / mib:.0f}",
            f"{row['tokens_per_second']:.1f}",
        ]
        for name, row in payload.get("rows", {}).items()
    ]
    return format_table(
        [
            "checkpoint",
            "stored MiB",
            "RSS after imports",
            "after load",
            "after generating",
            "held (generating - imports)",
            "held / stored",
            "peak RSS MiB",
            "tokens/s",
        ],
        rows,
        markdown=True,
    )


def plot(payload: dict, path) -> None:
    rows = payload.get("rows", {})
    names = list(rows)
    fig, ax = plt.subplots(figsize=(10, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [rows[n]["stored_bytes"] / 2**20 for n in names], width=0.4, label="stored")
    ax.bar(
        [i + 0.2 for i in x],
        [rows[n]["held_bytes"] / 2**20 for n in names],
        width=0.4,
        label="held in memory after generating",
    )
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("MiB")
    ax.legend()
    save_figure(fig, path, titled(payload, "stored bytes against resident memory"))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4)))
        return
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-resident-memory"
    )
    args = parser.parse_args()
    name = results_name("resident_memory", args.model)
    if args.report:
        return print_report(name, report)
    args.workdir.mkdir(parents=True, exist_ok=True)
    study = Study(name, {"model": args.model, "new_tokens": args.new_tokens}, args, plot=plot)
    loaded = study.load_model(args.model)
    float_bytes = weight_bytes(loaded.model)  # the float32 row's "stored": the model as it loads
    del loaded
    for row in study.todo("rows", ROWS):
        study.record("rows", row, measure(row, args, float_bytes), summary=summary)
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
