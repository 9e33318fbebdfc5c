"""The papers' tables on one model: every method of `leanlm showcase` at the papers' evaluation settings.

Per row: the checkpoint written the way `leanlm quantize` writes it (calibration: --calib-samples windows of 512
tokens of LAMBADA development text, never an evaluation set), its stored bytes and the peak resident memory of
writing it; then, each in a fresh process that loads it with `load_any` (its float parts computing in --dtype,
bfloat16 by default, against the fp32 row), WikiText-2 perplexity at the papers' window of 2048 (the whole test
set for the --whole rows, its first --max-tokens tokens for the others) and the six zero-shot tasks (the first
--limit items each), with that process's peak resident memory. GPTQ runs at the
paper's groups of 128 (the showcase's GPTQ row is the Q4_0-exportable one). The streaming row reads a
--stream-tokens WikiText-2 stream through StreamingLLM's sink cache; the QLoRA row trains adapters on an NF4 + DQ
base as the showcase does, and is evaluated with them.

Every (row, part) is saved as it finishes, and a checkpoint being written resumes where it stopped, so a run
killed anywhere goes on with --resume. Writes benchmarks/results/methods_<model>.json + .png:

    python benchmarks/methods.py --model qwen2.5-coder-1.5b --calib-samples 128 --resume
    python benchmarks/methods.py --model qwen2.5-coder-1.5b --calib-samples 128 --resume --only nf4
    python benchmarks/methods.py --model qwen2.5-coder-1.5b --report
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, measured_on, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import checkpoint_bytes, process_peak_rss_bytes, worker_result  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

SEQ_LEN = 2048
# Rows whose description names the dtype they compute in; the others take --dtype
FIXED_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "streaming": "float32"}
TASKS = ("lambada", "piqa", "hellaswag", "arc_easy", "arc_challenge", "winogrande")
TASK_TITLES = ("LAMBADA", "PIQA", "HellaSwag", "ARC-e", "ARC-c", "WinoGr.")


def rows() -> dict:
    """name -> (description, method configs for `quantize_`): the showcase's rows, bf16 beside fp32 and GPTQ at
    the paper's groups."""
    from leanlm.methods import GPTQConfig
    from leanlm.showcase import ROWS

    table = {}
    for row in ROWS:
        if row.name == "gptq-4bit":
            table["gptq-4bit-g128"] = ("GPTQ 4-bit, asymmetric groups of 128, act-order", (GPTQConfig(bits=4),))
            continue
        table[row.name] = (row.description, row.steps)
        if row.name == "fp32":
            table["bf16"] = ("bfloat16 weights and activations", ())
    return table


def _calibrated(steps: tuple, samples: int | None) -> tuple:
    from leanlm.plan import PlanSettings

    return PlanSettings(calibration_samples=samples).applied(steps)


def prepare_worker(model: str, row: str, out: str, calibration_samples: str) -> dict:
    """The row's checkpoint written to `out`, resuming a killed quantization's (for QLoRA: its adapters), with
    its record (the checkpoint's `leanlm_quant.json` less the per-module table: the method's settings, its time
    and what a search kept)."""
    from leanlm.methods.checkpoint import method_record
    from leanlm.methods.out_of_core import quantize_checkpoint
    from leanlm.methods.quantize import Calibration

    if row == "qlora":
        from leanlm.methods import load_any
        from leanlm.showcase import qlora_training
        from leanlm.training import finetune

        loaded = load_any(model)
        lora, training, documents = qlora_training(loaded.model)
        record = finetune(loaded.model, loaded.tokenizer, documents, training, lora, out, loaded.name, progress=False)
        return {"peak_rss_bytes": process_peak_rss_bytes(), "train_loss": record["train_loss_last"]}
    steps = _calibrated(rows()[row][1], int(calibration_samples) if calibration_samples != "default" else None)
    quantize_checkpoint(model, steps, out, calibration=Calibration(), resume=True, say=lambda line: None)
    return {
        "peak_rss_bytes": process_peak_rss_bytes(),
        "stored_bytes": checkpoint_bytes(out),
        "record": method_record(out),
    }


def evaluate_worker(source: str, dtype: str, adapter: str, task: str, limit: str, max_tokens: str) -> dict:
    """One task on the row's model, loaded as `leanlm eval` loads it."""
    from leanlm.evaluation import EvalSettings, evaluate
    from leanlm.methods import load_any

    loaded = load_any(source, dtype, adapter=adapter or None)
    settings = EvalSettings(
        tasks=(task,), limit=int(limit), max_tokens=None if max_tokens == "all" else int(max_tokens), seq_len=SEQ_LEN
    )
    result = evaluate(loaded.model, loaded.tokenizer, settings)
    return {
        **result["results"][task],
        "weights_bytes": result["weights_bytes"],
        "weights_note": loaded.weights_note,
        "peak_rss_bytes": process_peak_rss_bytes(),
    }


