"""Pre-training a small decoder LM from scratch (the sink-token study of Xiao's thesis section 4.3): packed blocks of
the training text, AdamW with linear warm-up and cosine decay, optionally one fixed token (a learnable sink)
prepended to every sample. The batch of step t is a pure function of (seed, t), as in fine-tuning."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.errors import ConfigError
from leanlm.optim import AdamW
from leanlm.training.data import batch_indices


@dataclass(frozen=True)
class PretrainSettings:
    steps: int = 600
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(f"pre-training needs steps and batch size >= 1, got {self.steps} and {self.batch_size}")


def pretrain(
    model: nn.Module,
    blocks: torch.Tensor,
    settings: PretrainSettings,
    prefix_token: int | None = None,
    progress: bool = True,
    desc: str = "pre-training",
) -> dict:
    """Train every parameter of `model` on `blocks` (n, length); with `prefix_token`, each sample becomes
    [prefix_token] + block (the token's embedding is learned like any other)."""
    if len(blocks) == 0:
        raise ConfigError("pre-training needs at least one block of text")
    optimizer = AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        state_bits=32,
    )
    losses = []
    started = time.perf_counter()
    model.train()
    bar = tqdm(range(settings.steps), desc=desc, unit="step", disable=not progress)
    for step in bar:
        progress_fraction = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        scale = (
            (step + 1) / settings.warmup_steps
            if step < settings.warmup_steps
            else 0.5 * (1 + math.cos(math.pi * progress_fraction))
        )
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * scale
        batch = blocks[batch_indices(step, settings.batch_size, len(blocks), settings.seed)]
        if prefix_token is not None:  # the sink is only ever input: the shifted labels never ask for it
            batch = torch.cat([torch.full((len(batch), 1), prefix_token, dtype=batch.dtype), batch], dim=1)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    seconds = time.perf_counter() - started
    return {
        "settings": asdict(settings),
        "losses": losses,
        "seconds": seconds,
        "tokens_per_second": settings.steps * settings.batch_size * blocks.shape[1] / seconds,
    }
