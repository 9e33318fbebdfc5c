"""The block pipeline every calibrated method runs through, and the one place that observes module inputs.

`walk_blocks(model, batches, observe=..., quantize_block=...)`: the calibration windows enter the model once,
up to the first decoder block (`capture_block_inputs`: the hidden states entering block 0, and the keyword
arguments - masks, position embeddings, a prefix cache - the model passes each block). Then, block by block:
the float block runs on every window with the method's observers active (input maxima for SmoothQuant and
static W8A8 ranges, Hessians for GPTQ / SpQR), the method may quantize the block in place, and the block as it
now is produces the next block's inputs (so GPTQ's later blocks see the quantized earlier ones, and observers
alone see the float model, exactly as a whole-model pass would).

Peak memory of a pass, beyond the model: one copy of the hidden states of every window, samples x seq_len x
hidden_size x 4 bytes (each window's output replaces its input), plus what the observers keep (a maximum per
input channel; GPTQ: in_features^2 floats per linear of the current block). SmolLM2 with SmoothQuant's 512 x 512
tokens: 604 MB; GPTQ's 128 x 512: 151 MB. The same pass over a model read block by block from disk holds one
block in float at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from leanlm.models.architectures import architecture_for, decoder_blocks

BlockVisitor = Callable[[int, nn.Module], Any]


@contextmanager
def observe_inputs(
    modules: Iterable[tuple[Any, nn.Module]], observer: Callable[[Any, torch.Tensor], None]
) -> Iterator[None]:
    """While active, `observer(key, x)` sees the first positional input of each (key, module) on every forward
    (not detached: prefix tuning needs its gradient)."""
    handles = [
        module.register_forward_pre_hook(lambda module, args, key=key: observer(key, args[0]))
        for key, module in modules
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def frozen_parameters(model: nn.Module) -> Iterator[None]:
    """While active, no parameter of `model` takes a gradient (a backward pass reaches activations only); the
    ones that took gradients before take them again after."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)


class _StopForward(Exception):
    pass


class _InputRecorder(nn.Module):
    """Stands in for a decoder block during the capture pass: records the block's arguments and passes the hidden
    state through untouched; the last one stops the forward (nothing after the blocks is needed)."""

    def __init__(self, calls: list, stop: bool):
        super().__init__()
        self.calls, self.stop = calls, stop

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((hidden_states, args, kwargs))
        if self.stop:
            raise _StopForward
        return hidden_states


def capture_block_inputs(model: nn.Module, batches: torch.Tensor) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """(the hidden states entering block 0, one per window; per block, per window: (args, kwargs) as the model
    passes them, which depend on positions only, or on a prefix cache's state)."""
    blocks = decoder_blocks(model)
    originals = list(blocks)
    calls: list[list] = [[] for _ in originals]
    for index in range(len(originals)):
        blocks[index] = _InputRecorder(calls[index], stop=index == len(originals) - 1)
    try:
        with torch.inference_mode():
            for sample in batches:
                try:
                    model(input_ids=sample[None], use_cache=False)
                except _StopForward:
                    pass
    finally:
        for index, block in enumerate(originals):
            blocks[index] = block
    first = [hidden.clone() for hidden, _, _ in calls[0]]
    return first, [[(args, kwargs) for _, args, kwargs in block_calls] for block_calls in calls]


def _block_output(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _run_block(block: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """`block` on one window, as the model would run it. A prefix cache the model passes its blocks (a CushionCache
    cushion) is left holding the prefix alone: the keys and values the block adds for the window are dropped once
    it has run, so that a second pass over the block (error feedback) attends to the prefix only, and no window's
    keys stay resident after the walk moves on."""
    cache = kwargs.get("past_key_values")
    kept = [dict(vars(layer)) for layer in cache.layers] if cache is not None else None
    try:
        return _block_output(block(hidden, *args, **kwargs))
    finally:
        if kept is not None:
            del cache.layers[len(kept) :]
            for layer, state in zip(cache.layers, kept):
                vars(layer).update(state)


class ResidentBlocks:
    """Where `walk_blocks` finds the blocks of a model held in memory: the model's own, kept after the walk.
    A source of blocks read from disk (`leanlm.methods.out_of_core`) has the same methods."""

    def __init__(self, blocks: nn.ModuleList):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def inputs(self) -> AbstractContextManager:
        """Active while the calibration windows enter the model: what they pass through before the blocks must
        be there then (in memory it always is)."""
        return nullcontext()

    def resume(self, hidden: list[torch.Tensor] | None) -> tuple[list, list[torch.Tensor] | None]:
        """(what `quantize_block` returned for each block already done, the hidden states entering the first
        block still to walk): here none is done."""
        return [], hidden

    def load(self, index: int) -> nn.Module:
        return self.blocks[index]

    def release(self, index: int, block: nn.Module, hidden: list[torch.Tensor] | None, result: Any) -> None:
        """`block` is done (`quantize_block` returned `result`); `hidden` holds the next block's inputs."""


def walk_blocks(
    model: nn.Module,
    batches: torch.Tensor | None,
    *,
    observe: Callable[[int, nn.Module], AbstractContextManager] | None = None,
    quantize_block: BlockVisitor | None = None,
    feed_quantized: bool | None = None,
    source: ResidentBlocks | None = None,
    desc: str = "blocks",
) -> list:
    """Run `batches` (windows, seq_len) through `model` block by block: `observe(index, block)` is active while
    the float block runs on every window; `quantize_block(index, block)` may then change the block. The next
    block reads the quantized block's outputs (`feed_quantized`, the default when there is a `quantize_block`:
    GPTQ's error feedback) or the float block's (observers then see exactly the float model, as a whole-model
    pass would). With no `batches`, each block is only quantized. `source` says where blocks come from and go
    to (default: the model's own, in memory). Returns what `quantize_block` returned, block by block."""
    table = architecture_for(model)
    source = source or ResidentBlocks(decoder_blocks(model, table))
    feed_quantized = quantize_block is not None if feed_quantized is None else feed_quantized
    hidden = arguments = None
    if batches is not None:
        with source.inputs():
            hidden, arguments = capture_block_inputs(model, batches)
    results, hidden = source.resume(hidden)
    start = len(results)
    with torch.inference_mode():
        for index in tqdm(
            range(start, len(source)), desc=desc, unit="block", initial=start, total=len(source), leave=False
        ):
            block = source.load(index)
            last = index + 1 == len(source)
            if hidden is not None:
                with observe(index, block) if observe is not None else nullcontext():
                    for window, (args, kwargs) in enumerate(arguments[index]):
                        output = _run_block(block, hidden[window], args, kwargs)
                        if not feed_quantized and not last:
                            hidden[window] = output
            result = None
            if quantize_block is not None:
                result = quantize_block(index, block)
                if feed_quantized and hidden is not None and not last:
                    for window, (args, kwargs) in enumerate(arguments[index]):
                        hidden[window] = _run_block(block, hidden[window], args, kwargs)
            source.release(index, block, None if last else hidden, result)
            results.append(result)
    return results
