"""Honest measurement, shared by every benchmark: warm-up then repeated timing (median, min, max), peak
resident memory, bytes of weights as stored, and result files (JSON + PNG) with the environment recorded."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from leanlm.kernels.cpu import cpu_fields, cpu_flags


@dataclass(frozen=True)
class Timing:
    median: float  # seconds
    min: float
    max: float
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)


def time_call(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 5, min_seconds: float = 0.0) -> Timing:
    """Time `fn()` after `warmup` untimed calls; repeats until both `repeats` runs and `min_seconds` are done."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        samples: list[float] = []
        began = time.perf_counter()
        while len(samples) < repeats or time.perf_counter() - began < min_seconds:
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


FLOAT_PATHS = ("fp32", "bf16")  # the float references every speed table has: float32, and bfloat16 beside it


def cpu_description() -> str:
    """The CPU, and which float and int8 instructions it has, as a speed figure should name it."""
    flags = cpu_flags()
    features = [
        name
        for name, flag in (
            ("AVX2", "avx2"),
            ("AVX-512", "avx512f"),
            ("VNNI", "avx512_vnni"),
            ("AVX512-BF16", "avx512_bf16"),
            ("AMX", "amx_bf16"),
        )
        if flag in flags
    ]
    return f"{environment_cpu()} ({', '.join(features) or 'no AVX2'}; {os.cpu_count()} cores)"


class InBfloat16(nn.Module):
    """A module run as a model computing in bfloat16 runs it: its input rounded to bfloat16, its output returned in
    the input's dtype, so that it takes and gives float32 like every other implementation a speed table compares.
    Over a float linear held in bfloat16 (`float_paths`) it is oneDNN's AVX512-BF16 / AMX GEMM where the CPU has
    those instructions (there the fastest float path), a slow emulation where it has not."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to(torch.bfloat16)).to(x.dtype)


def float_paths(linear: nn.Linear) -> dict[str, nn.Module]:
    """The float references of a speed table: the float32 linear itself and a bfloat16 copy of it."""
    copy = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None, dtype=torch.bfloat16)
    copy.load_state_dict(linear.state_dict())
    return {"fp32": linear, "bf16": InBfloat16(copy.requires_grad_(False))}


def add_speedups(results: dict[str, dict], key: str) -> dict[str, dict]:
    """Each entry's speed-up over float32 and over the best float path (the faster of float32 and bfloat16 in
    this very table, which is bfloat16 on a CPU with bf16 instructions), from the entries' `key` (a time)."""
    best = min((name for name in FLOAT_PATHS if name in results), key=lambda name: results[name][key])
    for entry in results.values():
        entry["speedup_vs_fp32"] = results["fp32"][key] / entry[key]
        entry["speedup_vs_best_float"] = results[best][key] / entry[key]
        entry["best_float"] = best
    return results


def speed_table(
    by_m: dict[str, dict[str, dict]],
    names: list[str] | None = None,
    *,
    first: str = "M",
    extra: dict[str, Callable[[dict[str, dict]], str]] | None = None,
) -> str:
    """Markdown, a row per M: float32's and bfloat16's times in ms, every other implementation's as "ms (its
    speed-up over the best float path at that M)" (over float32 in results measured before the bf16 reference
    existed), and `extra` columns computed from the row's entries."""
    from leanlm.report import format_table

    measured = next(iter(by_m.values()))
    names = [name for name in names or measured if name in measured]  # results from before bf16 have no bf16
    extra = extra or {}

    def cell(entry: dict, name: str) -> str:
        ratio = entry.get("speedup_vs_best_float", entry["speedup_vs_fp32"])
        return f"{entry['median_ms']:.2f}" + ("" if name in FLOAT_PATHS else f" ({ratio:.2f}x)")

    rows = [
        [m, *(cell(entries[n], n) for n in names), *(column(entries) for column in extra.values())]
        for m, entries in by_m.items()
    ]
    return format_table([first, *names, *extra], rows, markdown=True)


