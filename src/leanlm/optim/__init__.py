"""Optimizers whose state is stored compactly (built on the numeric formats; used by training and by methods
that tune a few tensors, such as CushionCache's prefix tuning)."""

from leanlm.optim.adamw import AdamW

__all__ = ["AdamW"]
