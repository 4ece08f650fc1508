"""Run a plan for every rank in one process.

Each rank's *store* is a list of ``(box, tensor)`` pieces in canonical dim order. The
executor loads the src pieces, applies the plan's steps by copying (or summing) the boxes
each step delivers (:meth:`~mimo_fx.plan.Step.deliveries`, the same for every kind), then
assembles every dst rank's local tensor. It decides nothing: every box it moves is named
by the plan.
"""

from __future__ import annotations

from itertools import product

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
from mimo_fx.plan import Plan, Step, backward_plan, kind_of, plan, size_arguments
from mimo_fx.regions import Box, Tiling
from mimo_fx.rows import is_row_layout
from mimo_fx.vjp import apply

__all__ = ["ReferenceExecutor", "redistribute"]

class ReferenceExecutor:
    """Executes plans on a tuple of pieces, one per src holder, in rank order."""

    def run(self, plan: Plan, tensors: tuple[torch.Tensor, ...],
            env: dict | None = None, *, direction: str = "forward"
            ) -> tuple[torch.Tensor, ...]:
        src_tiling = Tiling.of(plan.src, plan.dims, dict(plan.sizes))
        stores: dict[int, Store] = {}
        for rank, local in zip(plan.src.holders, tensors):
            canon = to_canonical(local, plan.src, src_tiling, rank)
            segments = src_tiling.segments(rank)
            stores[rank] = [(box, canon[box_slices(segments, box)])
                            for box in product(*segments)]
        for step in plan.steps:
            self._apply(step, stores)
        dtype, device = tensors[0].dtype, tensors[0].device
        return tuple(self._assemble(plan, rank, stores.get(rank, []), dtype, device)
                     for rank in plan.dst.holders)

    @staticmethod
    def _apply(step: Step, stores: dict[int, Store]) -> None:
        """Every step the same way, by what it delivers: each delivery's box is read from
        its senders (summed when several) before any store changes; a reducing step's
        members then drop their partial values."""
        kind_of(step)  # an unknown step raises here, naming its class
        sums: dict[tuple[Box, tuple[int, ...]], torch.Tensor] = {}
        incoming: dict[int, Store] = {}
        for receiver, box, senders in step.deliveries():
            if len(senders) == 1:
                value = take(stores[senders[0]], box)
            else:  # summed once per box and group (an all-reduce delivers it to each)
                key = (box, senders)
                if key not in sums:
                    sums[key] = torch.stack([take(stores[r], box) for r in senders]).sum(0)
                value = sums[key]
            incoming.setdefault(receiver, []).append((box, value))
        if step.reduces:
            for group in step.rank_groups:
                for rank in group:
                    stores[rank] = []
        for rank, pieces in incoming.items():
            stores.setdefault(rank, []).extend(pieces)

    @staticmethod
    def _assemble(plan: Plan, rank: int, store: Store, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        # on the pieces' device: CPU, or ``meta`` for shapes only (every rank in one
        # process shares one device)
        out = assemble(store, plan.need.segments(rank), dtype, device, check=True)
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
    devices = {t.device for t in pieces.values()}
    if len(devices) != 1:
        raise MimoFxError(f"redistribute: pieces are on several devices "
                          f"{sorted(map(str, devices))}; the reference backend runs every "
                          f"rank in one process: move them to one device (e.g. .cpu())")
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
