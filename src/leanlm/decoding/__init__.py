"""Decoding runtimes beside transformers' eager forward: `fused` runs a whole batch-1 decode step in one C++ call;
`packed` reads several sequences' prompt pieces in one forward."""

from leanlm.decoding.fused import (
    FusedCache,
    FusedDecoder,
    fused_decoder_problem,
    greedy_stream,
    greedy_tokens,
    new_cache,
    read_in_chunks,
)
from leanlm.decoding.packed import packing_problem, read_pieces

__all__ = [
    "FusedCache",
    "FusedDecoder",
    "fused_decoder_problem",
    "greedy_stream",
    "greedy_tokens",
    "new_cache",
    "packing_problem",
    "read_in_chunks",
    "read_pieces",
]
