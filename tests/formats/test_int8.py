import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.formats.int8 import (
    QMAX,
    absmax_scale,
    activation_scale,
    fake_quantize,
    quantize,
    quantize_weight,
    weight_scale,
)


def test_absmax_scale_maps_the_largest_value_to_127():
    x = torch.tensor([[1.0, -254.0], [3.0, 2.0]])
    assert absmax_scale(x).item() == 2.0
    assert quantize(x, absmax_scale(x)).abs().max().item() == QMAX
    assert torch.equal(activation_scale(x, "per_token").flatten(), torch.tensor([2.0, 3.0 / 127]))


def test_quantize_rounds_half_to_even_and_clamps():
    values = torch.tensor([0.5, 1.5, -2.5, 1000.0, -1000.0])
    assert torch.equal(quantize(values, torch.tensor(1.0)), torch.tensor([0.0, 2.0, -2.0, 127.0, -128.0]))


def test_weight_scales_lie_along_output_channels():
    weight = torch.arange(1.0, 9.0).reshape(4, 2)  # row maxima 2, 4, 6, 8
    assert torch.equal(weight_scale(weight, "per_tensor"), torch.full((4,), 8 / 127))
    assert torch.allclose(weight_scale(weight, "per_channel"), torch.tensor([2.0, 4, 6, 8]) / 127)
    assert torch.allclose(weight_scale(weight, "per_group", group_size=3), torch.tensor([6.0, 6, 6, 8]) / 127)
    with pytest.raises(ConfigError, match="per_tensor, per_channel or per_group"):
        weight_scale(weight, "per_block")


def test_int8_weights_reconstruct_within_half_a_step():
    weight = torch.randn(64, 32)
    q, scale = quantize_weight(weight, "per_channel")
    assert q.dtype == torch.int8
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("granularity", ["per_tensor", "per_token"])
def test_fake_quantize_in_bfloat16_is_the_float32_result_rounded_once(granularity):
    torch.manual_seed(0)
    x = torch.randn(8, 512).bfloat16()
    scale = activation_scale(x, granularity)
    got = fake_quantize(x, scale)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, fake_quantize(x.float(), scale).bfloat16())


def test_fake_quantize_sqnr_of_gaussian_data_is_high():
    x = torch.randn(256, 256)
    error = fake_quantize(x, activation_scale(x, "per_token")) - x
    sqnr_db = 10 * torch.log10(x.pow(2).mean() / error.pow(2).mean())
    assert sqnr_db > 30


def test_zeropoint_maps_the_range_onto_254_levels():
    from leanlm.formats.int8 import zeropoint_params

    x = torch.tensor([0.0, 1.0, 2.54])
    scale, zero_point = zeropoint_params(x)
    q = torch.round(x / scale) + zero_point
    assert q.min().item() == -127 and q.max().item() == 127
    assert torch.allclose((q - zero_point) * scale, x, atol=scale.item() / 2)
