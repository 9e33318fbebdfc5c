from dataclasses import replace

import pytest
import torch

from leanlm.errors import ConfigError
from leanlm.formats.gptq import SolverSettings, _leave_one_out_outliers, solve
from leanlm.formats.minmax import (
    dequantize_minmax,
    fit_minmax,
    fit_symmetric,
    quantize_minmax,
    round_trip_minmax,
    row_slices,
    search_symmetric,
)
from leanlm.kernels.kbit_gemm import SMALL_M, avx2_available
from leanlm.nn import SpQRLinear


def _layer(rows=96, columns=256, tokens=2048, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator)
    inputs = torch.randn(tokens, columns, generator=generator) * torch.linspace(0.2, 3.0, columns)
    inputs[:, 7] *= 8  # one outlier feature, as LLM activations have
    return weight, inputs, 2 * inputs.T @ inputs / tokens


def _output_error(weight, inputs, quantized):
    return ((inputs @ (weight - quantized).T).square().mean() / (inputs @ weight.T).square().mean()).item()


RTN = SolverSettings(bits=3, group_size=16, act_order=False, error_feedback=False)
GPTQ = SolverSettings(bits=3, group_size=16)
SPQR = SolverSettings(
    bits=3, group_size=16, statistic_bits=3, statistic_group_size=16, outlier_threshold=0.2, damping=1.0
)


def test_rtn_is_group_wise_min_max_rounding():
    weight, _, _ = _layer()
    solved = solve(weight, None, RTN)
    groups = weight.reshape(96, 16, 16)
    scale, zero = (s.half().float() for s in fit_minmax(groups, 3))  # statistics are stored in float16
    expected = dequantize_minmax(quantize_minmax(groups, scale, zero, 3), scale, zero).reshape(96, 256)
    torch.testing.assert_close(solved.weight, expected, rtol=0, atol=0)
    assert (solved.weight - round_trip_minmax(groups, 3).reshape(96, 256)).abs().mean() < 1e-3


def test_error_feedback_lowers_the_output_error_and_outliers_lower_it_further():
    weight, inputs, hessian = _layer()
    errors = {
        name: _output_error(weight, inputs, solve(weight, hessian, settings).weight)
        for name, settings in {"rtn": RTN, "gptq": GPTQ, "spqr": SPQR}.items()
    }
    assert errors["gptq"] < 0.95 * errors["rtn"]
    assert errors["spqr"] < errors["gptq"]


def _leave_one_out_cuts(group, diagonal, bits):
    """The oracle: for every weight, the group's scaled squared error less that of its row refitted without it."""

    def scaled_errors(values, divisors):
        return ((round_trip_minmax(values, bits) - values) / divisors).square()

    columns = group.shape[1]
    others = torch.tensor([[c for c in range(columns) if c != left_out] for left_out in range(columns)])
    return scaled_errors(group, diagonal).sum(dim=1, keepdim=True) - scaled_errors(
        group[:, others], diagonal[others]
    ).sum(dim=2)


@pytest.mark.parametrize("share", [0.5, 0.1, 0.01])
def test_spqr_outliers_are_the_weights_whose_leaving_out_cuts_the_error_past_the_threshold(share):
    generator = torch.Generator().manual_seed(0)
    group = torch.randn(512, 16, generator=generator)
    group[torch.rand(group.shape, generator=generator) < 0.01] *= 8
    group[:4] = 1.0  # flat rows
    group[4:8, :8] = 2.0  # a repeated smallest or largest value
    diagonal = torch.rand(16, generator=generator) + 0.5
    cuts = _leave_one_out_cuts(group, diagonal, 3)
    threshold = float(cuts.flatten().quantile(1 - share))
    assert torch.equal(_leave_one_out_outliers(group, diagonal, 3, threshold), cuts > threshold)


def test_lazy_blocks_do_not_change_the_result():
    weight, _, hessian = _layer()
    one = solve(weight, hessian, SolverSettings(bits=4, group_size=32, block_size=32)).weight
    many = solve(weight, hessian, SolverSettings(bits=4, group_size=32, block_size=256)).weight
    torch.testing.assert_close(one, many, rtol=0, atol=1e-4)