def stream_worker(source: str, dtype: str, tokens: str) -> dict:
    """WikiText-2 read as one stream of `tokens` through the sink cache (the showcase's cache of 256 tokens)."""
    from leanlm.evaluation.streaming import stream_evaluate
    from leanlm.methods import load_any
    from leanlm.showcase import STREAM

    loaded = load_any(source, dtype)
    entry = stream_evaluate(loaded.model, loaded.tokenizer, replace(STREAM, max_tokens=int(tokens)))
    streaming = entry["settings"]["streaming"]
    return {
        "perplexity": streaming["perplexity"],
        "tokens": streaming["tokens"],
        "cache_tokens": STREAM.cache_size,
        "ms_per_token": streaming["ms_per_token"],
        "peak_rss_bytes": process_peak_rss_bytes(),
    }


def _parts(row: str) -> tuple[str, ...]:
    return ("stream",) if row == "streaming" else ("wikitext2", *TASKS)


def measure_row(study: Study, row: str, steps: tuple, args) -> None:
    """The row's checkpoint (written once from its method configs `steps`, kept in --workdir until every part of
    the row is saved), then each of its parts in a fresh process."""
    todo = list(study.todo(("parts", row), _parts(row)))
    if not todo:
        return
    source, adapter, dtype = args.model, "", FIXED_DTYPES.get(row, args.dtype)
    if steps or row == "qlora":
        out = args.workdir / row
        if not (row in study.rows("prepare") and out.exists()):
            shutil.rmtree(out, ignore_errors=True)  # finished but not recorded: written again, measured
            samples = "default" if args.calib_samples is None else str(args.calib_samples)
            study.record(
                "prepare",
                row,
                worker_result(__file__, "prepare", args.model, row, str(out), samples),
                summary=lambda value: f"written, peak RSS {value['peak_rss_bytes'] / 2**20:,.0f} MiB",
            )
        source, adapter = (args.model, str(out)) if row == "qlora" else (str(out), "")
    for part in todo:
        if part == "stream":
            value = worker_result(__file__, "stream", source, dtype, str(args.stream_tokens))
        else:
            whole = row in args.whole or part != "wikitext2"
            tokens = "all" if whole else str(args.max_tokens)
            value = worker_result(__file__, "evaluate", source, dtype, adapter, part, str(args.limit), tokens)
        study.payload["weights_note"] = value.pop("weights_note", study.payload.get("weights_note"))
        study.record(("parts", row), part, value, summary=_summary)
    if all(part in study.rows(("parts", row)) for part in _parts(row)):
        shutil.rmtree(args.workdir / row, ignore_errors=True)


def _summary(value: dict) -> str:
    score = f"acc {value['acc']:.3f}" if "acc" in value else f"perplexity {value['perplexity']:.3f}"
    return f"{score}, peak RSS {value['peak_rss_bytes'] / 2**20:,.0f} MiB"


def row_summary(payload: dict, row: str) -> dict | None:
    """The row's table cells as numbers: perplexity and its token count, accuracies, zero-shot average (all six
    tasks measured, else None), stored bytes, peak RSS evaluating and quantizing."""
    parts = payload.get("parts", {}).get(row)
    if not parts:
        return None
    text = parts.get("stream") or parts.get("wikitext2") or {}
    accuracies = {task: parts[task]["acc"] for task in TASKS if task in parts}
    prepared = payload.get("prepare", {}).get(row, {})
    stored = prepared.get("stored_bytes") or next(iter(parts.values())).get("weights_bytes")
    return {
        "perplexity": text.get("perplexity"),
        "tokens": text.get("tokens"),
        "stream": "stream" in parts,
        "accuracies": accuracies,
        "average": sum(accuracies.values()) / len(TASKS) if len(accuracies) == len(TASKS) else None,
        "stored_bytes": stored,
        "evaluating_bytes": max(part["peak_rss_bytes"] for part in parts.values()),
        "quantizing_bytes": prepared.get("peak_rss_bytes"),
    }