def time_modules(
    modules: dict[str, nn.Module], x: torch.Tensor, reference: torch.Tensor, repeats: int
) -> dict[str, dict]:
    """Each module applied to `x`, all of them interleaved round by round (`time_interleaved`): timing (ms),
    relative error against `reference`, and speed-ups over float32 and over the best float path."""
    timings = time_interleaved(
        {name: (lambda module=module: module(x)) for name, module in modules.items()}, warmup=1, repeats=repeats
    )
    results = {}
    for name, module in modules.items():
        timing = timings[name]
        with torch.inference_mode():
            error = ((module(x).float() - reference).norm() / reference.norm()).item()
        results[name] = {
            "median_ms": timing.median * 1e3,
            "min_ms": timing.min * 1e3,
            "max_ms": timing.max * 1e3,
            "relative_error": error,
        }
    return add_speedups(results, "median_ms")


def time_interleaved(fns: dict[str, Callable[[], object]], *, warmup: int = 1, repeats: int = 5) -> dict[str, Timing]:
    """Time several callables in rounds, each round calling every one once (in a rotated order), so that a slow
    spell of a shared machine falls on all of them alike instead of on whichever ran then: what a ratio between
    them needs, when one call takes long enough (a whole prefill) for such spells to matter."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        for name in names:
            for _ in range(warmup):
                fns[name]()
        for round_index in range(repeats):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                fns[name]()
                samples[name].append(time.perf_counter() - started)
    return {name: Timing(statistics.median(t), min(t), max(t), len(t)) for name, t in samples.items()}


def time_prefill(
    models: dict[str, nn.Module], ids: torch.Tensor, repeats: int, logits_to_keep: int = 0
) -> dict[str, dict]:
    """One forward of `ids` through each model, the models interleaved round by round: timing, tokens per
    second, speed-ups over "fp32" and over the best float path (where "bf16" is among them), weight bytes. `logits_to_keep`: 0 computes every position's logits (a
    perplexity forward, transformers' default); 1 only the last one's, as a generation's prefill does."""
    timings = time_interleaved(
        {
            name: (lambda model=model: model(input_ids=ids, use_cache=False, logits_to_keep=logits_to_keep))
            for name, model in models.items()
        },
        warmup=1,
        repeats=repeats,
    )
    results = {}
    for name, model in models.items():
        timing = timings[name]
        results[name] = {
            "median_s": timing.median,
            "min_s": timing.min,
            "max_s": timing.max,
            "tokens_per_second": ids.numel() / timing.median,
            "weight_bytes": weight_bytes(model),
        }
    return add_speedups(results, "median_s")


