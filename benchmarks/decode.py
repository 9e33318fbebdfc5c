"""Batch-1 decode and prefill speed and resident memory, leanlm beside llama.cpp on the same model.

Every system runs in its own worker process (so that its peak RSS is its own), all loaded at once and driven
round by round in a rotated order (interleaved rounds, so that a slow spell of this shared machine falls on all
alike); medians over the rounds. A round: greedy decode of --new-tokens tokens after a --prompt-tokens prompt
(every token fed back, end-of-sequence ignored, so every system decodes the same count), then one prefill of
--prefill-tokens tokens computing the last position's logits. leanlm decodes with a manual loop over
transformers' forward and its DynamicCache (what `leanlm serve --no-fused` runs), and in the "fused" rows through
`leanlm.decoding.FusedDecoder` (the prompt through transformers, then one C++ call per token); llama.cpp through
its Python bindings (`Llama.eval`, one token per call), on GGUF files made from the same float weights and, for a
model that ships as a GGUF, on that file itself. The CPU, the load average before and after, and the threads
are recorded. The leanlm rows also score --quality-tokens of WikiText-2 in one forward and token by token.
Writes benchmarks/results/decode_<model>.json + .png.

    python benchmarks/decode.py                  # leanlm rows; llama.cpp rows where llama-cpp-python is installed
    python benchmarks/decode.py --report
    python benchmarks/decode.py --tag xeon          # another CPU's run, kept beside the first
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from leanlm.bench import Study, print_report, results_name, study_arguments, titled  # noqa: E402
from leanlm.bench.harness import cpu_description, process_peak_rss_bytes  # noqa: E402
from leanlm.report import format_table, save_figure  # noqa: E402

# ---- the worker side: one system, commands on stdin, one JSON line per answer on stdout ----


class LeanlmSystem:
    """`load_any(source, dtype, head)`, decoded through transformers' eager forward (what `leanlm serve --no-fused` runs) or
    leanlm's fused C++ step (`decoder`: eager | fused | fused-compact, the last keeping double-quantized block
    constants 8-bit in the step)."""

    def __init__(self, source: str, dtype: str, decoder: str, head: str, context: int):
        import torch

        from leanlm.decoding import FusedDecoder
        from leanlm.methods import load_any

        torch.set_num_threads(2)
        self.torch = torch
        self.model = load_any(source, dtype, head).model
        self.fused = (
            FusedDecoder(self.model, capacity=context, compact_constants=decoder == "fused-compact")
            if decoder.startswith("fused")
            else None
        )

    def decode(self, prompt: list[int], new_tokens: int) -> float:
        """Seconds for `new_tokens` greedy steps after the prompt."""
        from transformers import DynamicCache

        torch = self.torch
        if self.fused is not None:
            logits = self.fused.prefill(prompt)
            started = time.perf_counter()
            for _ in range(new_tokens):
                logits = self.fused.step(int(logits.argmax()))
            return time.perf_counter() - started
        with torch.inference_mode():
            cache = DynamicCache()
            logits = self.model(
                input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1
            ).logits
            started = time.perf_counter()
            for _ in range(new_tokens):
                token = logits[0, -1].argmax().view(1, 1)
                logits = self.model(input_ids=token, past_key_values=cache, use_cache=True).logits
            return time.perf_counter() - started

    def prefill(self, ids: list[int]) -> float:
        torch = self.torch
        with torch.inference_mode():
            started = time.perf_counter()
            self.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
            return time.perf_counter() - started

    def negative_log_likelihoods(self, ids: list[int]) -> dict:
        """Mean NLL of ids[1:] read two ways: in one forward (the prefill path, float activations: what `leanlm
        eval` scores) and token by token through this system's decoder (int8 activations in the 4- and 8-bit
        kernels at batch 1): what decoding quantizes beyond the weights."""
        from transformers import DynamicCache

        torch = self.torch
        targets = torch.tensor(ids[1:])
        with torch.inference_mode():
            whole = self.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            if self.fused is not None:
                steps = [self.fused.prefill(ids[:1])] + [self.fused.step(token) for token in ids[1:-1]]
            else:
                cache = DynamicCache()
                steps = [
                    self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                    .logits[0, -1]
                    .float()
                    for token in ids[:-1]
                ]
        nll = torch.nn.functional.cross_entropy
        return {"prefill": nll(whole, targets).item(), "decode": nll(torch.stack(steps), targets).item()}


class LlamaCppSystem:
    def __init__(self, path: str, context: int):
        from leanlm.bench.llama_cpp import llama_cpp_module

        self.model = llama_cpp_module().Llama(
            model_path=path,
            n_ctx=context,
            n_batch=context,
            n_ubatch=context,
            n_threads=2,
            n_threads_batch=2,
            verbose=False,
        )

    def last_logits(self):
        """The logits of the last token evaluated, from the context itself: `Llama.scores` is left unfilled on
        this path unless every position's logits are kept (`logits_all`), which would slow prefill."""
        import numpy as np

        from leanlm.bench.llama_cpp import llama_cpp_module

        pointer = llama_cpp_module().llama_get_logits_ith(self.model._ctx.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.model.n_vocab(),))

    def decode(self, prompt: list[int], new_tokens: int) -> float:
        import numpy as np

        self.model.reset()
        self.model.eval(prompt)
        started = time.perf_counter()
        for _ in range(new_tokens):
            self.model.eval([int(np.argmax(self.last_logits()))])
        return time.perf_counter() - started

    def prefill(self, ids: list[int]) -> float:
        self.model.reset()
        started = time.perf_counter()
        self.model.eval(ids)
        return time.perf_counter() - started


