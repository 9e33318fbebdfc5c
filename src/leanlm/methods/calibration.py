"""Calibration: run sample text through the model block by block and record, for every quantizable linear, the
running per-input-channel max|x| (SmoothQuant's act_scales; its max is the per-tensor static range), or the sum of
each input column's square (llama.cpp's importance matrix)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from leanlm.formats.ggml_inputs import INT8_BLOCKS, ROUNDINGS, int8_roundings
from leanlm.formats.imatrix import ImportanceMatrix
from leanlm.methods.blocks import frozen_parameters, observe_inputs, walk_blocks
from leanlm.models.architectures import (
    ArchitectureTable,
    architecture_for,
    decoder_blocks,
    gguf_tensor_names,
    linear_weight_out_in,
)
from leanlm.storage import cache_root, staged_file

# Part of the key of every kept sensitivity: a change to what `collect_sensitivity` computes must change it.
SENSITIVITY_FORMAT = 2
# Whether `kept_sensitivity` reads and writes leanlm's cache; False measures every time (what a first run holds).
KEEP_SENSITIVITY = True


def record_channel_absmax(known: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> None:
    """known[name] becomes the running max |x| per input channel (last dimension of `x`)."""
    channel_max = torch.linalg.vector_norm(x.detach().reshape(-1, x.shape[-1]), float("inf"), dim=0).float()
    known[name] = torch.maximum(known[name], channel_max) if name in known else channel_max


def _observe_block_linears(model: nn.Module, batches: torch.Tensor, table: ArchitectureTable, record, desc: str):
    """Run the calibration windows through the float model block by block; `record(name, x)` sees every block
    linear's input (one window per forward: no padding to pollute the statistics)."""

    def observe(index: int, block: nn.Module):
        prefix = f"{table.blocks}.{index}."
        return observe_inputs(
            ((prefix + path, block.get_submodule(path)) for path in table.quantizable_linears), record
        )

    walk_blocks(model, batches, observe=observe, desc=desc)


def collect_input_absmax(
    model: nn.Module, batches: torch.Tensor, table: ArchitectureTable | None = None, desc: str = "calibrating"
) -> dict[str, torch.Tensor]:
    """{linear name: (in_features,) max |x| per input channel over all calibration tokens}, observed on the
    float model through the block pipeline."""
    stats: dict[str, torch.Tensor] = {}
    table = table or architecture_for(model)
    _observe_block_linears(model, batches, table, lambda name, x: record_channel_absmax(stats, name, x), desc)
    return stats


