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
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn


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


def time_modules(modules: dict[str, nn.Module], x: torch.Tensor, reference: torch.Tensor, repeats: int,
                 slow: Callable[[str], bool] = lambda name: False) -> dict[str, dict]:
    """Each module applied to `x`: timing (ms), relative error against `reference`, and speed-up over the module
    named "fp32". The modules are timed interleaved, round by round (`time_interleaved`); `slow` names are timed
    apart, 2 repeats only."""
    fast = {name: (lambda module=module: module(x)) for name, module in modules.items() if not slow(name)}
    timings = time_interleaved(fast, warmup=1, repeats=repeats)
    for name, module in modules.items():
        if name not in timings:
            timings[name] = time_call(lambda module=module: module(x), warmup=1, repeats=2)
    results = {}
    for name, module in modules.items():
        timing = timings[name]
        with torch.inference_mode():
            error = ((module(x) - reference).norm() / reference.norm()).item()
        results[name] = {"median_ms": timing.median * 1e3, "min_ms": timing.min * 1e3, "max_ms": timing.max * 1e3,
                         "relative_error": error}
    for entry in results.values():
        entry["speedup_vs_fp32"] = results["fp32"]["median_ms"] / entry["median_ms"]
    return results


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


def time_prefill(models: dict[str, nn.Module], ids: torch.Tensor, repeats: int,
                 logits_to_keep: int = 0) -> dict[str, dict]:
    """One forward of `ids` through each model, the models interleaved round by round: timing, tokens per
    second, speed-up over "fp32", weight bytes. `logits_to_keep`: 0 computes every position's logits (a
    perplexity forward, transformers' default); 1 only the last one's, as a generation's prefill does."""
    timings = time_interleaved(
        {name: (lambda model=model: model(input_ids=ids, use_cache=False, logits_to_keep=logits_to_keep))
         for name, model in models.items()}, warmup=1, repeats=repeats)
    results = {}
    for name, model in models.items():
        timing = timings[name]
        results[name] = {"median_s": timing.median, "min_s": timing.min, "max_s": timing.max,
                         "tokens_per_second": ids.numel() / timing.median, "weight_bytes": weight_bytes(model)}
    for entry in results.values():
        entry["speedup_vs_fp32"] = results["fp32"]["median_s"] / entry["median_s"]
    return results


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


_peak_before_resets = 0  # the high-water mark as it was before `peak_memory` last reset it


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


def environment() -> dict:
    """What a result was measured on, stored beside it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    ) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "cores": os.cpu_count(),
    }


def results_dir() -> Path:
    return Path(os.environ.get("LEANLM_RESULTS", Path.cwd() / "benchmarks" / "results"))


def results_name(benchmark: str, model: str) -> str:
    """`<benchmark>_<model>` for a registry name, or for a model directory / file its last path component."""
    return f"{benchmark}_{Path(model).stem}"


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
