"""leanlm's float GEMV (batch-1 decode) against the plain-PyTorch reference, every variant this CPU runs."""

import pytest
import torch
from tiny import tiny_model, token_ids
from torch import nn

from leanlm.kernels.float_gemv import float_gemv, gemv_isas, reference_gemv, small_m_linear
from leanlm.nn import GemvLinear, use_gemv_

ISAS = gemv_isas()


@pytest.mark.skipif(not ISAS, reason="leanlm's kernels cannot be built here")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, out_features, in_features",
    [(1, 1, 16), (1, 130, 576), (3, 7, 100), (8, 64, 17), (2, 5, 1536), (1, 4099, 64), (5, 9, 47), (1, 6, 640)],
)
def test_every_variant_matches_the_reference(isa, dtype, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator)
    expected = reference_gemv(x, weight)
    # Float32 sums in another order: the error of a dot product of in_features terms, nothing more.
    torch.testing.assert_close(float_gemv(x, weight, isa), expected, rtol=1e-5, atol=1e-5 * in_features**0.5)


@pytest.mark.skipif(not ISAS, reason="leanlm's kernels cannot be built here")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [576, 600, 47])  # whole spans; a partial last span; fewer than two spans
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(isa, dtype, in_features):
    """Every row of x is summed in one order, alone or in a batch of up to 8 (a server's request gets the same
    logits whatever else is decoding)."""
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(70, in_features, generator=generator).to(dtype)
    x = torch.randn(8, in_features, generator=generator)
    alone = torch.cat([float_gemv(x[r : r + 1], weight, isa) for r in range(8)])
    for rows in range(2, 9):
        assert torch.equal(float_gemv(x[:rows], weight, isa), alone[:rows]), rows
    assert torch.equal(float_gemv(x[3:8], weight, isa), alone[3:8])


def test_it_refuses_what_it_cannot_compute():
    if not ISAS:
        pytest.skip("leanlm's kernels cannot be built here")
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        float_gemv(torch.randn(9, 16), torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="columns"):
        float_gemv(torch.randn(1, 16), torch.randn(4, 8))
    assert small_m_linear(torch.randn(9, 16), torch.randn(4, 16), None) is None  # GEMM's turn
    assert small_m_linear(torch.randn(1, 16, requires_grad=True), torch.randn(4, 16), None) is None  # autograd


def test_gemv_linear_is_nn_linear_at_every_size():
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    fast = nn.Linear(96, 40)
    fast.load_state_dict(linear.state_dict())
    assert use_gemv_(nn.Sequential(fast)) == 1 and type(fast) is GemvLinear and isinstance(fast, nn.Linear)
    for shape in [(1, 96), (2, 1, 96), (8, 96), (64, 96)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(1, 96, requires_grad=True)
    fast(x).sum().backward()  # gradients take nn.Linear's own path
    assert x.grad is not None and fast.weight.grad is not None


def test_a_bfloat16_weight_over_float32_inputs_gives_float32_at_every_size():
    """A quantized checkpoint's head held in bfloat16: small inputs take the GEMV, large ones a bfloat16 GEMM
    written into float32 a few rows at a time (chunks of 256 rows, so 600 rows cross two chunk edges)."""
    linear = GemvLinear(96, 40)
    linear.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
    linear.bias = nn.Parameter(linear.bias.detach().to(torch.bfloat16), requires_grad=False)
    for shape in [(1, 96), (2, 3, 96), (600, 96)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            got = linear(x)
        expected = nn.functional.linear(x, linear.weight.float(), linear.bias.float())
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=5e-2)  # the inputs rounded to bfloat16


def test_a_model_decodes_the_same_tokens_through_it():
    model = tiny_model("llama", vocab_size=128)
    reference = tiny_model("llama", vocab_size=128)
    assert use_gemv_(model) == 2 * 7 + 1  # 7 block linears per layer, and the lm_head
    prompt = token_ids(1, 8, seed=1)
    with torch.inference_mode():
        ours = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        theirs = reference.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