def worker(kind: str, spec: str, context: int) -> None:
    system = LlamaCppSystem(spec, context) if kind == "llama.cpp" else LeanlmSystem(*spec.split("|"), context)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "decode":
            answer = {"seconds": system.decode(command["prompt"], command["new_tokens"])}
        elif command["do"] == "prefill":
            answer = {"seconds": system.prefill(command["ids"])}
        elif command["do"] == "nll":
            answer = system.negative_log_likelihoods(command["ids"])
        else:
            answer = {"peak_rss_bytes": process_peak_rss_bytes()}
        print(json.dumps(answer), flush=True)


# ---- the driver ----


class Worker:
    def __init__(self, kind: str, spec: str, context: int, log: Path):
        with open(log, "ab") as output:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--worker", kind, spec, "--context", str(context)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=output,
                text=True,
                env={**os.environ, "TQDM_DISABLE": "1"},
            )
        self._answer()

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.process.wait()}); see its log")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def systems(model: str, work: Path) -> dict[str, tuple[str, str]]:
    """Row name -> (kind, spec) of its worker; llama.cpp rows only where its bindings are installed."""
    nf4, int8 = work / "nf4", work / "int8"
    # (source, --dtype, decoder, --head)
    leanlm = {
        "FP32": (model, "float32", "eager", "float"),
        "BF16": (model, "bfloat16", "eager", "float"),
        "NF4+DQ": (nf4, "float32", "eager", "float"),
        "SmoothQuant O3": (work / "sq-o3", "float32", "eager", "float"),
        "LLM.int8()": (work / "llm-int8", "float32", "eager", "float"),
        "FP32 fused": (model, "float32", "fused", "float"),
        "BF16 weights fused": (model, "bfloat16", "fused", "float"),
        "NF4+DQ fused": (nf4, "float32", "fused", "float"),
        "NF4+DQ fused, BF16 head": (nf4, "auto", "fused", "float"),
        "NF4+DQ fused, int8 head": (nf4, "auto", "fused", "int8"),
        # the step's constants as stored (decoded per row: 0.5 bits a weight less resident, more work)
        "NF4+DQ fused, 8-bit constants, int8 head": (nf4, "auto", "fused-compact", "int8"),
        # float32 block constants (4.5 bits a weight, Q4_0's size): no double-quantized constant to decode
        "NF4 fused, int8 head": (work / "nf4-plain", "auto", "fused", "int8"),
        "int8 blocks fused, int8 head": (int8, "auto", "fused", "int8"),
        "SmoothQuant O3 fused, int8 head": (work / "sq-o3", "auto", "fused", "int8"),
        "LLM.int8() fused, int8 head": (work / "llm-int8", "auto", "fused", "int8"),
        "GPTQ fused, int8 head": (work / "gptq", "auto", "fused", "int8"),
        # 3 bits through the 3-bit kernel (codes in the planes layout), k-bit and SpQR's default recipe
        "NF3+DQ": (work / "nf3", "float32", "eager", "float"),
        "NF3+DQ fused, int8 head": (work / "nf3", "auto", "fused", "int8"),
        "SpQR 3-bit fused, int8 head": (work / "spqr", "auto", "fused", "int8"),
    }
    rows = {f"leanlm {name}": ("leanlm", "|".join(map(str, spec))) for name, spec in leanlm.items()}
    if importlib.util.find_spec("llama_cpp") is not None:
        for name in ("F32", "Q8_0", "Q4_0"):
            rows[f"llama.cpp {name}"] = ("llama.cpp", str(work / f"{name.lower()}.gguf"))
        # The same block types without a float file (a model too large for one: an 8B is 30 GB in float32 and
        # loads whole to be written): leanlm's RTN on the symmetric grid in groups of 32, written as its exact
        # blocks, the other matrices as Q8_0.
        for name in ("Q8_0", "Q4_0"):
            rows[f"llama.cpp {name}, leanlm RTN blocks"] = ("llama.cpp", str(work / f"rtn-{name.lower()}.gguf"))
        own = own_gguf(model)
        if own is not None:  # the file the model ships as: the weights every leanlm row is made from
            rows["llama.cpp, the model's own GGUF"] = ("llama.cpp", str(own))
    return rows


