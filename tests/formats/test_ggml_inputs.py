"""llama.cpp's input roundings: Q8_0 and Q8_K leave every value on its block's int8 grid within half a step, the
largest magnitude of a Q8_K block kept; the int8 roundings offered for a row are those whose blocks tile it."""

import pytest
import torch

from leanlm.formats.ggml_inputs import int8_roundings, round_trip_q8_0, round_trip_q8_k


@pytest.mark.parametrize(
    "rule, block, scale_dtype",
    [(round_trip_q8_0, 32, torch.float16), (round_trip_q8_k, 256, torch.float32)],
    ids=["q8_0", "q8_k"],
)
def test_values_lie_on_each_blocks_int8_grid_within_half_a_step(rule, block, scale_dtype):
    x = torch.randn(3, 4 * block, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 4 * block)
    x[0, :block] = 0  # an all-zero block stays zero
    rounded = rule(x).reshape(3, 4, block)
    blocks = x.reshape(3, 4, block)
    exact = blocks.abs().amax(dim=-1, keepdim=True) / 127
    step = exact.to(scale_dtype).float()  # the stored scale
    assert rounded[0, 0].eq(0).all()
    live = step.squeeze(-1) > 0
    levels = rounded[live] / step[live]
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    assert levels.abs().max() <= 127 + 1e-4
    # rounded in units of the exact step, stored with the stored one: half a step and 127 times their difference
    assert ((rounded - blocks).abs() <= 0.5 * exact + 127 * (step - exact).abs() + 1e-6).all()


def test_q8_k_keeps_each_blocks_largest_magnitude_and_its_sign():
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    x[1, 300] = -9.0
    rounded = round_trip_q8_k(x).reshape(4, 256)
    blocks = x.reshape(4, 256)
    where = blocks.abs().argmax(dim=-1, keepdim=True)
    assert torch.allclose(rounded.gather(-1, where), blocks.gather(-1, where), rtol=1e-6, atol=0)
    assert rounded[3, 300 - 256] == pytest.approx(-9.0)


def test_only_the_roundings_whose_blocks_tile_a_row_are_offered():
    assert int8_roundings(1536) == ["q8_0", "q8_k"]
    assert int8_roundings(576) == ["q8_0"]
    assert int8_roundings(40) == []