def collect_importance(model: nn.Module, batches: torch.Tensor, source: str = "calibration") -> ImportanceMatrix:
    """llama.cpp's importance matrix of the float model: for every block linear, under its GGUF name, the sum over
    the calibration tokens of each input column's square and the number of tokens (what `llama-imatrix`
    accumulates); `source` names the text in the file's metadata."""
    table = architecture_for(model)
    names = gguf_tensor_names(model)
    sums: dict[str, torch.Tensor] = {}
    counts: Counter = Counter()

    def record(name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        sums[name] = sums[name] + x.square().sum(dim=0) if name in sums else x.square().sum(dim=0)
        counts[name] += x.shape[0]

    with torch.inference_mode():
        _observe_block_linears(model, batches, table, record, "importance")
    gguf_name = {name: f"{names.get_name(name)}.weight" for name in sums}
    return ImportanceMatrix(
        {gguf_name[name]: total.numpy() for name, total in sums.items()},
        {gguf_name[name]: float(count) for name, count in counts.items()},
        [source],
        len(batches),
        batches.shape[-1],
    )


@contextmanager
def activation_gradients(model: nn.Module) -> Iterator[None]:
    """While active, a backward pass of `model` reaches its activations and no parameter: the parameters are frozen
    and the gradient enters through the token embedding's output."""
    handle = model.get_input_embeddings().register_forward_hook(lambda module, args, out: out.requires_grad_())
    try:
        with frozen_parameters(model), torch.enable_grad():
            yield
    finally:
        handle.remove()


class Sensitivity(NamedTuple):
    """What a linear's rounding does to the loss, per `collect_sensitivity`: `g` (out,) the mean squared gradient of
    the next-token loss at each output, `h` (in,) the mean square of each input column, `inputs` {int8 rounding of
    llama.cpp's CPU backend (`ggml_inputs.INT8_BLOCKS`): the Fisher estimate of the loss that rounding this linear's
    input adds}."""

    g: torch.Tensor
    h: torch.Tensor
    inputs: dict[str, float]


def collect_sensitivity(
    model: nn.Module, batches: torch.Tensor, table: ArchitectureTable | None = None
) -> dict[str, Sensitivity]:
    """{BLOCK.PATH: Sensitivity} for every block linear of the float model, means over the calibration tokens.
    sum_ij g_i h_j dW_ij^2 is the Fisher (Kronecker-factored diagonal) estimate of what a change dW of the weight
    adds to the loss, so the errors of linears in different blocks are on one scale; the input roundings' estimate
    is the same sum taken token by token, sum_i G_ti^2 (W dx_t)_i^2 with dx_t the rounding's change to the token's
    input, since their error is largest exactly on the tokens with outlier inputs. One window per forward and
    backward; no parameter gradient is kept."""
    table = table or architecture_for(model)
    linears = [
        (f"{index}.{path}", block.get_submodule(path))
        for index, block in enumerate(decoder_blocks(model, table))
        for path in table.quantizable_linears
    ]
    outputs: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    rounded: dict[str, Counter] = {name: Counter() for name, _ in linears}
    tokens: Counter = Counter()

    def add(store: dict, name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().square().sum(dim=0)
        store[name] = store[name].add_(x) if name in store else x

    def record_input(name: str, x: torch.Tensor) -> None:
        add(inputs, name, x)
        tokens[name] += x.numel() // x.shape[-1]

    def watch_output(name: str):
        def hook(module, args, output) -> None:  # returns nothing: the output stays as it is
            output.register_hook(lambda grad: add(outputs, name, grad))
            x = args[0].detach().float()
            with torch.no_grad():
                weight = linear_weight_out_in(module, table).detach().float()
                # kept until the backward pass in bfloat16: an estimate's precision, half the memory
                changes = {r: F.linear(x - ROUNDINGS[r](x), weight).bfloat16() for r in int8_roundings(x.shape[-1])}
            for rounding, change in changes.items():
                output.register_hook(
                    lambda grad, rounding=rounding, change=change: rounded[name].update(
                        {rounding: float((grad.detach().float() * change.float()).square().sum())}
                    )
                )

        return hook

    handles = [module.register_forward_hook(watch_output(name)) for name, module in linears]
    try:
        with activation_gradients(model), observe_inputs(linears, record_input):
            for window in tqdm(batches, desc="sensitivity", unit="window", leave=False):
                ids = window.unsqueeze(0)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return {
        name: Sensitivity(
            outputs[name] / tokens[name],
            inputs[name] / tokens[name],
            {rounding: total / tokens[name] for rounding, total in rounded[name].items()},
        )
        for name in inputs
    }


def tensors_digest(model: nn.Module) -> str:
    """A digest of every parameter and buffer of `model`: names, dtypes, shapes and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        tensor = tensor.detach().reshape(-1).contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(memoryview(tensor.view(torch.uint8).numpy()))
    return digest.hexdigest()


def kept_sensitivity(
    model: nn.Module, batches: torch.Tensor, table: ArchitectureTable | None = None, digest: str | None = None
) -> dict[str, Sensitivity]:
    """`collect_sensitivity`, kept in leanlm's cache (`sensitivity/`) under a digest of the model's tensors and the
    windows' token ids: another budget or allocation on the same model and calibration text reads it back instead
    of repeating the backward passes. A cache that cannot be written only costs the next run its passes.
    `digest`: the model's `tensors_digest`, where the caller has it already."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    table = table or architecture_for(model)
    if not KEEP_SENSITIVITY:
        return collect_sensitivity(model, batches, table)
    key = hashlib.blake2b(digest_size=16)
    key.update(f"{SENSITIVITY_FORMAT} {torch.__version__} {table.blocks} {table.quantizable_linears}".encode())
    key.update((digest or tensors_digest(model)).encode())
    key.update(memoryview(batches.to(torch.int64).contiguous().numpy()))
    path = cache_root() / "sensitivity" / f"{key.hexdigest()}.safetensors"
    try:
        kept = load_file(path)
        names = dict.fromkeys(entry.rpartition(":")[0] for entry in kept)
        return {
            name: Sensitivity(
                kept[f"{name}:g"],
                kept[f"{name}:h"],
                {r: float(kept[f"{name}:{r}"]) for r in INT8_BLOCKS if f"{name}:{r}" in kept},
            )
            for name in names
        }
    except (OSError, SafetensorError):
        pass
    sensitivity = collect_sensitivity(model, batches, table)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with staged_file(path) as partial:
            save_file(
                {
                    f"{name}:{part}": tensor
                    for name, entry in sensitivity.items()
                    for part, tensor in (
                        ("g", entry.g.contiguous()),
                        ("h", entry.h.contiguous()),
                        *((r, torch.tensor(loss, dtype=torch.float64)) for r, loss in entry.inputs.items()),
                    )
                },
                partial,
            )
    except OSError:
        pass
    return sensitivity


def kept_type_errors(
    key: str, names: list[str], measure: Callable[[list[str]], dict[str, dict[str, float]]]
) -> dict[str, dict[str, float]]:
    """{name: {type: error}} for `names`: what leanlm's cache keeps under `key` (`sensitivity/KEY.errors.json`,
    the caller's digest of everything the errors depend on) read back, the rest measured by `measure(missing)` and
    added to it, so another budget on the same model and text skips every linear's fits. A cache that cannot be
    read or written only costs the measurement."""
    path = cache_root() / "sensitivity" / f"{key}.errors.json"
    kept: dict[str, dict[str, float]] = {}
    if KEEP_SENSITIVITY:
        try:
            read = json.loads(path.read_text())
            kept = {
                name: {kind: float(error) for kind, error in errors.items()}
                for name, errors in read.items()
                if isinstance(errors, dict)
            }
        except (OSError, ValueError, AttributeError, TypeError):
            kept = {}
    missing = [name for name in names if name not in kept]
    if missing:
        kept.update(measure(missing))
        if KEEP_SENSITIVITY:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with staged_file(path) as partial:
                    partial.write_text(json.dumps(kept))
            except OSError:
                pass
    return {name: kept[name] for name in names}


def output_divergence(model: nn.Module, windows: torch.Tensor):
    """A function of no argument giving the mean over `windows`' tokens of KL(p || q): p the model's next-token
    distribution as `output_divergence` found it, q the one it gives each time the function is called (after some
    of its weights changed). Zero for the unchanged model; unlike a change of the loss it has no first-order term,
    so one change's divergence is not swamped by how far the float model is from the text."""

    def log_probs(window: torch.Tensor) -> torch.Tensor:
        return model(input_ids=window.unsqueeze(0), use_cache=False).logits[0].float().log_softmax(-1)

    with torch.no_grad():
        reference = [log_probs(window) for window in windows]

    def divergence() -> float:
        total = 0.0
        with torch.no_grad():
            for window, before in zip(windows, reference, strict=True):
                total += float((before.exp() * (before - log_probs(window))).sum(-1).mean())
        return total / len(reference)

    return divergence
