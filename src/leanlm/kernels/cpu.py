"""What this CPU can run, read at run time: the machines leanlm runs on differ (some AVX2 only, others with
AVX-512, VNNI and bfloat16 instructions), so every choice that depends on the instruction set asks here."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

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


def has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 products in hardware (AVX512-BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)
