"""Compute dtype: what bfloat16 costs in accuracy and gives in speed and memory, beside float32
(the reference), on this CPU: for the float model (every weight and activation in bfloat16) and for an NF4 + DQ
checkpoint (its norms, attention, token embedding and output head in bfloat16, its 4-bit layers' inputs and
outputs too; their decode-size kernels are the same, their prefill GEMMs bfloat16's).
`--dtype auto` (the default of `leanlm chat` and `leanlm serve`) picks bfloat16 where the CPU has native bf16
instructions (AVX512-BF16 or AMX) and float32 elsewhere.

Accuracy: `leanlm eval MODEL --dtype D --tasks wikitext2 --json` per row, each in its own process (WikiText-2
test set, the papers' protocol: windows of 2048 tokens; `--max-tokens` takes its first N tokens), which also
gives that process's peak resident memory and its scoring speed (a full-sequence forward). Speed: every row's
model loaded in one process and timed interleaved round by round (medians of --rounds): a 512-token prefill
computing the last position's logits, and greedy decoding of --decode-tokens tokens after a 32-token prompt
(each token fed back through transformers' DynamicCache, as `leanlm chat` and `leanlm serve` do).

    python benchmarks/compute_dtype.py                          # about 45 minutes on 2 cores (the full test set)
    python benchmarks/compute_dtype.py --max-tokens 32768       # a quick look
    python benchmarks/compute_dtype.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, time_interleaved, titled  # noqa: E402
from leanlm.bench.harness import cpu_description  # noqa: E402
from leanlm.methods import load_any  # noqa: E402
from leanlm.models import compute_dtype, dtype_name  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

NF4 = ["--method", "kbit", "--double-quant"]
# row -> (the NF4 + DQ checkpoint or the float model, dtype)
ROWS = {
    "float32": (False, "float32"),
    "bfloat16": (False, "bfloat16"),
    "nf4-dq, float32": (True, "float32"),
    "nf4-dq, bfloat16": (True, "bfloat16"),
}
PROMPT_TOKENS, PREFILL_TOKENS = 32, 512


def float32_row(row: str) -> str:
    """The float32 row of the same model as `row`: what its accuracy and greedy tokens are compared with."""
    return next(name for name, spec in ROWS.items() if spec == (ROWS[row][0], "float32"))


def target(row: str, args) -> str:
    """What the row loads: the model, or its NF4 + DQ checkpoint (written once into --workdir)."""
    if not ROWS[row][0]:
        return args.model
    checkpoint = args.workdir / f"{args.model.replace('/', '_')}-nf4-dq"
    if not (checkpoint / "leanlm_quant.json").exists():
        subprocess.run(
            [sys.executable, "-m", "leanlm.cli.main", "quantize", args.model, *NF4, "--out", str(checkpoint)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return str(checkpoint)


def accuracy(model: str, dtype: str, tasks: str, max_tokens: int | None) -> dict:
    """`leanlm eval` in its own process: its JSON (perplexity, tokens/s, peak RSS)."""
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "eval.json")
        arguments = [
            "eval",
            model,
            "--dtype",
            dtype,
            "--tasks",
            tasks,
            *(["--max-tokens", str(max_tokens)] if max_tokens else []),
        ]
        result = subprocess.run(
            [sys.executable, "-m", "leanlm.cli.main", *arguments, "--json", path],
            capture_output=True,
            text=True,
            env={**os.environ, "TQDM_DISABLE": "1"},
        )
        if result.returncode != 0:
            raise SystemExit(f"leanlm eval --dtype {dtype} failed:\n{result.stderr[-3000:]}")
        with open(path) as handle:
            payload = json.load(handle)
    return {
        "command": " ".join(["leanlm", *arguments]),
        "results": payload["results"],
        "peak_rss_bytes": payload["peak_rss_bytes"],
        "weights_bytes": payload["weights_bytes"],
        "seconds": payload["seconds"],
    }


def speed(args) -> dict:
    """Prefill and decode of every row, interleaved round by round (medians)."""
    models = {row: load_any(target(row, args), dtype).model for row, (_, dtype) in ROWS.items()}
    decode_tokens, rounds = args.decode_tokens, args.rounds
    generator = torch.Generator().manual_seed(0)
    vocab = models["float32"].config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=generator)
    long_prompt = torch.randint(0, vocab, (1, PREFILL_TOKENS), generator=generator)
    produced = {}

    def decode(row):
        from transformers import DynamicCache

        model, cache, tokens = models[row], DynamicCache(), []
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(decode_tokens):
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token.item())
            out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        produced[row] = tokens

    def prefill(row):
        models[row](input_ids=long_prompt, use_cache=False, logits_to_keep=1)

    timings = time_interleaved(
        {
            **{f"decode {row}": (lambda row=row: decode(row)) for row in ROWS},
            **{f"prefill {row}": (lambda row=row: prefill(row)) for row in ROWS},
        },
        warmup=1,
        repeats=rounds,
    )
    result = {}
    for row in ROWS:
        reference = produced[float32_row(row)]
        result[row] = {
            "decode_tokens_per_second": decode_tokens / timings[f"decode {row}"].median,
            "decode_ms_per_token": timings[f"decode {row}"].median * 1e3 / decode_tokens,
            "prefill_tokens_per_second": PREFILL_TOKENS / timings[f"prefill {row}"].median,
            # greedy tokens equal to its float32 counterpart's before the first that differs
            "greedy_agreement": next(
                (i for i, (a, b) in enumerate(zip(reference, produced[row])) if a != b), decode_tokens
            ),
        }
    return {"rows": result, "decode_tokens": decode_tokens, "rounds": rounds, "load_average": list(os.getloadavg())}


def report(payload: dict) -> str:
    rows = []
    accuracy_rows, timed = payload.get("accuracy", {}), payload.get("speed", {})
    timed_rows = timed.get("rows", {})
    for row in ROWS:
        measured = accuracy_rows.get(row, {})
        wikitext = measured.get("results", {}).get("wikitext2", {})
        reference = accuracy_rows.get(float32_row(row), {})
        base = reference.get("results", {}).get("wikitext2", {}).get("perplexity")
        fast = timed_rows.get(row, {})
        rows.append(
            [
                row,
                f"{wikitext['perplexity']:.3f}" if wikitext else "",
                str(wikitext.get("tokens", "")),
                f"{wikitext['perplexity'] / base - 1:+.2%}" if wikitext and base else "",
                f"{wikitext['tokens_per_second']:.0f}" if wikitext else "",
                f"{fast['prefill_tokens_per_second']:.0f}" if fast else "",
                f"{fast['decode_tokens_per_second']:.1f}" if fast else "",
                f"{fast['greedy_agreement']}" if fast else "",
                f"{measured['weights_bytes'] / 2**20:,.0f}" if measured else "",
                f"{measured['peak_rss_bytes'] / 2**20:,.0f}" if measured else "",
            ]
        )
    lines = [
        format_table(
            [
                "row",
                "WikiText-2 ppl",
                "tokens",
                "against its float32",
                "scoring tokens/s",
                "prefill 512 tokens/s",
                "decode tokens/s",
                "greedy tokens as float32's",
                "weights MiB",
                "peak RSS MiB (eval)",
            ],
            rows,
            markdown=True,
        )
    ]
    if timed:
        lines.append(
            f"{timed['rounds']} interleaved rounds, {timed['decode_tokens']} decoded tokens each; load "
            f"average at the end {', '.join(f'{x:.2f}' for x in timed['load_average'])}"
        )
    lines.append(f"CPU: {payload.get('cpu')}; --dtype auto computes in {payload.get('auto_dtype')} here")
    return "\n".join(lines)


def plot(payload: dict, path) -> None:
    timed = payload.get("speed", {}).get("rows", {})
    accuracy_rows = payload.get("accuracy", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    present = [row for row in ROWS if row in accuracy_rows]
    axes[0].bar(range(len(present)), [accuracy_rows[r]["results"]["wikitext2"]["perplexity"] for r in present])
    axes[0].set_xticks(range(len(present)), present, rotation=15, ha="right", fontsize=7)
    axes[0].set_ylabel("WikiText-2 perplexity")
    if timed:
        names = list(timed)
        x = range(len(names))
        axes[1].bar(
            [i - 0.2 for i in x],
            [timed[r]["prefill_tokens_per_second"] / 10 for r in names],
            width=0.4,
            label="prefill tokens/s / 10",
        )
        axes[1].bar(
            [i + 0.2 for i in x],
            [timed[r]["decode_tokens_per_second"] for r in names],
            width=0.4,
            label="decode tokens/s",
        )
        axes[1].set_xticks(list(x), names, rotation=15, ha="right", fontsize=7)
        axes[1].legend()
    save_figure(fig, path, titled(payload, f"compute dtype on {payload.get('cpu')}"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--tasks", default="wikitext2", help="eval tasks of the accuracy part")
    parser.add_argument("--max-tokens", type=int, default=None, help="first N tokens of WikiText-2 (default: all)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-compute-dtype")
    args = parser.parse_args()
    name = results_name("compute_dtype", args.model)
    if args.report:
        return print_report(name, report)
    study = Study(
        name,
        {
            "model": args.model,
            "tasks": args.tasks,
            "max_tokens": args.max_tokens,
            "decode_tokens": args.decode_tokens,
            "rounds": args.rounds,
        },
        args,
        plot=plot,
    )
    study.payload["cpu"] = cpu_description()
    study.payload["auto_dtype"] = dtype_name(compute_dtype("auto"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    for row in study.todo("accuracy", ROWS):
        started = time.perf_counter()
        study.record(
            "accuracy",
            row,
            accuracy(target(row, args), ROWS[row][1], args.tasks, args.max_tokens),
            summary=lambda value: (
                f"perplexity {value['results']['wikitext2']['perplexity']:.3f} ({time.perf_counter() - started:.0f} s)"
            ),
        )
    if study.pending("speed"):
        study.set("speed", speed(args))
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