SPQR4 = SolverSettings(bits=4, group_size=16, statistic_bits=3, outlier_threshold=0.2, damping=1.0)


SYMMETRIC = SolverSettings(bits=4, group_size=32, act_order=False, grid="symmetric")


def test_the_symmetric_grid_puts_zero_at_the_middle_code_and_the_largest_value_on_the_end_code():
    weight, inputs, hessian = _layer()
    rtn = SolverSettings(bits=4, group_size=32, act_order=False, error_feedback=False, grid="symmetric")
    solved = solve(weight, None, rtn)
    groups = weight.reshape(96, 8, 32)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
    scales = torch.stack([s.values for s in solved.scales], dim=1)
    torch.testing.assert_close(scales, (extreme / -8).half().float(), rtol=0, atol=0)  # llama.cpp's d, in fp16
    assert all(bool((z.values == 8).all()) for z in solved.zeros)
    assert solved.codes.min() == 0 and solved.codes.max() == 15  # all 16 codes in use
    torch.testing.assert_close(
        solved.weight.reshape(96, 8, 32),
        scales[..., None] * (solved.codes.reshape(96, 8, 32).float() - 8),
        rtol=0,
        atol=0,
    )
    # Error feedback works on this grid as on min-max (on this layer it gains as little as there: 4-5%).
    assert _output_error(weight, inputs, solve(weight, hessian, SYMMETRIC).weight) < 0.97 * _output_error(
        weight, inputs, solved.weight
    )


def _searched_scale_oracle(x, bits, weights, steps=9):
    """The search as its docstring states it, one candidate at a time over the whole tensor."""
    half = 2 ** (bits - 1)
    extreme = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    safe = torch.where(extreme == 0, 1.0, extreme)
    best_scale = extreme.squeeze(-1) / -half
    best_error = torch.full_like(best_scale, float("inf"))
    for step in range(-steps, steps + 1):
        codes = torch.clamp(torch.round(x * (-(half + 0.1 * step) / safe)), -half, half - 1)
        denominator = (weights * codes.square()).sum(dim=-1)
        scale = (weights * x * codes).sum(dim=-1) / torch.where(denominator > 0, denominator, 1.0)
        error = (weights * (x - scale[..., None] * codes).square()).sum(dim=-1)
        better = error < best_error
        best_scale, best_error = torch.where(better, scale, best_scale), torch.where(better, error, best_error)
    return best_scale


def test_row_slices_cover_every_row_once_in_pieces_of_about_the_weights_asked():
    assert [(rows.start, rows.stop) for rows in row_slices(7, 10, 30)] == [(0, 3), (3, 6), (6, 7)]
    assert len(row_slices(3, 100, 10)) == 3  # never less than a row
    assert row_slices(4, 10, 1000) == [slice(0, 4)]
    assert row_slices(0, 10, 30) == []


@pytest.mark.parametrize("chunk", [None, 7 * 32 * 8])
def test_the_scale_search_is_its_oracle_bit_for_bit(monkeypatch, chunk):
    from leanlm.formats import minmax

    if chunk is not None:  # a few rows at a time, the last chunk shorter
        monkeypatch.setattr(minmax, "SEARCH_WEIGHTS", chunk)
    generator = torch.Generator().manual_seed(3)
    groups = torch.randn(96, 8, 32, generator=generator) * torch.rand(96, 8, 1, generator=generator)
    groups[5, 2] = 0  # an all-zero group: scale 0
    importance = torch.rand(8, 32, generator=generator) + 0.1
    for bits, weights in ((4, importance), (8, importance), (4, None)):
        scale, zero = search_symmetric(groups, bits, weights)
        assert torch.equal(zero, torch.full_like(zero, 2 ** (bits - 1)))
        assert torch.equal(scale, _searched_scale_oracle(groups, bits, torch.ones(32) if weights is None else weights))
        assert scale[5, 2] == 0


