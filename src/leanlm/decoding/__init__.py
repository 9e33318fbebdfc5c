"""Decoding runtimes beside transformers' eager forward: `fused` runs a whole batch-1 decode step in one C++ call."""

from leanlm.decoding.fused import (
    FusedCache,
    FusedDecoder,
    fused_decoder_problem,
    greedy_stream,
    greedy_tokens,
    new_cache,
    read_in_chunks,
)

__all__ = [
    "FusedCache",
    "FusedDecoder",
    "fused_decoder_problem",
    "greedy_stream",
    "greedy_tokens",
    "new_cache",
    "read_in_chunks",
]
