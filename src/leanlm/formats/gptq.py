"""The GPTQ / SpQR weight solver (Dettmers' thesis ch. 4): quantize one weight matrix column by column, feeding each column's
error forward into the columns not yet quantized through the inverse Hessian of the layer's inputs.

One solver serves three methods:
- RTN: no error feedback (the Hessian replaced by the identity): plain group-wise min-max rounding.
- GPTQ: error feedback in lazy blocks, act-order permutation, group-wise float16 scales and zeros, on the
  min-max grid or the symmetric one (GGUF's Q4_0 / Q8_0 grid: `leanlm.formats.minmax`).
- SpQR: GPTQ plus small groups (beta1) whose scales and zeros are themselves min-max quantized (3 bits, in groups
  of beta2 consecutive rows with float16 second-level statistics), and unstructured outliers kept in 16 bits.

Algorithm 1 of the chapter is garbled by text extraction; this follows its prose and the reference semantics:
H = 2 X X^T (running mean over calibration tokens) + damping * mean(diag H) I; U = the upper Cholesky factor
of H^-1; a column's scaled error is (w - q(w)) / U_jj and is propagated as W[:, k] -= err * U[j, k] for k > j.
Group statistics are fitted when the solver reaches the group's first column (on the already-updated weights).
SpQR finds outliers twice: before fitting a group (weights whose leave-one-out removal cuts the group's scaled
error by more than tau) and after quantizing a column (scaled squared error above tau). tau is relative: it is
multiplied by mean_j(var(W[:, j]) / U_jj^2). Outliers keep their (updated) float value and pass no error on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from leanlm.errors import ConfigError
from leanlm.formats import gguf_blocks
from leanlm.formats.minmax import (
    GRIDS,
    dequantize_minmax,
    fit_minmax,
    quantize_minmax,
    search_symmetric,
)

FLOAT16_MAX = 65504.0


@dataclass(frozen=True)
class SolverSettings:
    bits: int = 4  # b
    group_size: int | None = 128  # beta1: input columns sharing one scale and zero per row (None: whole row)
    statistic_bits: int | None = None  # SpQR: bits of the quantized scales and zeros (3); None: float16
    statistic_group_size: int = 16  # beta2: consecutive rows whose quantized statistics share float16 ones
    outlier_threshold: float | None = None  # tau (relative); None: no outliers
    act_order: bool = True  # quantize inputs in order of decreasing diag(H)
    damping: float = 0.01  # lambda as a fraction of mean(diag H); SpQR's near-lossless recipe uses 1.0
    block_size: int = 128  # lazy-batch columns; changes only rounding, not the result
    error_feedback: bool = True  # False: RTN
    grid: str = "minmax"  # how a group's scale and zero are fitted: a key of leanlm.formats.minmax.GRIDS
    # Fit every group before solving, on consecutive columns of the original weight, so that act-order's
    # permutation leaves groups contiguous (what GGUF blocks and compressed-tensors groups are); else each group
    # is fitted when the solver reaches it, on the feedback-updated weights, in the permuted order.
    static_groups: bool = False
    # Symmetric grid: choose each group's scale by its squared error weighted by the Hessian's diagonal (llama.cpp's
    # importance-matrix search, `search_symmetric`) instead of the rounding rule's.
    scale_search: bool = False
    # Fraction by which the Hessian's off-diagonal terms are pulled toward zero before solving: 0 is GPTQ, 1 keeps
    # only the diagonal, where error feedback vanishes and GPTQ is RTN weighted by each column's importance.
    # Between the two, the feedback trusts the calibration text's input correlations less (they need not be the
    # evaluated text's: on SmolLM2, calibrated on fiction and scored on WikiText, 0.5 beats both ends).
    hessian_shrinkage: float = 0.0
    # A GGUF block type (a key of leanlm.formats.gguf_blocks.BLOCK_TYPES): the weight is stored as that type's
    # blocks, its statistics fitted before solving as the format stores them (static groups of its sub-blocks),
    # and `bits`, `group_size`, `grid` and the scale search are the type's own; a row that is no whole number of
    # its blocks takes llama.cpp's fallback type.
    block_type: str | None = None

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise ConfigError(f"bits must be between 2 and 8, got {self.bits}")
        if self.group_size is not None and self.group_size < 2:
            raise ConfigError(f"group size must be at least 2, got {self.group_size}")
        if self.statistic_bits is not None and not 2 <= self.statistic_bits <= 8:
            raise ConfigError(f"statistic bits must be between 2 and 8, got {self.statistic_bits}")
        if self.statistic_group_size < 1:
            raise ConfigError(f"statistic group size must be positive, got {self.statistic_group_size}")
        if self.outlier_threshold is not None and self.outlier_threshold <= 0:
            raise ConfigError(f"outlier threshold must be positive, got {self.outlier_threshold}")
        if self.damping < 0:
            raise ConfigError(f"damping must be 0 or more, got {self.damping}")
        if not 0 <= self.hessian_shrinkage <= 1:
            raise ConfigError(f"Hessian shrinkage must be between 0 and 1, got {self.hessian_shrinkage}")
        if self.grid not in GRIDS:
            raise ConfigError(f"grid must be one of {', '.join(GRIDS)}, got {self.grid!r}")
        if self.scale_search and self.grid != "symmetric" and self.block_type is None:
            raise ConfigError("scale search chooses the symmetric grid's scale (grid='symmetric')")
        if self.static_groups and self.outlier_threshold is not None:
            raise ConfigError("static groups are fitted once, before solving; SpQR's outlier search refits them")
        if self.block_type is not None:
            gguf_blocks.block_type(self.block_type)
            if self.statistic_bits is not None or self.outlier_threshold is not None:
                raise ConfigError("a GGUF block type fits its own statistics (no SpQR statistics or outliers)")
        if self.grid != "minmax" and (self.statistic_bits is not None or self.outlier_threshold is not None):
            raise ConfigError(
                f"the {self.grid} grid keeps float16 statistics and no outliers (SpQR's quantized "
                "statistics and outlier search are min-max only)"
            )


@dataclass
class QuantizedStatistic:
    """One group's scale or zero for every row: float16 values, or codes + second-level float16 (scale, zero)."""

    values: torch.Tensor  # (rows,) float32: what the solver computed with (the stored form de-quantized)
    codes: torch.Tensor | None = None  # (rows,) uint8, statistic_bits each
    second_level: torch.Tensor | None = None  # (ceil(rows / beta2), 2) float16: scale, zero of each row group


