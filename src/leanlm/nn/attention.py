"""Attention with int8-quantized batched matmuls (SmoothQuant, Xiao's thesis Fig. 3.3), through transformers' own
attention-function registry: no attention class is patched.

Queries and keys (after RoPE) and values are quantized before the two matmuls. The softmax probabilities are
quantized on the fixed grid 1/127 only if asked (`quantize_probs`): SmoothQuant's int8 OPT kernel does that,
but its accuracy numbers come from the fake-quant path, which leaves them in float; on a 135M model with
strong attention sinks, rounding every probability below 1/254 to zero costs several perplexity points.
The matmuls run in floating point on the quantized values (simulated int8: the same numbers an int8 BMM
would multiply).

A module opts in by carrying a `BmmQuantizer` child named `bmm_quantizer`; without one the function is plain
eager attention. The quantizer can also *observe*: record max|q|, max|k| and per-channel max|v| during
calibration, for static (O3) scales.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from leanlm.formats.int8 import QMAX, ActivationGranularity, absmax_scale, activation_scale, fake_quantize
from leanlm.nn.base import QuantizedModule

ATTENTION_NAME = "leanlm_int8_bmm"


class BmmQuantizer(QuantizedModule):
    kind = "int8 attention matmuls"

    def __init__(
        self,
        activation: ActivationGranularity = "per_tensor",
        static: bool = False,
        kv_channels: int = 0,
        quantize_probs: bool = False,
    ):
        super().__init__()
        self.activation, self.static, self.quantize_probs = activation, static, quantize_probs
        self.observe = False
        self.register_buffer("q_absmax", torch.zeros(()))
        self.register_buffer("k_absmax", torch.zeros(()))
        # Per channel (kv heads x head_dim) because smoothing v_proj -> o_proj rescales exactly these channels.
        self.register_buffer("v_channel_absmax", torch.zeros(kv_channels))

    def compressed_tensors_problems(self) -> list[str]:
        return [
            "--no-bmm (attention's int8 q / k / v products have no compressed-tensors form: it quantizes the KV "
            "cache, never q)"
        ]

    def constructor_args(self) -> dict:
        """The arguments that rebuild this module before a checkpoint's state dict is loaded into it."""
        return {
            "activation": self.activation,
            "static": self.static,
            "kv_channels": self.v_channel_absmax.numel(),
            "quantize_probs": self.quantize_probs,
        }

    def record(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        inf = float("inf")
        self.q_absmax = torch.maximum(self.q_absmax, torch.linalg.vector_norm(query.detach(), inf).float())
        self.k_absmax = torch.maximum(self.k_absmax, torch.linalg.vector_norm(key.detach(), inf).float())
        # value: (batch, kv_heads, seq, head_dim) -> per (head, dim) channel, ordered like v_proj's outputs
        per_channel = torch.linalg.vector_norm(value.detach(), inf, dim=(0, 2)).flatten().float()
        if self.v_channel_absmax.numel() != per_channel.numel():
            self.v_channel_absmax = torch.zeros_like(per_channel)
        self.v_channel_absmax = torch.maximum(self.v_channel_absmax, per_channel)

    def static_scales(self) -> dict[str, torch.Tensor]:
        """The calibrated scales of q, k and v (one each, per tensor)."""
        absmax = {"q": self.q_absmax, "k": self.k_absmax, "v": self.v_channel_absmax.amax()}
        return {which: (value / QMAX).clamp(min=1e-8) for which, value in absmax.items()}

    def quantize(self, tensor: torch.Tensor, which: str) -> torch.Tensor:
        if self.static:
            return fake_quantize(tensor, self.static_scales()[which])
        if which == "v":  # v's token dimension is the inner one of P.V: it cannot carry a per-token scale
            return fake_quantize(tensor, absmax_scale(tensor))
        return fake_quantize(tensor, activation_scale(tensor, self.activation))


def _repeat_heads(states: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // states.shape[1]
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def int8_bmm_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    quantizer: BmmQuantizer | None = getattr(module, "bmm_quantizer", None)
    if quantizer is not None and quantizer.observe:
        quantizer.record(query, key, value)
    quantize = quantizer is not None and not quantizer.observe
    if quantize:
        query, key, value = quantizer.quantize(query, "q"), quantizer.quantize(key, "k"), quantizer.quantize(value, "v")
    key, value = _repeat_heads(key, query.shape[1]), _repeat_heads(value, query.shape[1])
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    if not (quantize and quantizer.quantize_probs) and softcap is None:
        # Nothing to do between the two matmuls: PyTorch's fused attention on the (quantized) q, k, v.
        out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:  # Gemma 2: logits squashed into (-softcap, softcap) before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if quantize and quantizer.quantize_probs:
        probs = torch.round(probs * QMAX) / QMAX
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTENTION_NAME, int8_bmm_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, eager_mask)


def use_int8_bmm_attention(model: nn.Module) -> None:
    """Route the model's attention through `int8_bmm_attention` (modules without a quantizer stay exact)."""
    model.config._attn_implementation = ATTENTION_NAME
