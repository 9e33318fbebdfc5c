"""The causal language-modelling loss without the whole batch's logits.

With vocabularies of 50k-260k entries the logits are the largest tensors of fine-tuning, and transformers'
`model(input_ids, labels=...)` holds them for the whole batch, with their float32 copy, softmax and gradient:
Gemma-3's 262,144 entries over 4 x 256 positions are 1 GiB per copy, several GiB at the peak, the same for LoRA
and QLoRA whatever the base weighs. Here the output head and the cross-entropy run over chunks of positions,
each chunk checkpointed (its logits recomputed in backward), so only one chunk's logits ever exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LOGITS_BYTES_PER_CHUNK = 64 * 2**20  # float32 logits of one chunk


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, chunk_positions: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy over `input_ids` (batch, length), each position predicting the next: the
    value of transformers' `model(input_ids=input_ids, labels=input_ids).loss`."""
    hidden = model.base_model(input_ids=input_ids).last_hidden_state[:, :-1]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    head = model.get_output_embeddings()
    if chunk_positions is None:
        chunk_positions = max(1, LOGITS_BYTES_PER_CHUNK // (4 * head.weight.shape[0]))
    softcap = getattr(model.config, "final_logit_softcapping", None)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, len(targets), chunk_positions):
        part = slice(start, start + chunk_positions)
        if torch.is_grad_enabled():
            total = total + checkpoint(_loss_sum, head, softcap, hidden[part], targets[part], use_reentrant=False)
        else:
            total = total + _loss_sum(head, softcap, hidden[part], targets[part])
    return total / len(targets)


def _loss_sum(head: nn.Module, softcap: float | None, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    if softcap:  # Gemma 2's final logit soft-capping, as its model applies it
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, reduction="sum")
