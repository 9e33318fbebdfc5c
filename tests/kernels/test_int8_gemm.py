import pytest
import torch

from leanlm.kernels.int8_gemm import fbgemm_available, int8_matmul, pack_weight

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="PyTorch has no fbgemm/x86 quantized engine here")


@pytest.mark.parametrize("m, k, n", [(1, 64, 48), (7, 129, 33), (64, 576, 192), (300, 1536, 576)])
def test_fbgemm_equals_the_exact_reference(m, k, n):
    torch.manual_seed(m + k + n)
    # Full-range uniform integers: the worst case for the int16 saturation AVX2 int8 kernels can suffer.
    x = torch.randint(-127, 128, (m, k)).float()
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    expected = int8_matmul(x, weight, "reference")
    assert torch.equal(int8_matmul(x, weight, "fbgemm"), expected)
    assert torch.equal(int8_matmul(x, weight, "fbgemm", pack_weight(weight)), expected)


def test_reference_is_the_integer_product():
    x = torch.tensor([[127.0, -127.0]])
    weight = torch.tensor([[127, 127], [-127, 1]], dtype=torch.int8)
    assert torch.equal(int8_matmul(x, weight, "reference"), torch.tensor([[0.0, -16256.0]]))


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown int8 backend 'cuda'"):
        int8_matmul(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.int8), "cuda")