@dataclass
class SolvedWeight:
    """The solver's output, in the permuted column order."""

    codes: torch.Tensor  # (rows, columns) uint8
    scales: list[QuantizedStatistic]  # one per column group
    zeros: list[QuantizedStatistic]
    permutation: torch.Tensor | None  # (columns,) int64: position p holds original column permutation[p]
    outlier_mask: torch.Tensor  # (rows, columns) bool
    outlier_residuals: torch.Tensor  # (rows, columns) float32: kept value minus the dense de-quantized one
    weight: torch.Tensor  # (rows, columns) float32, original column order: the weight the stored form encodes
    # GGUF block types: the type the rows take and the statistics their blocks store beside the codes
    blocks: tuple[gguf_blocks.BlockType, gguf_blocks.BlockStatistics] | None = None


def _to_float16(values: torch.Tensor) -> torch.Tensor:
    return values.clamp(-FLOAT16_MAX, FLOAT16_MAX).half().float()


def quantize_statistic(values: torch.Tensor, settings: SolverSettings) -> QuantizedStatistic:
    """A group's per-row scales (or zeros) as stored: float16, or min-max codes in groups of beta2 rows."""
    if settings.statistic_bits is None:
        return QuantizedStatistic(_to_float16(values))
    rows, size = values.numel(), settings.statistic_group_size
    padded = torch.cat([values, values[-1:].expand((-rows) % size)])  # a short last row group repeats its end
    grouped = padded.reshape(-1, size)
    scale, zero = fit_minmax(grouped, settings.statistic_bits)
    scale, zero = _to_float16(scale), _to_float16(zero)
    codes = quantize_minmax(grouped, scale, zero, settings.statistic_bits)
    restored = dequantize_minmax(codes, scale, zero).reshape(-1)[:rows]
    return QuantizedStatistic(restored, codes.reshape(-1)[:rows].to(torch.uint8), torch.stack([scale, zero], 1).half())


