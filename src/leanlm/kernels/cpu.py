"""What this CPU can run, read at run time: the machines leanlm runs on differ (some AVX2 only, others with
AVX-512, VNNI and bfloat16 instructions), so every choice that depends on the instruction set asks here.

A listed flag is not proof: a virtual machine may list instructions whose use faults (AMX tiles that die with
SIGILL). What leanlm would hand to an instruction set only its flags name is first run once, in a child process
(`probe`), and the answer kept per CPU and torch build in leanlm's cache."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch

from leanlm.storage import cache_root, write_text_atomically

_log = logging.getLogger(__name__)

# Instructions that compute in bfloat16 natively (oneDNN's bf16 GEMM uses them); without them PyTorch emulates
# bfloat16 arithmetic in float32 and is slower than float32 itself.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_fields() -> dict[str, str]:
    """The fields /proc/cpuinfo lists for this machine's first processor ("model name", "cpu family", "flags", ...;
    empty where there is no such file)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if not key.strip():
            break  # the blank line after the first processor
        fields.setdefault(key.strip(), value.strip())
    return fields


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where there is no such file)."""
    return frozenset(cpu_fields().get("flags", "").split())


# A bfloat16 matrix product through torch (oneDNN's GEMM, which takes AVX512-BF16 or AMX where the flags name them)
# against the same product in float32: exit status 0 only if it ran and agrees.
_BF16_PROBE = """
import torch
torch.manual_seed(0)
a, b = torch.randn(64, 512).bfloat16(), torch.randn(256, 512).bfloat16()
got = torch.nn.functional.linear(a, b).float()
want = torch.nn.functional.linear(a.float(), b.float())
raise SystemExit(0 if torch.allclose(got, want, rtol=0.02, atol=0.5) else 3)
"""


def probe(name: str, code: str, timeout: float = 120.0) -> bool:
    """Whether `code` exits with status 0 in a fresh Python on this machine (a fault, a wrong answer or a hang
    is False, with the reason logged); kept in the cache under `name` and this CPU's model, flags and torch."""
    fields = cpu_fields()
    key = f"{fields.get('model name')}|{fields.get('flags')}|{torch.__version__}|{code}"
    path = cache_root() / "cpu" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        return bool(json.loads(path.read_text())["ok"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        status = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        status = None
    if status != 0:
        reason = "timed out" if status is None else f"exit status {status}"
        _log.warning("CPU probe %s failed (%s): leanlm will not use that instruction path", name, reason)
    try:  # a cache that cannot be written (a read-only home) only means the probe runs again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({"ok": status == 0, "status": status}))
    except OSError as error:
        _log.info("CPU probe %s: answer not kept (%s)", name, error)
    return status == 0


@lru_cache(maxsize=1)
def has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 products in hardware (AVX512-BF16 or AMX listed, and a bfloat16 GEMM
    run by `probe` gives the float32 answer)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS) and probe("bf16-gemm", _BF16_PROBE)
