"""Rows of one forward that belong to sequences of their own (several requests' prompt pieces packed into one
forward: `leanlm.decoding.packed`). Inside `row_groups(lengths)` a linear that supports it (KbitLinear,
GemvLinear) computes each group of consecutive rows exactly as it computes those rows given alone: the kernel a
group takes is the one its own row count selects, and every product whose rounding could depend on the row count
(a GEMM, a bias over blocks) runs per group. What a group shares with the others is the work that does not round:
the weights read, and de-quantized, once."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from leanlm.kernels.kbit_gemm import per_group

_GROUPS: ContextVar[tuple[int, ...] | None] = ContextVar("leanlm_row_groups", default=None)


@contextmanager
def row_groups(lengths: Sequence[int]) -> Iterator[None]:
    """Forwards run inside give their linears sum(lengths) rows, in groups of `lengths` consecutive rows."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"row groups need one or more rows each, got {list(lengths)}")
    token = _GROUPS.set(tuple(lengths))
    try:
        yield
    finally:
        _GROUPS.reset(token)


def groups_of(rows: int) -> tuple[int, ...] | None:
    """The row groups of a linear's call on `rows` rows: None outside `row_groups` (or for a single group, which is
    a call alone); inside, a call on another row count is an error, since its rows could not be told apart."""
    groups = _GROUPS.get()
    if groups is None or len(groups) == 1:
        return None
    if sum(groups) != rows:
        raise ValueError(f"a linear got {rows} rows inside row groups of {sum(groups)}")
    return groups


def by_path(
    rows: torch.Tensor,
    groups: Sequence[int],
    path_of: Callable[[int], object],
    compute: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor],
) -> torch.Tensor:
    """`compute(rows, groups)` once for the groups that take one path alone (`path_of(group length)`: a kernel
    chosen by row count), the results put back in row order: rows (n, in) -> (n, out)."""
    paths = [path_of(length) for length in groups]
    if len(set(paths)) == 1:
        return compute(rows, tuple(groups))
    starts = [0]
    for length in groups[:-1]:
        starts.append(starts[-1] + length)
    out = None
    for path in dict.fromkeys(paths):
        chosen = [i for i, other in enumerate(paths) if other == path]
        index = torch.cat([torch.arange(starts[i], starts[i] + groups[i]) for i in chosen])
        part = compute(rows[index], tuple(groups[i] for i in chosen))
        if out is None:
            out = part.new_empty(rows.shape[0], part.shape[1])
        out[index] = part
    return out


def linear_by_group(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups) -> torch.Tensor:
    """`linear(x, weight, bias)`, each group's rows (`groups_of`) a product of their own; one product without."""
    if groups is None:
        return torch.nn.functional.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
    per_group(groups, rows, out, lambda part, into: into.copy_(torch.nn.functional.linear(part, weight, bias)))
    return out.reshape(*x.shape[:-1], weight.shape[0])
