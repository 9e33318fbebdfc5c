import os

import pytest
import torch

from leanlm.formats.blockwise import quantize_blockwise
from leanlm.formats.codebooks import codebook
from leanlm.formats.packing import pack
from leanlm.errors import ConfigError
from leanlm.formats.codebooks import DYNAMIC8
from leanlm.kernels.kbit_gemm import (
    BlockConstants,
    avx2_available,
    code_table,
    dequantize_weight,
    kbit_linear,
    kernel_isas,
    supports_fast_path,
)
from leanlm.nn import KbitLinear

needs_avx2 = pytest.mark.skipif(not avx2_available(), reason="the AVX2 k-bit kernel cannot be built or run here")


def operands(out_features, in_features, dtype, block):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    book = codebook(dtype, 4)
    quantized = quantize_blockwise(weight, book, block)
    return quantized, pack(quantized.codes, 4), code_table(book.values), torch.randn(out_features)


@needs_avx2
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 16, 17, 300])
# 576 = 4.5 x 128 codes: AVX-512's 64-code tail; blocks of 192 end inside a 128-code chunk
@pytest.mark.parametrize("dtype, block, in_features", [("nf", 64, 512), ("fp", 16, 512), ("nf", 32, 512),
                                                       ("int", 128, 512), ("nf", 512, 512), ("nf", 64, 576),
                                                       ("int", 192, 576)])
def test_every_kernel_matches_the_reference(rows, dtype, block, in_features):
    quantized, packed, table, bias = operands(96, in_features, dtype, block)
    x = torch.randn(rows, in_features)
    expected = x @ quantized.dequantize().T + bias
    reference = kbit_linear(x, packed, quantized.absmax, table, 96, block, bias, "reference")
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-4)
    for isa in kernel_isas():
        fast = kbit_linear(x, packed, quantized.absmax, table, 96, block, bias, "avx2", isa)
        torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-4, msg=lambda m: f"{isa}: {m}")


@needs_avx2
@pytest.mark.parametrize("rows", [1, 5, 8, 40])
@pytest.mark.parametrize("in_features", [512, 576, 96])  # the lane kernels (and AVX-512's tail), the in-order one
def test_double_quantized_constants_decoded_in_the_kernel_equal_the_float_ones(rows, in_features):
    """The kernel reads QLoRA's 8-bit block constants as stored, decoding a row's worth at a time: every ISA and
    the large-M tiles give exactly what they give with the float32 constants, bit for bit."""
    torch.manual_seed(2)
    weight = torch.randn(80, in_features)
    quantized = quantize_blockwise(weight, codebook("nf", 4), 32, double_quant=True)
    packed, table, bias = pack(quantized.codes, 4), code_table(codebook("nf", 4).values), torch.randn(80)
    stored = BlockConstants(quantized.absmax, quantized.absmax_scale, DYNAMIC8.values, quantized.absmax_offset.item())
    dense = quantized.block_constants()
    assert quantized.absmax.dtype == torch.uint8 and torch.equal(stored.dense(), dense)
    x = torch.randn(rows, in_features)
    for isa in kernel_isas() if in_features % 64 == 0 else ["in-order"]:
        torch.testing.assert_close(kbit_linear(x, packed, stored, table, 80, 32, bias, "avx2", isa),
                                   kbit_linear(x, packed, dense, table, 80, 32, bias, "avx2", isa), rtol=0, atol=0)
    assert torch.equal(dequantize_weight(packed, stored, table, 80, in_features, 32),
                       dequantize_weight(packed, dense, table, 80, in_features, 32))
    torch.testing.assert_close(kbit_linear(x, packed, stored, table, 80, 32, bias, "reference"),
                               x @ quantized.dequantize().T + bias, rtol=1e-5, atol=1e-4)


@needs_avx2
def test_a_double_quantized_layer_keeps_no_float_copy_of_its_constants():
    layer = KbitLinear.from_float(torch.randn(64, 256), None, "nf", 4, 64, double_quant=True)
    layer(torch.randn(1, 256))
    constants, _ = layer._kernel_state()
    assert constants.absmax is layer.absmax and constants.absmax.dtype == torch.uint8


@needs_avx2
def test_rows_not_a_multiple_of_64_take_the_in_order_kernel():
    quantized, packed, table, bias = operands(24, 96, "nf", 32)
    x = torch.randn(2, 96)
    reference = kbit_linear(x, packed, quantized.absmax, table, 24, 32, bias, "reference")
    torch.testing.assert_close(kbit_linear(x, packed, quantized.absmax, table, 24, 32, bias, "avx2"), reference,
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="in_features % 64"):
        kbit_linear(x, packed, quantized.absmax, table, 24, 32, bias, "avx2", "avx2")
    for rows in (x, torch.randn(40, 96)):  # the small-M kernel and the large-M path alike
        with pytest.raises(ConfigError, match="unknown k-bit kernel"):
            kbit_linear(rows, packed, quantized.absmax, table, 24, 32, bias, "avx2", "sse")


@needs_avx2
@pytest.mark.parametrize("double_quant", [False, True])
def test_kbit_linear_module_takes_the_fast_path_and_agrees(double_quant):
    torch.manual_seed(1)
    weight, bias = torch.randn(64, 256), torch.randn(64)
    fast = KbitLinear.from_float(weight, bias, "nf", 4, 64, double_quant)
    slow = KbitLinear.from_float(weight, bias, "nf", 4, 64, double_quant)
    slow.backend = "reference"
    x = torch.randn(2, 5, 256)
    torch.testing.assert_close(fast(x), slow(x), rtol=1e-5, atol=1e-4)
    assert fast.backend == "avx2"


def test_layouts_the_kernel_does_not_cover_use_the_reference():
    assert supports_fast_path(4, 64, 4096) and not supports_fast_path(3, 64, 4096)
    assert not supports_fast_path(4, 64, 4000) and not supports_fast_path(4, 40, 4000)
    module = KbitLinear.from_float(torch.randn(8, 96), None, "int", 3, 32)
    module(torch.randn(1, 96))
    assert module.backend == "reference"


@pytest.mark.skipif(not avx2_available(), reason="the AVX2 k-bit kernel cannot be built on this machine")
def test_kernel_dequantization_equals_the_reference():
    from leanlm.nn import KbitLinear

    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    fast = KbitLinear.from_float(weight, None, "nf", 4, 64, double_quant=True)
    slow = KbitLinear.from_float(weight, None, "nf", 4, 64, double_quant=True)
    fast.backend, slow.backend = "avx2", "reference"
    torch.testing.assert_close(fast.dequantized_weight(), slow.dequantized_weight(), rtol=0, atol=0)


@needs_avx2
def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load(tmp_path):
    """torch's build lock is a bare file; a build killed mid-way left one behind and every later load waited on it
    forever. A fresh process, given a cache holding the built kernel and such a stale lock, loads at once."""
    import shutil
    import subprocess
    import sys

    from leanlm.kernels.kbit_gemm import _cache_dir

    built = _cache_dir()
    cache = tmp_path / "cache"
    shutil.copytree(built, cache / built.relative_to(built.parents[1]))
    (cache / built.relative_to(built.parents[1]) / "lock").touch()
    probe = "from leanlm.kernels.kbit_gemm import avx2_available; print(avx2_available())"
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "LEANLM_CACHE": str(cache)},
                          capture_output=True, text=True, timeout=240)
    assert done.stdout.strip() == "True", done.stderr
