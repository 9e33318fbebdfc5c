"""The model SWARM trains: a small byte-level decoder LM cut into equal pipeline stages.

Stage 0 embeds bytes (and positions), every stage runs `layers_per_stage` pre-LN Transformer blocks, the last
stage adds the final norm, the vocabulary head and the loss. A stage's initial weights depend only on
(seed, stage index), so every peer serving a stage starts from the same parameters, and `full_model` (all
stages in one process) is the single-process baseline with identical initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.settings import option


@dataclass(frozen=True)
class SwarmModelConfig:
    stages: int = option(3, "pipeline stages")
    layers_per_stage: int = 2
    hidden: int = 128
    heads: int = 4
    seq_len: int = 128
    vocab_size: int = 256  # bytes: the shipped text needs no tokenizer
    seed: int = 0

    def __post_init__(self):
        if self.stages < 2:
            raise ConfigError(f"a pipeline needs at least 2 stages, got {self.stages}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden size {self.hidden} is not a multiple of {self.heads} heads")


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, hidden))
        return x + self.mlp(self.mlp_norm(x))


class Stage(nn.Module):
    def __init__(self, config: SwarmModelConfig, index: int):
        super().__init__()
        if not 0 <= index < config.stages:
            raise ConfigError(f"stage {index} does not exist (the model has {config.stages})")
        self.index, self.first, self.last = index, index == 0, index == config.stages - 1
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed * 1000 + index)
        if self.first:
            self.embed = nn.Embedding(config.vocab_size, config.hidden)
            self.position = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config.hidden, config.heads) for _ in range(config.layers_per_stage))
        if self.last:
            self.norm, self.head = nn.LayerNorm(config.hidden), nn.Linear(config.hidden, config.vocab_size)
        torch.random.set_rng_state(generator_state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Stage 0 takes byte ids (batch, length); the others hidden states. The last returns logits."""
        if self.first:
            x = self.embed(x) + self.position(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.last else x

    @staticmethod
    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def full_model(config: SwarmModelConfig) -> nn.Sequential:
    return nn.Sequential(*(Stage(config, index) for index in range(config.stages)))


def byte_blocks(text: str, seq_len: int) -> torch.Tensor:
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    count = data.numel() // seq_len
    return data[: count * seq_len].reshape(count, seq_len)
