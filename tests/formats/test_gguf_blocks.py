"""GGUF block types as leanlm writes them: any bytes de-quantize here exactly as the `gguf` package de-quantizes
them and unpack / pack back to themselves; fitted statistics and codes are what the format can store, and round
to nearest; rows that are no whole number of super-blocks take llama.cpp's fallback type."""

import gguf
import numpy as np
import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.formats import gguf_blocks
from leanlm.formats.gguf_blocks import (
    BLOCK_TYPES,
    codes_for,
    decode,
    dequantize,
    fit_statistics,
    pack,
    type_for_row,
    unpack,
    zero_points,
)
from leanlm.formats.minmax import row_slices


def _random_blocks(kind, rows=3, blocks=4, seed=0) -> np.ndarray:
    """Random bytes, with each float16 field's exponent kept below infinity (every other bit pattern allowed)."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(rows, blocks * kind.bytes), dtype=np.uint8)
    for _, at in kind.half_fields:
        raw.reshape(rows * blocks, kind.bytes)[:, at + 1] &= 0x7B
    return raw


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_any_block_bytes_decode_as_the_gguf_package_decodes_them_and_pack_back_to_themselves(name):
    kind = BLOCK_TYPES[name]
    raw = _random_blocks(kind)
    columns = 4 * kind.block
    expected = gguf.quants.dequantize(raw, kind.ggml).reshape(3, columns)
    ours = dequantize(kind, torch.from_numpy(raw.copy()), columns).numpy()
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))  # bit for bit, signed zeros included
    codes, statistics = unpack(kind, torch.from_numpy(raw.copy()), columns)
    assert int(codes.max()) < 2**kind.bits
    assert np.array_equal(pack(kind, codes, statistics).numpy(), raw)
    assert kind.bytes == gguf.GGML_QUANT_SIZES[kind.ggml][1] and kind.block == gguf.GGML_QUANT_SIZES[kind.ggml][0]


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_a_weight_unpacked_a_few_rows_at_a_time_is_the_weight_unpacked_at_once(name, monkeypatch):
    kind = BLOCK_TYPES[name]
    raw, columns = torch.from_numpy(_random_blocks(kind, rows=5)), 4 * kind.block
    codes, statistics = unpack(kind, raw, columns)
    weight = dequantize(kind, raw, columns)
    monkeypatch.setattr(gguf_blocks, "UNPACK_WEIGHTS", 2 * columns)  # rows 2, 2 and 1
    assert len(row_slices(5, columns, gguf_blocks.UNPACK_WEIGHTS)) == 3
    chunked_codes, chunked = unpack(kind, raw, columns)
    assert torch.equal(chunked_codes, codes)
    for field in ("d", "dmin", "scales", "mins"):  # no NaN among the random float16 fields (_random_blocks)
        ours, whole = getattr(chunked, field), getattr(statistics, field)
        assert (ours is None and whole is None) or torch.equal(ours, whole)
    assert torch.equal(dequantize(kind, raw, columns).view(torch.int32), weight.view(torch.int32))


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_a_weight_fitted_a_few_rows_at_a_time_is_the_weight_fitted_at_once(name, monkeypatch):
    kind = BLOCK_TYPES[name]
    weight = _weight(rows=7, columns=2 * 256)
    importance = torch.rand(weight.shape[1], generator=torch.Generator().manual_seed(1)) + 0.1
    monkeypatch.setattr(gguf_blocks, "FIT_WEIGHTS", weight.numel())
    statistics = fit_statistics(kind, weight, importance)
    codes = codes_for(kind, weight, statistics)
    monkeypatch.setattr(gguf_blocks, "FIT_WEIGHTS", 3 * weight.shape[1])  # rows 3, 3 and 1
    chunked = fit_statistics(kind, weight, importance)
    # the importance as GPTQ passes it: the diagonal of a Hessian, a strided view
    from_hessian = fit_statistics(kind, weight, torch.diag(importance).diagonal())
    for fitted in (chunked, from_hessian):
        for field in ("d", "dmin", "scales", "mins"):
            ours, whole = getattr(fitted, field), getattr(statistics, field)
            assert (ours is None and whole is None) or torch.equal(ours, whole)
    assert torch.equal(codes_for(kind, weight, statistics), codes)


def _weight(rows=64, columns=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * torch.exp(torch.randn(1, columns, generator=generator))
    weight[:, :3] *= 10  # outlier columns
    return weight


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_fitted_blocks_hold_the_weight_to_the_precision_their_bits_allow(name):
    kind = BLOCK_TYPES[name]
    weight = _weight()
    statistics = fit_statistics(kind, weight)
    codes = codes_for(kind, weight, statistics)
    restored = dequantize(kind, pack(kind, codes, statistics), weight.shape[1])
    assert torch.equal(restored, decode(kind, codes, statistics))
    sqnr = 10 * torch.log10(weight.square().sum() / (restored - weight).square().sum()).item()
    assert sqnr > 6.0 * kind.bits - 8, sqnr  # about 6 dB per bit, less a few for the grid's coarseness
    if kind.k_quant:  # the integer scales fill their range
        assert int(statistics.scales.abs().max()) == 2 ** (kind.scale_bits - kind.signed_scales) - (
            not kind.signed_scales
        )


@pytest.mark.parametrize("name", ["q4_0", "q3_k", "q4_k", "q6_k", "iq4_nl", "iq4_xs"])
def test_codes_are_the_nearest_on_the_fitted_grid(name):
    kind = BLOCK_TYPES[name]
    weight = _weight(rows=8)
    statistics = fit_statistics(kind, weight)
    codes = codes_for(kind, weight, statistics)
    error = (decode(kind, codes, statistics) - weight).abs()
    for step in (-1, 1):  # no code one step away is closer
        moved = (codes.long() + step).clamp(0, 2**kind.bits - 1).to(torch.uint8)
        assert bool(((decode(kind, moved, statistics) - weight).abs() >= error - 1e-6).all())
    scale, zero = zero_points(kind, statistics)
    column_group = torch.arange(weight.shape[1]) // kind.sub
    if kind.levels is None:
        grid = scale[:, column_group] * (codes.float() - zero[:, column_group])
    else:  # a non-linear grid: the codes' levels, no zero point
        assert not zero.any()
        grid = scale[:, column_group] * torch.tensor(kind.levels).float()[codes.long()]
    torch.testing.assert_close(grid, decode(kind, codes, statistics), rtol=1e-5, atol=1e-6)


K_QUANTS = [name for name, kind in BLOCK_TYPES.items() if kind.k_quant]


# Q2_K's and IQ4_XS's fits do not find every super-block's d (and IQ4_XS's levels have no one step) again
@pytest.mark.parametrize("name", ["q3_k", "q4_k", "q5_k", "q6_k"])
def test_a_weight_already_on_the_grid_gets_its_own_blocks_back(name, monkeypatch):
    import leanlm.formats.gguf_blocks as blocks

    kind = BLOCK_TYPES[name]
    weight = _weight()
    with monkeypatch.context() as patch:  # llama.cpp's integers: each rounded, the largest at the end of its range
        patch.setattr(blocks, "_chosen_integers", lambda kind, x, weights, fitted: fitted)
        first = fit_statistics(kind, weight)
    on_grid = decode(kind, codes_for(kind, weight, first), first)  # what a de-quantized K-quant file holds
    statistics = fit_statistics(kind, on_grid)
    assert torch.equal(decode(kind, codes_for(kind, on_grid, statistics), statistics), on_grid)


@pytest.mark.parametrize("name", K_QUANTS)
def test_each_sub_blocks_integers_round_no_worse_than_the_rounded_ones(name, monkeypatch):
    import leanlm.formats.gguf_blocks as blocks

    kind = BLOCK_TYPES[name]
    weight = _weight(rows=16)
    importance = torch.rand(weight.shape[1], generator=torch.Generator().manual_seed(1)) + 0.1
    chosen = fit_statistics(kind, weight, importance)
    monkeypatch.setattr(blocks, "_chosen_integers", lambda kind, x, weights, fitted: fitted)
    rounded = fit_statistics(kind, weight, importance)
    x = weight.reshape(16, -1, kind.subs, kind.sub)
    weights = importance.reshape(-1, kind.subs, kind.sub).expand_as(x)
    errors = [blocks._sub_block_errors(kind, x, s, weights) for s in (chosen, rounded)]
    assert bool((errors[0] <= errors[1]).all()) and errors[0].sum() < errors[1].sum()


def test_an_importance_vector_moves_the_error_to_the_columns_that_matter_less():
    kind = BLOCK_TYPES["q4_k"]
    weight = _weight(columns=256)
    importance = torch.ones(256)
    importance[::2] = 100.0
    plain, weighted = (
        decode(kind, codes_for(kind, weight, s), s)
        for s in (fit_statistics(kind, weight), fit_statistics(kind, weight, importance))
    )

    def weighted_error(restored):
        return ((restored - weight).square() * importance).sum().item()

    assert weighted_error(weighted) < weighted_error(plain)


def test_rows_that_are_no_whole_number_of_super_blocks_take_llama_cpps_fallback():
    assert [type_for_row(name, 576).name for name in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")] == [
        "q4_0",
        "q4_0",
        "q5_0",
        "q5_1",
        "q8_0",
        "iq4_nl",
    ]
    assert type_for_row("q4_k", 1536).name == "q4_k"
    with pytest.raises(ConfigError, match="a row of 100 weights is not a whole number of Q4_K blocks"):
        type_for_row("q4_k", 100)
    with pytest.raises(ConfigError, match="choose from"):
        type_for_row("q4_k_m", 256)
