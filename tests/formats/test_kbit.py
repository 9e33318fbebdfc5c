"""k-bit data types, block-wise quantization, double quantization, packing and the bits account."""

import importlib.util

import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.formats.blockwise import bits_per_parameter, quantize_blockwise
from leanlm.formats.codebooks import DTYPES, DYNAMIC8, FP4_BITSANDBYTES, NF4, codebook, floating, normal_float
from leanlm.formats.packing import pack, packed_bytes, unpack

bitsandbytes_missing = importlib.util.find_spec("bitsandbytes") is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", range(3, 9))
def test_every_type_has_2_to_the_k_codes_within_unit_range(dtype, bits):
    values = codebook(dtype, bits).values
    assert values.numel() == 2**bits and values.abs().max() == 1.0 and (values == 0).any()


def test_nf4_is_the_normal_quantile_construction():
    assert torch.allclose(normal_float(4).values, NF4.values, atol=2e-7)
    assert NF4.values[7] == 0 and NF4.values[0] == -1 and NF4.values[15] == 1
    # 8 positive and 7 negative values: the asymmetric fix that gives an exact zero
    assert (NF4.values > 0).sum() == 8 and (NF4.values < 0).sum() == 7


def test_float_types_follow_the_ieee_layout():
    e2m1 = sorted(set(floating(2, 1).values.abs().tolist()))
    assert e2m1 == pytest.approx([0, 1 / 12, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 1])  # {0, .5, 1, 1.5, 2, 3, 4, 6} / 6
    e3m0 = sorted(set(floating(3, 0).values.abs().tolist()))
    assert e3m0 == pytest.approx([0] + [2.0**-i for i in range(6, -1, -1)])


def test_dynamic_type_spans_decades():
    positive = DYNAMIC8.values[DYNAMIC8.values > 0]
    assert positive.min() < 1e-6 and positive.max() == 1.0


def test_unknown_type_and_bits_are_refused():
    with pytest.raises(ConfigError, match="unknown data type"):
        codebook("posit", 4)
    with pytest.raises(ConfigError, match="bits must be between"):
        codebook("int", 9)


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_round_trips_at_exactly_k_bits(bits):
    codes = torch.randint(0, 2**bits, (1001,), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.numel() == packed_bytes(1001, bits) == (1001 * bits + 7) // 8
    assert torch.equal(unpack(packed, bits, 1001), codes)


@pytest.mark.parametrize("count", [64, 1001, 4096])
def test_the_3_bit_planes_layout_round_trips_in_24_bytes_per_64_codes(count):
    codes = torch.randint(0, 8, (count,), dtype=torch.uint8)
    packed = pack(codes, 3, "planes")
    assert packed.numel() == packed_bytes(count, 3, "planes") == -(-count // 64) * 24
    assert torch.equal(unpack(packed, 3, count, "planes"), codes)


def test_the_3_bit_planes_layout_puts_low_pairs_then_high_bits():
    """Code i's low pair is in byte i % 16 at bits 2 * (i // 16); its high bit is bit i of the 8 bytes after."""
    codes = torch.zeros(64, dtype=torch.uint8)
    codes[17], codes[63] = 5, 7  # 0b101: pair 1 in byte 1, bits 2-3; high bit 17. 0b111: byte 15, bits 6-7; bit 63
    expected = torch.zeros(24, dtype=torch.uint8)
    expected[1], expected[15], expected[16 + 2], expected[16 + 7] = 1 << 2, 3 << 6, 1 << 1, 1 << 7
    assert torch.equal(pack(codes, 3, "planes"), expected)
    with pytest.raises(ConfigError, match="planes layout holds 3-bit"):
        pack(codes, 4, "planes")


def test_blockwise_error_shrinks_with_the_block_size():
    torch.manual_seed(0)
    weight = torch.randn(128, 512) * torch.logspace(-1, 1, 512)  # columns of very different scales
    errors = [(quantize_blockwise(weight, NF4, size).dequantize() - weight).norm() for size in (4096, 256, 32)]
    assert errors[0] > errors[1] > errors[2]
    per_row = quantize_blockwise(weight, NF4, None)
    assert per_row.block_size == 512 and per_row.absmax.numel() == 128


@pytest.mark.parametrize("block_size", [64, 4096])
def test_quantizing_chunk_by_chunk_codes_every_value_to_its_nearest(monkeypatch, block_size):
    """Large tensors are quantized a few blocks at a time into preallocated results (to bound the temporaries);
    across chunk boundaries and a short last block every value still gets its block's absmax and the nearest
    code (an oracle: the distance to all 16 values, ties to the lower code as bitsandbytes' midpoints do)."""
    import leanlm.formats.blockwise as blockwise

    monkeypatch.setattr(blockwise, "_CHUNK_VALUES", 3 * block_size + 5)  # 3 blocks a chunk
    torch.manual_seed(2)
    flat = torch.randn(10 * block_size + 37) * torch.rand(10 * block_size + 37) ** 3
    flat[block_size : 2 * block_size] = 0.0  # an all-zero block is coded as zeros
    result = quantize_blockwise(flat, NF4, block_size)
    blocks = torch.split(flat, block_size)
    absmax = torch.stack([block.abs().max() for block in blocks])
    assert torch.equal(result.absmax, absmax)
    inverse = 1.0 / absmax.clamp(min=1e-38)  # the scaling bitsandbytes does: times the reciprocal
    normalized = torch.cat([block * scale for block, scale in zip(blocks, inverse)])
    distance = (normalized[:, None] - NF4.values).abs()
    nearest = (distance == distance.min(dim=1, keepdim=True).values).int().argmax(dim=1)  # first of any tie
    assert torch.equal(result.codes.long(), nearest)


def test_bits_account():
    assert bits_per_parameter(4, 64, double_quant=False) == 4.5  # 32-bit constant per 64 values
    assert bits_per_parameter(4, 64, double_quant=True) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256))  # 4.127
    assert bits_per_parameter(4, 64, False, constant_bits=16) == 4.25  # the k-bit study's 16-bit constants
    assert bits_per_parameter(3, 128, False, outlier_fraction=0.02) == pytest.approx(3 + 0.25 + 0.02 * 16)


