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
