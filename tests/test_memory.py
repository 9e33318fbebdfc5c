import pytest


def test_freed_memory_goes_back_to_the_system_at_once():
    """In a fresh process (the setting is process-wide): after returning freed memory is switched on, freed
    blocks of a few MiB leave resident memory, where glibc's dynamic threshold keeps them in its heap (without
    the call this script prints 0)."""
    import subprocess
    import sys

    script = """
import torch
from leanlm.bench.harness import _status_kib
from leanlm.memory import return_freed_memory_at_once
if not return_freed_memory_at_once():
    print("skip"); raise SystemExit
big = torch.ones(16 * 2**20 // 4); del big  # a large free: glibc would raise its threshold to 16 MiB
live = [torch.ones(2**20) for _ in range(50)]  # 50 blocks of 4 MiB ...
before = _status_kib("VmRSS")
del live[:-1]  # ... all but the last freed, so none sits at the top of a heap
print(before - _status_kib("VmRSS"))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    if result.stdout.strip() == "skip":
        pytest.skip("the C library is not glibc")
    assert int(result.stdout.strip()) > 150 * 1024  # KiB: at least 150 of the 196 MiB freed left
