"""The one forward-and-score primitive that evaluation and calibration-time searches share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_nll(model, ids: torch.Tensor) -> float:
    """Sum over positions of -log P(ids[t+1] | ids[..t]) for one (1, L) window."""
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum").item()
