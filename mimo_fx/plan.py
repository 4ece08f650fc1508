"""The planner: a pure, cached, deterministic schedule for one redistribution.

``plan(src, dst, sizes, dtype)`` works on index boxes only and never touches
``torch.distributed``; executors (``mimo_fx.reference``, ``mimo_fx.compiled``) run its
steps. The same inputs give the same plan on every rank, so every rank issues the same
collectives in the same order. ``plan_for_rank(..., rank=r)`` is rank ``r``'s part of
that plan (its groups and transfers only), planned without the other ranks' transfers:
what a rank of a 65,536-rank job lowers.

How a plan is built:

1. *Reduce*: partial src axes (unless dst keeps them partial) are reduce-scattered inside
   their group, the region cut along the dim that leaves the least peak traffic after
   it, so each element crosses once.
2. *Exchange*: every dst rank gets, box by box, what it needs and does not hold, each
   piece from one holder: the receiver's own replica when it is on the src grid, else
   the holder its index among the piece's readers names (``mimo_fx.exchange``). When
   the grids are disjoint and dst replicates over some axes, each replica first takes a
   1/k share (round one)...
3. *Gather*: ...and the replicas all-gather their shares (round two), so a piece several
   replicas need crosses between the grids once. A small exchange goes in one round
   instead, each replica taking its whole piece (:func:`_one_round`).
4. The executor assembles every dst rank's local tensor from what it holds.

An exchange whose transfers form disjoint all-gather groups is issued as all-gathers;
a reduce-scatter followed by an all-gather of the same shares is fused into an all-reduce.
Everything else is one uneven all-to-all over the union of the grids' ranks. Those
decisions, which every rank must take alike, are made from the layouts in one pass over
the ranks' coordinates (:func:`_frame`), never from the transfers.

>>> from mimo_fx import Grid, Layout
>>> enc, llm = Grid(tp=2, dp=4), Grid(tp=2, cp=2, dp=2)
>>> p = plan(Layout(enc, "(dp b) s h"), Layout(llm, "(dp b) s h"), {"b": 8, "s": 4, "h": 16})
>>> [step.kind.value for step in p.steps]
['all_gather']
>>> p.max_recv == p.max_lower_bound
True
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from math import prod
from typing import Any, NamedTuple, overload

from .collective import Collective
from .errors import MimoFxError
from .exchange import Geometry, ReduceCosts, Transfer, want_holders
from .layout import Layout
from .regions import Size, Tiling, _digit_column, box_volume
from .sizes import check_sizes, size_arguments
from .steps import (
    STEPS,
    AllReduce,
    Exchange,
    Gather,
    Plan,
    RankPlan,
    Reduce,
    ReduceScatter,
    Step,
    kind_of,
)
from .text import format_bytes

__all__ = [
    "Collective", "Transfer", "Step", "STEPS", "kind_of", "ReduceScatter", "AllReduce", "Reduce",
    "Gather", "Exchange", "Plan", "RankPlan", "plan", "plan_for_rank", "backward_plan", "row_plans",
    "backward_layouts", "plan_groups", "plan_tilings", "check_sizes", "size_arguments",
    "format_bytes",
]



# -- entry points --------------------------------------------------------------------------
def plan(src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None, *,
         all_to_all: bool = False) -> Plan:
    """The plan moving a tensor with global ``sizes`` from ``src`` to ``dst`` (a ragged
    dim's size is its tuple of counts).

    ``dtype`` is anything with an ``itemsize`` (a ``torch.dtype``); default 4 bytes.
    ``all_to_all``: issue an exchange that forms all-gathers, or gathers among dst
    replicas after it, as one all-to-all over the union instead (for a caller without
    those groups' process groups). Pure and cached:
    equal arguments return the same object.
    """
    rows = _routed_rows(src, dst, sizes, dtype)
    if rows is not None:
        return rows[0]
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise MimoFxError(f"plan needs two layouts, got {src!r} and {dst!r}; build them "
                          f"with Layout(Grid(...), \"(dp b) s h\") (or PackedLayout)")
    return _plan(src, dst, check_sizes(src, dst, sizes), _itemsize(dtype), all_to_all)


def _itemsize(dtype) -> int:
    itemsize = 4 if dtype is None else getattr(dtype, "itemsize", dtype)
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise MimoFxError(f"dtype={dtype!r}: give a torch.dtype (or a positive number of "
                          f"bytes per element)")
    return itemsize


def plan_for_rank(src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None, *,
                  rank: int, all_to_all: bool = False) -> RankPlan:
    """``rank``'s part of ``plan(src, dst, sizes, dtype)``, planned alone.

    What a rank needs to lower its program (``mimo_fx.compiled.lowering.lower``): the
    same steps with only the groups and transfers it takes part in. Its cost grows with
    that rank's own transfers, not the world's; the decisions every rank must take alike
    take one cheap pass over the ranks. Pure and cached like :func:`plan`.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise MimoFxError(f"plan_for_rank needs two Layouts, got {src!r} and {dst!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise MimoFxError(f"plan_for_rank: rank={rank!r} must be a non-negative integer (the "
                          f"rank whose part to plan)")
    return _rank_plan(src, dst, check_sizes(src, dst, sizes), _itemsize(dtype), rank,
                      all_to_all)


def backward_plan(
    src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None, grad_partial=()
) -> Plan:
    """The adjoint plan: dst cotangents -> src* (src with partial axes replicated).

    Cotangents on dst's replicated axes are taken as consistent, except over the axes in
    ``grad_partial``, where each replica holds a contribution and they are summed.
    """
    rows = _routed_rows(src, dst, sizes, dtype, tuple(grad_partial))
    if rows is not None:
        return rows[1]
    return plan(*backward_layouts(src, dst, grad_partial), sizes, dtype)


def _routed_rows(src, dst, sizes, dtype, grad_partial: tuple[str, ...] = ()
                 ) -> tuple[Plan, Plan] | None:
    """Both plans of a pair with a packed layout on a side, which the row router routes
    (None for a pair of box layouts): the one place the planner asks a layout's kind."""
    from .rows import is_row_pair, plan_layouts

    if not is_row_pair(src, dst):
        return None
    return row_plans(plan_layouts(src, dst, sizes, _itemsize(dtype), grad_partial))


@overload
def row_plans(routing: Any, rank: None = None) -> tuple[Plan, Plan]: ...
@overload
def row_plans(routing: Any, rank: int) -> tuple[RankPlan, RankPlan]: ...
def row_plans(routing: Any, rank: int | None = None
              ) -> tuple[Plan, Plan] | tuple[RankPlan, RankPlan]:
    """Both directions of the row router's ``routing`` (:class:`~mimo_fx.rows.RowRouting`)
    as plans: forward, every rank's src rows to its dst rows; backward, the counted ranks'
    cotangents (each distinct row summed) to every holder of each row. One dim, the rows
    (its element a row of ``routing.row_bytes``; a box, a run of rows), what each rank
    holds a :class:`~mimo_fx.rows.RowTiling`, and one exchange of runs of rows over the
    routing's ranks each way. With ``rank``: that rank's parts (:class:`RankPlan`, equal
    to ``plan.for_rank(rank)``), which list only the transfers it sends or receives."""
    from .rows import RowMap, RowTiling

    r = routing
    src = r.src if r.src is not None else RowMap(dict(zip(r.ranks, r.src_rows)))
    dst = r.dst if r.dst is not None else RowMap(dict(zip(r.ranks, r.dst_rows)))
    held = RowTiling(dict(zip(r.ranks, r.src_rows)))
    used = RowTiling(dict(zip(r.ranks, r.dst_rows)))
    counted = RowTiling({rank: rows if rank in r.counted else (-1,) * len(rows)
                         for rank, rows in zip(r.ranks, r.dst_rows)})
    dims, sizes = (r.dim_name,), ((r.dim_name, r.n_rows),)
    fwd = (_row_exchange(r.ranks, r.sends, rank),)
    bwd = (_row_exchange(r.ranks, r.backward_sends, rank),)
    if rank is None:
        return (Plan(src, dst, dims, sizes, r.row_bytes, fwd, held, used, element="row"),
                Plan(dst, src, dims, sizes, r.row_bytes, bwd, counted, held, element="row"))
    return (RankPlan(src, dst, dims, sizes, r.row_bytes, fwd, held, used, element="row",
                     rank=rank),
            RankPlan(dst, src, dims, sizes, r.row_bytes, bwd, counted, held, element="row",
                     rank=rank))


def _row_exchange(ranks: tuple[int, ...], sends, rank: int | None = None) -> Exchange:
    """``sends[i][j]`` (the rising rows ``ranks[i]`` sends ``ranks[j]``) as one exchange:
    a transfer per run ``[a, b)`` of consecutive rows (with ``rank``: only those it
    sends or receives, in the same order)."""
    from .rows import runs

    return Exchange(tuple(Transfer(s, d, (run,)) for i, s in enumerate(ranks)
                          for j, d in enumerate(ranks) if rank is None or rank in (s, d)
                          for run in runs(sends[i][j])), ranks)


def backward_layouts(src: Layout, dst: Layout, grad_partial=()) -> tuple[Layout, Layout]:
    """The adjoint's (src, dst): dst with ``grad_partial`` partial, and src* (src with
    its partial axes replicated); ``plan_for_rank(*backward_layouts(...), ...)`` is one
    rank's part of :func:`backward_plan`."""
    return _bwd_dst(dst, tuple(grad_partial)), _star(src)


def plan_groups(src: Layout, dst: Layout, sizes: Mapping[str, Size], *,
                all_to_all: bool = False) -> tuple[tuple[int, ...], ...]:
    """The groups of ranks (two or more) the plan's steps run on, in issue order --
    ``plan(...).rank_groups`` -- from the decisions every rank shares, without any
    transfer: what every rank needs to create the same process groups in the same
    order while planning only its own part."""
    f = _frame(src, dst, check_sizes(src, dst, sizes), all_to_all)
    groups = (g for stage in _stages(f) for g in stage.groups())
    return tuple(dict.fromkeys(g for g in groups if len(g) > 1))


def plan_tilings(src: Layout, dst: Layout, sizes: Mapping[str, Size]) -> tuple[Tiling, ...]:
    """Every tiling the plan's boxes are cut from -- what src holds before and after its
    reduction, what the exchange delivers (dst's need, or its first phase's shares), what
    dst needs -- so every boundary of the plan is one of theirs."""
    f = _frame(src, dst, check_sizes(src, dst, sizes))
    return f.before, f.hold, f.exchange.want, f.need


@cache
def _star(layout: Layout) -> Layout:
    return layout.with_partial() if layout.partial else layout


@cache
def _bwd_dst(dst: Layout, grad_partial: tuple[str, ...]) -> Layout:
    for axis in grad_partial:
        if axis not in dst.replicated:
            raise MimoFxError(
                f"grad_partial={grad_partial}: axis {axis!r} is not replicated in dst "
                f"{dst.describe()!r} (replicated axes: {dst.replicated}); only cotangents "
                f"on replicated axes can be per-replica contributions"
            )
    return dst.with_partial(grad_partial) if grad_partial or dst.partial else dst



# -- what every rank's part of a plan derives from ------------------------------------------
@dataclass(frozen=True)
class _Frame:
    """The decisions of a plan that every rank must take alike (tilings, the reduction's
    cut, whether there is an exchange and which collective it is), each computed from
    the layouts alone in at most one cheap pass over the ranks."""

    src: Layout
    dst: Layout
    dims: tuple[str, ...]
    before: Tiling      # what src holds
    hold: Tiling        # what src holds after the reduction (before it if none)
    need: Tiling        # what dst needs
    exchange: Geometry  # what the exchange delivers: need, or its first phase's share
    reduce_axes: tuple[str, ...]
    gather_axes: tuple[str, ...]  # the second phase's axes (disjoint grids only)
    kind: Collective | None  # the exchange: None, ALL_GATHER or ALL_TO_ALL
    fused: bool         # reduce-scatter + all-gather of the same shares: one all-reduce

    @cached_property
    def union(self) -> tuple[int, ...]:
        """The ranks of both grids, in order: every one issues the all-to-all."""
        a, b = sorted((self.src.grid.ranks, self.dst.grid.ranks), key=lambda r: r.start)
        if b.start <= a.stop:
            return tuple(range(a.start, max(a.stop, b.stop)))
        return tuple(a) + tuple(b)


def _disjoint(src: Layout, dst: Layout) -> bool:
    a, b = src.grid.ranks, dst.grid.ranks
    return a.stop <= b.start or b.stop <= a.start


@lru_cache(maxsize=64)
def _frame(src: Layout, dst: Layout, sizes: tuple[tuple[str, Size], ...],
           all_to_all: bool = False) -> _Frame:
    dims = tuple(d for d, _ in sizes)
    size_map = dict(sizes)
    before = hold = Tiling.of(src, dims, size_map)
    need = Tiling.of(dst, dims, size_map)
    kept = dst.partial
    reduce_axes = tuple(a for a in src.partial if a not in kept)
    gather_axes = tuple(a for a in need.free_axes if a not in kept)
    want = need
    ragged = frozenset(src.ragged_dims) | frozenset(dst.ragged_dims)
    k = prod(dst.grid.axis_size(a) for a in gather_axes)
    phase_dim = _share_dim(need, dst, k, ragged)
    if (_disjoint(src, dst) and k > 1 and phase_dim is not None and not all_to_all
            and (reduce_axes or not _one_round(src, dst, dims, size_map, kept))):
        want = need.refine(phase_dim, gather_axes)
    else:  # (every dim ragged, a small exchange, or one all-to-all over the union asked
        gather_axes = ()  # for: each dst rank takes its whole box in one round)
    cut = _reduce_dim(src, dst, hold, want, reduce_axes) if reduce_axes else None
    if cut is not None:
        hold = hold.refine(cut, reduce_axes)
    geometry = Geometry(hold, want, kept)
    kind = geometry.kind()
    if all_to_all and kind is Collective.ALL_GATHER:
        kind = Collective.ALL_TO_ALL
    fused = (cut is not None and kind is Collective.ALL_GATHER
             and _fusable(before, want, cut, reduce_axes))
    return _Frame(src, dst, dims, before, hold, need, geometry, reduce_axes, gather_axes, kind,
                  fused)


ONE_ROUND_ELEMENTS = 1 << 16  # an exchange up to this many elements per receiver: one round
ONE_ROUND_SAMPLE = 256  # src and dst holders whose traffic decides one round or two


def _one_round(src: Layout, dst: Layout, dims: tuple[str, ...], sizes: Mapping[str, Size],
               kept: tuple[str, ...]) -> bool:
    """Whether an exchange across disjoint grids that several dst replicas need goes in
    one round, every dst rank taking its whole piece from the src holders, rather than
    two (a share from them, then the rest all-gathered among the replicas, so that each
    element crosses once). Both give every receiver the same bytes, the lower bound.
    Two rounds spare the link between the grids; one saves a round trip and a
    collective, which is most of the time of a small exchange. One round is taken when
    the busiest receiver takes at most ``ONE_ROUND_ELEMENTS`` and no sender sends more
    than it. Decided at even sizes (a ragged dim's counts equal), so that the sizes of a
    bridge whose sizes change share its template's structure, on the first
    ``ONE_ROUND_SAMPLE`` holders of each side (grids repeat their pattern along their
    outer axes)."""
    even = {d: _even_counts(sizes[d]) for d in dims}
    geometry = Geometry(Tiling.of(src, dims, even), Tiling.of(dst, dims, even), kept)
    recv = 0
    for r in dst.holders[:ONE_ROUND_SAMPLE]:  # (a large exchange is known at its first)
        recv = max(recv, sum(box_volume(t.box) for t in geometry.receives(r)))
        if recv > ONE_ROUND_ELEMENTS:
            return False
    return all(sum(box_volume(t.box) for t in geometry.sends(r)) <= recv
               for r in src.holders[:ONE_ROUND_SAMPLE])


def _even_counts(size: Size) -> Size:
    """``size``; a ragged dim's counts made equal (their mean, at least 1)."""
    if not isinstance(size, tuple):
        return size
    return (max(1, sum(size) // len(size)),) * len(size)


def _longest_dim(tiling: Tiling, rank: int, ragged: frozenset[str] = frozenset()) -> str | None:
    """The dim along which ``rank``'s region is longest (first on ties): where to cut. A
    ragged dim is never cut (its boundaries are run-time counts); None if only those."""
    extents = [sum(b - a for a, b in seg) for seg in tiling.segments(rank)]
    candidates = [i for i, d in enumerate(tiling.dims) if d not in ragged]
    if not candidates:
        return None
    return tiling.dims[max(candidates, key=lambda i: (extents[i], -i))]


def _share_dim(need: Tiling, dst: Layout, k: int, ragged: frozenset[str]) -> str | None:
    """The dim the first phase cuts into ``k`` shares: the outermost of the dst piece
    (its first local dim) that splits evenly, else the outermost at least ``k`` long,
    else the longest. Cut there, each share is a contiguous run of the dst piece: a
    sender sends a view, and the gathered shares laid end to end are the dst piece, with
    no copy on either side. None if every dim is ragged (never cut)."""
    rank = dst.holders[0]
    extents = dict(zip(need.dims, (sum(b - a for a, b in seg) for seg in need.segments(rank))))
    order = [d for d in dst.dims if d not in ragged]
    for fits in (lambda n: n % k == 0 and n >= k, lambda n: n >= k):
        for d in order:
            if fits(extents[d]):
                return d
    return _longest_dim(need, rank, ragged)


def _reduce_dim(src: Layout, dst: Layout, hold: Tiling, want: Tiling,
                axes: tuple[str, ...]) -> str:
    """The dim the reduce-scatter cuts: the least peak per-rank traffic (reduction plus
    what is exchanged after it), then the least exchange, then the longest dim; so
    partial -> TP-sharded on the same dim is one reduce-scatter and nothing else."""
    first = src.holders[0]
    k = len(src.grid.group_of(first, axes))
    ragged = frozenset(src.ragged_dims) | frozenset(dst.ragged_dims)
    longest = _longest_dim(hold, first, ragged)
    extents = dict(zip(hold.dims, (sum(b - a for a, b in seg) for seg in hold.segments(first))))
    hinted = {d for d, run in dst.sharding.items() if set(run) & set(axes)}
    order = sorted(((i, d) for i, d in enumerate(hold.dims) if d not in ragged),
                   key=lambda e: (e[1] not in hinted, e[1] != longest))
    if not order:
        raise MimoFxError(
            f"src {src.describe()!r} is partial over {axes} but every dim is ragged; a "
            f"reduce-scatter cuts a dim of known size: add one, or reduce before moving")
    costs = ReduceCosts(hold, want, axes)
    best = None
    for index, dim in order:
        peak, exchanged = costs.cost(index)
        cost = (peak, exchanged, dim != longest, index)
        if best is None or cost < best[0]:
            best = (cost, dim)
        if not exchanged and extents[dim] % k == 0:
            break  # a balanced reduce-scatter that leaves nothing to move: optimal
    assert best is not None  # k >= 2 candidates were tried
    return best[1]


def _fusable(before: Tiling, want: Tiling, dim: str, axes: tuple[str, ...]) -> bool:
    """Whether the reduce-scatter (into ``dim``, over ``axes``) and the all-gather after
    it are one all-reduce: every src holder wants exactly its group's region, cut as src
    cuts it, and every member's share is non-empty. Then the all-gather's groups are the
    reduce-scatter's and each member sends exactly its share. A column at a time."""
    ranks = before.grid.ranks
    head = range(ranks.start, min(ranks.stop, ranks.start + 64))
    return _fusable_over(head, before, want, dim, axes) and (
        head == ranks or _fusable_over(ranks, before, want, dim, axes))


def _fusable_over(ranks: range, before: Tiling, want: Tiling, dim: str,
                  axes: tuple[str, ...]) -> bool:
    """:func:`_fusable` for the src holders among ``ranks``."""
    k = prod(before.grid.axis_size(a) for a in axes)
    held = before.holds_column(ranks)
    cut = before.dims.index(dim)
    for d, (wanted, owners) in enumerate(zip(want.held_owner_columns(ranks),
                                             before.owner_columns(ranks))):
        w, h = want.tilings[d], before.tilings[d]

        def same(pair: tuple[int, int], w=w, h=h, d=d) -> bool:
            if pair[0] < 0:
                return False  # a src holder that holds no dst piece
            region = h.owned(pair[1])
            return w.owned(pair[0]) == region and (
                d != cut or all(b - a >= k for a, b in region))

        pairs = list(zip(wanted, owners))
        table = {pair: same(pair) for pair in set(pairs)}
        if not all(table[pair] for pair, mine in zip(pairs, held) if mine):
            return False
    return True


# -- the steps, for every rank or for one ---------------------------------------------------
class _Stage(NamedTuple):
    """One step of the plan, decided: the groups it runs on (all of them, without a
    transfer: what every rank creates process groups for) and the step itself, for every
    rank or for one (``step(rank)``)."""

    groups: Callable[[], tuple[tuple[int, ...], ...]]
    step: Callable[[int | None], Step]


def _stages(f: _Frame) -> tuple[_Stage, ...]:
    """The plan's steps in issue order: each decision written once, for the plan's
    steps and its process groups alike."""
    stages: list[_Stage] = []
    if f.reduce_axes:  # fused: the reduce-scatter's shares are all-gathered in its groups
        stages.append(_Stage(lambda: _groups(f.src, f.reduce_axes, None),
                             (lambda r: _all_reduce(f, r)) if f.fused
                             else (lambda r: _reduce_step(f, r))))
    if f.kind is Collective.ALL_TO_ALL:
        stages.append(_Stage(lambda: (f.union,),
                             lambda r: Exchange(_transfers(f, r), f.union)))
    elif f.kind is Collective.ALL_GATHER and not f.fused:
        stages.append(_Stage(lambda: _exchange_gather(f, None).groups,
                             lambda r: _exchange_gather(f, r)))
    if f.gather_axes:
        stages.append(_Stage(lambda: _groups(f.dst, f.gather_axes, None),
                             lambda r: _phase_two(f, r)))
    return tuple(stages)


def _steps(f: _Frame, rank: int | None) -> tuple[Step, ...]:
    """The plan's steps; with ``rank``, only the groups and transfers it takes part in."""
    return tuple(stage.step(rank) for stage in _stages(f))


def _all_reduce(f: _Frame, rank: int | None) -> AllReduce:
    rs = _reduce_step(f, rank)
    return AllReduce(rs.groups, rs.regions, rs.shares)


def _groups(layout: Layout, axes: tuple[str, ...], rank: int | None):
    """The groups of ``layout``'s holders varying ``axes``: all, or ``rank``'s (if any)."""
    if rank is None:
        return tuple(g for g in layout.grid.groups(axes) if layout.holds(g[0]))
    return (layout.grid.group_of(rank, axes),) if layout.holds(rank) else ()


def _reduce_step(f: _Frame, rank: int | None) -> ReduceScatter:
    groups = _groups(f.src, f.reduce_axes, rank)
    regions = tuple(f.before.boxes(g[0]) for g in groups)
    shares = tuple(tuple(f.hold.boxes(r) for r in g) for g in groups)
    return ReduceScatter(groups, regions, shares)


def _phase_two(f: _Frame, rank: int | None) -> Gather:
    groups = _groups(f.dst, f.gather_axes, rank)
    want = f.exchange.want
    return Gather(groups, tuple(tuple(want.boxes(r) for r in g) for g in groups))


def _exchange_gather(f: _Frame, rank: int | None) -> Gather:
    """The exchange issued as all-gathers: every group, or ``rank``'s."""
    geometry = f.exchange
    if rank is None:
        leaders = [r for r in want_holders(geometry.want) if geometry.lacks(r)]
    else:
        leaders = [rank] if geometry.want.holds(rank) and geometry.lacks(rank) else []
    groups, shares = [], []
    listed: set[int] = set()
    for leader in leaders:
        if leader in listed:
            continue  # its group is listed already, by its first member
        group = geometry.group(leader)
        listed.update(group)
        groups.append(group)
        shares.append(tuple(geometry.payload(m, group[0] if m != group[0] else group[1])
                            for m in group))
    return Gather(tuple(groups), tuple(shares))


def _transfers(f: _Frame, rank: int | None) -> tuple[Transfer, ...]:
    """Every receiver's transfers in rank order; or ``rank``'s part of that list."""
    geometry = f.exchange
    if rank is None:
        return tuple(t for r in want_holders(geometry.want) for t in geometry.receives(r))
    sends = geometry.sends(rank)
    cut = next((i for i, t in enumerate(sends) if t.dst > rank), len(sends))
    return tuple(sends[:cut]) + tuple(geometry.receives(rank)) + tuple(sends[cut:])


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Pause the cycle collector while planning: a plan at scale allocates millions of
    small acyclic tuples, which the collector would otherwise walk again and again (more
    than half the planning time of a 65,536-rank all-to-all). The caller's setting is
    restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@lru_cache(maxsize=64)
@_no_cycle_collection()
def _plan(src: Layout, dst: Layout, sizes: tuple[tuple[str, Size], ...], itemsize: int,
          all_to_all: bool = False) -> Plan:
    f = _frame(src, dst, sizes, all_to_all)
    return Plan(src, dst, f.dims, sizes, itemsize, _steps(f, None), f.hold, f.need,
                f.reduce_axes, f.before)


@lru_cache(maxsize=256)
@_no_cycle_collection()
def _rank_plan(src: Layout, dst: Layout, sizes: tuple[tuple[str, Size], ...], itemsize: int,
               rank: int, all_to_all: bool = False) -> RankPlan:
    f = _frame(src, dst, sizes, all_to_all)
    return RankPlan(src, dst, f.dims, sizes, itemsize, _steps(f, rank), f.hold, f.need,
                    f.reduce_axes, f.before, rank=rank)


def clear_caches() -> None:
    """Forget every cached plan (the whole-world ones, the per-rank ones, and the
    decisions both share): for timing cold planning."""
    _plan.cache_clear()
    _rank_plan.cache_clear()
    _frame.cache_clear()
    _digit_column.cache_clear()
