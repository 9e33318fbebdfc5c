import os

import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.formats.blockwise import quantize_blockwise
from leanlm.formats.codebooks import DYNAMIC8, codebook
from leanlm.formats.packing import pack
from leanlm.kernels.cpu import has_native_bf16
from leanlm.kernels.kbit_gemm import (
    SMALL_M,
    BlockConstants,
    SparseRows,
    avx2_available,
    code_table,
    compiled_kernels,
    dequantize_weight,
    int8_kernel_isas,
    int8_table,
    kbit_linear,
    kernel_isas,
    quantize_activations,
    reference_int8_activations,
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
@pytest.mark.parametrize(
    "dtype, block, in_features",
    [
        ("nf", 64, 512),
        ("fp", 16, 512),
        ("nf", 32, 512),
        ("int", 128, 512),
        ("nf", 512, 512),
        ("nf", 64, 576),
        ("int", 192, 576),
    ],
)
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
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [96, 1100])  # 1100: three tiles of 512 rows, the sparse rows split by them
def test_block_offsets_and_a_sparse_part_add_to_the_weight(rows, compute_dtype, out_features):
    """An asymmetric grid's weight is scale * code + offset per block, plus SpQR's sparse outliers: at decode sizes
    the offsets meet the block sums of x and the outliers multiply on their own; at prefill sizes both go into each
    decoded tile before it is rounded to bfloat16."""
    if compute_dtype == torch.bfloat16 and not has_native_bf16():
        pytest.skip("no bfloat16 products on this CPU")
    quantized, packed, table, bias = operands(out_features, 512, "int", 64)
    offsets = torch.randn(out_features, 512 // 64)
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(out_features, 512, generator=generator) < 0.02
    mask[5] = False  # a row without outliers
    outliers = torch.where(mask, torch.randn(out_features, 512, generator=generator) * 3, torch.zeros(()))
    row_offsets = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(dim=1).cumsum(0)])
    sparse = SparseRows(row_offsets, mask.nonzero()[:, 1], outliers[mask], (out_features, 512))
    weight = quantized.dequantize() + offsets.repeat_interleave(64, dim=1) + outliers
    x = torch.randn(rows, 512)
    arguments = dict(block_offsets=offsets, sparse=sparse)
    reference = kbit_linear(x, packed, quantized.absmax, table, out_features, 64, bias, "reference", **arguments)
    torch.testing.assert_close(reference, x @ weight.T + bias, rtol=1e-5, atol=1e-4)
    fast = kbit_linear(
        x,
        packed,
        quantized.absmax,
        table,
        out_features,
        64,
        bias,
        "avx2",
        int8_activations=False,
        compute_dtype=compute_dtype,
        **arguments,
    ).float()
    if compute_dtype == torch.bfloat16 and rows > 16:  # the whole weight rounded, not s * q rounded then shifted
        expected = (x.bfloat16() @ weight.bfloat16().T).float() + bias
        torch.testing.assert_close(fast, expected, rtol=2e-2, atol=5e-2)
    else:
        torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-4)


