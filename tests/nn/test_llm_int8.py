"""LLM.int8(): vector-wise int8 with mixed-precision decomposition, cross-checked against bitsandbytes."""

import importlib.util

import pytest
import torch

from leanlm.nn import W8A8Linear


def _inputs_with_outliers(rows=33, features=256, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator)
    x[:, 7] *= 40  # a systematic outlier feature, as in Dettmers' thesis
    x[3, 100] = -9.0  # a single value above the threshold also makes its whole dimension an outlier one
    return x


def _vector_wise(weight, threshold):
    return W8A8Linear.from_float(weight, None, "per_channel", activation="per_token", outlier_threshold=threshold)


def test_decomposition_is_eq_2_2():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 256) * 0.05, _inputs_with_outliers()
    module = _vector_wise(weight, 6.0)
    columns = torch.tensor([7, 100])
    dequantized = module.weight.float() * module.weight_scale[:, None]
    rest = x.index_fill(1, columns, 0.0)
    plain = _vector_wise(weight, None)
    plain.load_state_dict(module.state_dict())
    expected = x[:, columns] @ dequantized[:, columns].T + plain(rest)
    assert torch.allclose(module(x), expected, atol=1e-5)


def test_decomposition_removes_the_outlier_error():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 256) * 0.05, _inputs_with_outliers()
    exact = x @ weight.T
    error = {t: ((_vector_wise(weight, t)(x) - exact).norm() / exact.norm()).item() for t in (None, 6.0)}
    assert error[6.0] < error[None] / 3


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_agrees_with_bitsandbytes_linear8bitlt():
    import bitsandbytes as bnb

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    reference = bnb.nn.Linear8bitLt(256, 96, bias=True, has_fp16_weights=False, threshold=6.0)
    reference.load_state_dict(linear.state_dict())
    # In training mode bitsandbytes' CPU path de-quantizes the weight and skips activation quantization.
    reference = reference.to("cpu").eval()
    ours = W8A8Linear.from_float(
        linear.weight, linear.bias, "per_channel", activation="per_token", outlier_threshold=6.0
    )
    x = _inputs_with_outliers(seed=1)
    with torch.inference_mode():
        exact, theirs, mine = linear(x), reference(x), ours(x)
    # Same quantization grid (bitsandbytes rounds its inputs to float16 first): the two agree far more closely
    # than either agrees with FP32 ...
    assert ((mine - theirs).norm() / exact.norm()).item() < 4e-3
    # ... and leanlm is at least as accurate.
    assert (mine - exact).norm() <= (theirs - exact).norm() * 1.05


def test_the_share_of_float_dimensions_is_counted():
    module = _vector_wise(torch.randn(8, 256), 6.0)
    module(_inputs_with_outliers())
    module(torch.zeros(4, 256))
    assert module.decomposition_counts == {"dims": 512, "outlier_dims": 2}
