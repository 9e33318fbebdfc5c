"""`leanlm plan`'s estimates against the processes they predict, row by row (every method row `leanlm plan` prints).

For each row: the plan (`leanlm plan MODEL --context N --json`, its own process, nothing loaded), then in fresh
processes what it predicts: the checkpoint written the way `leanlm quantize` writes it (its peak resident memory;
the bytes of its safetensors files) and the model running: loaded with `load_any`, N tokens read in chunks of
512 into its cache (the sink cache's 256 tokens for the streaming row), then 8 tokens decoded greedily (the
process' peak resident memory). Writes benchmarks/results/plan_accuracy_<model>.json + .png.

A row the plan says does not fit this machine's available memory is not run (the table says so). With --resume,
a row whose out-of-core quantization was killed continues from the blocks it wrote; its quantizing peak is the
highest of its processes' (each one's high-water mark is saved every few seconds beside the staging directory).
The Llama-3-8B-shaped model of benchmarks/out_of_core.py (random bfloat16 weights, 14.8 GB) is written once under DIR:

    python benchmarks/plan_accuracy.py [--model smollm2-135m] [--context 2048]
    python benchmarks/plan_accuracy.py --llama3-8b-shape DIR --context 512 --only bf16 nf4 w8a8 llm-int8
    python benchmarks/plan_accuracy.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import checkpoint_bytes, process_peak_rss_bytes, worker_result  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

DECODE_TOKENS = 8
ESTIMATES = (("stored", "stored_bytes"), ("running", "running_bytes"), ("quantizing", "quantizing_bytes"))
PEAK_EVERY_SECONDS = 2.0


def _steps(row: str, calibration_samples: int) -> tuple:
    from leanlm.plan import PlanSettings, method_rows

    steps = next((configs for name, _, configs in method_rows() if name == row), ())
    return PlanSettings(calibration_samples=calibration_samples).applied(steps)


def _keep_peak(path: Path, attempt: int) -> None:
    """Every few seconds, this process' high-water mark as `attempt`'s entry of the JSON list at `path`."""
    from leanlm.storage import write_text_atomically

    while True:
        peaks = json.loads(path.read_text()) if path.is_file() else []
        peaks[attempt:] = [process_peak_rss_bytes()]
        write_text_atomically(path, json.dumps(peaks) + "\n")
        time.sleep(PEAK_EVERY_SECONDS)


def quantize_worker(model: str, row: str, out: str, calibration_samples: str, peaks: str) -> dict:
    from leanlm.methods import calibration
    from leanlm.methods.out_of_core import quantize_checkpoint
    from leanlm.methods.quantize import Calibration

    calibration.KEEP_SENSITIVITY = False  # the plan's peak is a first run's: the loss's gradients measured anew
    peaks_path = Path(peaks)
    attempt = len(json.loads(peaks_path.read_text())) if peaks_path.is_file() else 0
    threading.Thread(target=_keep_peak, args=(peaks_path, attempt), daemon=True).start()
    steps = _steps(row, int(calibration_samples))
    quantize_checkpoint(model, steps, out, calibration=Calibration(), resume=True, say=lambda line: None)
    return {"peak_rss_bytes": process_peak_rss_bytes(), "attempts": attempt + 1}


def run_worker(source: str, context: int, dtype: str, streaming: bool) -> dict:
    import torch

    from leanlm.decoding import new_cache, read_in_chunks
    from leanlm.methods import load_any
    from leanlm.methods.streaming import StreamingConfig

    loaded = load_any(source, dtype)
    vocab = loaded.model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    sink = StreamingConfig(sinks=4, window=252) if streaming else None
    cache = new_cache(loaded.model, sink)
    logits = read_in_chunks(loaded.model, cache, ids, 256 if streaming else 512)
    with torch.inference_mode():
        for _ in range(DECODE_TOKENS):
            token = torch.tensor([[int(logits.argmax())]])
            logits = loaded.model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1]
    return {"peak_rss_bytes": process_peak_rss_bytes()}


def measure(row: dict, args, workdir: Path) -> dict:
    measured: dict = {}
    source = args.model
    if row["quantizing_bytes"] is not None:
        out = workdir / row["row"]
        staging, peaks = workdir / f".{out.name}.partial-resumable", workdir / f".{out.name}.peaks.json"
        shutil.rmtree(out, ignore_errors=True)
        if not (args.resume and staging.is_dir()):  # a killed run's blocks are kept only to resume them
            shutil.rmtree(staging, ignore_errors=True)
            peaks.unlink(missing_ok=True)
        result = worker_result(
            __file__, "quantize", args.model, row["row"], str(out), str(args.calib_samples), str(peaks)
        )
        earlier = json.loads(peaks.read_text()) if peaks.is_file() else []
        measured["quantizing_bytes"] = max([result["peak_rss_bytes"], *earlier])
        measured["quantizing_processes"] = result["attempts"]
        peaks.unlink(missing_ok=True)
        measured["stored_bytes"] = checkpoint_bytes(out)
        source = str(out)
    dtype = "bfloat16" if row["row"] == "bf16" else "float32"
    streaming = "1" if row["row"] == "streaming" else "0"
    measured["running_bytes"] = worker_result(__file__, "run", source, str(args.context), dtype, streaming)[
        "peak_rss_bytes"
    ]
    if row["quantizing_bytes"] is not None:
        shutil.rmtree(workdir / row["row"], ignore_errors=True)
    return {**_predicted(row), "measured": measured}


def _predicted(row: dict) -> dict:
    return {"predicted": {key: row[key] for _, key in ESTIMATES}, "parts": row["parts"]}


def _error(value: dict, key: str) -> float | None:
    predicted, measured = value["predicted"].get(key), value["measured"].get(key)
    if predicted is None or measured is None:
        return None
    return predicted / measured - 1


def summary(value: dict) -> str:
    return ", ".join(
        f"{label} {value['measured'][key] / 2**20:.0f} MiB measured, {100 * _error(value, key):+.1f}%"
        for label, key in ESTIMATES
        if _error(value, key) is not None
    )


def report(payload: dict) -> str:
    def mib(value):
        return "-" if value is None else f"{value / 2**20:,.0f}"

    def error(value, key):
        e = _error(value, key)
        return "-" if e is None else f"{100 * e:+.1f}%"

    rows = []
    for name, value in payload.get("rows", {}).items():
        cells = [name]
        for _, key in ESTIMATES:
            measured = "not run" if "not_run" in value and value["predicted"].get(key) is not None else None
            cells += [mib(value["predicted"].get(key)), measured or mib(value["measured"].get(key)), error(value, key)]
        rows.append(cells)
    headers = ["row"]
    for label, _ in ESTIMATES:
        headers += [f"{label} predicted MiB", "measured MiB", "error"]
    errors = [abs(e) for v in payload.get("rows", {}).values() for _, k in ESTIMATES if (e := _error(v, k)) is not None]
    worst = f"\nlargest error: {100 * max(errors):.1f}%" if errors else ""
    resumed = [
        f"\n{name}: quantized by {n} processes, each resuming the one killed before it"
        for name, value in payload.get("rows", {}).items()
        if (n := value["measured"].get("quantizing_processes", 1)) > 1
    ]
    return (
        f"{payload.get('model')}, context {payload['settings']['context']} tokens, "
        f"{payload['settings']['calibration_samples']} calibration windows\n"
        + format_table(headers, rows, markdown=True)
        + worst
        + "".join(resumed)
    )


def plot(payload: dict, path: Path) -> None:
    rows = payload.get("rows", {})
    figure, axis = plt.subplots(figsize=(9, 4.5))
    for offset, (label, key) in enumerate(ESTIMATES):
        names = [n for n, v in rows.items() if _error(v, key) is not None]
        axis.bar(
            [i + 0.27 * (offset - 1) for i in range(len(names))],
            [100 * _error(rows[n], key) for n in names],
            width=0.27,
            label=label,
        )
    axis.set_xticks(range(len(rows)), list(rows), rotation=35, ha="right", fontsize=8)
    axis.axhline(10, color="grey", linestyle=":")
    axis.axhline(-10, color="grey", linestyle=":")
    axis.set_ylabel("predicted / measured - 1 (%)")
    axis.set_title(titled(payload, "leanlm plan: predicted against measured memory"))
    axis.legend()
    save_figure(figure, path)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, *rest = sys.argv[2:]
        if kind == "quantize":
            result = quantize_worker(*rest)
        else:
            source, context, dtype, streaming = rest
            result = run_worker(source, int(context), dtype, streaming == "1")
        print(json.dumps(result))
        return
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--calib-samples", type=int, default=16, help="calibration windows of the calibrated rows")
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-plan")
    parser.add_argument(
        "--llama3-8b-shape", type=Path, metavar="DIR", help="measure the Llama-3-8B-shaped model, written under DIR"
    )
    args = parser.parse_args()
    if args.llama3_8b_shape is not None:
        args.model = str(args.llama3_8b_shape / "llama3-8b-shape")
    name = results_name("plan_accuracy", args.model)
    if args.report:
        return print_report(name, report)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.llama3_8b_shape is not None and not (Path(args.model) / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).parent))
        from out_of_core import write_worker

        write_worker(Path(args.model))
    plan_file = args.workdir / "plan.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "leanlm.cli.main",
            "plan",
            args.model,
            "--context",
            str(args.context),
            "--calib-samples",
            str(args.calib_samples),
            "--json",
            str(plan_file),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    plan = json.loads(plan_file.read_text())
    settings = {"model": args.model, "context": args.context, "calibration_samples": args.calib_samples}
    study = Study(name, settings, args, plot=plot)
    study.payload["model"] = args.model
    rows = {row["row"]: row for row in plan["rows"]}
    for name, saved in study.rows("rows").items():  # measured before: the current planner's prediction beside it
        if name in rows:
            saved.update(_predicted(rows[name]))
    study.save()
    for row in study.todo("rows", rows):
        if not rows[row]["fits"]:  # the planner's own answer for this machine's available memory: not run
            needs = max(rows[row][key] or 0 for _, key in ESTIMATES if key != "stored_bytes")
            value = {**_predicted(rows[row]), "measured": {}, "not_run": f"needs {needs / 2**30:.1f} GiB"}
            study.record("rows", row, value, summary=lambda value: f"not run: {value['not_run']}")
            continue
        study.record("rows", row, measure(rows[row], args, args.workdir), summary=summary)
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
