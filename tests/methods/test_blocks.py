"""The block pipeline gives exactly what whole-model passes give."""

import pytest
import torch
from tiny import FAMILIES, tiny_model, token_ids

from leanlm.methods import SmoothQuantConfig, W8A8Config, calibrate, collect_input_absmax, quantize_
from leanlm.methods.blocks import capture_block_inputs, observe_inputs, walk_blocks
from leanlm.methods.quantize import Calibration
from leanlm.models.architectures import iter_quantizable_linears


def _windows(samples=3, length=20):
    return token_ids(samples, length)


def _whole_model_absmax(model, batches):
    """The oracle: every window through the whole model, the linears' inputs observed on the way."""
    stats = {}

    def record(name, x):
        channel_max = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), float("inf"), dim=0).float()
        stats[name] = torch.maximum(stats[name], channel_max) if name in stats else channel_max

    with observe_inputs(iter_quantizable_linears(model), record), torch.inference_mode():
        for sample in batches:
            model(input_ids=sample[None], use_cache=False)
    return stats


@pytest.mark.parametrize("family", FAMILIES)
def test_block_by_block_statistics_equal_whole_model_ones(family):
    model = tiny_model(family)
    walked, whole = collect_input_absmax(model, _windows()), _whole_model_absmax(model, _windows())
    assert walked.keys() == whole.keys() and all(torch.equal(walked[name], whole[name]) for name in whole)


def test_a_walk_without_changes_ends_where_the_model_does():
    model = tiny_model("llama")
    last_inputs = []
    blocks = model.model.layers

    def observe(index, block):
        return observe_inputs([(index, block.mlp.down_proj)], lambda i, x: last_inputs.append(x.clone()))

    walk_blocks(model, _windows(2), observe=observe)
    hidden, arguments = capture_block_inputs(model, _windows(2))
    assert len(hidden) == 2 and len(arguments) == len(blocks) and len(last_inputs) == 2 * len(blocks)
    reference = []
    with (
        observe_inputs([(1, blocks[1].mlp.down_proj)], lambda i, x: reference.append(x.clone())),
        torch.inference_mode(),
    ):
        for sample in _windows(2):
            model(input_ids=sample[None], use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(last_inputs[2:], reference))


def test_smoothquant_on_the_pipeline_equals_calibrating_once_by_hand():
    """SmoothQuant + static W8A8 through the verb (statistics from the pipeline) equals the same steps on
    statistics observed beforehand: the verb adds nothing and loses nothing."""
    steps = [SmoothQuantConfig(0.5), W8A8Config(level="O3")]
    by_verb, by_hand = tiny_model("llama"), tiny_model("llama")
    quantize_(by_verb, steps, calibration=Calibration(token_ids=_windows()))
    quantize_(by_hand, steps, calibration=Calibration(int8_stats=calibrate(by_hand, _windows())))
    ids = torch.randint(0, 128, (1, 16))
    with torch.inference_mode():
        assert torch.equal(by_verb(ids).logits, by_hand(ids).logits)
    assert all(torch.equal(a, b) for a, b in zip(by_verb.state_dict().values(), by_hand.state_dict().values()))


@pytest.mark.parametrize("feed_quantized", [False, True])
def test_a_cushioned_walk_runs_each_window_after_the_cushion_alone_and_keeps_no_window_keys(feed_quantized):
    """A prefix cache the model passes each block (a CushionCache cushion) holds the cushion only, whichever pass
    over a block a window is in: the error-feedback pass after the observing one, and every later block."""
    from leanlm.cache.prefix import Cushion, attach_cushion, cushion_keys_values

    model = tiny_model("llama")
    prefix = [5, 17, 3]
    attach_cushion(model, Cushion(prefix, *cushion_keys_values(model, prefix)))
    windows = _windows(2)
    last, caches = [], []
    first = model.model.layers[0]
    grab = first.register_forward_pre_hook(lambda m, a, k: caches.append(k["past_key_values"]), with_kwargs=True)

    def observe(index, block):
        return observe_inputs([(index, block.mlp.down_proj)], lambda i, x: last.append(x.clone()))

    walk_blocks(
        model, windows, observe=observe, quantize_block=lambda index, block: None, feed_quantized=feed_quantized
    )
    grab.remove()
    reference = []
    down = model.model.layers[-1].mlp.down_proj
    with observe_inputs([(0, down)], lambda i, x: reference.append(x.clone())), torch.inference_mode():
        for sample in windows:
            model(input_ids=sample[None], use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(last[-2:], reference))
    walked = {id(cache): cache for cache in caches}.values()  # one per window, made when the windows were read
    assert len(walked) == len(windows)
    assert all(layer.keys.shape[-2] == len(prefix) for cache in walked for layer in cache.layers)
