"""Run a plan for every rank in one process.

Each rank's *store* is a list of ``(box, tensor)`` pieces in the plan's dims. The
executor asks the plan to load every input rank's piece into its store, applies the
plan's steps by copying (or summing) the boxes each step delivers
(:meth:`~mimo_fx.plan.Step.deliveries`, the same for every kind), then asks the plan to
assemble every output rank's piece. It decides nothing, and asks no plan its kind: a
plan's tilings load and assemble pieces (a plan between box layouts: boxes of the
tensor; one with a packed layout on a side: runs of its rows, :class:`~mimo_fx.rows.RowTiling`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout, axis_names
from mimo_fx.local import Store, infer_sizes, read_box
from mimo_fx.plan import (
    Plan,
    Step,
    backward_plan,
    kind_of,
    plan,
    row_plans,
    size_arguments,
)
from mimo_fx.regions import Box
from mimo_fx.rows import RowRouting, row_side
from mimo_fx.sizes import as_int
from mimo_fx.vjp import apply

__all__ = ["ReferenceExecutor", "redistribute", "run_rows"]

class ReferenceExecutor:
    """Executes a plan on a tuple of pieces, one per input rank of the plan, in order."""

    def run(self, plan: Plan, tensors: tuple[torch.Tensor, ...],
            env: dict | None = None, *, direction: str = "forward"
            ) -> tuple[torch.Tensor, ...]:
        stores: dict[int, Store] = {rank: plan.load(rank, local)
                                    for rank, local in zip(plan.inputs, tensors)}
        for step in plan.steps:
            self._apply(step, stores)
        return tuple(plan.assemble(rank, stores.get(rank, []), tensors[0])
                     for rank in plan.outputs)

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
                value = read_box(stores[senders[0]], box)
            else:  # summed once per box and group (an all-reduce delivers it to each)
                key = (box, senders)
                if key not in sums:
                    sums[key] = torch.stack([read_box(stores[r], box) for r in senders]).sum(0)
                value = sums[key]
            incoming.setdefault(receiver, []).append((box, value))
        if step.reduces:
            for group in step.rank_groups:
                for rank in group:
                    stores[rank] = []
        for rank, pieces in incoming.items():
            stores.setdefault(rank, []).extend(pieces)


_EXECUTOR = ReferenceExecutor()


def redistribute(
    pieces: dict[int, torch.Tensor], src: Layout, dst: Layout, *, sizes=None,
    grad_partial=(), frozen: bool | None = None, **dim_sizes
) -> dict[int, torch.Tensor]:
    """Redistribute every src rank's piece to every dst rank, through the custom vjp.

    ``pieces`` must hold exactly the src holders' local tensors; the result holds the dst
    holders'. Global sizes (``sizes={dim: n}`` and size keywords) are inferred from the
    pieces unless given; a keyword that is not a dim raises. ``frozen=True``: the source
    needs no gradient, so no result requires grad (a piece that requires grad is an
    error: its gradient would be lost); the compiled backend's rule.
    """
    given = size_arguments(src, dst, sizes, dim_sizes, "redistribute (reference backend)",
                           ("sizes", "grad_partial", "frozen"))
    grad_partial = axis_names(grad_partial, "grad_partial")
    pieces = _checked_pieces(pieces, src)
    dtypes = {t.dtype for t in pieces.values()}
    if len(dtypes) != 1:
        raise MimoFxError(f"redistribute: pieces have mixed dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    devices = {t.device for t in pieces.values()}
    if len(devices) != 1:
        raise MimoFxError(f"redistribute: pieces are on several devices "
                          f"{sorted(map(str, devices))}; the reference backend runs every "
                          f"rank in one process: move them to one device (e.g. .cpu())")
    full = _sizes(pieces, src, dst, given)
    fwd = plan(src, dst, full, dtype)
    bwd = backward_plan(src, dst, full, dtype, grad_partial)
    if frozen not in (None, True, False):
        raise MimoFxError(f"frozen={frozen!r} must be True, False or None")
    if frozen:
        wanting = sorted(r for r, t in pieces.items() if t.requires_grad)
        if wanting and torch.is_grad_enabled():
            raise MimoFxError(f"redistribute with frozen=True: the pieces of ranks {wanting} "
                              f"require grad, and a frozen source's gradient would be lost; "
                              f"pass them detached, or drop frozen=True")
        with torch.no_grad():
            return _run(fwd, bwd, pieces)
    return _run(fwd, bwd, pieces)


def _checked_pieces(pieces, src: Layout) -> dict[int, torch.Tensor]:
    """``pieces`` as a dict of src holder ranks (numpy or torch integer keys as ints) to
    tensors, or an error naming what is wrong."""
    if not isinstance(pieces, Mapping):
        raise MimoFxError(f"redistribute: pieces must be a dict {{rank: local tensor}} "
                          f"(mimo_fx.reference.shard(x, src) makes one), got a "
                          f"{type(pieces).__name__}")
    pieces = {as_int(r): t for r, t in pieces.items()}  # (numpy or torch integer keys)
    missing = [r for r in src.holders if r not in pieces]
    extra = [r for r in pieces if not src.holds(r)]
    if missing or extra:
        raise MimoFxError(f"redistribute: src {src.describe()!r} on {src.grid!r} is held by "
                          f"ranks {list(src.holders)}; pieces miss {missing} and have extra "
                          f"{extra}")
    wrong = {r: type(t).__name__ for r, t in pieces.items() if not isinstance(t, torch.Tensor)}
    if wrong:
        raise MimoFxError(f"redistribute: every piece must be a torch.Tensor (the rank's local "
                          f"tensor); ranks {sorted(wrong)} have "
                          f"{sorted(set(wrong.values()))}")
    return pieces


def _sizes(pieces: Mapping[int, torch.Tensor], src, dst, given: dict) -> dict:
    """Every size of the plan from ``src`` to ``dst``, as src's row side shows them: a box
    side's from its holders' shapes, a side given row by row (a packed layout) its
    features' from a piece and its rows' from the layouts."""
    from mimo_fx.rows import check_row_sizes, row_dims

    def features() -> dict:
        like, rows = next(iter(pieces.values())), row_dims(src, dst)
        sizes = dict(given)
        for d, n in zip([d for d in src.dims if d not in rows], like.shape[1:]):
            sizes.setdefault(d, int(n))
        return sizes

    sizes = row_side(src).sizes_shown(
        lambda: infer_sizes(src, {r: tuple(pieces[r].shape) for r in src.holders}, given),
        features)
    return check_row_sizes(src, dst, sizes)


def _run(fwd: Plan, bwd: Plan, pieces: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """``fwd`` through the custom vjp (its backward ``bwd``): every output rank's piece
    from the input ranks' pieces (one holding nothing may be missing: an empty piece)."""
    like = next(iter(pieces.values()))
    empty = like.new_zeros((0, *like.shape[1:]))
    out = apply(_EXECUTOR, fwd, bwd, tuple(pieces.get(r, empty) for r in fwd.inputs))
    return dict(zip(fwd.outputs, out))


