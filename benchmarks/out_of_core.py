"""Out of core: quantize and run a model larger than this machine's memory, measured.

A Llama-3-8B-shaped model (32 blocks, hidden 4096, intermediate 14336, 32 query / 8 key-value heads, untied
output head) with SmolLM2's tokenizer and vocabulary (49,152: so it runs end to end on real text) and seeded
random bf16 weights: 7.4B parameters, 14.8 GB as bf16 shards, 29.5 GB in float32, which cannot be loaded on this
24 GB machine. Every step runs in a fresh process (its peak resident memory, imports included, is its own) and
is a row of the result file (--resume keeps finished rows):

  write      the shards, written by `leanlm.models.synthetic.write_random_model` one shard at a time
  nf4-dq     `leanlm quantize SRC --method kbit --double-quant` (block by block from disk)
  nf4-dq-bf16-tables   the same with `--table-dtype bfloat16` (the embedding and output head stored in bfloat16)
  w8a8-O2    `leanlm quantize SRC --method w8a8 --level O2`
  gptq-4bit  `leanlm quantize SRC --method gptq --calib-samples 16 --calib-seq-len 512`
  generate   greedy decoding of --new-tokens tokens from the NF4 checkpoint (`load_quantized`: no float model)
  qlora      `leanlm finetune NF4_CHECKPOINT --method qlora --max-steps 5 --batch-size 1 --seq-len 256
             --gradient-checkpointing` on lines of LAMBADA's development text (the checkpoint is the frozen base)

Checkpoints are written under --workdir (about 30 GB of disk for all steps; each step checks first). Writes
benchmarks/results/out_of_core_llama3-8b-shape.json + .png.

    python benchmarks/out_of_core.py                       # every step, about an hour on 2 cores
    python benchmarks/out_of_core.py --only write nf4 generate
    python benchmarks/out_of_core.py --only gptq --step-minutes 60   # GPTQ takes hours here: in parts
    python benchmarks/out_of_core.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, study_arguments  # noqa: E402
from leanlm.bench.harness import cpu_description, process_peak_rss_bytes, worker_result  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

NAME = "out_of_core_llama3-8b-shape"
SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
QUANTIZE_STEPS = {
    "nf4-dq": ["--method", "kbit", "--double-quant"],
    "nf4-dq-bf16-tables": ["--method", "kbit", "--double-quant", "--table-dtype", "bfloat16"],
    "w8a8-O2": ["--method", "w8a8", "--level", "O2"],
    "gptq-4bit": ["--method", "gptq", "--bits", "4", "--calib-samples", "16", "--calib-seq-len", "512"],
}
BUDGET_GIB = {
    "nf4-dq": 4,
    "nf4-dq-bf16-tables": 4,
    "w8a8-O2": 4,
    "gptq-4bit": 6,  # the targets
    "generate": 6,
    "qlora": 10,
}
QLORA_STEPS = 5
PROMPT = "The history of the city begins with"


def _tokenizer():
    from leanlm.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def write_worker(directory: Path) -> dict:
    import transformers as hf

    from leanlm.models.synthetic import write_random_model

    tokenizer = _tokenizer()
    config = hf.LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **SHAPE
    )
    started = time.perf_counter()
    write_random_model(config, directory, seed=0, tokenizer=tokenizer, shard_bytes=2 << 30)
    stored = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    parameters = json.loads((directory / "model.safetensors.index.json").read_text())["metadata"]["total_size"] // 2
    return {
        "seconds": time.perf_counter() - started,
        "stored_bytes": stored,
        "parameters": parameters,
        "float32_bytes": 4 * parameters,
        "peak_rss_bytes": process_peak_rss_bytes(),
    }


def generate_worker(checkpoint: Path, new_tokens: int) -> dict:
    import torch

    from leanlm.methods import load_quantized

    torch.set_num_threads(2)
    started = time.perf_counter()
    loaded, _ = load_quantized(checkpoint)
    load_seconds = time.perf_counter() - started
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        started = time.perf_counter()
        loaded.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - started
    return {
        "load_seconds": load_seconds,
        "prompt_tokens": ids.shape[1],
        "new_tokens": new_tokens,
        "generate_seconds": seconds,
        "tokens_per_second": new_tokens / seconds,
        "peak_rss_bytes": process_peak_rss_bytes(),
    }


def qlora_worker(checkpoint: Path, out: Path) -> dict:
    from leanlm.cli.main import main
    from leanlm.data import plain_text

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    data = out / "train.txt"
    data.write_text("\n".join(plain_text("lambada-dev").splitlines()[:150]) + "\n")
    started = time.perf_counter()
    code = main(
        [
            "finetune",
            str(checkpoint),
            "--method",
            "qlora",
            "--data",
            str(data),
            "--out",
            str(out / "adapter"),
            "--max-steps",
            str(QLORA_STEPS),
            "--batch-size",
            "1",
            "--seq-len",
            "256",
            "--gradient-checkpointing",
            "--json",
            str(out / "finetune.json"),
        ]
    )
    if code != 0:
        raise SystemExit(f"leanlm finetune exited with {code}")
    record = json.loads((out / "finetune.json").read_text())
    return {
        "seconds": time.perf_counter() - started,
        "steps": record["steps"],
        "seconds_per_step": 256 / record["tokens_per_second"],
        "train_loss_first": record["train_loss_first"],
        "train_loss_last": record["train_loss_last"],
        "trainable_parameters": record["trainable_parameters"],
        "peak_rss_bytes": process_peak_rss_bytes(),
    }


def _check_disk(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SystemExit(f"{directory} has {free / 2**30:.1f} GiB free; this step needs about {needed / 2**30:.1f}")


def quantize_step(source: Path, out: Path, flags: list[str], float_bytes: int, minutes: float | None) -> dict:
    """`leanlm quantize` in a subprocess, its peak RSS read from /proc while it runs. With a budget of `minutes`
    it is stopped (Ctrl-C: the blocks written are kept) when the budget runs out, and the row says how far it
    got; the next run of the step continues it (`--resume`)."""
    from leanlm.bench.harness import process_memory_bytes
    from leanlm.storage import resumable_staging

    shutil.rmtree(out, ignore_errors=True)
    _check_disk(out.parent, float_bytes // 3)
    result_json = out.with_suffix(".json")
    result_json.unlink(missing_ok=True)
    staging = resumable_staging(out)
    done_before = len(list(staging.glob("block-*.safetensors")))
    started = time.perf_counter()
    log = out.with_suffix(".log")  # a file, not a pipe: progress bars never fill a buffer nobody reads
    with open(log, "w") as stderr:
        # SIGINT as the default action: a shell's background job would pass on an ignored one, and Ctrl-C would
        # not reach Python.
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "leanlm",
                "quantize",
                str(source),
                *flags,
                "--out",
                str(out),
                "--resume",
                "--json",
                str(result_json),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    peak, stopped = 0, False
    while process.poll() is None:
        try:
            peak = max(peak, process_memory_bytes(process.pid))
        except (OSError, ValueError):  # it has just ended
            pass
        if minutes is not None and not stopped and time.perf_counter() - started > 60 * minutes:
            process.send_signal(signal.SIGINT)
            stopped = True
        time.sleep(2)
    error = log.read_text()
    seconds = time.perf_counter() - started
    if stopped and process.returncode == 130:
        written = sorted(staging.glob("block-*.safetensors"), key=lambda path: path.stat().st_mtime)
        times = [path.stat().st_mtime for path in written[done_before:]]
        return {
            "partial": True,
            "blocks_done": len(written),
            "blocks": SHAPE["num_hidden_layers"],
            "seconds": seconds,
            "peak_rss_bytes": peak,
            "seconds_per_block": statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else None,
        }
    if process.returncode != 0:
        raise SystemExit(f"leanlm quantize {' '.join(flags)} failed:\n{error[-3000:]}")
    payload = json.loads(result_json.read_text())
    stored = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    return {
        "seconds": seconds,
        "quantize_seconds": payload["seconds"],
        "avg_bits": payload["avg_bits"],
        "stored_bytes": stored,
        "peak_rss_bytes": max(peak, payload["peak_rss_bytes"]),
        "resumed_after_blocks": done_before,
    }


def report(payload: dict) -> str:
    steps = payload.get("steps", {})
    written = steps.get("write", {})
    lines = [
        f"{payload.get('cpu', '')}, {payload.get('memory_bytes', 0) / 2**30:.1f} GiB of memory; "
        f"{written.get('parameters', 0) / 1e9:.2f}B parameters, {written.get('float32_bytes', 0) / 2**30:.1f} GiB "
        "in float32"
    ]
    rows = []
    for step, value in steps.items():
        budget = BUDGET_GIB.get(step)
        if step == "generate":
            what = (
                f"{value['tokens_per_second']:.2f} tok/s ({value['new_tokens']} tokens from the NF4 checkpoint; "
                f"load {value['load_seconds']:.0f} s)"
            )
        elif step == "qlora":
            what = (
                f"{value['seconds_per_step']:.0f} s per step (batch 1 x 256 tokens, {value['steps']} steps, "
                f"{value['trainable_parameters'] / 1e6:.1f}M adapter weights); loss {value['train_loss_first']:.2f} "
                f"-> {value['train_loss_last']:.2f}"
            )
        elif step == "write":
            what = "seeded random bf16 shards"
        elif value.get("partial"):
            per_block = value["seconds_per_block"]
            what = (
                f"stopped at its time budget: {value['blocks_done']} of {value['blocks']} blocks written"
                + (f", {per_block / 60:.1f} min per block" if per_block else "")
                + "; --resume continues it"
            )
        else:
            what = f"{value['avg_bits']:.2f} bits/weight" if value.get("avg_bits") else "int8 weights"
        stored = f"{value['stored_bytes'] / 2**30:.2f}" if "stored_bytes" in value else ""
        seconds = value.get("seconds", value.get("load_seconds", 0) + value.get("generate_seconds", 0))
        rows.append(
            [
                step,
                stored,
                f"{value['peak_rss_bytes'] / 2**30:.2f}",
                f"<= {budget}" if budget else "",
                f"{seconds / 60:.1f}",
                what,
            ]
        )
    lines.append(
        format_table(["step", "stored GiB", "peak RSS GiB", "target GiB", "wall min", "result"], rows, markdown=True)
    )
    return "\n\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    steps = payload.get("steps", {})
    names = list(steps)
    figure, axis = plt.subplots(figsize=(8, 4))
    axis.bar(names, [steps[name]["peak_rss_bytes"] / 2**30 for name in names], label="peak RSS")
    axis.bar(names, [steps[name].get("stored_bytes", 0) / 2**30 for name in names], width=0.4, label="stored")
    written = steps.get("write")
    if written:
        axis.axhline(written["float32_bytes"] / 2**30, color="red", linestyle="--", label="float32 model")
    axis.axhline(payload.get("memory_bytes", 0) / 2**30, color="black", linestyle=":", label="machine memory")
    axis.set_ylabel("GiB")
    axis.tick_params(axis="x", labelrotation=20, labelsize=8)  # step names are long ("nf4-dq-bf16-tables")
    axis.set_title("Llama-3-8B-shaped model (random weights), out of core")
    axis.legend(fontsize=8)
    save_figure(figure, path)


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model=False)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--step-minutes",
        type=float,
        help="stop a quantize step after this long (its blocks are "
        "kept; the next run continues it) and record how far it got",
    )
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-out-of-core")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        workers = {
            "write": lambda: write_worker(Path(rest[0])),
            "generate": lambda: generate_worker(Path(rest[0]), int(rest[1])),
            "qlora": lambda: qlora_worker(Path(rest[0]), Path(rest[1])),
        }
        result = workers[kind]()
        print(json.dumps(result))
        return
    if args.report:
        return print_report(NAME, report)
    study = Study(NAME, {"shape": SHAPE, "new_tokens": args.new_tokens}, args, plot=plot)
    study.payload["cpu"] = cpu_description()
    study.payload["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = args.workdir / "source"
    summary = lambda value: f"peak RSS {value['peak_rss_bytes'] / 2**30:.2f} GiB"  # noqa: E731
    for step in study.todo("steps", ["write", *QUANTIZE_STEPS, "generate", "qlora"]):
        if step == "write":
            shutil.rmtree(source, ignore_errors=True)
            value = worker_result(__file__, "write", str(source))
        elif not source.is_dir():
            raise SystemExit(f"{source} is missing: run the write step first (--only write)")
        elif step in ("generate", "qlora"):
            checkpoint = args.workdir / "nf4-dq"
            if not checkpoint.is_dir():
                raise SystemExit(f"{checkpoint} is missing: run the nf4-dq step first (--only nf4-dq)")
            value = (
                worker_result(__file__, "generate", str(checkpoint), str(args.new_tokens))
                if step == "generate"
                else worker_result(__file__, "qlora", str(checkpoint), str(args.workdir / "qlora"))
            )
        else:
            out = args.workdir / step
            value = quantize_step(
                source, out, QUANTIZE_STEPS[step], study.rows("steps")["write"]["float32_bytes"], args.step_minutes
            )
            if step != "nf4-dq":  # only the NF4 checkpoint is used again
                shutil.rmtree(out, ignore_errors=True)
        value["load_average"] = os.getloadavg()[0]  # a shared machine: what else ran, at the step's end
        study.record("steps", step, value, summary)
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
