import pytest
import torch
from torch import nn

from leanlm.errors import ConfigError
from leanlm.nn import KbitLinear, LoRALinear


def test_lora_starts_as_the_base_and_trains_only_the_adapter():
    torch.manual_seed(0)
    base = nn.Linear(64, 32)
    layer = LoRALinear(base, rank=4, alpha=8)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)  # B = 0
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_A.weight", "lora_B.weight"]


def test_gradients_reach_the_adapter_through_a_frozen_kbit_base():
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    base = KbitLinear.from_float(weight, None, "nf", 4, 64, double_quant=True)
    layer = LoRALinear(base, rank=4, alpha=4)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(5, 64, requires_grad=True)
    layer(x).square().sum().backward()
    # Oracle: the same computation with the de-quantized weight as an ordinary tensor.
    w = base.dequantized_weight()
    x2 = x.detach().clone().requires_grad_(True)
    a, b = (
        layer.lora_A.weight.detach().clone().requires_grad_(True),
        layer.lora_B.weight.detach().clone().requires_grad_(True),
    )
    (x2 @ w.T + (x2 @ a.T) @ b.T).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.lora_A.weight.grad, a.grad, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(layer.lora_B.weight.grad, b.grad, rtol=1e-4, atol=1e-3)


def test_merged_weight_gives_the_same_output():
    torch.manual_seed(1)
    base = KbitLinear.from_float(torch.randn(32, 64), torch.randn(32), "nf", 4, 64)
    layer = LoRALinear(base, rank=8, alpha=16)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(20, 64)  # past SMALL_M: float activations (at decode sizes the kernel quantizes x)
    torch.testing.assert_close(x @ layer.merged_weight().T + base.bias, layer(x), rtol=1e-5, atol=1e-5)


def test_each_row_goes_through_the_adapter_named_for_it():
    from leanlm.nn.lora import adapter_rows

    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(12, 8), rank=4, alpha=8.0)
    nn.init.normal_(layer.lora_B.weight)
    a, b = torch.randn(2, 12), torch.randn(8, 2)
    assert layer.add_adapter(a, b, scaling=3.0) == 1
    x = torch.randn(3, 5, 12)
    with torch.no_grad():
        own = layer.base(x) + layer.lora_B(layer.lora_A(x)) * 2.0
        other = layer.base(x) + (x @ a.T @ b.T) * 3.0
        torch.testing.assert_close(layer(x), own)  # outside adapter_rows: the layer's own
        with adapter_rows([1, -1, 0]):
            rows = layer(x)
    torch.testing.assert_close(rows[0], other[0])
    torch.testing.assert_close(rows[1], layer.base(x[1]))
    torch.testing.assert_close(rows[2], own[2])
    with pytest.raises(ConfigError, match="does not fit"):
        layer.add_adapter(torch.randn(2, 11), b, 1.0)