def own_gguf(model: str) -> Path | None:
    """The GGUF file `model` is (a .gguf path) or ships as (a registry name), else None."""
    from leanlm.models import REGISTRY, cache_root
    from leanlm.models.registry import gguf_path_of

    if model in REGISTRY:
        return gguf_path_of(REGISTRY[model], cache_root() / "gguf")
    return Path(model) if model.endswith(".gguf") else None


def chosen_systems(model: str, work: Path, names: list[str] | None) -> dict[str, tuple[str, str]]:
    """The rows of `systems` whose name contains one of `names` (all when None); the "leanlm RTN blocks" rows only
    when a text names them ("RTN"), so that the runs of the tables before them keep their rows."""

    def chosen(name: str) -> bool:
        if "RTN blocks" in name:
            return any("RTN" in text and text in name for text in names or [])
        return not names or any(text in name for text in names)

    return {name: row for name, row in systems(model, work).items() if chosen(name)}


def prepare(model: str, work: Path, rows: dict[str, tuple[str, str]]) -> None:
    """The checkpoints and GGUF files `rows` load (made once, kept in the work directory)."""
    specs = [spec for _, spec in rows.values()]
    recipes = {
        "nf4": ["--method", "kbit", "--double-quant"],
        "nf4-plain": ["--method", "kbit"],
        "int8": ["--method", "kbit", "--dtype", "int", "--bits", "8"],  # blocks of 64: Q8_0's kind
        "sq-o3": ["--method", "smoothquant", "--level", "O3", "--no-bmm", "--calib-samples", "64"],
        "llm-int8": ["--method", "llm-int8"],
        "gptq": ["--method", "gptq", "--calib-samples", "64", "--group-size", "128"],  # act-order
        "nf3": ["--method", "kbit", "--bits", "3", "--double-quant"],
        "spqr": ["--method", "spqr", "--calib-samples", "64"],
    }  # 3-bit base, beta1 = beta2 = 16
    for name, recipe in recipes.items():
        if not (work / name).exists() and any(spec.startswith(f"{work / name}|") for spec in specs):
            subprocess.run(
                [sys.executable, "-m", "leanlm.cli.main", "quantize", model, *recipe, "--out", str(work / name)],
                check=True,
            )
    from leanlm.bench.llama_cpp import quantize_gguf
    from leanlm.export import export_gguf

    files = {Path(spec).name for kind, spec in rows.values() if kind == "llama.cpp"}
    for bits, kind in ((8, "q8_0"), (4, "q4_0")):
        if f"rtn-{kind}.gguf" in files and not (work / f"rtn-{kind}.gguf").exists():
            checkpoint = work / f"rtn-{bits}bit-g32"
            if not checkpoint.exists():
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "leanlm.cli.main",
                        "quantize",
                        model,
                        "--method",
                        "rtn",
                        "--bits",
                        str(bits),
                        "--grid",
                        "symmetric",
                        "--group-size",
                        "32",
                        "--out",
                        str(checkpoint),
                    ],
                    check=True,
                )
            export_gguf(checkpoint, work / f"rtn-{kind}.gguf", "q8_0")
    if not files & {"f32.gguf", "q8_0.gguf", "q4_0.gguf"}:
        return
    if not (work / "f32.gguf").exists():
        export_gguf(model, work / "f32.gguf", "f32")
    for kind in ("q8_0", "q4_0"):
        if not (work / f"{kind}.gguf").exists():
            quantize_gguf(work / "f32.gguf", work / f"{kind}.gguf", kind)


