"""Prefix caches: keys and values of a fixed token prefix (CushionCache's cushion, section 4 of Son et al. 2024)
placed in front of every forward of a model, through the same SinkCache and position hook as StreamingLLM.

The cushion's search and tuning are a method (`leanlm.methods.cushion`); what is here is the cache itself: the
tensors, how a forward gets them, and how they are stored beside a checkpoint (`cushion.safetensors`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from leanlm.cache.sink_cache import SinkCache, cache_positions_hook
from leanlm.errors import CorruptModelError, UnsupportedArchitectureError
from leanlm.models.architectures import architecture_for, mixes_attention_kinds

CUSHION_FILE = "cushion.safetensors"
_HOOK_ATTRIBUTE = "_leanlm_cushion_hook"


@dataclass
class Cushion:
    tokens: list[int]  # the searched prompt (its keys/values may since have been tuned)
    keys: list[torch.Tensor]  # per layer (1, kv_heads, p, head_dim), as the cache stores them (RoPE applied)
    values: list[torch.Tensor]
    record: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.tokens)


def cushion_problem(model: nn.Module) -> str | None:
    """Why a cushion cannot serve `model` (it shifts every position by its length and sits in a full-attention
    cache), or None."""
    if mixes_attention_kinds(model.config):
        return (
            f"{architecture_for(model).family} mixes sliding-window and full-attention layers; a cushion needs every "
            "layer to attend to the whole prefix"
        )
    return None


def check_cushion_support(model: nn.Module) -> None:
    problem = cushion_problem(model)
    if problem:
        raise UnsupportedArchitectureError(problem)


def prefix_cache(model: nn.Module, cushion: Cushion | None, batch: int) -> SinkCache | None:
    """A fresh cache for one forward: the cushion in the sink slots, expanded over the batch, nothing evicted
    (so no key is ever shifted: any position encoding works)."""
    if cushion is None or cushion.length == 0:
        return None
    return put_cushion(SinkCache(sinks=cushion.length, window=None), cushion, batch)


def put_cushion(cache: SinkCache, cushion: Cushion, batch: int = 1) -> SinkCache:
    """`cache` (empty, its sinks at least the cushion's length) with the cushion's keys and values read in,
    expanded over the batch."""
    for layer, (keys, values) in enumerate(zip(cushion.keys, cushion.values)):
        cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), layer)
    return cache


def attach_cushion(model: nn.Module, cushion: Cushion) -> None:
    """Prepend `cushion` to every forward of `model` that does not already continue a cache."""
    check_cushion_support(model)
    detach_cushion(model)

    def supply_cache(module: nn.Module, args: tuple, kwargs: dict):
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() > 0:
            return None  # a continuing generation: its cache already starts with the cushion
        inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        if inputs is None and args:
            inputs = args[0]
        kwargs["past_key_values"] = prefix_cache(module, cushion, inputs.shape[0])
        return cache_positions_hook(module, args, kwargs)

    setattr(model, _HOOK_ATTRIBUTE, model.register_forward_pre_hook(supply_cache, with_kwargs=True))
    model._leanlm_cushion = cushion


def detach_cushion(model: nn.Module) -> None:
    handle = getattr(model, _HOOK_ATTRIBUTE, None)
    if handle is not None:
        handle.remove()
        setattr(model, _HOOK_ATTRIBUTE, None)
        model._leanlm_cushion = None


def attached_cushion(model: nn.Module) -> Cushion | None:
    return getattr(model, "_leanlm_cushion", None)


def follow_value_smoothing_(model: nn.Module, producer_scales: dict[str, torch.Tensor]) -> None:
    """SmoothQuant's v_proj -> o_proj smoothing divides v_proj's output channels by s and scales o_proj's input
    columns by s. An attached cushion's values were produced before it, so they are divided alike; left as they
    were, o_proj would amplify the cushion's share of every attention output by s, and the cushion is the sink
    that takes most of the attention. `producer_scales` as `SmoothingResult` gives them; `smooth_` calls this."""
    cushion = attached_cushion(model)
    if cushion is None:
        return
    table = architecture_for(model)
    values = []
    for index, value in enumerate(cushion.values):
        names = [f"{table.blocks}.{index}.{path}" for path in table.attention_inputs]
        scales = next((producer_scales[name] for name in names if name in producer_scales), None)
        _, heads, _, head_dim = value.shape
        values.append(value if scales is None else value / scales.reshape(heads, 1, head_dim))
    attach_cushion(model, Cushion(cushion.tokens, cushion.keys, values, cushion.record))


def cushion_keys_values(model: nn.Module, tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The float model's cached keys and values of `tokens` at positions 0..p-1: an untuned cushion's tensors."""
    if not tokens:
        return [], []
    with torch.inference_mode():
        output = model.base_model(input_ids=torch.tensor([tokens]), use_cache=True)
    cache = output.past_key_values
    return ([layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers])


def save_cushion(cushion: Cushion, directory: str | os.PathLike) -> None:
    tensors = {
        f"{kind}.{layer}": tensor.contiguous()
        for kind, group in (("keys", cushion.keys), ("values", cushion.values))
        for layer, tensor in enumerate(group)
    }
    save_file(
        tensors,
        str(Path(directory) / CUSHION_FILE),
        metadata={"tokens": json.dumps(cushion.tokens), "record": json.dumps(cushion.record)},
    )


def load_cushion(directory: str | os.PathLike) -> Cushion:
    path = Path(directory) / CUSHION_FILE
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        tokens, record = json.loads(metadata["tokens"]), json.loads(metadata["record"])
    except Exception as error:  # missing or damaged: safetensors and json raise their own types
        raise CorruptModelError(f"{path} cannot be read as a cushion: {error}") from error
    layers = len([name for name in tensors if name.startswith("keys.")])
    return Cushion(
        tokens, [tensors[f"keys.{i}"] for i in range(layers)], [tensors[f"values.{i}"] for i in range(layers)], record
    )
