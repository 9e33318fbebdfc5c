"""Seeded random-weight models of real shapes, written straight to bf16 safetensors shards.

No model larger than SmolLM2 / Gemma-3-270M can be installed here, so scale (memory, speed) is shown on models
with a real model's shapes and random weights: `write_random_model(config, directory)` writes a Hugging Face
directory (config.json, sharded safetensors with an index) one shard at a time, so an 8B model (16 GB in bf16,
32 GB in float32) is written in the memory of one shard. Each tensor's values depend only on the seed and its
name: N(0, 0.02) for matrices and embeddings (GPT-2 / Llama initialisation), ones for norm weights, zeros for
biases.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import save_file

from leanlm.errors import ConfigError
from leanlm.models.untrusted import model_from_config
from leanlm.storage import staged_directory

INIT_STD = 0.02


def _random_tensor(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if len(shape) == 1:  # norm weights
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * INIT_STD).to(torch.bfloat16)


def write_random_model(
    config, directory: str | os.PathLike, *, seed: int = 0, tokenizer=None, shard_bytes: int = 1 << 30
) -> Path:
    """Write a model of `config` (a transformers config) with seeded random bf16 weights to `directory`, shard by
    shard (at most `shard_bytes` each); refuses up front when the disk has not room for it. Returns the
    directory, which appears only when complete."""
    with init_empty_weights():
        skeleton = model_from_config(config)
    shapes, seen = {}, set()
    for name, tensor in skeleton.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # tied weights are stored once
            seen.add(id(tensor))
            shapes[name] = tensor.shape
    total = sum(2 * shape.numel() for shape in shapes.values())
    directory = Path(directory)
    free = shutil.disk_usage(directory.parent if directory.parent.exists() else Path.cwd()).free
    if total > 0.95 * free:
        raise ConfigError(
            f"the model needs {total / 2**30:.1f} GiB in bf16 and {directory.parent} has {free / 2**30:.1f} GiB free"
        )
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if shards[-1] and size + 2 * shape.numel() > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += 2 * shape.numel()
    weight_map = {}
    with staged_directory(directory) as staging:
        config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for number, names in enumerate(shards, start=1):
            file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            save_file(
                {name: _random_tensor(name, shapes[name], seed) for name in names},
                str(staging / file),
                metadata={"format": "pt"},
            )
            weight_map.update({name: file for name in names})
        (staging / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
    return directory