def test_the_scale_search_never_does_worse_than_the_rule_and_gptq_gains_from_it():
    weight, inputs, hessian = _layer()
    groups = weight.reshape(96, 8, 32)
    importance = hessian.diagonal().reshape(8, 32)[None]  # each group's own columns
    rule_scale, zero = fit_symmetric(groups, 4)
    searched_scale, searched_zero = search_symmetric(groups, 4, importance)
    assert torch.equal(searched_zero, zero)

    def weighted_error(scale):
        restored = dequantize_minmax(quantize_minmax(groups, scale, zero, 4), scale, zero)
        return (importance * (groups - restored).square()).sum(-1)

    assert bool((weighted_error(searched_scale) <= weighted_error(rule_scale) * (1 + 1e-5)).all())
    searched = SolverSettings(bits=4, group_size=32, grid="symmetric", static_groups=True, scale_search=True)
    plain = SolverSettings(bits=4, group_size=32, grid="symmetric", static_groups=True)
    assert _output_error(weight, inputs, solve(weight, hessian, searched).weight) < 0.97 * _output_error(
        weight, inputs, solve(weight, hessian, plain).weight
    )


def test_rtn_weighs_its_scale_search_by_an_importance_vector_and_lowers_the_output_error():
    weight, inputs, _ = _layer()
    inputs = inputs * torch.randn(256, generator=torch.Generator().manual_seed(2)).exp()  # columns of mixed scale
    importance = inputs.square().mean(dim=0)  # within each group too, as real layers' inputs are
    searched = SolverSettings(
        bits=4, group_size=32, act_order=False, error_feedback=False, grid="symmetric", scale_search=True
    )
    hessian = 2 * inputs.T @ inputs / inputs.shape[0]
    weighted = solve(weight, None, searched, importance=importance)
    expected, _ = search_symmetric(weight.reshape(96, 8, 32), 4, importance.reshape(8, 32)[None])
    torch.testing.assert_close(
        torch.stack([s.values for s in weighted.scales], 1), expected.half().float(), rtol=0, atol=0
    )
    unweighted = solve(weight, None, searched)
    assert _output_error(weight, inputs, weighted.weight) < 0.97 * _output_error(weight, inputs, unweighted.weight)
    with pytest.raises(ConfigError, match="does not fit a weight with 256 input columns"):
        solve(weight, None, searched, importance=importance[:32])
    with pytest.raises(ConfigError, match="GPTQ and SpQR take the Hessian"):
        solve(weight, hessian, SYMMETRIC, importance=importance)


def test_hessian_shrinkage_moves_gptq_from_error_feedback_to_importance_weighted_rtn():
    weight, inputs, hessian = _layer()
    gptq = SolverSettings(bits=4, group_size=32, grid="symmetric", scale_search=True, static_groups=True)
    weighted_rtn = solve(
        weight, None, replace(gptq, act_order=False, error_feedback=False), importance=hessian.diagonal()
    )
    diagonal_only = solve(weight, hessian, replace(gptq, hessian_shrinkage=1.0))
    torch.testing.assert_close(diagonal_only.weight, weighted_rtn.weight, rtol=0, atol=0)
    errors = [
        _output_error(weight, inputs, solve(weight, hessian, replace(gptq, hessian_shrinkage=amount)).weight)
        for amount in (0.0, 0.5, 1.0)
    ]
    # On the calibration inputs themselves feedback can only help: shrinking it gives up some of that gain.
    assert errors[0] < errors[1] < errors[2]
    with pytest.raises(ConfigError, match="Hessian shrinkage must be between 0 and 1, got 1.5"):
        replace(gptq, hessian_shrinkage=1.5)