def measure(model: str, work: Path, args) -> dict:
    from leanlm.data import datasets
    from leanlm.evaluation.tokens import encode
    from leanlm.models import load_tokenizer

    ids = encode(load_tokenizer(model), datasets.wikitext2_test_text()[:20_000])
    prompt, prefill_ids = ids[: args.prompt_tokens], ids[: args.prefill_tokens]
    quality_ids = ids[: args.quality_tokens]
    context = max(args.prompt_tokens + args.new_tokens + args.prefill_tokens, args.quality_tokens) + 8
    load_before = os.getloadavg()
    workers = {
        name: Worker(kind, spec, context, work / "workers.log")
        for name, (kind, spec) in chosen_systems(model, work, args.systems).items()
    }
    samples = {name: {"decode": [], "prefill": []} for name in workers}
    try:
        names = list(workers)
        for name in names:  # warm-up
            workers[name].ask(do="decode", prompt=prompt, new_tokens=4)
            workers[name].ask(do="prefill", ids=prefill_ids)
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name]["decode"].append(
                    workers[name].ask(do="decode", prompt=prompt, new_tokens=args.new_tokens)["seconds"]
                )
                samples[name]["prefill"].append(workers[name].ask(do="prefill", ids=prefill_ids)["seconds"])
            print(f"round {round_index + 1}/{args.rounds}", flush=True)
        rows = {}
        for name, worker_ in workers.items():
            decode, prefill = statistics.median(samples[name]["decode"]), statistics.median(samples[name]["prefill"])
            rows[name] = {
                "decode_tokens_per_second": args.new_tokens / decode,
                "decode_ms_per_token": 1e3 * decode / args.new_tokens,
                "prefill_tokens_per_second": args.prefill_tokens / prefill,
                "peak_rss_bytes": worker_.ask(do="rss")["peak_rss_bytes"],
                "samples": samples[name],
            }
            if name.startswith("leanlm"):  # after the RSS: a whole window's logits would raise the peak
                rows[name]["nll"] = worker_.ask(do="nll", ids=quality_ids)
            print(
                f"{name}: decode {rows[name]['decode_tokens_per_second']:.1f} tok/s, prefill "
                f"{rows[name]['prefill_tokens_per_second']:.0f} tok/s, {rows[name].get('nll', '')}",
                flush=True,
            )
    finally:
        for worker_ in workers.values():
            worker_.close()
    return {
        "rows": rows,
        "cpu": cpu_description(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "llama_cpp_build": llama_cpp_build(),
    }


def llama_cpp_build() -> str | None:
    """The instruction sets llama.cpp was built with (its own report), if its bindings are installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def report(payload: dict) -> str:
    run = payload["run"]
    settings = payload["settings"]
    head = (
        f"{run['cpu']}, 2 threads each, load average {run['load_average_before'][0]:.1f} before / "
        f"{run['load_average_after'][0]:.1f} after; decode of {settings['new_tokens']} tokens after "
        f"{settings['prompt_tokens']}, prefill of {settings['prefill_tokens']}, medians of {settings['rounds']} "
        f"interleaved rounds; perplexity of the first {settings['quality_tokens']} WikiText-2 test tokens read in "
        "one forward and token by token through the row's decoder"
    )

    def perplexity(row: dict, path: str) -> str:
        return f"{math.exp(row['nll'][path]):.2f}" if "nll" in row else "-"

    table = [
        [
            name,
            f"{row['decode_tokens_per_second']:.1f}",
            f"{row['decode_ms_per_token']:.1f}",
            f"{row['prefill_tokens_per_second']:.0f}",
            f"{row['peak_rss_bytes'] / 2**20:,.0f}",
            perplexity(row, "prefill"),
            perplexity(row, "decode"),
        ]
        for name, row in run["rows"].items()
    ]
    if run.get("llama_cpp_build"):
        head += f"; llama.cpp built with {run['llama_cpp_build']}"
    return (
        head
        + "\n\n"
        + format_table(
            [
                "system",
                "decode tokens/s",
                "ms per token",
                "prefill tokens/s",
                "peak RSS MiB",
                "ppl, one forward",
                "ppl, token by token",
            ],
            table,
            markdown=True,
        )
    )


def plot(payload: dict, path) -> None:
    rows = payload.get("run", {}).get("rows")
    if not rows:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(rows)
    colors = ["C0" if name.startswith("leanlm") else "C1" for name in names]
    left.barh(names, [rows[n]["decode_tokens_per_second"] for n in names], color=colors)
    left.set_xlabel("batch-1 decode tokens/s")
    left.invert_yaxis()
    right.barh(names, [rows[n]["peak_rss_bytes"] / 2**20 for n in names], color=colors)
    right.set_xlabel("peak RSS, MiB")
    right.invert_yaxis()
    right.set_yticks([])
    save_figure(fig, path, titled(payload, "decode: leanlm (blue) and llama.cpp (orange)"))


def main() -> None:
    parser = study_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), tag=True)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="only the rows whose name contains one of these (a larger model's workers may not "
        "all fit in memory at once)",
    )
    parser.add_argument(
        "--quality-tokens",
        type=int,
        default=512,
        help="WikiText-2 tokens scored in one forward and token by token (leanlm rows)",
    )
    parser.add_argument("--context", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "leanlm-decode")
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker, args.context)
    name = results_name("decode", args.model, args.tag)
    if args.report:
        return print_report(name, report)
    study = Study(
        name,
        {
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "prefill_tokens": args.prefill_tokens,
            "rounds": args.rounds,
            "quality_tokens": args.quality_tokens,
            "systems": args.systems,
        },
        args,
        plot=plot,
    )
    study.payload["model"] = args.model
    work = args.workdir / Path(args.model).name  # a model directory's own name, not its whole path
    work.mkdir(parents=True, exist_ok=True)
    prepare(args.model, work, chosen_systems(args.model, work, args.systems))
    if study.pending("run"):
        study.set("run", measure(args.model, work, args))
    print(report(study.payload))
    print(f"wrote {study.path}")


if __name__ == "__main__":
    main()
