"""Measurement helpers shared by all benchmarks (the scripts live in the repo's benchmarks/ folder)."""

from leanlm.bench.harness import (
    PeakMemory,
    Timing,
    environment,
    peak_memory,
    previous_results,
    process_peak_rss_bytes,
    results_dir,
    results_name,
    time_call,
    time_interleaved,
    time_modules,
    time_prefill,
    weight_bytes,
    write_results,
)

__all__ = ["PeakMemory", "Timing", "environment", "peak_memory", "previous_results", "process_peak_rss_bytes", "results_dir", "results_name", "time_call", "time_interleaved", "time_modules", "time_prefill", "weight_bytes", "write_results"]
