"""Measurement helpers shared by all benchmarks (the scripts live in the repo's benchmarks/ folder): honest timing
and memory (`harness`), the row-by-row result file every script is (`study`), the peers' modules (`peers`)."""

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
from leanlm.bench.study import Study, measured_on, print_report, study_arguments, titled

__all__ = [
    "PeakMemory",
    "Study",
    "Timing",
    "environment",
    "measured_on",
    "peak_memory",
    "previous_results",
    "print_report",
    "process_peak_rss_bytes",
    "results_dir",
    "results_name",
    "study_arguments",
    "time_call",
    "time_interleaved",
    "time_modules",
    "time_prefill",
    "titled",
    "weight_bytes",
    "write_results",
]