def run_rows(routing: RowRouting, pieces: Mapping[int, torch.Tensor]
             ) -> dict[int, torch.Tensor]:
    """Every rank's dst piece from every rank's src piece under a row routing, differentiably
    (:func:`~mimo_fx.plan.row_plans`); a rank missing from ``pieces`` must hold no src rows.

    >>> from mimo_fx.rows import plan_rows
    >>> p = plan_rows({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1, -1]}, n_rows=4)
    >>> x = torch.arange(4.0).unsqueeze(1).requires_grad_()
    >>> y = run_rows(p, {0: x[:2], 1: x[2:]})
    >>> {r: t.flatten().tolist() for r, t in y.items()}
    {0: [3.0, 0.0, 3.0], 1: [1.0, 0.0]}
    >>> sum(t.sum() for t in y.values()).backward()
    >>> x.grad.flatten().tolist()
    [1.0, 1.0, 0.0, 2.0]
    """
    if not pieces:
        raise MimoFxError("a row plan in one process needs at least one src piece (for the "
                          "dtype and row shape)")
    strangers = sorted(set(pieces) - set(routing.ranks))
    if strangers:
        raise MimoFxError(f"got pieces for ranks {strangers} that take no part in the plan; "
                          f"its ranks are {routing.ranks}")
    return _run(*row_plans(routing), pieces)