@pytest.mark.skipif(bitsandbytes_missing, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("quant_type, book", [("nf4", NF4), ("fp4", FP4_BITSANDBYTES)])
@pytest.mark.parametrize("double_quant", [False, True])
def test_quantize_4bit_matches_bitsandbytes(quant_type, book, double_quant):
    import bitsandbytes.functional as bnbf

    torch.manual_seed(1)
    weight = torch.randn(257, 192) * 0.05  # a partial last block as well
    theirs, state = bnbf.quantize_4bit(weight, blocksize=64, quant_type=quant_type, compress_statistics=double_quant)
    ours = quantize_blockwise(weight, book, 64, double_quant)
    assert torch.equal(pack(ours.codes, 4), theirs.flatten())  # first-level codes, packed: bit for bit
    if not double_quant:
        assert torch.equal(ours.absmax, state.absmax)
        assert torch.equal(ours.dequantize(), bnbf.dequantize_4bit(theirs, state))
        return
    assert torch.equal(ours.absmax_offset, state.offset) and torch.equal(ours.absmax_scale, state.state2.absmax)
    # Second level: bitsandbytes' CPU kernel finds each 8-bit code by an approximate binary search, so at a few
    # near-ties it keeps the farther neighbour; leanlm always takes the nearest, never worse.
    assert (ours.absmax != state.absmax).float().mean() < 0.01
    exact = torch.stack([block.abs().max() for block in torch.split(weight.flatten(), 64)])
    theirs_constants = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    assert torch.all((ours.block_constants() - exact).abs() <= (theirs_constants - exact).abs() + 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", range(3, 9))
def test_every_value_gets_a_code_of_its_nearest_value(dtype, bits):
    """Books of up to 32 codes are searched by comparisons, larger ones by bucketize: either way the value a code
    stands for is a nearest one (oracle: the distance to every value of the book)."""
    book = codebook(dtype, bits)
    values = torch.cat([torch.rand(20_000, generator=torch.Generator().manual_seed(bits)) * 2 - 1, book.values])
    codes = book.nearest(values)
    assert codes.dtype == torch.uint8 and codes.shape == values.shape
    distance = (values[:, None] - book.values).abs()
    assert torch.equal((book.values[codes.long()] - values).abs(), distance.min(dim=1).values)


def test_a_value_listed_twice_is_coded_by_its_first_index():
    """The symmetric int books end on an unused second zero; `nearest` never emits it (the 8-bit kernel reads int
    codes as int8 values plus 127). (0.0 and -0.0 of bitsandbytes' FP4 keep their codes: its parity tests.)"""
    for bits in (4, 8):
        book = codebook("int", bits)
        codes = book.nearest(torch.linspace(-1, 1, 10_001))
        assert codes.max() == 2**bits - 2 and (codes == 2 ** (bits - 1) - 1).any()
