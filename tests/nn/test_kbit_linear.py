import pytest
import torch

from leanlm.formats.blockwise import bits_per_parameter
from leanlm.kernels.cpu import has_native_bf16
from leanlm.kernels.kbit_gemm import prefill_dtype
from leanlm.nn import KbitLinear


@pytest.mark.parametrize(
    "dtype, bits, block_size, double_quant",
    [
        ("nf", 4, 64, False),
        ("nf", 4, 64, True),
        ("fp", 4, 128, False),
        ("int", 3, 256, False),
        ("dynamic", 8, 32, True),
        ("int_asym", 5, None, False),
    ],
)
def test_stores_k_bits_and_round_trips(dtype, bits, block_size, double_quant):
    torch.manual_seed(0)
    weight, bias = torch.randn(256, 512) * 0.02, torch.randn(256)
    module = KbitLinear.from_float(weight, bias, dtype, bits, block_size, double_quant)
    assert module.packed.numel() == 256 * 512 * bits // 8
    if block_size is not None:
        # Measured storage equals the account (up to the per-tensor mean of double quantization).
        assert module.bits_per_weight() == pytest.approx(bits_per_parameter(bits, block_size, double_quant), abs=1e-3)
    again = KbitLinear(**module.constructor_args())
    again.load_state_dict(module.state_dict())
    x = torch.randn(3, 512)
    assert torch.equal(again(x), module(x))
    exact = x @ weight.T + bias
    relative = ((module(x) - exact).norm() / (exact - bias).norm()).item()
    assert relative < {3: 0.35, 4: 0.15, 5: 0.08, 8: 0.02}[bits]  # int3: 7 levels, step ~0.9 sigma


@pytest.mark.parametrize(
    "dtype, bits, proxy", [("nf", 4, False), ("int", 8, False), ("nf", 3, False), ("nf", 4, True), ("int", 8, True)]
)
def test_a_bfloat16_prefill_multiplies_in_bfloat16_where_the_cpu_does(dtype, bits, proxy):
    """Above decode sizes a model computing in bfloat16 gets a bfloat16 GEMM on CPUs that multiply bfloat16 in
    hardware (its weights then rounded to bfloat16, as bitsandbytes computes at compute_dtype=bfloat16), float32
    elsewhere; either way the product is the de-quantized weight's (proxy columns included), to bfloat16
    rounding."""
    torch.manual_seed(0)
    columns = torch.tensor([3, 70]) if proxy else None
    module = KbitLinear.from_float(
        torch.randn(96, 128) * 0.02, torch.randn(96) * 0.01, dtype, bits, 64, True, proxy_columns=columns
    )
    x = torch.randn(2, 40, 128).to(torch.bfloat16)  # 80 rows: the large-M path
    if proxy:
        x[..., 70] = 8.0  # an outlier dimension: the reason to keep its column in 16 bits
    assert prefill_dtype(torch.bfloat16) == (torch.bfloat16 if has_native_bf16() else torch.float32)
    assert prefill_dtype(torch.float32) == torch.float32
    expected = x.float() @ module.dequantized_weight().T + module.bias
    got = module(x)
    assert got.dtype == torch.bfloat16
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=1e-2 * scale)
