import pytest
import torch

from leanlm.formats.blockwise import bits_per_parameter
from leanlm.nn import KbitLinear


@pytest.mark.parametrize("dtype, bits, block_size, double_quant", [
    ("nf", 4, 64, False), ("nf", 4, 64, True), ("fp", 4, 128, False), ("int", 3, 256, False),
    ("dynamic", 8, 32, True), ("int_asym", 5, None, False),
])
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
