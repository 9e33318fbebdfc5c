import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.kernels.int8_gemm import fbgemm_available
from leanlm.nn import SharedInputGemm, W8A8Linear


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    return (10 * torch.log10(reference.pow(2).mean() / (reference - approximation).pow(2).mean())).item()


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
@pytest.mark.parametrize("activation, static", [("per_token", False), ("per_tensor", False), ("per_tensor", True)])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel", "per_group"])
def test_fast_path_matches_the_reference(activation, static, granularity):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 80), torch.randn(96), torch.randn(2, 5, 80) * 4
    scale = x.abs().max() / 127 if static else None
    modules = [
        W8A8Linear.from_float(weight, bias, granularity, 32, activation, scale, backend)
        for backend in ("reference", "fbgemm")
    ]
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
    modules = {
        backend: W8A8Linear.from_float(weight, None, asymmetric=True, backend=backend)
        for backend in ("reference", "fbgemm")
    }
    assert torch.allclose(modules["fbgemm"](x), modules["reference"](x), rtol=1e-5, atol=1e-4)
    symmetric = W8A8Linear.from_float(weight, None)
    assert sqnr_db(exact, modules["reference"](x)) > sqnr_db(exact, symmetric(x))
    state = modules["fbgemm"].state_dict()
    again = W8A8Linear(**modules["fbgemm"].constructor_args())
    again.load_state_dict(state)
    assert torch.equal(again(x), modules["fbgemm"](x))


def _group(activation: str, static: bool, backend: str = "fbgemm"):
    torch.manual_seed(0)
    weights = [torch.randn(48, 40), torch.randn(16, 40), torch.randn(16, 40) * 3]
    biases = [None, torch.randn(16), None]  # one member with a bias: the stacked bias pads the others with 0
    scale = torch.tensor(0.05) if static else None
    return [
        W8A8Linear.from_float(w, b, "per_tensor", activation=activation, input_scale=scale, backend=backend)
        for w, b in zip(weights, biases)
    ]


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
@pytest.mark.parametrize("activation, static", [("per_token", False), ("per_tensor", False), ("per_tensor", True)])
def test_a_shared_input_gemm_gives_each_member_its_own_output(activation, static):
    separate, shared = _group(activation, static), _group(activation, static)
    SharedInputGemm(shared)
    x = torch.randn(2, 7, 40) * 4
    expected = [m(x) for m in separate]
    got = [m(x) for m in shared]  # the first call computes all three, the others take theirs
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.is_contiguous()
        assert torch.allclose(g, e, rtol=1e-6, atol=1e-5)
    assert shared[0].shared_input._pending == {}  # every member took its output: nothing is kept


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
def test_a_shared_input_gemm_never_hands_out_an_output_computed_from_another_input():
    separate, shared = _group("per_token", False), _group("per_token", False)
    SharedInputGemm(shared)
    x, y = torch.randn(5, 40), torch.randn(5, 40)
    shared[0](x)
    assert torch.allclose(shared[1](y), separate[1](y), atol=1e-5)  # another tensor: a new round
    shared[0](x)
    x.mul_(2)  # the same tensor, changed in place: its version counter moved
    assert torch.allclose(shared[2](x), separate[2](x), atol=1e-5)
    assert torch.allclose(shared[2](x.clone()), separate[2](x), atol=1e-5)  # equal values, another tensor


def test_linears_that_quantize_their_input_differently_cannot_share_a_gemm():
    static = _group("per_tensor", True, "reference")
    static[1].input_scale = torch.tensor(0.1)
    assert "static input scales" in SharedInputGemm.problem(static)
    mixed = _group("per_token", False, "reference")[:1] + _group("per_tensor", False, "reference")[1:]
    assert "granularity" in SharedInputGemm.problem(mixed)
    outliers = [
        W8A8Linear.from_float(torch.randn(8, 4), None, "per_channel", activation="per_token", outlier_threshold=6.0)
        for _ in range(2)
    ]
    assert "outlier" in SharedInputGemm.problem(outliers)
    with pytest.raises(ConfigError, match="cannot share one GEMM"):
        SharedInputGemm(static)


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
@pytest.mark.parametrize("kind", ["per_token", "llm_int8", "zeropoint", "shared"])
def test_after_packing_only_the_packed_copy_is_kept_and_saving_is_unchanged(kind):
    torch.manual_seed(3)
    weight, bias, x = torch.randn(24, 40), torch.randn(24), torch.randn(6, 40) * 3
    x[:, 5] = 20.0  # an outlier column for LLM.int8()
    options = {
        "per_token": dict(activation="per_token"),
        "shared": dict(activation="per_token"),
        "llm_int8": dict(activation="per_token", outlier_threshold=6.0),
        "zeropoint": dict(asymmetric=True),
    }
    granularity = "per_tensor" if kind == "zeropoint" else "per_channel"
    modules = [W8A8Linear.from_float(weight * (i + 1), bias, granularity, **options[kind]) for i in range(2)]
    reference = [
        W8A8Linear.from_float(weight * (i + 1), bias, granularity, backend="reference", **options[kind])
        for i in range(2)
    ]
    if kind == "shared":
        SharedInputGemm(modules)
    before = [m.state_dict() for m in modules]
    outputs = [m(x) for m in modules]
    for module, expected, saved, output in zip(modules, reference, before, outputs):
        assert module._buffers["weight"] is None  # the plain int8 tensor is gone: one copy resident
        assert torch.allclose(output, expected(x), rtol=1e-5, atol=1e-4)
        after = module.state_dict()
        assert after.keys() == saved.keys() and all(torch.equal(after[k], saved[k]) for k in saved)
    again = W8A8Linear(**modules[1].constructor_args())
    again.load_state_dict(modules[1].state_dict())
    assert torch.equal(again(x), outputs[1])
    modules[0].load_state_dict(before[0])  # loading into a packed module: every weight is plain again
    assert all(m._buffers["weight"] is not None for m in (modules if kind == "shared" else modules[:1]))
    assert torch.equal(modules[0](x), outputs[0]) and torch.equal(modules[1](x), outputs[1])


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
@pytest.mark.parametrize("activation, static", [("per_token", False), ("per_tensor", True)])
def test_packed_linears_switch_to_the_reference_and_then_compute_exactly_what_it_does(activation, static):
    packed, reference = _group(activation, static), _group(activation, static, "reference")
    SharedInputGemm(packed)
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(4))
    for module in packed:
        module(x)  # packs: fbgemm's copy is then the only one
    for module, oracle in zip(packed, reference):
        module.use_reference_()
        assert module.backend == "reference" and torch.equal(module.weight, oracle.weight)
        assert torch.equal(module(x), oracle(x))


@pytest.mark.skipif(not fbgemm_available(), reason="no fbgemm engine")
def test_linears_packed_alone_then_grouped_keep_one_packed_copy():
    separate, grouped = _group("per_token", False), _group("per_token", False)
    x = torch.randn(5, 40)
    for module in grouped:
        module(x)  # each packs its own copy and releases its int8 tensor
    SharedInputGemm(grouped)
    assert all(m._packed is None and m._buffers["weight"] is not None for m in grouped)
    for expected, module in zip(separate, grouped):
        assert torch.allclose(module(x), expected(x), atol=1e-5)
    assert all(m._buffers["weight"] is None for m in grouped)  # now only the stacked packed copy
