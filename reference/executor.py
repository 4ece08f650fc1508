"""Run a plan for every rank in one process.

Each rank's *store* is a list of ``(box, tensor)`` pieces in canonical dim order. The
executor loads the src pieces, applies the plan's steps (reduce, exchange, gather) by
copying boxes between stores, then assembles every dst rank's local tensor. It decides
nothing: every box it moves is named by the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product
from typing import Any

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import (
    Store,
    assemble,
    box_slices,
    from_canonical,
    infer_sizes,
    take,
    to_canonical,
)
from mimo_fx.plan import (
    AllReduce,
    Exchange,
    Gather,
    Plan,
    Reduce,
    ReduceScatter,
    backward_plan,
    plan,
    size_arguments,
)
from mimo_fx.regions import Tiling
from mimo_fx.rows import is_row_layout
from mimo_fx.vjp import apply

__all__ = ["ReferenceExecutor", "redistribute"]

class ReferenceExecutor:
    """Executes plans on a tuple of pieces, one per src holder, in rank order."""

    def run(self, plan: Plan, tensors: tuple[torch.Tensor, ...],
            env: dict | None = None) -> tuple[torch.Tensor, ...]:
        src_tiling = Tiling.of(plan.src, plan.dims, dict(plan.sizes))
        stores: dict[int, Store] = {}
        for rank, local in zip(plan.src.holders, tensors):
            canon = to_canonical(local, plan.src, src_tiling, rank)
            segments = src_tiling.segments(rank)
            stores[rank] = [(box, canon[box_slices(segments, box)])
                            for box in product(*segments)]
        run: dict[type, Callable[[Any, dict[int, Store]], None]] = {
            ReduceScatter: self._reduce_scatter, AllReduce: self._all_reduce,
            Gather: self._gather, Exchange: self._exchange}
        for step in plan.steps:  # one method per step class
            run[type(step)](step, stores)
        dtype = tensors[0].dtype
        return tuple(self._assemble(plan, rank, stores.get(rank, []), dtype)
                     for rank in plan.dst.holders)

    @staticmethod
    def _sums(step: Reduce, stores: dict[int, Store]):
        for group, region, parts in zip(step.groups, step.regions, step.shares):
            summed = [torch.stack([take(stores[r], box) for r in group]).sum(0)
                      for box in region]
            yield group, parts, list(zip(region, summed))

    @classmethod
    def _reduce_scatter(cls, step: ReduceScatter, stores: dict[int, Store]) -> None:
        for group, parts, full in cls._sums(step, stores):
            for rank, part in zip(group, parts):
                stores[rank] = [(box, take(full, box)) for box in part]

    @classmethod
    def _all_reduce(cls, step: AllReduce, stores: dict[int, Store]) -> None:
        for group, _, full in cls._sums(step, stores):
            for rank in group:
                stores[rank] = full

    @staticmethod
    def _gather(step: Gather, stores: dict[int, Store]) -> None:
        incoming: dict[int, Store] = {}
        for group, parts in zip(step.groups, step.shares):
            shares = [[(box, take(stores[r], box)) for box in part]
                      for r, part in zip(group, parts)]
            for rank in group:
                incoming[rank] = [p for share in shares for p in share]
        for rank, pieces in incoming.items():
            stores.setdefault(rank, []).extend(pieces)

    @staticmethod
    def _exchange(step: Exchange, stores: dict[int, Store]) -> None:
        incoming: dict[int, Store] = {}
        for t in step.transfers:
            incoming.setdefault(t.dst, []).append((t.box, take(stores[t.src], t.box)))
        for rank, pieces in incoming.items():
            stores.setdefault(rank, []).extend(pieces)

    @staticmethod
    def _assemble(plan: Plan, rank: int, store: Store, dtype: torch.dtype) -> torch.Tensor:
        out = assemble(store, plan.need.segments(rank), dtype, "cpu", check=True)
        return from_canonical(out, plan.dst, plan.dims)


_EXECUTOR = ReferenceExecutor()


def redistribute(
    pieces: dict[int, torch.Tensor], src: Layout, dst: Layout, *, sizes=None,
    grad_partial=(), **dim_sizes
) -> dict[int, torch.Tensor]:
    """Redistribute every src rank's piece to every dst rank, through the custom vjp.

    ``pieces`` must hold exactly the src holders' local tensors; the result holds the dst
    holders'. Global sizes (``sizes={dim: n}`` and size keywords) are inferred from the
    pieces unless given; a keyword that is not a dim raises.
    """
    given = size_arguments(src, dst, sizes, dim_sizes, "redistribute (reference backend)",
                           ("sizes", "grad_partial"))
    if is_row_layout(src) or is_row_layout(dst):
        return _redistribute_rows(pieces, src, dst, given, tuple(grad_partial))
    holders = src.holders
    missing = [r for r in holders if r not in pieces]
    extra = [r for r in pieces if r not in holders]
    if missing or extra:
        raise MimoFxError(f"redistribute: src {src.describe()!r} on {src.grid!r} is held by "
                          f"ranks {list(holders)}; pieces miss {missing} and have extra {extra}")
    dtypes = {t.dtype for t in pieces.values()}
    if len(dtypes) != 1:
        raise MimoFxError(f"redistribute: pieces have mixed dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    full = infer_sizes(src, {r: tuple(pieces[r].shape) for r in holders}, given)
    fwd = plan(src, dst, full, dtype)
    bwd = backward_plan(src, dst, full, dtype, grad_partial)
    out = apply(_EXECUTOR, fwd, bwd, tuple(pieces[r] for r in holders))
    return dict(zip(dst.holders, out))


def _redistribute_rows(pieces: dict, src, dst, given: dict, grad_partial: tuple) -> dict:
    """A row plan (a packed layout on a side) for every rank: sizes from the pieces and
    the layouts, the plan run by :func:`mimo_fx.reference.rows.run_rows`."""
    from mimo_fx.rows import check_row_sizes, plan_layouts, row_dims

    from .rows import run_rows

    like = next(iter(pieces.values()), None)
    if like is None:
        raise MimoFxError("redistribute (reference backend): no pieces given")
    rows = row_dims(src, dst)
    features = [d for d in src.dims if d not in rows]
    sizes = dict(given)
    for d, n in zip(features, like.shape[1:]):
        sizes.setdefault(d, int(n))
    if not is_row_layout(src):
        sizes = {**infer_sizes(src, {r: tuple(pieces[r].shape) for r in src.holders
                                     if r in pieces}, sizes)}
    full = check_row_sizes(src, dst, sizes)
    p = plan_layouts(src, dst, full, like.dtype.itemsize, grad_partial)
    out = run_rows(p, {r: t for r, t in pieces.items()})
    return {r: out[r] for r in dst.holders}
