"""SoftMax-off-by-one attention ("zero sink", Xiao's thesis section 4.3): softmax over the scores plus one extra logit
fixed at 0, so a head can put its attention mass nowhere instead of dumping it on the first token:

    p_i = exp(s_i) / (1 + sum_j exp(s_j))

Computed stably by shifting with m = max(0, max_j s_j): p_i = exp(s_i - m) / (exp(-m) + sum_j exp(s_j - m)).
Registered in transformers' attention-function registry (no attention class is patched); returns the
probabilities, so attention-mass probes work on it as on eager attention.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

SOFTMAX_ONE = "leanlm_softmax1"


def softmax_one(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    shift = scores.amax(dim=dim, keepdim=True).clamp(min=0)
    exponentials = torch.exp(scores - shift)
    return exponentials / (torch.exp(-shift) + exponentials.sum(dim=dim, keepdim=True))


def softmax_one_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = softmax_one(scores.float()).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


AttentionInterface.register(SOFTMAX_ONE, softmax_one_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SOFTMAX_ONE, eager_mask)
