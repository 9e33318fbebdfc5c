"""Perplexity with the papers' protocol (GPTQ, SmoothQuant, SpQR): tokenize the whole test set, cut it into
non-overlapping windows of `seq_len` tokens, run each window on its own, and average the negative
log-likelihood over every predicted token.

One deliberate difference from GPTQ's script: it multiplies each window's mean loss by `seq_len` although a
window predicts `seq_len - 1` tokens; here the mean is taken over the tokens actually predicted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from leanlm.errors import ConfigError
from leanlm.evaluation.tokens import bos_prefix, encode
from leanlm.models.scoring import next_token_nll


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    tokens: int  # predicted tokens, the denominator of the mean NLL
    windows: int
    seq_len: int
    seconds: float
    tokens_per_second: float  # model input tokens per second of forward passes


def perplexity_windows(
    tokenizer, text: str, *, seq_len: int = 2048, max_tokens: int | None = None, desc: str = "perplexity"
) -> list[list[int]]:
    """The token ids of every window the protocol scores (the model's BOS, if it has one, then `seq_len` minus
    that many text tokens): what leanlm and, in the benchmarks, other engines are given."""
    if seq_len < 2:
        raise ConfigError(f"seq_len must be at least 2, got {seq_len}")
    prefix = bos_prefix(tokenizer)
    stream = encode(tokenizer, text)
    if max_tokens is not None:
        stream = stream[:max_tokens]
    step = seq_len - len(prefix)  # text tokens per window; a window's input is always seq_len long
    windows = len(stream) // step
    if windows == 0:
        raise ConfigError(
            f"{desc}: {len(stream)} tokens do not fill one window of seq_len {seq_len}; "
            "raise max_tokens or lower seq_len"
        )
    return [prefix + stream[index * step : (index + 1) * step] for index in range(windows)]


def perplexity(
    model, tokenizer, text: str, *, seq_len: int = 2048, max_tokens: int | None = None, desc: str = "perplexity"
) -> PerplexityResult:
    windows = perplexity_windows(tokenizer, text, seq_len=seq_len, max_tokens=max_tokens, desc=desc)
    return windows_perplexity(model, windows, desc=desc)


def windows_perplexity(model, windows: list[list[int]], *, desc: str = "perplexity") -> PerplexityResult:
    """The mean NLL over every predicted token of the given windows (each run on its own), as a perplexity."""
    total_nll, predicted, forward_seconds = 0.0, 0, 0.0
    for window in tqdm(windows, desc=desc, unit="window"):
        ids = torch.tensor([window])
        started = time.perf_counter()
        total_nll += next_token_nll(model, ids)
        forward_seconds += time.perf_counter() - started
        predicted += ids.shape[1] - 1
    return PerplexityResult(
        perplexity=math.exp(total_nll / predicted),
        tokens=predicted,
        windows=len(windows),
        seq_len=len(windows[0]),
        seconds=forward_seconds,
        tokens_per_second=sum(map(len, windows)) / forward_seconds,
    )