def test_static_groups_keep_act_order_groups_on_consecutive_columns():
    weight, inputs, hessian = _layer()
    static = SolverSettings(bits=4, group_size=32, grid="symmetric", static_groups=True)
    solved = solve(weight, hessian, static)
    assert solved.permutation is None  # stored in the original column order
    groups = weight.reshape(96, 8, 32)  # each group's scale is fitted on the original weight's own columns
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(
        torch.stack([s.values for s in solved.scales], 1), (extreme / -8).half().float(), rtol=0, atol=0
    )
    in_order = _output_error(weight, inputs, solve(weight, hessian, SYMMETRIC).weight)
    assert _output_error(weight, inputs, solved.weight) < in_order  # act-order still pays


@pytest.mark.parametrize("columns", [256, 100])  # eight whole groups; three and a short one
def test_static_groups_search_each_groups_scale_on_its_own_columns_weighted_by_the_hessian(columns):
    weight, _, hessian = _layer(columns=columns)
    settings = SolverSettings(bits=4, group_size=32, grid="symmetric", static_groups=True, scale_search=True)
    solved = solve(weight, hessian, settings)
    expected = [
        search_symmetric(weight[:, start : start + 32], 4, hessian.diagonal()[start : start + 32])[0]
        for start in range(0, columns, 32)
    ]
    assert len(solved.scales) == len(expected)
    for stored, scale in zip(solved.scales, expected):
        assert torch.equal(stored.values, scale.half().float())


def _assert_kernel_close(actual, expected, int8_activations):
    """At decode sizes (M <= SMALL_M) the kernel quantizes x to int8 where its blocks are multiples of 64: within
    about 3% of the float product (SQNR > 25 dB; 30-38 dB measured: GPTQ's codes 0..15 are all positive, so the
    rounding of x meets their mean before the offset cancels it); otherwise equal up to float rounding."""
    if int8_activations:
        assert 20 * torch.log10(expected.norm() / (actual - expected).norm()) > 25
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "settings",
    [
        RTN,
        GPTQ,
        SPQR,
        SPQR4,
        SolverSettings(bits=4, group_size=None),
        SYMMETRIC,
        SolverSettings(bits=4, group_size=32, grid="symmetric", static_groups=True),
        SolverSettings(bits=4, group_size=32, grid="symmetric", scale_search=True),
    ],
    ids=["rtn", "gptq", "spqr", "spqr-4bit", "per-row", "symmetric", "static-groups", "scale-search"],
)
def test_stored_form_reproduces_the_solver_and_counts_every_bit(settings):
    weight, _, hessian = _layer()
    solved = solve(weight, hessian, settings)
    module = SpQRLinear.from_solved(solved, settings, None)
    torch.testing.assert_close(module.dequantized_weight(), solved.weight, rtol=0, atol=0)
    module.backend = "reference"
    for m in (1, 7, 40):  # the kernel's register path (M <= 16) and its tile path
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        reference = module(x)
        # 3 bits: the int8 kernel at decode sizes (SpQR's blocks of 16 too), the de-quantized weight above them
        for backend in ("dense_sparse", "kernel") if module.bits in (3, 4) and avx2_available() else ("dense_sparse",):
            module.backend = backend
            _assert_kernel_close(module(x), reference, int8_activations=backend == "kernel" and m <= SMALL_M)
        module.backend = "reference"
    assert module.code_layout == ("planes" if module.bits == 3 else "stream")
    state_bits = sum(t.numel() * t.element_size() * 8 for name, t in module.state_dict().items())
    assert module.bits_per_weight() == pytest.approx(state_bits / weight.numel())


@pytest.mark.skipif(not avx2_available(), reason="the 4-bit kernel needs AVX2")
def test_rows_that_end_on_a_partial_group_still_run_the_kernel():
    """SmolLM2's 576 columns in groups of 128 end on a group of 64 (here 320 = 2.5 x 128): the kernel runs blocks
    of gcd(128, 320) = 64 columns with their group's scale, instead of de-quantizing the weight every forward."""
    weight, _, hessian = _layer(columns=320)
    settings = SolverSettings(bits=4, group_size=128)
    module = SpQRLinear.from_solved(solve(weight, hessian, settings), settings, torch.randn(96))
    assert module.kernel_block == 64 and module._resolve_backend() == "kernel"
    for m in (1, 7, 40):
        x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m))
        _assert_kernel_close(module(x), x @ module.dequantized_weight().T + module.bias, int8_activations=m <= SMALL_M)


