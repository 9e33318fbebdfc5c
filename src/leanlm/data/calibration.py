"""The calibration sampler: random token windows from text that no evaluation uses."""

from __future__ import annotations

import torch

from leanlm.data.datasets import plain_text
from leanlm.data.tokens import token_ids
from leanlm.errors import ConfigError


def calibration_batches(
    tokenizer, n_samples: int = 512, seq_len: int = 512, seed: int = 0, source: str = "lambada-dev"
) -> torch.Tensor:
    """`n_samples` windows of `seq_len` tokens at random offsets of the tokenized `source` text, as one
    (n_samples, seq_len) LongTensor. Default source: the LAMBADA development novels, not an evaluation set."""
    if n_samples < 1 or seq_len < 2:
        raise ConfigError(f"calibration needs n_samples >= 1 and seq_len >= 2, got {n_samples} and {seq_len}")
    ids = torch.tensor(token_ids(tokenizer, plain_text(source), special_tokens=True), dtype=torch.long)
    if ids.numel() <= seq_len:
        raise ConfigError(f"calibration text {source!r} has {ids.numel()} tokens, fewer than seq_len={seq_len}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n_samples,), generator=generator)
    return torch.stack([ids[start : start + seq_len] for start in starts.tolist()])
