"""GGUFLinear: the kernel path of the 4-bit types computes what the reference path (de-quantize, matmul) does, at
decode and prefill sizes, with and without bias; the other types run the reference."""

import pytest
import torch

from leanlm.formats.gguf_blocks import BLOCK_TYPES, codes_for, fit_statistics
from leanlm.kernels.kbit_gemm import avx2_available, prefill_dtype
from leanlm.nn import GGUFLinear


def _module(name: str, bias: bool = True, rows: int = 96, columns: int = 512) -> GGUFLinear:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, columns, generator=generator)
    kind = BLOCK_TYPES[name]
    statistics = fit_statistics(kind, weight)
    return GGUFLinear.from_codes(
        kind, codes_for(kind, weight, statistics), statistics, torch.randn(rows, generator=generator) if bias else None
    )


@pytest.mark.skipif(not avx2_available(), reason="the k-bit kernel needs AVX2")
@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q4_k", "iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("m", [1, 7, 600])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_computes_what_the_reference_does(name, m, bias):
    module = _module(name, bias)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(1))
    assert module._resolve_backend() == "kernel"
    with torch.inference_mode():
        fast = module(x)
        module.backend = "reference"
        expected = module(x)
    torch.testing.assert_close(fast, expected, rtol=0, atol=1e-5 * expected.abs().max().item())  # float rounding only


@pytest.mark.parametrize("name", ["q3_k", "q5_k", "q6_k", "q8_0"])
def test_the_other_types_run_the_reference(name):
    module = _module(name)
    assert module._resolve_backend() == "reference"
    x = torch.randn(3, 512)
    torch.testing.assert_close(module(x), torch.nn.functional.linear(x, module.dequantized_weight(), module.bias))


@pytest.mark.skipif(not avx2_available(), reason="the k-bit kernel needs AVX2")
def test_a_bfloat16_input_reaches_the_kernel_as_it_is(monkeypatch):
    """A bfloat16 model's rows go to the kernel in bfloat16, and its prompt GEMM is `prefill_dtype`'s (bfloat16 where
    the CPU multiplies it in hardware); the output is the reference's to bfloat16 rounding."""
    import leanlm.nn.gguf_linear as gguf_linear

    module = _module("q4_0")
    seen = []
    kernel = gguf_linear.kbit_linear

    def spy(rows, *args, **kwargs):
        seen.append((rows.dtype, kwargs["compute_dtype"]))
        return kernel(rows, *args, **kwargs)

    monkeypatch.setattr(gguf_linear, "kbit_linear", spy)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.inference_mode():
        got = module(x)
        module.backend = "reference"
        expected = module(x.float())
    assert seen == [(torch.bfloat16, prefill_dtype(torch.bfloat16))]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=1e-2 * expected.abs().max().item())
