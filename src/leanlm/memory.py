"""Asking the C library to give freed memory back to the system, so that resident memory falls when tensors are
freed. PyTorch's CPU tensors come from glibc's malloc, which keeps freed heap memory for reuse; both calls are
glibc's own (`malloc_trim`, `mallopt`) and do nothing where the C library is another."""

from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_freed_memory() -> None:
    """Give the memory freed so far back to the system now (malloc_trim)."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def return_freed_memory_at_once() -> bool:
    """Make glibc give every freed block of 128 KiB or more back to the system at once (mallopt
    M_MMAP_THRESHOLD, which also stops glibc from raising that threshold as it goes). By default glibc raises it
    to the size of any large block freed (up to 32 MiB), after which blocks of that size come from its heap and
    stay resident once freed, scattered between live ones: training's activations of a few MiB then hold the
    peak resident memory at several times the live tensors. The price is a fresh, zeroed mapping for each such
    block, which slows training (benchmarks/qlora.py measures both). False where the C library is not glibc."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024))