def test_runtime_bytes_are_what_a_forward_leaves_beside_the_stored_buffers_until_the_module_moves():
    """What the planner counts for a running SpQR layer: the kernel's constants and the outliers' sparse form."""
    weight, _, hessian = _layer()
    module = SpQRLinear.from_solved(solve(weight, hessian, SPQR), SPQR, None)
    assert module.outlier_count > 0
    module(torch.randn(1, 256))
    module(torch.randn(40, 256))
    sparse = module._outliers()
    held = sum(t.nbytes for t in (sparse.row_offsets, sparse.columns, sparse.values, sparse.rows))
    assert sparse.matrix.values().data_ptr() == sparse.values.data_ptr()  # the CSR matrix shares them
    assert sparse.matrix.col_indices().data_ptr() == sparse.columns.data_ptr()
    if module._kernel_inputs is not None:
        held += sum(t.nbytes for t in module._kernel_inputs)
    assert module.runtime_bytes() == held
    module.to("meta")  # as a finished block of an out-of-core run is emptied: nothing derived is kept
    assert module._kernel_inputs is None and module._sparse is None


def test_spqr_account_matches_the_chapter_formula():
    """b + (b_s + b_z)/beta1 + 2 * 32/(beta1 beta2) + 32 r_o, plus what the formula leaves out: the int16
    permutation, the int32 CSR row offsets and the outliers' 16-bit column indices (counted in the 32)."""
    weight, _, hessian = _layer()
    module = SpQRLinear.from_solved(solve(weight, hessian, SPQR), SPQR, None)
    rows, columns = weight.shape
    rate = module.outlier_count / weight.numel()
    formula = 3 + 6 / 16 + 2 * 32 / (16 * 16) + 32 * rate
    extra = (16 * columns + 32 * (rows + 1)) / weight.numel()
    assert module.bits_per_weight() == pytest.approx(formula + extra)
    assert 0 < rate < 0.05


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="group size must be at least 2"):
        SolverSettings(group_size=1)
    with pytest.raises(ConfigError, match="need the Hessian"):
        solve(torch.randn(4, 8), None, GPTQ)
    with pytest.raises(ConfigError, match="does not fit"):
        solve(torch.randn(4, 8), torch.eye(6), GPTQ)
    with pytest.raises(ConfigError, match="grid must be one of minmax, symmetric"):
        SolverSettings(grid="nf4")
    with pytest.raises(ConfigError, match="scale search chooses the symmetric grid"):
        SolverSettings(scale_search=True)
    with pytest.raises(ConfigError, match="static groups are fitted once"):
        SolverSettings(static_groups=True, outlier_threshold=0.2)
    with pytest.raises(ConfigError, match="min-max only"):
        SolverSettings(grid="symmetric", statistic_bits=3)


def test_gptq_keeps_a_weight_on_its_grid_exactly_even_where_an_input_is_never_active():
    """A weight already on Q5_0's grid comes back unchanged, dead input columns (a zero row and column of the
    Hessian, as Gemma's norms with weight -1 make) included: nothing re-rounds the blocks they share."""
    from leanlm.formats.gguf_blocks import BLOCK_TYPES, codes_for, decode, fit_statistics

    kind = BLOCK_TYPES["q5_0"]
    weight, inputs, _ = _layer(rows=32, columns=128)
    weight[:, 5] *= 4  # the dead column holds its blocks' largest weights
    on_grid = decode(kind, codes_for(kind, weight, fit_statistics(kind, weight)), fit_statistics(kind, weight))
    inputs[:, 5] = 0.0
    hessian = 2 * inputs.T @ inputs / inputs.shape[0]
    solved = solve(on_grid, hessian, replace(GPTQ, block_type="q5_0", hessian_shrinkage=0.5))
    assert torch.equal(solved.weight, on_grid)
