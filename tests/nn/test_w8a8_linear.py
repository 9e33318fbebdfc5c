import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.kernels.int8_gemm import fbgemm_available
from leanlm.nn import W8A8Linear


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    return (10 * torch.log10(reference.pow(2).mean() / (reference - approximation).pow(2).mean())).item()


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
@pytest.mark.parametrize("activation, static", [("per_token", False), ("per_tensor", False), ("per_tensor", True)])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel", "per_group"])
def test_fast_path_matches_the_reference(activation, static, granularity):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 80), torch.randn(96), torch.randn(2, 5, 80) * 4
    scale = x.abs().max() / 127 if static else None
    modules = [W8A8Linear.from_float(weight, bias, granularity, 32, activation, scale, backend)
               for backend in ("reference", "fbgemm")]
    reference, fast = (m(x) for m in modules)
    assert fast.shape == (2, 5, 96)
    assert torch.allclose(fast, reference, rtol=1e-6, atol=1e-6)
    assert sqnr_db(x @ weight.T + bias, reference) > 30


def test_stores_int8_weights_and_saves_through_the_state_dict():
    weight = torch.randn(16, 8)
    module = W8A8Linear.from_float(weight, None, "per_channel", activation="per_token")
    assert module.weight.dtype == torch.int8 and module.bias is None
    state = module.state_dict()
    assert set(state) == {"weight", "weight_scale"}
    again = W8A8Linear(**module.constructor_args())
    again.load_state_dict(state)
    x = torch.randn(3, 8)
    assert torch.equal(again(x), module(x))


def test_static_scale_clamps_values_beyond_the_calibrated_range():
    module = W8A8Linear.from_float(torch.eye(4), None, input_scale=torch.tensor(1 / 127))
    out = module(torch.tensor([[0.5, 2.0, -3.0, 0.0]]))
    assert torch.allclose(out, torch.tensor([[64 / 127, 1.0, -128 / 127, 0.0]]))  # int8 floor is -128


def test_bad_input_is_named():
    module = W8A8Linear.from_float(torch.randn(4, 8), None)
    with pytest.raises(ValueError, match="expects 8 input features"):
        module(torch.randn(2, 7))
    with pytest.raises(ConfigError, match="static activation scales are per tensor"):
        W8A8Linear(8, 4, False, activation="per_token", static=True)


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
def test_zeropoint_uses_the_whole_range_of_one_signed_inputs():
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.rand(6, 64) * 5 + 1  # all positive, like most outlier features
    exact = x @ weight.T
    modules = {backend: W8A8Linear.from_float(weight, None, asymmetric=True, backend=backend)
               for backend in ("reference", "fbgemm")}
    assert torch.allclose(modules["fbgemm"](x), modules["reference"](x), rtol=1e-5, atol=1e-4)
    symmetric = W8A8Linear.from_float(weight, None)
    assert sqnr_db(exact, modules["reference"](x)) > sqnr_db(exact, symmetric(x))
    state = modules["fbgemm"].state_dict()
    again = W8A8Linear(**modules["fbgemm"].constructor_args())
    again.load_state_dict(state)
    assert torch.equal(again(x), modules["fbgemm"](x))