def report(payload: dict) -> str:
    def number(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    def mib(value):
        return "-" if value is None else f"{value / 2**20:,.0f}"

    headers = ["method", "WikiText-2 ppl", "tokens", *TASK_TITLES, "average", "stored MiB"]
    headers += ["peak RSS MiB (evaluating)", "peak RSS MiB (quantizing)", "what"]
    table = []
    for row, description in payload["rows"].items():
        cells = row_summary(payload, row)
        if cells is None:
            table.append([row, "not measured yet", *["-"] * (len(headers) - 3), description.replace("|", "\\|")])
            continue
        tokens = "-" if cells["tokens"] is None else f"{cells['tokens']:,}" + (" (stream)" if cells["stream"] else "")
        table.append(
            [
                row,
                number(cells["perplexity"], 2),
                tokens,
                *[number(cells["accuracies"].get(task)) for task in TASKS],
                number(cells["average"]),
                mib(cells["stored_bytes"]),
                mib(cells["evaluating_bytes"]),
                mib(cells["quantizing_bytes"]),
                description.replace("|", "\\|"),
            ]
        )
    settings = payload["settings"]
    head = (
        f"{payload.get('model')}: WikiText-2 at windows of {SEQ_LEN}, zero-shot on the first {settings['limit']} items "
        f"of each task, calibration {settings['calibration_samples'] or 'each method default'} windows of 512"
    )
    return f"{head}\n{format_table(headers, table, markdown=True)}\n\n{_machines_text(payload)}"


def _machines_text(payload: dict) -> str:
    """Which CPU measured each row's parts (the CPU sets the bfloat16 GEMM's summation order and every speed)."""
    lines = []
    for row in payload["rows"]:
        by_cpu: dict[str, list[str]] = {}
        for part in payload.get("parts", {}).get(row, {}):
            cpu = measured_on(payload, f"parts/{row}/{part}") or "not recorded"
            by_cpu.setdefault(cpu, []).append(part)
        lines += [[row, cpu, ", ".join(parts)] for cpu, parts in by_cpu.items()]
    return "Which CPU measured each part\n" + format_table(["method", "CPU", "parts"], lines, markdown=True)


def plot(payload: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in payload["rows"]:
        cells = row_summary(payload, row)
        if cells is None or cells["stored_bytes"] is None:
            continue
        for axis, key in ((left, "perplexity"), (right, "average")):
            if cells[key] is not None and not (key == "perplexity" and cells["stream"]):
                axis.scatter(cells["stored_bytes"] / 2**20, cells[key])
                axis.annotate(row, (cells["stored_bytes"] / 2**20, cells[key]), fontsize=7)
    left.set(xlabel="stored MiB", ylabel="WikiText-2 perplexity")
    right.set(xlabel="stored MiB", ylabel="zero-shot average (six tasks)")
    save_figure(fig, path, titled(payload, "methods at the papers' settings"))
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, *rest = sys.argv[2:]
        worker = {"prepare": prepare_worker, "evaluate": evaluate_worker, "stream": stream_worker}[kind]
        print(json.dumps(worker(*rest)))
        return
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--limit", type=int, default=200, help="items of each zero-shot task")
    parser.add_argument("--max-tokens", type=int, default=65_536, help="WikiText-2 tokens of the rows not in --whole")
    parser.add_argument(
        "--whole",
        nargs="+",
        default=["bf16", "smoothquant-O3", "nf4-dq", "gptq-4bit-g128"],
        metavar="ROW",
        help="rows evaluated on the whole WikiText-2 test set",
    )
    parser.add_argument("--stream-tokens", type=int, default=16_384, help="length of the streaming row's stream")
    parser.add_argument("--calib-samples", type=int, default=None, help="calibration windows (default: each method's)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="what every row but fp32 computes its float parts in (`leanlm eval --dtype`; QLoRA's adapters: float32)",
    )
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-methods")
    args = parser.parse_args()
    name = results_name("methods", args.model)
    if args.report:
        return print_report(name, report)
    table = rows()
    unknown = sorted(set(args.whole) - set(table))
    if unknown:
        raise SystemExit(f"--whole: unknown rows {', '.join(unknown)}; rows: {', '.join(table)}")
    if args.max_tokens < SEQ_LEN:
        raise SystemExit(f"--max-tokens {args.max_tokens} does not fill one window of {SEQ_LEN} tokens")
    args.workdir = args.workdir / Path(args.model).name
    args.workdir.mkdir(parents=True, exist_ok=True)
    settings = {
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "whole": sorted(args.whole),
        "stream_tokens": args.stream_tokens,
        "calibration_samples": args.calib_samples,
        "seq_len": SEQ_LEN,
        "dtype": args.dtype,
    }
    study = Study(name, settings, args, plot=plot)
    study.payload.update(model=args.model, rows={row: description for row, (description, _) in table.items()})
    study.save()
    for row, (_, steps) in table.items():
        measure_row(study, row, steps, args)
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