@needs_avx2
def test_constants_decoded_once_by_the_kernel_equal_their_oracle_bit_for_bit():
    """`decoded_once` (the fused step's float32 copy of double-quantized constants) is `dense()` exactly: groups of
    256 and 5, a count that ends inside a group."""
    torch.manual_seed(8)
    quantized = quantize_blockwise(torch.randn(301, 192), codebook("nf", 4), 64, double_quant=True)
    for group in (256, 5):  # other groups than 256 take their own scales, any values
        scales = quantized.absmax_scale if group == 256 else torch.rand(-(-quantized.absmax.numel() // group)) + 0.5
        stored = BlockConstants(quantized.absmax, scales, DYNAMIC8.values, quantized.absmax_offset.item(), group)
        once = stored.decoded_once()
        assert once.scales is None and torch.equal(once.absmax, stored.dense())
    plain = BlockConstants(quantized.block_constants())
    assert plain.decoded_once() is plain


def test_the_constants_of_some_rows_are_those_rows_of_all_the_constants():
    """`BlockConstants.rows` decodes only the rows asked for (an 8-bit head's embedding reads a few per token):
    the same floats as `dense()` there, double-quantized (groups of 256 straddling rows) or not."""
    torch.manual_seed(3)
    quantized = quantize_blockwise(torch.randn(300, 192), codebook("nf", 4), 64, double_quant=True)
    stored = BlockConstants(quantized.absmax, quantized.absmax_scale, DYNAMIC8.values, quantized.absmax_offset.item())
    plain = BlockConstants(quantized.block_constants())
    for constants in (stored, plain):
        every = constants.dense().reshape(300, 3)
        assert torch.equal(constants.rows(slice(85, 171), 3), every[85:171])
        ids = torch.tensor([299, 0, 86, 86, 170])
        assert torch.equal(constants.rows(ids, 3), every[ids])


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
        torch.testing.assert_close(
            kbit_linear(x, packed, stored, table, 80, 32, bias, "avx2", isa),
            kbit_linear(x, packed, dense, table, 80, 32, bias, "avx2", isa),
            rtol=0,
            atol=0,
        )
    assert torch.equal(
        dequantize_weight(packed, stored, table, 80, in_features, 32),
        dequantize_weight(packed, dense, table, 80, in_features, 32),
    )
    torch.testing.assert_close(
        kbit_linear(x, packed, stored, table, 80, 32, bias, "reference"),
        x @ quantized.dequantize().T + bias,
        rtol=1e-5,
        atol=1e-4,
    )


@needs_avx2
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_tiles_decoded_into_bfloat16_are_the_float32_tiles_rounded_to_nearest_even(bits, double_quant, with_offsets):
    """The large-M path decodes straight into the GEMM's dtype: a bfloat16 tile is the float32 tile (offsets
    included) as PyTorch rounds it, bit for bit, halfway cases going to the even neighbour."""
    torch.manual_seed(3)
    weight = torch.randn(40, 256)
    book = codebook("int", bits)
    quantized = quantize_blockwise(weight, book, 64, double_quant=double_quant)
    table = code_table(book.values) if bits == 4 else book.values.float()
    if bits == 4:  # exact ties of bfloat16 (1 + 2^-8 lies halfway between 1 and 1 + 2^-7), up and down
        table[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2 - 2**-9])
    constants = (
        BlockConstants(quantized.absmax, quantized.absmax_scale, DYNAMIC8.values, quantized.absmax_offset.item())
        if double_quant
        else BlockConstants(torch.where(torch.rand(40 * 4) < 0.3, torch.ones(()), quantized.absmax))
    )
    offsets = torch.randn(40, 4) if with_offsets else None
    extension = compiled_kernels()
    tiles = {dtype: torch.empty(24, 256, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    for tile in tiles.values():
        extension.dequantize_rows(
            pack(quantized.codes, bits), constants.absmax, table, 64, 16, tile,
            **constants.kernel_arguments(), bits=bits, block_offsets=offsets,
        )  # fmt: skip
    expected = (table[quantized.codes.long()].reshape(-1, 64) * constants.dense()[:, None]).reshape(40, 256)
    if with_offsets:
        expected = (expected.reshape(40, 4, 64) + offsets[:, :, None]).reshape(40, 256)
    assert torch.equal(tiles[torch.float32], expected[16:])
    assert torch.equal(tiles[torch.bfloat16].view(torch.int16), tiles[torch.float32].bfloat16().view(torch.int16))


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
    torch.testing.assert_close(
        kbit_linear(x, packed, quantized.absmax, table, 24, 32, bias, "avx2"), reference, rtol=1e-5, atol=1e-4
    )
    with pytest.raises(RuntimeError, match="in_features % 64"):
        kbit_linear(x, packed, quantized.absmax, table, 24, 32, bias, "avx2", "avx2")
    for rows in (x, torch.randn(40, 96)):  # the small-M kernel and the large-M path alike
        with pytest.raises(ConfigError, match="unknown k-bit kernel"):
            kbit_linear(rows, packed, quantized.absmax, table, 24, 32, bias, "avx2", "sse")


@needs_avx2
@pytest.mark.parametrize("double_quant", [False, True])
def test_kbit_linear_module_takes_the_fast_path_and_agrees(double_quant):
    """Up to SMALL_M rows the module runs the int8-activation kernel, above it the float path."""
    torch.manual_seed(1)
    weight, bias = torch.randn(64, 256), torch.randn(64)
    fast = KbitLinear.from_float(weight, bias, "nf", 4, 64, double_quant)
    slow = KbitLinear.from_float(weight, bias, "nf", 4, 64, double_quant)
    slow.backend = "reference"
    decode, prefill = torch.randn(2, 5, 256), torch.randn(2, 20, 256)
    torch.testing.assert_close(fast(prefill), slow(prefill), rtol=1e-5, atol=1e-4)
    constants, table = fast._kernel_state()
    expected = reference_int8_activations(decode.reshape(10, 256), fast.packed, constants, table, 64, 64) + bias
    torch.testing.assert_close(fast(decode), expected.reshape(2, 5, 64), rtol=1e-5, atol=1e-4)
    assert fast.backend == "avx2"


@needs_avx2
@pytest.mark.parametrize("in_features", [576, 1024])  # 9 chunks a row (8 and a tail), 16 (two whole eights)
@pytest.mark.parametrize("group", [256, 12, 5])  # double quantization's groups: across 8-chunk windows, or smaller
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_int8_kernels_decode_double_quantized_constants_eight_at_a_time_exactly(in_features, group, rows):
    """The int8 kernels decode a row's double-quantized constants 8 chunks at a time (a gather, and a blend where a
    group ends inside the 8): bit for bit the output of the same constants given as float32, for every group size,
    at a row's tail, and against the oracle."""
    torch.manual_seed(4)
    out_features, blocks = 40, 40 * in_features // 64
    codes = torch.randint(0, 256, (blocks,), dtype=torch.uint8)
    stored = BlockConstants(codes, torch.rand((blocks + group - 1) // group) + 0.5, DYNAMIC8.values, 0.01, group)
    dense = BlockConstants(stored.dense())
    packed = torch.randint(0, 256, (out_features * in_features // 2,), dtype=torch.uint8)
    table, x = code_table(codebook("nf", 4).values), torch.randn(rows, in_features)
    expected = reference_int8_activations(x, packed, stored, table, out_features, 64)
    for isa in int8_kernel_isas():
        fast = kbit_linear(x, packed, stored, table, out_features, 64, None, "avx2", isa)
        assert torch.equal(fast, kbit_linear(x, packed, dense, table, out_features, 64, None, "avx2", isa)), isa
        torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-4, msg=lambda m: f"{isa}: {m}")


@needs_avx2
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 11, 16, 40])
@pytest.mark.parametrize(
    "dtype, block, in_features, double_quant",
    [("nf", 64, 512, False), ("fp", 192, 576, False), ("nf", 64, 576, True), ("int", 256, 512, True)],
)
def test_int8_activation_kernels_match_their_reference(rows, dtype, block, in_features, double_quant):
    """Each int8 kernel computes the oracle's integers; only the float sums of scaled chunks may round apart."""
    torch.manual_seed(3)
    quantized = quantize_blockwise(torch.randn(96, in_features), codebook(dtype, 4), block, double_quant)
    constants = (
        BlockConstants(quantized.absmax, quantized.absmax_scale, DYNAMIC8.values, quantized.absmax_offset.item())
        if double_quant
        else BlockConstants(quantized.absmax)
    )
    packed, table, bias = pack(quantized.codes, 4), code_table(codebook(dtype, 4).values), torch.randn(96)
    x = torch.randn(rows, in_features) * torch.rand(in_features) * 4  # channels of different sizes
    expected = reference_int8_activations(x, packed, constants, table, 96, block) + bias
    for isa in int8_kernel_isas():
        torch.testing.assert_close(
            kbit_linear(x, packed, constants, table, 96, block, bias, "avx2", isa),
            expected,
            rtol=1e-5,
            atol=1e-4,
            msg=lambda m: f"{isa}: {m}",
        )
    if rows <= SMALL_M:  # the automatic choice at decode sizes
        torch.testing.assert_close(
            kbit_linear(x, packed, constants, table, 96, block, bias, "avx2"), expected, rtol=1e-5, atol=1e-4
        )


def test_int8_activations_cost_little_accuracy():
    """Quantizing x per chunk of 64 and the code book to int8 keeps the product within 1.5% (SQNR > 36 dB) of the
    float product, on activations with a few large channels as real ones have."""
    quantized, packed, table, _ = operands(256, 1024, "nf", 64)
    x = torch.randn(8, 1024)
    x[:, :8] *= 20
    exact = x @ quantized.dequantize().T
    approximate = reference_int8_activations(x, packed, BlockConstants(quantized.absmax), table, 256, 64)
    sqnr = 20 * torch.log10(exact.norm() / (approximate - exact).norm())
    assert sqnr > 36, f"SQNR {sqnr:.1f} dB"


def test_the_int8_code_book_and_activations():
    values, inverse = int8_table(code_table(codebook("nf", 4).values))
    assert values[0] == -127 and values[-1] == 127 and values[7] == 0 and inverse == pytest.approx(1 / 127)
    identity, inverse = int8_table(torch.arange(16, dtype=torch.float32))  # GPTQ's codes: exact
    assert torch.equal(identity, torch.arange(16, dtype=torch.int8)) and inverse == 1.0
    codes, scale = quantize_activations(torch.cat([torch.linspace(-2, 2, 64), torch.zeros(64)])[None])
    assert codes[0, 0, 0] == -127 and codes[0, 0, -1] == 127 and scale[0, 0] == pytest.approx(2 / 127)
    assert scale[0, 1] == 0 and not codes[0, 1].any()  # an all-zero chunk quantizes to zeros, not NaN


@needs_avx2
def test_blocks_the_int8_kernel_cannot_read_keep_float_activations():
    quantized, packed, table, bias = operands(96, 512, "nf", 32)  # one constant per 32 values: not per chunk of 64
    x = torch.randn(2, 512)
    torch.testing.assert_close(
        kbit_linear(x, packed, quantized.absmax, table, 96, 32, bias, "avx2"),
        x @ quantized.dequantize().T + bias,
        rtol=1e-5,
        atol=1e-4,
    )
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kbit_linear(x, packed, quantized.absmax, table, 96, 32, bias, "avx2", "avx2-int8")


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
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "LEANLM_CACHE": str(cache)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.stdout.strip() == "True", done.stderr


@needs_avx2
@pytest.mark.parametrize("bits, dtype", [(4, "nf"), (8, "int")])
def test_a_batch_over_many_cache_tiles_of_weight_rows_is_each_rows_product(bits, dtype):
    """Output rows are taken a cache-sized tile at a time (rows of 4096 inputs: tens of rows a tile), every group of
    rows of x over each tile: the product is the oracle's for every row of x, across tile edges and the 4-row
    groups' remainder."""
    torch.manual_seed(5)
    layer = KbitLinear.from_float(torch.randn(600, 4096), torch.randn(600), dtype, bits, 64)
    constants, table = layer._kernel_state()
    x = torch.randn(9, 4096)
    expected = reference_int8_activations(x, layer.packed, constants, table if bits == 4 else None, 600, 64, bits=bits)
    for isa in int8_kernel_isas():
        got = kbit_linear(x, layer.packed, constants, table, 600, 64, layer.bias, "avx2", isa, bits=bits)
        torch.testing.assert_close(got, expected + layer.bias, rtol=1e-5, atol=1e-3, msg=lambda m: f"{isa}: {m}")


@needs_avx2
@pytest.mark.parametrize("bits, dtype, block", [(4, "nf", 64), (4, "fp", 128), (8, "int", 64), (8, "int", 192)])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("out_features", [16, 40, 7])  # whole groups of 16 output rows, and a part of one
def test_a_rows_product_is_the_same_whatever_rows_share_its_pass(bits, dtype, block, double_quant, out_features):
    """The int8 kernels take rows of x alone, in twos, fours and eights: every row of a batch of 15 is bit for bit
    that row's product taken alone, and the oracle's within float rounding."""
    torch.manual_seed(6)
    layer = KbitLinear.from_float(torch.randn(out_features, 768), None, dtype, bits, block, double_quant)
    constants, table = layer._kernel_state()
    x = torch.randn(15, 768) * torch.rand(768) * 4
    expected = reference_int8_activations(
        x, layer.packed, constants, table if bits == 4 else None, out_features, block, bits=bits
    )
    for isa in int8_kernel_isas():

        def run(rows, isa=isa):
            return kbit_linear(rows, layer.packed, constants, table, out_features, block, None, "avx2", isa, bits=bits)

        batch = run(x)
        for r in range(x.shape[0]):
            assert torch.equal(batch[r], run(x[r : r + 1])[0]), (isa, r)
        torch.testing.assert_close(batch, expected, rtol=1e-5, atol=1e-4, msg=lambda m: f"{isa}: {m}")


@needs_avx2
@pytest.mark.parametrize("rows", [1, 4, 5])
@pytest.mark.parametrize("double_quant", [False, True])
def test_8_bit_int_codes_run_the_int8_kernel_as_stored(rows, double_quant):
    """8-bit codes of the symmetric int book are the int8 weight plus 127: each int8 kernel computes the oracle's
    integers; the layer is within 1% of the float product at decode sizes and equal to it at prefill sizes."""
    torch.manual_seed(4)
    layer = KbitLinear.from_float(torch.randn(96, 576), torch.randn(96), "int", 8, 64, double_quant)
    assert layer.packed.max() < 255  # the unused code (a second zero) is never emitted
    constants, _ = layer._kernel_state()
    x = torch.randn(rows, 576)
    expected = reference_int8_activations(x, layer.packed, constants, None, 96, 64, bits=8) + layer.bias
    for isa in int8_kernel_isas():
        torch.testing.assert_close(
            kbit_linear(x, layer.packed, constants, None, 96, 64, layer.bias, "avx2", isa, bits=8),
            expected,
            rtol=1e-5,
            atol=1e-4,
            msg=lambda m: f"{isa}: {m}",
        )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    exact = x @ layer.dequantized_weight().T + layer.bias
    assert 20 * torch.log10(exact.norm() / (layer(x) - exact).norm()) > 40
    prefill = torch.randn(40, 576)
    torch.testing.assert_close(layer(prefill), prefill @ layer.dequantized_weight().T + layer.bias)
    _, table = layer._kernel_state()  # the 256-entry book the prefill tiles decode through
    for inputs in (prefill, x):  # float activations at a decode size (under autograd) take the tiles too
        torch.testing.assert_close(
            kbit_linear(
                inputs, layer.packed, constants, table, 96, 64, layer.bias, "avx2", int8_activations=False, bits=8
            ),
            inputs @ layer.dequantized_weight().T + layer.bias,
            rtol=1e-5,
            atol=1e-4,
        )


@needs_avx2
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
@pytest.mark.parametrize(
    "block, in_features, double_quant",
    [(64, 576, False), (128, 512, True), (16, 192, False), (32, 576, False), (256, 512, True)],
)
def test_3_bit_codes_run_the_int8_kernel_as_its_reference_computes(rows, block, in_features, double_quant):
    """3-bit codes in the planes layout (blocks of 16 and 32 too: each 16 codes of a chunk scaled on their own): each
    int8 kernel computes the oracle's integers; only the float sums of scaled parts may round apart."""
    torch.manual_seed(5)
    quantized = quantize_blockwise(torch.randn(80, in_features), codebook("nf", 3), block, double_quant)
    constants = (
        BlockConstants(quantized.absmax, quantized.absmax_scale, DYNAMIC8.values, quantized.absmax_offset.item())
        if double_quant
        else BlockConstants(quantized.absmax)
    )
    packed, table, bias = pack(quantized.codes, 3, "planes"), code_table(codebook("nf", 3).values), torch.randn(80)
    x = torch.randn(rows, in_features) * torch.rand(in_features) * 4
    expected = reference_int8_activations(x, packed, constants, table, 80, block, bits=3) + bias
    for isa in int8_kernel_isas():
        torch.testing.assert_close(
            kbit_linear(x, packed, constants, table, 80, block, bias, "avx2", isa, bits=3),
            expected,
            rtol=1e-5,
            atol=1e-4,
            msg=lambda m: f"{isa}: {m}",
        )
    exact = x @ quantized.dequantize().T + bias
    assert 20 * torch.log10(exact.norm() / (expected - exact).norm()) > 30  # int8 activations and book: SQNR


@needs_avx2
@pytest.mark.parametrize("dtype, block", [("nf", 64), ("int", 32), ("fp", 16)])
def test_a_3_bit_layer_decodes_through_the_kernel_and_prefills_through_decoded_tiles(dtype, block):
    """A 3-bit KbitLinear keeps its codes in the planes layout (3 bits per weight, as the bit stream) and never
    de-quantizes its whole weight at decode sizes; a longer input multiplies by tiles of rows the kernel decodes."""
    torch.manual_seed(6)
    layer = KbitLinear.from_float(torch.randn(96, 576), torch.randn(96), dtype, 3, block)
    assert layer.code_layout == "planes" and layer.packed.numel() == 96 * 576 * 3 // 8
    x = torch.randn(2, 576)
    constants, table = layer._kernel_state()
    expected = reference_int8_activations(x, layer.packed, constants, table, 96, block, bits=3) + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert layer.backend == "avx2"
    prefill = torch.randn(40, 576)
    torch.testing.assert_close(layer(prefill), prefill @ layer.dequantized_weight().T + layer.bias)
    tall = torch.randn(1100, 576)
    wide = KbitLinear.from_float(torch.randn(1100, 576), None, dtype, 3, block)  # 3 tiles of output rows (512 each)
    torch.testing.assert_close(wide(prefill), prefill @ wide.dequantized_weight().T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(tall), tall @ layer.dequantized_weight().T + layer.bias, rtol=1e-5, atol=1e-4)


def test_3_bit_layers_of_checkpoints_from_before_the_planes_layout_still_read_their_bit_stream():
    """A checkpoint record without `code_layout` builds a bit-stream layer (the only 3-bit layout then), which
    takes the reference path and computes what the planes layer computes."""
    torch.manual_seed(7)
    layer = KbitLinear.from_float(torch.randn(32, 128), None, "nf", 3, 64)
    arguments = {key: value for key, value in layer.constructor_args().items() if key != "code_layout"}
    old = KbitLinear(**arguments)
    state = layer.state_dict()
    state["packed"] = pack(layer.quantized().codes, 3)
    old.load_state_dict(state)
    assert old.code_layout == "stream"
    x = torch.randn(20, 128)
    torch.testing.assert_close(old(x), x @ layer.dequantized_weight().T)
    assert old.backend == "reference"


@needs_avx2
def test_8_bit_codes_written_with_the_unused_code_still_decode():
    """Checkpoints written before `Codebook.nearest` stopped emitting code 255 (the int book's second zero) may
    hold it; the layer maps it to 127, the same value, before the kernel reads the bytes."""
    layer = KbitLinear.from_float(torch.randn(8, 64), None, "int", 8, 64)
    layer.packed[layer.packed == 127] = 255
    before = layer.dequantized_weight()
    x = torch.randn(1, 64)
    assert 20 * torch.log10((x @ before.T).norm() / (layer(x) - x @ before.T).norm()) > 40
    assert torch.equal(layer.dequantized_weight(), before) and layer.packed.max() < 255