def _leave_one_out_outliers(group: torch.Tensor, diagonal: torch.Tensor, bits: int, threshold: float) -> torch.Tensor:
    """Weights whose exclusion from their row's group statistics cuts the group's scaled squared error by more
    than `threshold` (the error removed includes the weight's own). Leaving out a weight that is neither its row's
    smallest nor its largest keeps the row's min-max fit, so the cut is that weight's own error; only the smallest
    and the largest are refitted without them."""
    columns = group.shape[1]
    if columns < 3:
        return torch.zeros_like(group, dtype=torch.bool)

    def scaled_errors(values: torch.Tensor, divisors: torch.Tensor) -> torch.Tensor:
        """((x_hat - x) / divisor)^2 of min-max round trips along the last dimension, worked in place."""
        scale, zero = fit_minmax(values, bits)
        error = quantize_minmax(values, scale, zero, bits).sub_(zero[..., None]).mul_(scale[..., None]).sub_(values)
        return error.div_(divisors).square_()

    cut = scaled_errors(group, diagonal)
    base = cut.sum(dim=1, keepdim=True)
    positions = torch.arange(columns - 1)
    for extreme in (group.argmin(dim=1, keepdim=True), group.argmax(dim=1, keepdim=True)):
        others = positions + (positions >= extreme)  # (rows, columns - 1): every column but the row's extreme
        left = scaled_errors(group.gather(1, others), diagonal[others]).sum(dim=1, keepdim=True)
        cut.scatter_(1, extreme, base - left)
    return cut > threshold


def _group_statistics(
    group: torch.Tensor, outliers: torch.Tensor, settings: SolverSettings, importance: torch.Tensor | None = None
) -> tuple[QuantizedStatistic, QuantizedStatistic]:
    """Statistics of a group, fitted without its outliers (replaced by the mean of the row's others);
    `importance` (one weight per column: the Hessian's diagonal) weighs the scale search."""
    if outliers.any():
        kept = (~outliers).float()
        row_mean = (group * kept).sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True).clamp(min=1)
        group = torch.where(outliers, row_mean, group)
    scale, zero = _fit_grid(group, settings, importance)
    return quantize_statistic(scale, settings), quantize_statistic(zero, settings)


