"""The row router: layouts given row by row, each dst rank receiving exactly the rows it
needs.

Some layouts are not boxes: a packed sequence (:class:`~mimo_fx.packed.PackedLayout`)
gives each rank the tokens of its chunks of every sequence, image tokens land wherever
the text puts them. Such a layout says, per rank, which global row (along the tensor's
first dims, flattened) each of its local rows holds -- ``-1`` for a padding row, zero
in the piece and holding no row. :func:`plan_rows` moves rows between two such maps (a
box layout gives its map with :func:`layout_rows`), pure and deterministic:

- a rank never receives a row it holds itself: it copies it locally;
- any other needed row reaches a receiver once, however often the receiver uses it, so
  each rank receives exactly its lower bound (its distinct needed rows it does not hold);
- a row held by several src ranks has one *sender*: rows go, heaviest first (most
  receivers), to the holder with the least load so far, ties to the lowest rank.

The backward is the adjoint under DESIGN's rules: every holder of a row gets that row's
full gradient (the sum of the cotangents of every dst position it fed); a dst rank's
cotangents count unless it is a replica of another (``counted``: the ranks whose
cotangents count; a dst replicated over an axis takes them as consistent, as box plans
do, unless ``grad_partial`` names the axis). Each direction is one uneven
``all_to_all`` over the plan's ranks (a rank's own rows take its self split: a local
copy).

The router's :class:`RowRouting` counts rows; :func:`mimo_fx.plan` makes it two ordinary
plans (:func:`~mimo_fx.plan.row_plans`): one dim, the rows, an exchange of runs of rows,
and what each rank holds a :class:`RowTiling`. Lowering reads a rank's numbers and index
vectors (:class:`RankRoute`) from the two plans
(:func:`mimo_fx.compiled.lowering.lower_route`), so executors decide nothing.

>>> p = plan_rows({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1]}, n_rows=4)
>>> print(p)
rows: 4 rows over ranks (0, 1), 1 all_to_all each way
  forward: 0 -> 1: rows [1]; 1 -> 0: rows [3]
  cost: max recv 1 row(s)/rank (lower bound 1)
>>> p.received(), p.needed_rows()
({0: 1, 1: 1}, {0: 1, 1: 1})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, cast

import torch

from .errors import MimoFxError
from .grid import Grid
from .local import int_tensor
from .regions import Box

__all__ = ["RankRoute", "RowRouting", "RowTiling", "RowMap", "plan_rows", "layout_rows",
           "seed_bytes", "ROUTE_INDEX", "route_tensors", "row_side", "is_row_layout",
           "is_row_pair", "row_dims", "BoxRows"]

Ints = tuple[int, ...]

# the index vectors of a route, in order (see RankRoute)
ROUTE_INDEX = ("send_index", "gather", "dst_pos", "bwd_pos", "unique", "bsend_index",
               "recv_local")


@dataclass(frozen=True)
class RankRoute:
    """One rank's part of a row plan, both directions, as the row programs take it (every
    count per peer, in the plan's rank order, the rank's own split included).

    Forward: ``send = x[send_index]`` cut by ``send_counts``; it receives ``recv_counts``
    rows per peer; its dst piece is ``n_dst`` rows, zero but at ``dst_pos``, where
    ``received[gather]`` go. Backward: its counted cotangent rows ``g[bwd_pos]`` summed
    per distinct row into ``n_unique`` slots (``unique[k]``: row ``k``'s slot); ``send =
    sums[bsend_index]`` cut by ``bsend_counts``; ``brecv_counts`` rows arrive per peer
    and add to its src gradient (``n_src`` rows) at ``recv_local``.
    """

    send_index: Ints
    send_counts: Ints
    recv_counts: Ints
    gather: Ints
    dst_pos: Ints
    n_dst: int
    bwd_pos: Ints
    unique: Ints
    n_unique: int
    bsend_index: Ints
    bsend_counts: Ints
    brecv_counts: Ints
    recv_local: Ints
    n_src: int

    @property
    def counts(self) -> Ints:
        """Every count in one vector: forward send and receive, backward send and
        receive (one per rank each), then ``n_unique``, ``n_src``, ``n_dst``."""
        return (*self.send_counts, *self.recv_counts, *self.bsend_counts,
                *self.brecv_counts, self.n_unique, self.n_src, self.n_dst)


def route_tensors(route: RankRoute, device=None) -> tuple[tuple[torch.Tensor, ...],
                                                           torch.Tensor]:
    """A route as tensors: its index vectors (int64, on ``device``) and its counts (one
    int64 CPU vector) -- what a compiled step takes as inputs, so one graph serves every
    plan."""
    index = tuple(torch.tensor(getattr(route, name), dtype=torch.int64, device=device)
                  for name in ROUTE_INDEX)
    return index, torch.tensor(route.counts, dtype=torch.int64)


def runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Rising distinct rows as maximal runs ``[a, b)`` of consecutive ones."""
    out: list[tuple[int, int]] = []
    start = end = -1  # the run so far, [start, end) (none yet: -1)
    for g in rows:
        if g == end:
            end = g + 1
            continue
        if start >= 0:
            out.append((start, end))
        start, end = g, g + 1
    if start >= 0:
        out.append((start, end))
    return out


@dataclass(frozen=True, eq=False)
class RowTiling:
    """What each rank of a row plan holds or needs, as a plan's tiling: ``rows[rank]``
    gives, per local row of the rank's piece, its global row (-1: padding, or a cotangent
    that does not count). Its boxes are runs ``[a, b)`` of distinct global rows, in the
    plan's one dim (the rows); a piece loads into them and assembles from them."""

    rows: Mapping[int, Ints]

    def boxes(self, rank: int) -> tuple[Box, ...]:
        """The runs of distinct rows ``rank`` holds, rising."""
        return tuple((run,) for run in runs(sorted({g for g in self.rows.get(rank, ())
                                                     if g >= 0})))

    def load(self, layout, dims, rank: int, local: torch.Tensor) -> list:
        """``rank``'s piece as ``(run, rows)`` pieces, one per run of the distinct rows it
        holds (a row held at several local rows: their sum, as the adjoint of a dst piece
        that uses a row twice)."""
        rows = torch.tensor(self.rows.get(rank, ()), dtype=torch.int64)
        if not isinstance(local, torch.Tensor) or local.dim() == 0 \
                or local.shape[0] != len(rows):
            shape = tuple(local.shape) if isinstance(local, torch.Tensor) else local
            raise MimoFxError(f"rank {rank} holds {len(rows)} src rows under this plan, so "
                              f"its src piece must be ({len(rows)}, *row_shape); got {shape}")
        keep = torch.nonzero(rows >= 0).flatten().to(local.device)
        distinct, slot = torch.unique(rows[rows >= 0], sorted=True, return_inverse=True)
        sums = local.new_zeros((len(distinct), *local.shape[1:])).index_add(
            0, slot.to(local.device), local.index_select(0, keep))
        out, at = [], 0
        for a, b in runs(distinct.tolist()):
            out.append((((a, b),), sums[at:at + b - a]))
            at += b - a
        return out

    def assemble(self, layout, dims, rank: int, store: list, like: torch.Tensor
                 ) -> torch.Tensor:
        """``rank``'s piece: each local row the sum of the stored runs holding its row
        (one run but for a src gradient, which every user of the row sends)."""
        rows = torch.tensor(self.rows.get(rank, ()), dtype=torch.int64)
        out = like.new_zeros((len(rows), *like.shape[1:]))
        for ((a, b),), values in store:
            at = torch.nonzero((rows >= a) & (rows < b)).flatten()
            if len(at):
                out = out.index_add(0, at.to(like.device), values.index_select(
                    0, (rows[at] - a).to(like.device)))
        return out


@dataclass(frozen=True, eq=False)
class RowMap:
    """A layout given rank by rank as global rows (:func:`plan_rows`'s maps): it holds
    nothing else, so it serves a plan between two of them."""

    rows: Mapping[int, Ints]

    @property
    def holders(self) -> Ints:
        return tuple(self.rows)

    @property
    def grid(self) -> Grid:
        return Grid(r=max(self.rows, default=0) + 1)

    partial: tuple[str, ...] = ()

    def holds(self, rank: int) -> bool:
        return rank in self.rows

    def describe(self) -> str:
        return f"rows of ranks {list(self.rows)}"


@dataclass(frozen=True, eq=False)
class RowRouting:
    """Who sends which rows to whom, both directions (see the module docstring), counted
    in rows; :func:`~mimo_fx.plan.row_plans` makes it the two plans (whose costs are in
    bytes, as every plan's).

    ``src_rows``/``dst_rows``: per rank of :attr:`ranks`, the global row of each local
    row (-1: padding); ``counted``: the dst ranks whose cotangents count;
    ``sender``: per global row, the rank that sends it (-1 if nobody needs it from
    another rank); ``sends[i][j]``: the rows ``ranks[i]`` sends ``ranks[j]``, rising;
    ``holders``: per global row, the ranks holding it, rising.
    """

    n_rows: int
    ranks: Ints
    src_rows: tuple[Ints, ...]
    dst_rows: tuple[Ints, ...]
    counted: frozenset[int]
    sender: tuple[int, ...]
    sends: tuple[tuple[Ints, ...], ...]
    holders: tuple[Ints, ...]
    row_bytes: int = 4  # bytes of one row (its elements times the item size)
    src: Any = None  # the layouts planned between (plan_layouts), None for raw maps
    dst: Any = None
    rows: tuple[str, ...] = ()  # the dims flattened into rows (plan_layouts)

    def index(self, rank: int) -> int:
        """The position of ``rank`` in :attr:`ranks`."""
        if rank not in self.ranks:
            raise MimoFxError(f"rank {rank} takes no part in this plan; its ranks are "
                              f"{self.ranks}")
        return self.ranks.index(rank)

    @cached_property
    def backward_sends(self) -> list[list[list[int]]]:
        """``[i][j]``: the distinct rows counted rank ``ranks[i]`` sends holder
        ``ranks[j]`` backward (not itself)."""
        holders = self.holders
        out = []
        for i, r in enumerate(self.ranks):
            used = sorted({g for g in self.dst_rows[i] if g >= 0}) if r in self.counted \
                else []
            out.append([[g for g in used if h in holders[g]] if j != i else []
                        for j, h in enumerate(self.ranks)])
        return out

    @property
    def dim_name(self) -> str:
        """Its plans' one dim: the rows (the row dims flattened, as ``(b s)``)."""
        if self.src is None:  # (a routing of bare row maps: plan_rows)
            return "rows"
        dims = self.rows  # (plan_layouts sets src, dst and rows together)
        return dims[0] if len(dims) == 1 else f"({' '.join(dims)})"

    # -- cost ---------------------------------------------------------------------------
    def received(self, direction: str = "forward") -> dict[int, int]:
        """Rows each rank receives from other ranks in ``direction``."""
        return {r: sum(n for j, n in enumerate(c) if j != i)
                for i, (r, c) in enumerate(zip(self.ranks, self._counts(direction, 1)))}

    def sent(self, direction: str = "forward") -> dict[int, int]:
        """Rows each rank sends to other ranks in ``direction``."""
        return {r: sum(n for j, n in enumerate(c) if j != i)
                for i, (r, c) in enumerate(zip(self.ranks, self._counts(direction, 0)))}

    def _counts(self, direction: str, received: int) -> list[Ints]:
        if _direction(direction) == 0:
            rows = [[len(self.sends[i][j]) for j in range(len(self.ranks))]
                    for i in range(len(self.ranks))]
        else:
            rows = [[len(s) for s in per] for per in self.backward_sends]
        if received:
            rows = [list(col) for col in zip(*rows)]
        return [tuple(r) for r in rows]

    def pairs(self, direction: str = "forward") -> dict[tuple[int, int], int]:
        """Rows each rank sends each other rank in ``direction``: ``{(src, dst): rows}``."""
        sent = self._counts(direction, 0)
        return {(s, d): n for i, s in enumerate(self.ranks) for j, d in enumerate(self.ranks)
                if i != j and (n := sent[i][j])}

    def needed_rows(self) -> dict[int, int]:
        """Per rank, the distinct rows it needs and does not hold: what any scheme must
        bring it forward."""
        return {r: len({g for g in d if g >= 0} - set(s))
                for r, s, d in zip(self.ranks, self.src_rows, self.dst_rows)}

    def __str__(self) -> str:
        pairs = [f"{src} -> {dst}: rows {list(self.sends[i][j])}"
                 for i, src in enumerate(self.ranks) for j, dst in enumerate(self.ranks)
                 if self.sends[i][j]]
        shown = "; ".join(pairs[:8]) + (f"; ... ({len(pairs)} pairs)" if len(pairs) > 8
                                        else "")
        bound = max(self.needed_rows().values(), default=0)
        recv = max(self.received().values(), default=0)
        return (f"rows: {self.n_rows} rows over ranks {self.ranks}, 1 all_to_all each "
                f"way\n  forward: {shown or '(nothing moves)'}\n"
                f"  cost: max recv {recv} row(s)/rank (lower bound {bound})")


def _direction(direction: str) -> int:
    if direction not in ("forward", "backward"):
        raise MimoFxError(f"direction must be 'forward' or 'backward', got {direction!r}")
    return 0 if direction == "forward" else 1


def seed_bytes(n_rows: int, cp_ranks: Sequence[int], row_bytes: int,
               held: Mapping[int, int] | None = None) -> dict[str, int]:
    """Bytes the replicate-then-all-reduce scheme moves, summed over ranks: every cp rank
    receives all ``n_rows`` (less the rows it ``held``), the backward all-reduces the
    whole ``(n_rows, ...)`` gradient over cp (a ring: each rank receives
    ``2*(cp-1)/cp`` of it), then returns each row's gradient to one src holder."""
    held = held or {}
    cp = len(cp_ranks)
    forward = sum(n_rows - held.get(r, 0) for r in cp_ranks)
    reduce = 2 * (cp - 1) * n_rows
    back = n_rows - sum(held.get(r, 0) for r in cp_ranks)
    return {"forward": forward * row_bytes, "backward": (reduce + back) * row_bytes}


# -- rows of a box layout --------------------------------------------------------------
def layout_rows(layout, sizes: Mapping[str, object], rows: Sequence[str]
                ) -> dict[int, list[int]]:
    """Per holder of ``layout``, the global rows its local tensor holds, in local order:
    a box layout (an encoder's ``(dp b) s h``, or ``(dp t) h`` with ``ragged="dp"``) as
    a row map.

    ``rows`` are the layout's leading dims, flattened row-major into global row ids (row
    ``b * S + s`` for ``("b", "s")``); the rest are a row's features and must not be cut
    (a row plan moves whole rows: redistribute to a layout with whole rows first).
    ``sizes`` gives every dim's size (a ragged dim's: its counts). TP replicas list the
    same rows; a plan then sends each from one of them and returns its gradient to each.
    """
    from .layout import Layout
    from .regions import Tiling, total

    if not isinstance(layout, Layout):
        raise MimoFxError(f"layout_rows needs a Layout, got {layout!r}")
    rows = (rows,) if isinstance(rows, str) else tuple(rows)
    dims = layout.dims
    if not rows or dims[:len(rows)] != rows:
        raise MimoFxError(f"layout_rows: rows={rows} must be the leading dims of "
                          f"{layout.describe()!r}, whose dims are {dims}")
    missing = [d for d in dims if d not in sizes]
    if missing:
        raise MimoFxError(f"layout_rows: give the size of every dim of "
                          f"{layout.describe()!r}; missing {missing}")
    cut = [d for d in dims[len(rows):] if layout.sharding[d]]
    if cut or layout.partial:
        raise MimoFxError(f"{layout.describe()!r} cuts a row's features "
                          f"{cut or ''}{' (partial)' if layout.partial else ''}; a row plan "
                          f"moves whole rows, so redistribute to a layout that keeps "
                          f"{list(dims[len(rows):])} whole first")
    tiling = Tiling.of(layout, dims, {d: sizes[d] for d in dims})  # type: ignore[misc]
    extents = [total(sizes[d]) for d in rows]  # type: ignore[arg-type]
    out = {}
    for rank in layout.holders:
        ids = torch.zeros((), dtype=torch.int64)
        for extent, segments in zip(extents, tiling.segments(rank)[:len(rows)]):
            held = torch.cat([torch.arange(a, b) for a, b in segments]) if segments \
                else torch.zeros(0, dtype=torch.int64)
            ids = (ids.unsqueeze(-1) * extent + held).flatten()
        out[rank] = ids.tolist()
    return out


# -- the planner --------------------------------------------------------------------------
def plan_rows(src_rows: Mapping[int, object], dst_rows: Mapping[int, object],
              n_rows: int, counted=None, row_bytes: int = 4) -> RowRouting:
    """The plan moving the rows ``dst_rows`` needs from the ranks ``src_rows`` says hold
    them (both ``{rank: global row of each local row}``, ``-1`` a padding row; a rank
    missing from one mapping holds, or needs, nothing). ``counted``: the dst ranks
    whose cotangents count backward (default: all); ``row_bytes``: for the byte counts."""
    n = _check_n_rows(n_rows)
    src = {r: _check_rows(rows, n, f"src_rows[{r}]") for r, rows in _check_map(
        src_rows, "src_rows").items()}
    dst = {r: _check_rows(rows, n, f"dst_rows[{r}]") for r, rows in _check_map(
        dst_rows, "dst_rows").items()}
    ranks = tuple(sorted(set(src) | set(dst)))
    srcs = tuple(src.get(r, ()) for r in ranks)
    dsts = tuple(dst.get(r, ()) for r in ranks)
    _check_src_distinct(ranks, srcs)
    holders = _holders(ranks, srcs, n)
    _check_held(ranks, dsts, holders)
    sender = _choose_senders(ranks, srcs, dsts, holders, n)
    sends = _sends(ranks, srcs, dsts, sender)
    counted_set = frozenset(dst) if counted is None else frozenset(counted) & frozenset(dst)
    return RowRouting(n, ranks, srcs, dsts, counted_set, sender, sends,
                      tuple(map(tuple, holders)), row_bytes)


def _sends(ranks: Ints, srcs: tuple[Ints, ...], dsts: tuple[Ints, ...],
           sender: tuple[int, ...]) -> tuple[tuple[Ints, ...], ...]:
    """``[i][j]``: the rows ``ranks[i]`` sends ``ranks[j]``, rising: each row ``ranks[j]``
    needs and does not hold, from its sender. One pass over every rank's rows (a row
    needed and not held always has a sender)."""
    at = {r: i for i, r in enumerate(ranks)}
    out: list[list[set[int]]] = [[set() for _ in ranks] for _ in ranks]
    for j, (need, have) in enumerate(zip(dsts, srcs)):
        held = set(have)
        for g in need:
            if g >= 0 and g not in held:
                out[at[sender[g]]][j].add(g)
    return tuple(tuple(tuple(sorted(rows)) for rows in per) for per in out)


def _holders(ranks: Ints, srcs: tuple[Ints, ...], n: int) -> list[list[int]]:
    """Per global row, the ranks holding it, rising."""
    holders: list[list[int]] = [[] for _ in range(n)]
    for r, rows in zip(ranks, srcs):
        for g in rows:
            if g >= 0:
                holders[g].append(r)
    return holders


def _choose_senders(ranks: Ints, srcs: tuple[Ints, ...], dsts: tuple[Ints, ...],
                    holders: list[list[int]], n: int) -> tuple[int, ...]:
    """One sender per row some rank needs and lacks: heaviest rows first, each to the
    holder that has the least to send so far (ties: lowest rank)."""
    weight = [0] * n
    for need, have in zip(dsts, srcs):
        for g in set(need).difference(have):
            if g >= 0:
                weight[g] += 1
    load = dict.fromkeys(ranks, 0)
    sender = [-1] * n
    needed = [g for g in range(n) if weight[g]]
    needed.sort(key=weight.__getitem__, reverse=True)  # (a stable sort: ties by row)
    for g in needed:
        rows = holders[g]  # rising: min keeps the lowest of equally loaded ranks
        s = rows[0] if len(rows) == 1 else min(rows, key=load.__getitem__)
        sender[g] = s
        load[s] += weight[g]
    return tuple(sender)


# -- validation ---------------------------------------------------------------------------
def _check_n_rows(n_rows: object) -> int:
    if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 0:
        raise MimoFxError(f"n_rows must be a row count >= 0 (the global rows of the src "
                          f"tensor), got {n_rows!r}")
    return n_rows


def _check_map(rows: object, what: str) -> Mapping[int, object]:
    if not isinstance(rows, Mapping):
        raise MimoFxError(f"{what} must map each rank to its global rows, e.g. "
                          f"{{0: [0, 1], 1: [2]}}; got {rows!r}")
    for r in rows:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise MimoFxError(f"{what} has key {r!r}; keys are ranks (integers >= 0)")
    return rows


def _check_rows(rows: object, n: int, what: str) -> Ints:
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.is_floating_point() or rows.is_complex() \
                or rows.dtype == torch.bool:
            raise MimoFxError(f"{what} must be a 1-D integer tensor of global rows, got "
                              f"dtype {rows.dtype} and shape {tuple(rows.shape)}")
        rows = rows.tolist()
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise MimoFxError(f"{what} must be a sequence of global rows, got {rows!r}")
    out = tuple(rows)
    if set(map(type, out)) <= {int} and (not out or -1 <= min(out) and max(out) < n):
        return out  # (the common case, checked without a Python loop)
    bad = [g for g in out if isinstance(g, bool) or not isinstance(g, int)
           or not -1 <= g < n]
    if bad:
        raise MimoFxError(f"{what} has {bad[:8]}: rows must be integers in 0..{n - 1} "
                          f"(n_rows = {n}), or -1 for a padding row")
    return out


def _check_src_distinct(ranks: Ints, srcs: tuple[Ints, ...]) -> None:
    for r, rows in zip(ranks, srcs):
        real = [g for g in rows if g >= 0]
        if len(set(real)) != len(real):
            twice = sorted({g for g in real if real.count(g) > 1})
            raise MimoFxError(f"src_rows[{r}] lists rows {twice} more than once; a rank "
                              f"holds each of its rows once (a replica lives on another "
                              f"rank)")


def _check_held(ranks: Ints, dsts: tuple[Ints, ...], holders: list[list[int]]) -> None:
    for r, rows in zip(ranks, dsts):
        orphans = sorted({g for g in rows if g >= 0 and not holders[g]})
        if orphans:
            raise MimoFxError(f"dst_rows[{r}] needs rows {orphans[:8]} that no src rank "
                              f"holds; every needed row must appear in some src_rows")


# -- the row side of a layout ------------------------------------------------------------
def row_side(layout) -> Any:
    """``layout`` as one side of a row plan, the one place that asks its kind: a
    :class:`~mimo_fx.packed.PackedLayout` is its own row side, a box layout is seen through
    :class:`BoxRows` (which lists the questions both answer)."""
    from .packed import PackedLayout

    return layout if isinstance(layout, PackedLayout) else BoxRows(layout)


def is_row_layout(layout) -> bool:
    """Whether ``layout`` is given row by row (its row side names row dims)."""
    return bool(row_side(layout).row_dims)


def is_row_pair(src, dst) -> bool:
    """Whether a plan from ``src`` to ``dst`` moves rows (a side is given row by row)."""
    return bool(row_dims(src, dst))


def row_dims(src, dst) -> tuple[str, ...]:
    """The dims a row plan flattens into rows: the row side's (src's if both); () for two boxes."""
    return row_side(src).row_dims or row_side(dst).row_dims


@dataclass(frozen=True)
class BoxRows:
    """A box layout as a side of a row plan: its leading dims hold whole rows (checked by
    :meth:`check_side`), and a call's batch on it is the row dims' sizes.

    The row-side protocol, which :class:`~mimo_fx.packed.PackedLayout` implements too:
    ``row_dims`` (the dims it gives row by row; none here), :meth:`row_map`, :meth:`check_side`,
    :meth:`count_rows`, :meth:`implied`, :meth:`sizes_shown`, and a call's batch as
    data (:meth:`for_call`, :meth:`batch`, :meth:`batch_key`, :meth:`batch_data`,
    :meth:`from_batch`)."""

    layout: Any
    row_dims: tuple[str, ...] = ()

    def row_map(self, sizes: Mapping[str, object], rows: tuple[str, ...]
                ) -> dict[int, list[int]]:
        """Per holder, the global row of each local row (:func:`layout_rows`)."""
        return layout_rows(self.layout, sizes, rows)

    def check_side(self, rows: tuple[str, ...]) -> None:
        """Raises unless the layout holds whole ``rows`` (:func:`check_box_side`)."""
        check_box_side(self.layout, rows)

    def count_rows(self, sizes: dict, rows: tuple[str, ...]) -> dict:
        """``sizes`` as they are: a box side's row sizes are given or learned."""
        return sizes

    def implied(self, rows: tuple[str, ...]) -> tuple[str, ...]:
        """The row dims whose size every batch of the side gives: none."""
        return ()

    def sizes_shown(self, learn_shapes, learn_features) -> dict:
        """What a gather of the holders' local shapes shows: every dim (``learn_shapes()``)."""
        return learn_shapes()

    def for_call(self, layout) -> BoxRows:
        """The side of a call that brings ``layout``: itself (its batch is its row sizes)."""
        return self

    def batch(self) -> list[torch.Tensor]:
        """A call's batch as tensors: none (its row sizes travel as the call's sizes)."""
        return []

    def batch_values(self) -> list[tuple[int, ...]]:
        """:meth:`batch` as host ints: none."""
        return []

    def batch_key(self, full: Mapping[str, object], rows: tuple[str, ...]) -> tuple:
        """What makes a call's batch this one: its row sizes."""
        return tuple(full.get(d) for d in rows)

    def batch_data(self, flat: list) -> torch.Tensor:
        """A call's batch as one int64 vector: its row sizes ``flat`` (ints, or SymInts)."""
        return int_tensor(flat, "cpu")

    def from_batch(self, values: list[int], sizes: dict) -> tuple[Any, dict]:
        """The call's layout and row sizes from :meth:`batch_data`'s ints, read as ``sizes``."""
        return self.layout, sizes


def _row_map(layout, sizes: Mapping[str, object], rows: tuple[str, ...]) -> dict[int, list]:
    return row_side(layout).row_map(sizes, rows)


def check_box_side(layout, rows: tuple[str, ...]) -> None:
    """A box layout in a row plan: its first local dim is the rows, its other local
    dims whole features (a row plan moves whole rows, and local tensors as
    ``(rows, *features)``)."""
    from .layout import Layout

    if not isinstance(layout, Layout):
        raise MimoFxError(f"a row plan needs layouts, got {type(layout).__name__} "
                          f"{layout!r}")
    first = tuple(f.dim for f in layout.local_dims[0])
    rest = layout.local_dims[1:]
    if first != rows or any(len(g) != 1 or g[0].axes for g in rest) or layout.partial:
        flat = f"({' '.join(rows)})" if len(rows) > 1 else rows[0]
        raise MimoFxError(
            f"{layout.describe()!r} must hold whole rows to move to or from a packed "
            f"layout: its first local dim the rows {rows} (e.g. '(dp {flat}) h'), every "
            f"other dim a whole feature; reshape or redistribute to such a layout first")


def whole_features(layout):
    """``layout`` with its features whole: the axes that cut a local dim after the rows
    (e.g. ``tp`` of ``(cp t) (tp h)``) replicate it instead (``(cp t) h``); the layout
    itself where none does. A row plan moves whole rows; a bridge into cut features
    moves them whole to every rank of those axes, and each keeps its slice
    (:func:`feature_slices`)."""
    from .layout import Layout, _format_group

    groups = layout.local_dims
    cut = {a for g in groups[1:] for f in g for a in f.axes}
    if not cut:
        return layout
    pattern = " ".join([_format_group(groups[0])] + [" ".join(f.dim for f in g)
                                                     for g in groups[1:]])
    return Layout(layout.grid, pattern, partial=layout.partial, at=dict(layout.at),
                  zigzag=[a for a in layout.zigzag if a not in cut], split=layout.split,
                  ragged=layout.ragged)


def feature_slices(layout, sizes: Mapping[str, object], rank: int
                   ) -> tuple[tuple[int, int, int], ...]:
    """``(local dim, start, length)`` of ``rank``'s slice of each feature ``layout``
    cuts (local dims after the rows; ``sizes``: the features' sizes), in the row of
    :func:`whole_features`' layout; () where it cuts none or ``rank`` holds nothing."""
    from .regions import Tiling

    groups = layout.local_dims
    dims = tuple(g[0].dim for g in groups[1:] if g[0].axes)
    if not dims or not layout.holds(rank):
        return ()
    tiling = Tiling.of(layout, dims, {d: cast(int, sizes[d]) for d in dims})
    out = []
    for k, (t, owner) in enumerate(zip(tiling.tilings, tiling.owners(rank))):
        (start, stop), = t.owned(owner) or ((0, 0),)
        at = next(i for i, g in enumerate(groups) if g[0].dim == dims[k])
        out.append((at, start, stop - start))
    return tuple(out)


def _cut_features_fixed(layout, rows: tuple[str, ...], fixed: Mapping[str, object]) -> bool:
    """Whether ``layout`` holds whole rows and cuts its features only evenly or by
    ``tensor_split``/``chunk``, one axis group a feature, each of a size in ``fixed``
    (a bridge into it then moves whole rows: :func:`whole_features`)."""
    groups = layout.local_dims
    if tuple(f.dim for f in groups[0]) != rows or layout.partial:
        return False
    rest = groups[1:]
    if any(len(g) != 1 for g in rest):
        return False
    cut = [g[0] for g in rest if g[0].axes]
    return all(f.dim in fixed and not set(f.axes) & set(layout.zigzag) for f in cut)


def _counted(layout, grad_partial: tuple[str, ...]) -> list[int]:
    """The ranks whose cotangents count: one replica per set of replicas over the axes
    not in ``grad_partial`` (their coordinate 0)."""
    axes = [a for a in layout.replicated if a not in grad_partial]
    return [r for r in layout.holders
            if all(layout.grid.coord(r)[a] == 0 for a in axes)]


def check_row_sizes(src, dst, sizes: Mapping[str, object],
                    rows: tuple[str, ...] = ()) -> dict[str, object]:
    """Every dim's size for a row plan between ``src`` and ``dst`` over ``rows`` (default
    :func:`row_dims`): ``sizes`` plus what a side given row by row says of the row dims;
    raises if they disagree or one is missing."""
    if set(src.dims) != set(dst.dims):
        raise MimoFxError(
            f"src {src.describe()!r} and dst {dst.describe()!r} must name the same dims; "
            f"only in src: {sorted(set(src.dims) - set(dst.dims))}, only in dst: "
            f"{sorted(set(dst.dims) - set(src.dims))}")
    rows = rows or row_dims(src, dst)
    out = dict(sizes)
    for lay in (src, dst):
        out = row_side(lay).count_rows(out, rows)
    missing = [d for d in src.dims if d not in out]
    if missing:
        raise MimoFxError(f"sizes miss dims {missing}; pass the global size of every dim, "
                          f"e.g. {missing[0]}=...")
    return out


def plan_layouts(src, dst, sizes: Mapping[str, object], itemsize: int = 4,
                 grad_partial: tuple[str, ...] = (), rows: tuple[str, ...] = ()
                 ) -> RowRouting:
    """The row routing from layout ``src`` to layout ``dst`` (one of them a row layout,
    the other a row layout or a box layout whose leading dims are the rows); its plans
    are what :func:`mimo_fx.plan` returns for the pair. ``rows``: the dims moved as
    rows where neither side is given row by row (two box layouts whose leading dim is
    a ragged one: :func:`ragged_rows`)."""
    from .regions import total

    rows = rows or row_dims(src, dst)
    for lay in (src, dst):
        row_side(lay).check_side(rows)
    full = check_row_sizes(src, dst, sizes, rows)
    n = 1
    for d in rows:
        n *= total(full[d])  # type: ignore[arg-type]
    width = 1
    for d in src.dims:
        if d not in rows:
            width *= full[d]  # type: ignore[operator]
    for axis in grad_partial:
        if axis not in dst.replicated:
            raise MimoFxError(
                f"grad_partial={grad_partial}: axis {axis!r} is not replicated in dst "
                f"{dst.describe()!r} (replicated axes: {dst.replicated})")
    p = plan_rows(_row_map(src, full, rows), _row_map(dst, full, rows), n,
                  counted=_counted(dst, tuple(grad_partial)), row_bytes=width * itemsize)
    return replace(p, src=src, dst=dst, rows=rows)


def ragged_rows(src, dst, fixed: Mapping[str, object]) -> tuple[str, ...]:
    """The dim two box layouts move as rows, where a template cannot serve them: a free
    ragged dim (not in ``fixed``) that one layout cuts at its counts and the other evenly
    (the pieces are then intersections of two sets of bounds, no polynomial of the
    counts), when both layouts hold whole rows of it (:func:`check_box_side`; dst may
    cut features whose sizes are ``fixed``: see :func:`whole_features`); () if none."""
    from .layout import Layout

    if not (isinstance(src, Layout) and isinstance(dst, Layout)):
        return ()
    for d in dict.fromkeys(src.ragged_dims + dst.ragged_dims):
        if d in fixed or not any(lay.sharding[d] and d not in lay.ragged_dims
                                 for lay in (src, dst)):
            continue
        try:
            check_box_side(src, (d,))
            check_box_side(whole_features(dst), (d,))
        except MimoFxError:
            return ()
        # (a dst that cuts features gets whole rows and keeps its slices: the features
        # of a size built in)
        return (d,) if _cut_features_fixed(dst, (d,), fixed) else ()
    return ()