def _status_kib(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    # A process that has just ended (a zombie not yet waited for) keeps its status file without the memory lines:
    # an OSError, as when the file is gone, so that callers polling another process catch one error type.
    raise ProcessLookupError(f"{field} not in /proc/{pid}/status: the process has ended")


_peak_before_resets = 0  # the high-water mark as it was before `peak_memory` last reset it


def process_memory_bytes(pid: int, field: str = "VmHWM") -> int:
    """Another process's peak (VmHWM) or current (VmRSS) resident memory."""
    return _status_kib(field, pid) * 1024


def process_peak_rss_bytes() -> int:
    """The process's peak resident memory since it started, whatever `peak_memory` blocks reset in between."""
    return max(_peak_before_resets, _status_kib("VmHWM") * 1024)


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process' resident memory (Linux >= 4.0)."""
    global _peak_before_resets
    _peak_before_resets = process_peak_rss_bytes()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakMemory:
    """Filled in by `peak_memory()`: resident bytes before, and the highest resident bytes during, the block."""

    before_bytes: int = 0
    peak_bytes: int = 0

    @property
    def added_bytes(self) -> int:
        return max(0, self.peak_bytes - self.before_bytes)


@contextmanager
def peak_memory() -> Iterator[PeakMemory]:
    """Peak resident memory (RSS) of the process during the block. Uses the kernel's exact high-water mark
    where it can be reset, else samples RSS every millisecond in a thread."""
    record = PeakMemory(before_bytes=_status_kib("VmRSS") * 1024)
    if _reset_peak_rss():
        yield record
        record.peak_bytes = _status_kib("VmHWM") * 1024
        return
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            record.peak_bytes = max(record.peak_bytes, _status_kib("VmRSS") * 1024)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield record
    finally:
        stop.set()
        sampler.join()
        record.peak_bytes = max(record.peak_bytes, _status_kib("VmRSS") * 1024)


def checkpoint_bytes(directory: str | os.PathLike) -> int:
    """Bytes of a checkpoint's safetensors files as stored on disk."""
    return sum(path.stat().st_size for path in Path(directory).glob("*.safetensors"))


def worker_result(script: str | os.PathLike, *args: str) -> dict:
    """`python SCRIPT --worker ARGS...` in a fresh process (whose peak resident memory is then its own work's): the
    JSON object the last line of its output holds. A worker that fails stops the study with the end of its error
    output."""
    result = subprocess.run([sys.executable, str(script), "--worker", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"worker {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _stored_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold `tensor`'s data: itself, or the inner tensors of a tensor subclass (the
    way torchao stores quantized weights)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _stored_tensors(getattr(tensor, name))
    else:
        yield tensor


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor in the state dict (parameters and persistent buffers) as stored, counting shared
    storage (tied embeddings) once. Packed low-bit weights count at their packed size."""
    seen, total = set(), 0
    for value in model.state_dict().values():
        for tensor in _stored_tensors(value):
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += tensor.numel() * tensor.element_size()
    return total


def environment_cpu() -> str:
    """The CPU's model name, with its family and model numbers where the name alone does not say which generation
    it is (a virtual machine's "AMD EPYC" covers generations whose vector units differ in width)."""
    fields = cpu_fields()
    name = fields.get("model name", platform.processor())
    if "cpu family" in fields and "model" in fields and not any(ch.isdigit() for ch in name):
        name += f" family {fields['cpu family']} model {fields['model']}"
    return name


def environment() -> dict:
    """What a result was measured on, stored beside it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    cpu = environment_cpu()
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "cpu_flags": sorted(flag for flag in cpu_flags() if flag.startswith(("avx", "amx", "fma"))),
        "load_average": list(os.getloadavg()),
        "cores": os.cpu_count(),
    }


def results_dir() -> Path:
    return Path(os.environ.get("LEANLM_RESULTS", Path.cwd() / "benchmarks" / "results"))


def results_name(benchmark: str, model: str, tag: str | None = None) -> str:
    """`<benchmark>_<model>` for a registry name (whole: `qwen2.5-coder-1.5b`), for a model directory its last path
    component, for a file that component without its suffix; then `_<tag>` if a tag is given (another CPU's run,
    kept beside the first)."""
    from leanlm.models.registry import REGISTRY

    path = Path(model)
    label = model if model in REGISTRY else path.stem if path.suffix in (".gguf", ".safetensors") else path.name
    return f"{benchmark}_{label}" + (f"_{tag}" if tag else "")


def previous_results(name: str, settings: dict | None = None) -> dict:
    """What an earlier run wrote to `name.json` ({} if nothing). Given `settings`, only if that run used exactly
    these (compared through JSON, so a tuple matches the list it was saved as): what a `--resume` may keep."""
    path = results_dir() / f"{name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    if settings is not None and previous.get("settings") != json.loads(json.dumps(settings)):
        return {}
    return previous


def write_results(name: str, payload: dict, plot: Callable[[Path], None] | None = None) -> Path:
    """Write `name.json` (payload + environment) and, if given, let `plot` draw `name.png`. The JSON is written
    beside its place and renamed into it, so a run killed while saving leaves the previous file whole."""
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    partial.write_text(json.dumps({**payload, "environment": environment()}, indent=2) + "\n")
    os.replace(partial, path)
    if plot is not None:
        plot(directory / f"{name}.png")
    return path