def _fit_grid(
    values: torch.Tensor, settings: SolverSettings, importance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of the settings' grid along the last dimension: searched (weighted by `importance`) or by the
    grid's rule."""
    if settings.scale_search:
        return search_symmetric(values, settings.bits, importance)
    return GRIDS[settings.grid](values, settings.bits)


def _static_group_statistics(
    weight: torch.Tensor, group: int, settings: SolverSettings, importance: torch.Tensor
) -> list[tuple[QuantizedStatistic, QuantizedStatistic]]:
    """Every group's statistics, fitted before solving as `_group_statistics` fits one (no outliers): the whole
    groups in one call on a (rows, groups, group) view, a shorter last group alone."""
    rows, columns = weight.shape
    whole = columns // group * group
    fitted = []
    if whole:
        scale, zero = _fit_grid(
            weight[:, :whole].reshape(rows, -1, group), settings, importance[:whole].reshape(-1, group)
        )
        fitted = [(scale[:, g], zero[:, g]) for g in range(scale.shape[1])]
    if whole < columns:
        fitted.append(_fit_grid(weight[:, whole:], settings, importance[whole:]))
    return [(quantize_statistic(scale, settings), quantize_statistic(zero, settings)) for scale, zero in fitted]


def inverse_hessian_factor(hessian: torch.Tensor, damping: float, overwrite: bool = False) -> torch.Tensor:
    """U, the upper Cholesky factor of (H + damping * mean(diag H) I)^-1 (`overwrite`: H is damped in place)."""
    damped = hessian if overwrite else hessian.clone()
    damped.diagonal().add_(damping * damped.diagonal().mean())
    try:
        lower = torch.linalg.cholesky(damped)
    except torch.linalg.LinAlgError as error:
        raise ConfigError(
            f"the Hessian is not positive definite even with damping {damping}; raise the damping "
            "or give more calibration samples"
        ) from error
    del damped
    inverse = torch.cholesky_inverse(lower)
    del lower  # at most three in_features^2 matrices at once: 2.5 GB for an 8B model's down_proj
    return torch.linalg.cholesky(inverse, upper=True)


def _round_to_nearest(
    W: torch.Tensor, group: int, settings: SolverSettings, importance: torch.Tensor | None = None
) -> SolvedWeight:
    """RTN without outliers: what the column loop of `solve` gives with no feedback, one group at a time
    (`importance`: one weight per column for the scale search)."""
    rows, columns = W.shape
    codes = torch.zeros(rows, columns, dtype=torch.uint8)
    scales, zeros = [], []
    for start in range(0, columns, group):
        values = W[:, start : start + group]
        weights = None if importance is None else importance[start : start + group]
        scale, zero = _group_statistics(values, torch.zeros_like(values, dtype=torch.bool), settings, weights)
        q = quantize_minmax(values, scale.values, zero.values, settings.bits)
        codes[:, start : start + group] = q.to(torch.uint8)
        W[:, start : start + group] = dequantize_minmax(q, scale.values, zero.values)
        scales.append(scale)
        zeros.append(zero)
    nothing = torch.zeros(rows, columns, dtype=torch.bool)
    return SolvedWeight(codes, scales, zeros, None, nothing, torch.zeros(rows, columns), W)


def solve(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    settings: SolverSettings,
    *,
    overwrite_hessian: bool = False,
    importance: torch.Tensor | None = None,
) -> SolvedWeight:
    """Quantize `weight` (out, in) given the Hessian of its inputs (in, in); None or RTN settings: no feedback.
    `overwrite_hessian`: the caller is done with `hessian` (a float32 tensor), which is then worked on in place
    instead of copied (an 8B model's down_proj has a 0.8 GB one). `importance` (RTN only): the Hessian's diagonal
    alone, one weight per input column for the scale search (llama.cpp's importance matrix)."""
    W = weight.detach().float().clone()
    rows, columns = W.shape
    if settings.error_feedback and hessian is None:
        raise ConfigError("GPTQ and SpQR need the Hessian of the layer's inputs (calibrate first)")
    if importance is not None:
        if settings.error_feedback or settings.outlier_threshold is not None:
            raise ConfigError("an importance vector weighs RTN's scale search; GPTQ and SpQR take the Hessian")
        if importance.shape != (columns,):
            raise ConfigError(
                f"importance of shape {tuple(importance.shape)} does not fit a weight with {columns} input columns"
            )
    kind = None
    if settings.block_type is not None:
        kind = gguf_blocks.type_for_row(settings.block_type, columns)
        settings = replace(settings, bits=kind.bits, group_size=kind.sub, static_groups=True)
    if kind is not None and not settings.error_feedback:  # RTN on the block type's grid
        statistics = gguf_blocks.fit_statistics(kind, W, importance)
        codes = gguf_blocks.codes_for(kind, W, statistics)
        nothing = torch.zeros(rows, columns, dtype=torch.bool)
        restored = gguf_blocks.decode(kind, codes, statistics)
        return SolvedWeight(codes, [], [], None, nothing, torch.zeros(rows, columns), restored, (kind, statistics))
    if not settings.error_feedback and settings.outlier_threshold is None:  # RTN: no Hessian, no factor
        return _round_to_nearest(W, settings.group_size or columns, settings, importance)
    if not settings.error_feedback:
        H = torch.eye(columns)
    else:
        in_place = overwrite_hessian and hessian.dtype == torch.float32 and hessian.is_contiguous()
        H = hessian.detach() if in_place else hessian.detach().float().clone()
    if H.shape != (columns, columns):
        raise ConfigError(f"Hessian of shape {tuple(H.shape)} does not fit a weight with {columns} input columns")
    # Inputs never active in the calibration text: a unit diagonal keeps H invertible. GPTQ rounds their weights as
    # they are (the text gives no reason to change them, other text may use them, and a weight on the grid stays
    # exact) and, their row and column of H being zero, they feed no error forward and receive none. SpQR zeroes
    # them, so that they are never taken for outliers.
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    if settings.outlier_threshold is not None:
        W[:, dead] = 0.0
    if settings.hessian_shrinkage:
        diagonal = H.diagonal().clone()
        H.mul_(1.0 - settings.hessian_shrinkage).diagonal().copy_(diagonal)
    group = settings.group_size or columns
    static = None
    fitted = None
    if kind is not None:  # every sub-block's statistics, fitted as the block type stores them
        fitted = gguf_blocks.fit_statistics(kind, W, H.diagonal())
        scale, zero = gguf_blocks.zero_points(kind, fitted)
        static = [(QuantizedStatistic(scale[:, g]), QuantizedStatistic(zero[:, g])) for g in range(scale.shape[1])]
    elif settings.static_groups and settings.error_feedback:
        static = _static_group_statistics(W, group, settings, H.diagonal())
    permutation = None
    if settings.act_order and settings.error_feedback:
        permutation = torch.argsort(H.diagonal(), descending=True)
        W = W[:, permutation]
        rows_permuted = torch.index_select(H, 0, permutation)
        torch.index_select(rows_permuted, 1, permutation, out=H)  # H[permutation][:, permutation], in H's memory
        del rows_permuted
    h_diagonal = H.diagonal().clone()  # what the group statistics weigh columns by; H itself is damped next
    U = inverse_hessian_factor(H, settings.damping, overwrite=True) if settings.error_feedback else torch.eye(columns)
    del H
    diagonal = U.diagonal().clone()
    threshold = None
    if settings.outlier_threshold is not None:
        threshold = settings.outlier_threshold * (W.var(dim=0) / diagonal.square()).mean().item()

    # Every group must start on a block boundary or lie inside one block, so that it is fitted on columns that
    # have already received all earlier columns' feedback.
    block = max(group, settings.block_size // group * group) if group <= settings.block_size else group
    codes = torch.zeros(rows, columns, dtype=torch.uint8)
    outliers = torch.zeros(rows, columns, dtype=torch.bool)
    residuals = torch.zeros(rows, columns)
    scales: list[QuantizedStatistic] = []
    zeros: list[QuantizedStatistic] = []
    for start in range(0, columns, block):
        end = min(start + block, columns)
        # The lazy block is worked on transposed (column j of W is row j - start of `lazy`), so that each column
        # and each feedback update is contiguous memory: W's columns are a whole row apart (4096 x 4 bytes for an
        # 8B model), which made the column loop several times slower. The arithmetic is element for element the
        # same, so the result is too.
        lazy = W[:, start:end].T.contiguous()
        errors = torch.empty(end - start, rows)
        feedback = torch.empty(end - start, rows)  # each column's update of the block's later columns, in place
        block_codes = torch.empty(end - start, rows, dtype=torch.uint8)
        for j in range(start, end):
            local = j - start
            if static is not None:  # the group of the column's original position, fitted before solving
                scale, zero = static[(int(permutation[j]) if permutation is not None else j) // group]
            elif j % group == 0:
                stop = min(j + group, columns)
                values = lazy[local : stop - start].T.contiguous()
                if threshold is not None:
                    outliers[:, j:stop] |= _leave_one_out_outliers(values, diagonal[j:stop], settings.bits, threshold)
                scale, zero = _group_statistics(values, outliers[:, j:stop], settings, h_diagonal[j:stop])
                scales.append(scale)
                zeros.append(zero)
            w = lazy[local]
            if kind is not None and kind.levels is not None:  # a non-linear grid: the nearest of its levels
                q, kept = gguf_blocks.nearest_levels(kind, w, scale.values)
            else:
                q = quantize_minmax(w[:, None], scale.values, zero.values, settings.bits)[:, 0]
                kept = scale.values * (q - zero.values)
            block_codes[local] = q
            if threshold is not None:
                outliers[:, j] |= ((w - kept) / diagonal[j]).square() > threshold
                residuals[:, j] = torch.where(outliers[:, j], _to_float16(w - kept), 0.0)
                kept = torch.where(outliers[:, j], kept + residuals[:, j], kept)
            error = torch.div(w - kept, diagonal[j], out=errors[local])
            lazy[local] = kept
            later = feedback[: end - j - 1]
            lazy[local + 1 :] -= torch.mul(U[j, j + 1 : end][:, None], error[None, :], out=later)
        W[:, start:end] = lazy.T
        codes[:, start:end] = block_codes.T
        W[:, end:] -= errors.T.contiguous() @ U[start:end, end:]
    if permutation is not None:
        W = _original_order(W, permutation)
    if static is not None:  # groups already lie on the original columns: store the codes there, unpermuted
        scales, zeros = [scale for scale, _ in static], [zero for _, zero in static]
        if permutation is not None:
            codes, outliers, residuals = (_original_order(t, permutation) for t in (codes, outliers, residuals))
            permutation = None
    if kind is not None:
        return SolvedWeight(
            codes, [], [], None, outliers, residuals, gguf_blocks.decode(kind, codes, fitted), (kind, fitted)
        )
    return SolvedWeight(codes, scales, zeros, permutation, outliers, residuals, W)


def _original_order(permuted: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
    restored = torch.empty_like(permuted)
    restored[:, permutation] = permuted
    return restored
