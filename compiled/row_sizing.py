"""Sizes and programs of a row bridge: to or from a row layout (a packed batch).

A bridge with a :class:`~mimo_fx.packed.PackedLayout` on either side moves rows
(:mod:`mimo_fx.rows`): one uneven all-to-all over both grids' ranks per direction. Its
programs (:func:`~.lowering.lower_rows`) are the same for every plan; what changes with
the batch is the *route*, this rank's parts of the batch's two plans (forward and adjoint,
each a :class:`~mimo_fx.plan.RankPlan`) lowered by
:func:`~.lowering.lower_route` to tensors: index vectors (the programs' inputs) and
counts (the programs' numbers). The layouts' batch travels as
tensors too (:attr:`PackedLayout.data`), so under ``torch.compile`` one graph serves
every batch: the route is computed while the graph runs, by the ordered op
``mimo_fx::route``, which plans in Python on the batch it is given -- the same
planning, and the same errors, as an eager call.

:class:`RowSizing` answers what :class:`~.sizing.Sizing` answers for box bridges (which
sizes are fixed, given or learned; the programs and their numbers) and the route. It
asks its layouts the row-side protocol (:func:`mimo_fx.rows.row_side`), never their kind.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, cast

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.plan import RankPlan, row_plans, size_arguments
from mimo_fx.rows import (
    ROUTE_INDEX,
    RowTiling,
    feature_slices,
    is_row_pair,
    plan_layouts,
    ragged_rows,
    route_tensors,
    row_dims,
    row_side,
    whole_features,
)

from . import lowering, straight
from .guard import runtime_check
from .live import named
from .ops import define
from .sizing import CallSizes, Programs, Sizing, flat_sizes, read_sizes

__all__ = ["RowSizing", "key_of", "sizing_for"]

CACHED_PLANS = 16  # batches whose routes a row bridge keeps (least recently used go)


def key_of(layout):
    """What a bridge is built for: a box layout itself, a row layout's structure (one
    bridge serves every batch)."""
    return layout.structure


def sizing_for(src, dst, fixed: dict | None, dtype: torch.dtype,
               grad_partial: tuple[str, ...], rank: int, context: str,
               device=None) -> CallSizes:
    """The sizing of a ``src -> dst`` bridge, the one place that picks it by the layouts'
    kind: :class:`RowSizing` where a side is a row layout, else :class:`~.sizing.Sizing`.
    A bridge asks it everything else through :class:`~.sizing.CallSizes`. ``device``:
    the data's, where a row bridge's route indices live (default: the CPU's)."""
    if is_row_pair(src, dst):
        return RowSizing(src, dst, fixed, dtype, grad_partial, rank, context, (), device)
    rows = ragged_rows(src, dst, fixed or {})
    if rows:  # (sizes no template serves: routed as rows, one graph for every count)
        return RowSizing(src, dst, fixed, dtype, grad_partial, rank, context, rows, device)
    return Sizing(src, dst, fixed, dtype, grad_partial, rank, context)


class RowSizing(CallSizes):
    """Sizes, routes and programs of one row bridge for ``rank`` (see the module
    docstring). ``src``/``dst`` are the layouts it is built with (a call may bring
    other batches of the same structure)."""

    def __init__(self, src, dst, fixed: dict | None, dtype: torch.dtype,
                 grad_partial: tuple[str, ...], rank: int, context: str,
                 rows: tuple[str, ...] = (), device=None) -> None:
        self.row_dims = rows or row_dims(src, dst)
        # a box dst that cuts features (``(cp t) (tp h)``) gets whole rows, as the layout
        # without those cuts would (every rank of their axes all of each row, tp times
        # the bytes of the cut), and keeps its slices (:meth:`finish`); the cotangents of
        # those ranks, zero off their slices, sum (partial over the axes)
        whole = whole_features(dst) if rows else dst
        self.slices = feature_slices(dst, fixed or {}, rank) if whole != dst else ()
        if whole != dst:
            grad_partial = (*grad_partial, *(a for a in dst.sharded_axes
                                             if a not in whole.sharded_axes))
            self.cut_dst, dst = dst, whole
        else:
            self.cut_dst = dst
        # the route's index vectors index the data: on its device (its counts, host
        # metadata, stay on the CPU)
        self.device = torch.device("cpu" if device is None else device)
        self.sides = (row_side(src), row_side(dst))
        for side in self.sides:
            side.check_side(self.row_dims)
        self.src, self.dst, self.dtype, self.rank = src, dst, dtype, rank
        self.grad_partial, self.context = tuple(grad_partial), context
        self.features = tuple(d for d in src.dims if d not in self.row_dims)
        self.fixed = size_arguments(src, dst, fixed, {}, "Redistributor", ()) if fixed else {}
        # one row dim whose count both sides' batches give: no call gives or learns it
        implied = set(self.sides[0].implied(self.row_dims)) & set(
            self.sides[1].implied(self.row_dims))
        self.free = tuple(d for d in src.dims if d not in self.fixed and d not in implied)
        self.union = tuple(sorted(set(src.grid.ranks) | set(dst.grid.ranks)))
        union = (self.union,) if len(self.union) > 1 else ()
        self.groups = {"forward": union, "backward": union}
        self.template = None
        self._variables = lowering.row_variables(len(self.union), self.features)
        self.fwd_program, self.bwd_program = lowering.lower_rows(
            self.union, self.features, src.holds(rank), dst.holds(rank))
        lowering.prime((self.fwd_program, self.bwd_program))  # (numbers a trace evaluates)
        straight.attach(self.fwd_program, self.bwd_program)
        self.fingerprint = 0
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._last = (src, dst)  # the batch of the last eager call
        self.name = ""  # its bridge's (see .live), set by the bridge

    def batch_of(self, src, dst) -> dict:
        return {"src": src, "dst": dst}  # a call may bring another batch of its structure

    def call_batch(self, src, dst, context: str) -> dict:
        """The layouts a call names (``src=``/``dst=``), each of this bridge's
        structure."""
        out = {}
        for name, given, own in (("src", src, self.src), ("dst", dst, self.dst)):
            if given is None:
                continue
            if key_of(given) != key_of(own):
                raise MimoFxError(context + f"{name}={given!r} is not a batch of this "
                                  f"bridge's {name} {own!r}; build a bridge for it")
            out[name] = given
        return out

    @property
    def variables(self) -> tuple:
        return self._variables  # the route's counts, then the feature sizes

    @property
    def unbacked(self) -> bool:
        return True  # a route's index vectors

    # -- a call's sizes (given, missing: CallSizes) ----------------------------------------
    def batch(self, layouts: dict) -> list[torch.Tensor]:
        src, dst = self._call_sides(layouts.get("src", self.src), layouts.get("dst", self.dst))
        return src.batch() + dst.batch()

    def batch_values(self, layouts: dict) -> list[tuple[int, ...]]:
        src, dst = self._call_sides(layouts.get("src", self.src), layouts.get("dst", self.dst))
        return src.batch_values() + dst.batch_values()

    def _call_sides(self, src, dst) -> tuple:
        """The row sides of a call that brings layouts ``src``/``dst`` (its batch)."""
        return self.sides[0].for_call(src), self.sides[1].for_call(dst)

    @property
    def varies(self) -> bool:
        return True  # every call may bring another batch

    def gathers_sizes(self, missing: tuple) -> bool:
        return True  # the size gather checks the batch every rank passed

    def size_values(self, x) -> list:
        from .learn import Record

        return Record.encode(x, 1 + len(self.features), self.fingerprint)

    def sizes_from(self, rows: torch.Tensor | list, known: dict, ranks=None) -> dict:
        """The sizes the src holders' shapes show (see :mod:`.learn`): a box src's every
        dim; a row src's features only (its rows are its batch's)."""
        from .learn import learn_sizes

        ranks = ranks or self.union
        table = rows if isinstance(rows, list) else rows.view(len(ranks), -1)
        return self.sides[0].sizes_shown(
            lambda: learn_sizes(table, ranks, self.src, known, self.fingerprint, self.dtype,
                                self.context),
            lambda: self._features(table, known, ranks))

    def _features(self, table: torch.Tensor | list, known: dict, ranks: tuple[int, ...]) -> dict:
        """``known`` and the feature sizes the first src holder's row shows (each entry
        read is a SymInt in a graph: one holder's only)."""
        from .learn import HEADER

        out = dict(known)
        first = next(i for i, r in enumerate(ranks) if self.src.holds(r))
        at = HEADER + 1  # (after the header, the local shape: its row count, then these)
        if isinstance(table, list):  # (host rows: a one-rank bridge's own shape)
            row = table[first][at:at + len(self.features)]
        else:
            row = table[first, at:at + len(self.features)].tolist()
        for d, size in zip(self.features, row):
            out.setdefault(d, size)
        return out

    # -- the route and the programs ------------------------------------------------------
    def programs(self, full: dict, learned: frozenset, x=None, src=None, dst=None
                 ) -> Programs:
        """The programs of a call at ``full`` sizes moving ``src``'s batch to ``dst``'s
        (default: the bridge's layouts): the route's counts and the feature sizes as
        their numbers, its index vectors, the batch's digest."""
        src = self.src if src is None else src
        dst = self.dst if dst is None else dst
        if not torch.compiler.is_compiling():
            self._last = (src, dst)
        if torch.compiler.is_compiling():
            # the row sizes as ints (a row dim both sides' batches count is in no
            # call's sizes: read as one int), and how they read back
            flat, spec = flat_sizes({d: full.get(d, 0) for d in self.row_dims})
            s_side, d_side = self._call_sides(src, dst)
            index, counts = _route_op(self.name, spec, s_side.batch_data(flat),
                                      d_side.batch_data(flat))
            values = counts.tolist()
            digest = values.pop()
            for v in values:
                torch._check(v >= 0)
        else:
            route, index = self.route(src, dst, full)
            values, digest = list(route.counts), self._digest(src, dst, full)
        values += [full[d] for d in self.features]
        return Programs(self.fwd_program, self.bwd_program, tuple(values), tuple(index),
                        digest)

    def _digest(self, src, dst, full: dict) -> int:
        """A batch's digest (checked mode compares it across ranks)."""
        from .guard import fingerprint

        return fingerprint(*self._keys(src, dst, full))

    def _keys(self, src, dst, full: dict) -> tuple:
        return tuple(side.batch_key(full, self.row_dims) for side in self._call_sides(src, dst))

    def plan(self, src, dst, full: dict, rank: int) -> tuple[RankPlan, RankPlan]:
        """``rank``'s parts of the plan of a batch and of its adjoint."""
        sizes = {d: full[d] for d in self.row_dims if d in full}
        sizes.update({d: 1 for d in self.features})  # (rows do not depend on them)
        try:
            return row_plans(plan_layouts(src, dst, sizes, self.dtype.itemsize,
                                          self.grad_partial, self.row_dims), rank)
        except MimoFxError as err:
            raise MimoFxError(self.context + str(err)) from None

    def route(self, src, dst, full: dict):
        """This rank's route for a batch (its plans lowered, :func:`~.lowering.lower_route`)
        and its index vectors on the data's device (planned once per batch, cached)."""
        key = self._keys(src, dst, full)
        hit = self._plans.get(key)
        if hit is None:
            route = lowering.lower_route(*self.plan(src, dst, full, self.rank), self.rank)
            hit = self._plans[key] = (route, route_tensors(route, self.device)[0])
            if len(self._plans) > CACHED_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return hit

    def check_src(self, x, n_src) -> None:
        """Under ``torch.compile``: ``x`` has the route's ``n_src`` rows (known when the
        graph runs; eagerly the guard knows it already)."""
        runtime_check("equal", (x.shape[0], n_src),
                      self.context + f"rank {self.rank}: the local tensor has {{}} rows but "
                      f"src holds {{}} rows on this rank in this batch; pass this rank's "
                      f"piece of this batch")

    def shape(self, side: str, rank: int, full: dict) -> tuple | None:
        """``rank``'s local shape on ``side`` in the last batch this rank planned (what
        messages say a rank was to pass)."""
        layout = self.src if side == "src" else self.dst
        if not layout.holds(rank):
            return None
        fwd, _ = self.plan(*self._last, full, rank)
        tiling = cast(RowTiling, fwd.source if side == "src" else fwd.need)
        shape = [len(tiling.rows.get(rank, ())), *(full[d] for d in self.features)]
        for at, _, length in (self.slices if side == "dst" and rank == self.rank else ()):
            shape[at] = length
        return tuple(shape)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's dst piece from the rows it got: its slices of the features its dst
        cuts (autograd pads the cotangent back with zeros)."""
        for at, start, length in self.slices:
            y = y.narrow(at, start, length)
        # (a copy: a view would keep every whole row alive)
        return y.contiguous() if self.slices else y

    def summary(self) -> list[str]:
        return [f": a row bridge, one all_to_all over {len(self.union)} ranks each way; "
                f"routes planned per batch"]

    def forget(self) -> None:
        self._plans.clear()


# -- the route op ------------------------------------------------------------------------
_OUTPUTS = len(ROUTE_INDEX) + 1


def _route_impl(src_data: torch.Tensor, dst_data: torch.Tensor, bridge: str, spec: str):
    sizing = named(bridge).sizing
    src_values, dst_values = src_data.tolist(), dst_data.tolist()
    src, s_sizes = sizing.sides[0].from_batch(src_values, read_sizes(src_values, spec))
    dst, d_sizes = sizing.sides[1].from_batch(dst_values, read_sizes(dst_values, spec))
    full = {**s_sizes, **d_sizes}
    route, index = sizing.route(src, dst, full)
    counts = torch.tensor((*route.counts, sizing._digest(src, dst, full)), dtype=torch.int64)
    return (*(t.clone() for t in index), counts)


def _route_fake(src_data, dst_data, bridge: str, spec: str):
    ctx = torch.library.get_ctx()
    bridge_ = named(bridge)
    index = [torch.empty((ctx.new_dynamic_size(),), dtype=torch.int64,
                         device=bridge_.sizing.device) for _ in ROUTE_INDEX]
    n = len(bridge_.union)
    return (*index, src_data.new_empty((4 * n + 4,)))  # the counts, then the digest


_ROUTE = define("route(Tensor src_data, Tensor dst_data, str bridge, str spec) -> ("
                + ", ".join(["Tensor"] * _OUTPUTS) + ")", _route_impl, _route_fake)


def _route_op(bridge: str, spec: str, src_data: torch.Tensor, dst_data: torch.Tensor):
    out = _ROUTE(src_data, dst_data, bridge, spec)
    index = tuple(out[:-1])
    for t in index:
        torch._check(t.shape[0] >= 0)
    return index, out[-1]
