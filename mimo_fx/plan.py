"""The planner: a pure, cached, deterministic schedule for one redistribution.

``plan(src, dst, sizes, dtype)`` works on index boxes only and never touches
``torch.distributed``; executors (``mimo_fx.reference``, ``mimo_fx.compiled``) run its
steps. The same inputs give the same plan on every rank, so every rank issues the same
collectives in the same order.

How a plan is built:

1. *Reduce*: partial src axes (unless dst keeps them partial) are reduce-scattered inside
   their group, the region cut along the dim that leaves the least peak traffic after
   it, so each element crosses once.
2. *Exchange*: every dst rank asks, box by box, for what it needs and does not hold; the
   sender is chosen among the replicas holding the box (the receiver's own replica when
   it is on the src grid, else round-robin). When the grids are disjoint and dst
   replicates over some axes, each replica first takes a 1/k share (phase one)...
3. *Gather*: ...and the replicas all-gather their shares (phase two), so a piece several
   replicas need crosses between the grids once.
4. The executor assembles every dst rank's local tensor from what it holds.

An exchange whose transfers form disjoint all-gather groups is issued as all-gathers;
a reduce-scatter followed by an all-gather of the same shares is fused into an all-reduce.
Everything else is one uneven all-to-all over the union of the grids' ranks.

>>> from mimo_fx import Grid, Layout
>>> enc, llm = Grid(tp=2, dp=4), Grid(tp=2, cp=2, dp=2)
>>> p = plan(Layout(enc, "(dp b) s h"), Layout(llm, "(dp b) s h"), {"b": 8, "s": 4, "h": 16})
>>> [step.kind.value for step in p.steps]
['all_gather']
>>> p.max_recv == p.max_lower_bound
True
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cache, cached_property, lru_cache
from math import prod

from .errors import MimoFxError
from .layout import Layout
from .regions import Box, Size, Tiling, box_volume, intersect, total

__all__ = [
    "Collective", "Transfer", "ReduceScatter", "AllReduce", "Reduce", "Gather", "Exchange",
    "Plan", "plan", "backward_plan", "check_sizes", "size_arguments", "format_bytes",
]


class Collective(str, Enum):
    """The collectives a plan step can lower to."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"


@dataclass(frozen=True)
class Transfer:
    """``src`` sends ``box`` (canonical dim order) to ``dst``."""

    src: int
    dst: int
    box: Box


def _shared_traffic(step, reduce: bool, gather: bool):
    """Per-rank ``(sent, received)`` elements of a step over groups: a reduce-scatter
    member receives every other member's partials of its share and sends its partials
    of the others' shares; an all-gather member receives every other share and sends
    its own to each other member; an all-reduce is both."""
    for g, ranks in enumerate(step.groups):
        vols = [sum(map(box_volume, part)) for part in step.shares[g]]
        k, total = len(ranks), sum(vols)
        for rank, vol in zip(ranks, vols):
            sent = recv = 0
            if reduce:
                recv += (k - 1) * vol
                sent += total - vol
            if gather:
                recv += total - vol
                sent += (k - 1) * vol
            yield rank, sent, recv


def _shared_pairs(step, reduce: bool, gather: bool):
    """``(sender, receiver, elements)`` of a step over groups (see :func:`_shared_traffic`)."""
    for ranks, parts in zip(step.groups, step.shares):
        vols = [sum(map(box_volume, part)) for part in parts]
        for i, sender in enumerate(ranks):
            for j, receiver in enumerate(ranks):
                n = (vols[j] if reduce else 0) + (vols[i] if gather else 0)
                if i != j and n:
                    yield sender, receiver, n


def _reduction_bound(step, factor: int):
    """``(rank, elements)``: the bandwidth-optimal volume of a reduction per member: a
    reduce-scatter of a region R over k ranks receives (k-1)/k of R (``factor`` 1), an
    all-reduce twice that (``factor`` 2)."""
    for ranks, region in zip(step.groups, step.regions):
        k, volume = len(ranks), sum(map(box_volume, region))
        for rank in ranks:
            yield rank, factor * -(-(k - 1) * volume // k)


@dataclass(frozen=True)
class ReduceScatter:
    """Sum partial values inside each group: ``regions[g]`` is the group's common
    region, and member ``i`` of ``groups[g]`` keeps the sum over ``shares[g][i]``."""

    groups: tuple[tuple[int, ...], ...]
    regions: tuple[tuple[Box, ...], ...]
    shares: tuple[tuple[tuple[Box, ...], ...], ...]

    kind = Collective.REDUCE_SCATTER

    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups

    def traffic(self):
        """``(rank, elements sent, elements received)`` per member."""
        return _shared_traffic(self, True, False)

    def pairs(self):
        """``(sender, receiver, elements)`` per pair that exchanges anything."""
        return _shared_pairs(self, True, False)

    def reduction_bound(self):
        return _reduction_bound(self, 1)


@dataclass(frozen=True)
class AllReduce:
    """Sum partial values inside each group; every member keeps the sum over the whole
    region ``regions[g]``. It is a reduce-scatter of ``shares[g]`` fused with the
    all-gather of the same shares, and costs both."""

    groups: tuple[tuple[int, ...], ...]
    regions: tuple[tuple[Box, ...], ...]
    shares: tuple[tuple[tuple[Box, ...], ...], ...]

    kind = Collective.ALL_REDUCE

    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups

    def traffic(self):
        return _shared_traffic(self, True, True)

    def pairs(self):
        return _shared_pairs(self, True, True)

    def reduction_bound(self):
        return _reduction_bound(self, 2)


Reduce = ReduceScatter | AllReduce  # the steps that sum partial values


@dataclass(frozen=True)
class Gather:
    """All-gather inside each group: member ``i`` contributes ``shares[g][i]``."""

    groups: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[tuple[Box, ...], ...], ...]

    kind = Collective.ALL_GATHER

    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups

    def traffic(self):
        return _shared_traffic(self, False, True)

    def pairs(self):
        return _shared_pairs(self, False, True)

    def reduction_bound(self):
        return iter(())


@dataclass(frozen=True)
class Exchange:
    """Point-to-point transfers, issued as one uneven all-to-all over ``ranks``."""

    transfers: tuple[Transfer, ...]
    ranks: tuple[int, ...]

    kind = Collective.ALL_TO_ALL

    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        return (self.ranks,)

    def traffic(self):
        sent: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            n = box_volume(t.box)
            sent[t.src] += n
            recv[t.dst] += n
        for rank in sent.keys() | recv.keys():
            yield rank, sent[rank], recv[rank]

    def pairs(self):
        for t in self.transfers:
            yield t.src, t.dst, box_volume(t.box)

    def reduction_bound(self):
        return iter(())


Step = ReduceScatter | AllReduce | Gather | Exchange


@dataclass(frozen=True, eq=False)
class Plan:
    """A schedule of steps plus the tilings that define what every rank holds and needs.

    Compared and hashed by identity: plans are cached, and equal inputs return the same
    object.
    """

    src: Layout
    dst: Layout
    dims: tuple[str, ...]
    sizes: tuple[tuple[str, Size], ...]  # ragged dims: their counts
    itemsize: int
    steps: tuple[Step, ...]
    hold: Tiling = field(repr=False)
    need: Tiling = field(repr=False)
    reduced_axes: tuple[str, ...] = ()

    # -- cost ----------------------------------------------------------------------------
    @cached_property
    def _traffic(self) -> tuple[dict[int, int], dict[int, int]]:
        sent: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for step in self.steps:
            for rank, n_sent, n_recv in step.traffic():
                sent[rank] += n_sent
                recv[rank] += n_recv
        b = self.itemsize
        return ({r: v * b for r, v in sorted(sent.items()) if v},
                {r: v * b for r, v in sorted(recv.items()) if v})

    @property
    def bytes_sent(self) -> dict[int, int]:
        """Bytes each rank sends (ranks that send nothing are absent)."""
        return self._traffic[0]

    @property
    def bytes_recv(self) -> dict[int, int]:
        """Bytes each rank receives (ranks that receive nothing are absent)."""
        return self._traffic[1]

    @cached_property
    def lower_bound(self) -> dict[int, int]:
        """Per dst rank: bytes it needs and does not already hold (partial values don't count)."""
        out = {}
        held_counts = not self.reduced_axes
        for rank in self.dst.holders:
            need = self.need.boxes(rank)
            have = self.hold.boxes(rank) if held_counts else ()
            missing = sum(map(box_volume, need))
            for a in need:
                for h in have:
                    inter = intersect(a, h)
                    if inter:
                        missing -= box_volume(inter)
            out[rank] = missing * self.itemsize
        return out

    @property
    def max_recv(self) -> int:
        return max(self.bytes_recv.values(), default=0)

    @property
    def max_sent(self) -> int:
        return max(self.bytes_sent.values(), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())

    @property
    def max_lower_bound(self) -> int:
        return max(self.lower_bound.values(), default=0)

    @cached_property
    def reduction_bound(self) -> dict[int, int]:
        """Per rank: the bandwidth-optimal volume of the plan's reductions, in bytes.

        Reduce-scatter of a region R over k ranks: each receives (k-1)/k of R; an
        all-reduce: twice that.
        """
        out: dict[int, int] = defaultdict(int)
        for step in self.steps:
            for rank, n in step.reduction_bound():
                out[rank] += n * self.itemsize
        return dict(out)

    @cached_property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups of ranks (two or more) its steps run on, in issue order."""
        out: list[tuple[int, ...]] = []
        for step in self.steps:
            out.extend(g for g in step.rank_groups if len(g) > 1 and g not in out)
        return tuple(out)

    @property
    def collectives(self) -> tuple[tuple[Collective, int], ...]:
        """``(kind, number of groups)`` per step, in issue order."""
        return tuple((s.kind, len(s.rank_groups)) for s in self.steps)

    @property
    def totals(self) -> dict[str, int]:
        """Every dim's global size (a ragged dim's: the sum of its counts)."""
        return {d: total(n) for d, n in self.sizes}

    # -- printing ------------------------------------------------------------------------
    def describe_box(self, box: Box) -> str:
        sizes = self.totals
        parts = [f"{d}[{a}:{b}]" for d, (a, b) in zip(self.dims, box) if (a, b) != (0, sizes[d])]
        return " ".join(parts) or "all"

    def __str__(self) -> str:
        sizes = " ".join(f"{d}={n}" for d, n in self.sizes)
        lines = [
            f"plan {self.src.describe()} on {self.src.grid!r}",
            f"  -> {self.dst.describe()} on {self.dst.grid!r}   ({sizes}, {self.itemsize} B/elem)",
        ]
        if not self.steps:
            lines.append("  1. local: every dst rank slices what it holds (no communication)")
        for i, step in enumerate(self.steps, 1):
            lines.append(f"  {i}. {self._describe_step(step)}")
        lines.append(
            f"  cost: max recv {format_bytes(self.max_recv)}/rank (lower bound "
            f"{format_bytes(self.max_lower_bound)}), max sent {format_bytes(self.max_sent)}/rank, "
            f"total {format_bytes(self.total_bytes)}, {len(self.steps)} collective(s)"
        )
        return "\n".join(lines)

    def _describe_step(self, step: Step) -> str:
        if isinstance(step, Exchange):
            pairs = sorted({(t.src, t.dst) for t in step.transfers})
            shown = ", ".join(f"{s}->{d}" for s, d in pairs[:8])
            more = f", ... ({len(pairs)} pairs)" if len(pairs) > 8 else ""
            return (f"all_to_all over {len(step.ranks)} ranks, {len(step.transfers)} transfers: "
                    f"{shown}{more}")
        groups = _fmt_groups(step.groups)
        first = step.shares[0]
        shares = " | ".join(
            ", ".join(self.describe_box(b) for b in part) or "-" for part in first[:4]
        )
        if isinstance(step, Reduce):
            what = " + ".join(self.describe_box(b) for b in step.regions[0])
            return f"{step.kind.value} over {groups}: region {what}; shares {shares}"
        return f"all_gather over {groups}: shares {shares}"


def _fmt_groups(groups) -> str:
    shown = " ".join("(" + ",".join(map(str, g)) + ")" for g in groups[:4])
    more = f" ... {len(groups)} groups" if len(groups) > 4 else ""
    return shown + more


def format_bytes(n: float, digits: int = 1) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError


# -- entry points --------------------------------------------------------------------------
def plan(src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None) -> Plan:
    """The plan moving a tensor with global ``sizes`` from ``src`` to ``dst`` (a ragged
    dim's size is its tuple of counts).

    ``dtype`` is anything with an ``itemsize`` (a ``torch.dtype``); default 4 bytes.
    Pure and cached: equal arguments return the same object.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise MimoFxError(f"plan needs two Layouts, got {src!r} and {dst!r}")
    sizes_key = check_sizes(src, dst, sizes)
    itemsize = 4 if dtype is None else getattr(dtype, "itemsize", dtype)
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise MimoFxError(f"dtype={dtype!r}: give a torch.dtype (or a positive number of "
                          f"bytes per element)")
    return _plan(src, dst, sizes_key, itemsize)


def backward_plan(
    src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None, grad_partial=()
) -> Plan:
    """The adjoint plan: dst cotangents -> src* (src with partial axes replicated).

    Cotangents on dst's replicated axes are taken as consistent, except over the axes in
    ``grad_partial``, where each replica holds a contribution and they are summed.
    """
    return plan(_bwd_dst(dst, tuple(grad_partial)), _star(src), sizes, dtype)


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


def size_arguments(src: Layout, dst: Layout, sizes, dim_sizes: dict, where: str,
                   options: tuple[str, ...]) -> dict[str, int]:
    """The global sizes a call gives: ``sizes=`` merged with size keywords. Every name
    must be a dim of the layouts (a misspelt option is not a size)."""
    if sizes is not None and not isinstance(sizes, Mapping):
        raise MimoFxError(f"{where}: sizes={sizes!r} must be a dict {{dim: global size}}")
    merged = dict(sizes or {})
    twice = sorted(set(merged) & set(dim_sizes))
    if twice:
        raise MimoFxError(f"{where}: sizes of {twice} are given twice (in sizes= and as "
                          f"keywords); give each once")
    merged.update(dim_sizes)
    dims = tuple(dict.fromkeys(src.dims + dst.dims))
    unknown = [n for n in merged if n not in dims]
    if unknown:
        raise MimoFxError(
            f"{where}: {', '.join(map(repr, unknown))} is not a dim of src {src.pattern!r} or "
            f"dst {dst.pattern!r} (dims: {', '.join(dims)}) nor an option ("
            f"{', '.join(options)}); size keywords name dims only (a dim named like an "
            f"option goes in sizes={{...}})")
    ragged = set(src.ragged_dims) | set(dst.ragged_dims)
    for d, n in merged.items():
        _check_size(d, n, d in ragged, f"{where}: ")
    return merged


def _symbolic(n) -> bool:
    """A ``torch.SymInt`` (a size under ``torch.compile``): checked at run time."""
    return type(n).__name__ == "SymInt"


def _check_size(dim: str, n, ragged: bool = False, prefix: str = "") -> None:
    """A size is a positive int; a ragged dim's is its counts (non-negative ints)."""
    if isinstance(n, list):
        n = tuple(n)
    if _symbolic(n):
        return
    if ragged:
        if isinstance(n, tuple) and n and all(
                _symbolic(c) or (not isinstance(c, bool) and isinstance(c, int) and c >= 0)
                for c in n):
            return
        what = "a tuple" if not isinstance(n, tuple) else "a non-empty tuple"
        raise MimoFxError(f"{prefix}dim {dim!r} is cut ragged, so its size is a tuple of "
                          f"counts: {dim}={n!r} must be {what} of non-negative integers "
                          f"(one per ragged shard, or per segment)")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        kind = ("a tuple of counts (it is cut ragged)" if ragged
                else "a positive integer (the global size)")
        raise MimoFxError(f"{prefix}size {dim}={n!r} must be {kind}")


def check_sizes(src: Layout, dst: Layout,
                sizes: Mapping[str, Size]) -> tuple[tuple[str, Size], ...]:
    """Validate dims and sizes; return the sizes as a hashable tuple in src's dim order
    (a ragged dim keeps its counts as a tuple)."""
    if set(src.dims) != set(dst.dims):
        raise MimoFxError(
            f"src {src.pattern!r} and dst {dst.pattern!r} must name the same dims; "
            f"only in src: {sorted(set(src.dims) - set(dst.dims))}, only in dst: "
            f"{sorted(set(dst.dims) - set(src.dims))}"
        )
    unknown = sorted(set(sizes) - set(src.dims))
    if unknown:
        raise MimoFxError(f"sizes name dims {unknown} that {src.pattern!r} does not have; "
                          f"its dims are {src.dims}")
    missing = [d for d in src.dims if d not in sizes]
    if missing:
        raise MimoFxError(f"sizes miss dims {missing} of {src.pattern!r}; pass the global "
                          f"size of every dim, e.g. {missing[0]}=...")
    ragged = set(src.ragged_dims) | set(dst.ragged_dims)
    for d in src.dims:
        _check_size(d, sizes[d], d in ragged)
    if dst.partial:
        if dst.grid != src.grid or not set(dst.partial) <= set(src.partial):
            raise MimoFxError(
                f"dst {dst.describe()!r} is partial over {dst.partial}; a redistribute can "
                f"only keep partial axes that src {src.describe()!r} already has, on the same "
                f"grid. Make dst replicated (the values are then summed) instead"
            )
    return tuple((d, tuple(sizes[d]) if d in ragged else sizes[d])  # type: ignore[arg-type]
                 for d in src.dims)


# bounded: a run whose sizes change every step plans many sizes, and a plan at thousands
# of ranks holds many transfers
@lru_cache(maxsize=64)
def _plan(src: Layout, dst: Layout, sizes: tuple[tuple[str, Size], ...], itemsize: int) -> Plan:
    dims = tuple(d for d, _ in sizes)
    size_map = dict(sizes)
    hold = Tiling.of(src, dims, size_map)
    need = Tiling.of(dst, dims, size_map)
    kept = dst.partial
    reduce_axes = tuple(a for a in src.partial if a not in kept)
    steps: list[Step] = []
    phase_one, gather = need, None
    two_phase_axes = tuple(a for a in need.free_axes if a not in kept)
    disjoint = not set(src.grid.ranks) & set(dst.grid.ranks)
    if disjoint and prod(dst.grid.axis_size(a) for a in two_phase_axes) > 1:
        phase_one, gather = _two_phase(src, dst, need, two_phase_axes)
    if reduce_axes:
        hold, reduce_step, transfers = _reduce_scatter(src, hold, reduce_axes, phase_one, dst)
        steps.append(reduce_step)
    else:
        transfers = _exchange(hold, phase_one, dst, kept)
    if transfers:
        steps.append(_classify(transfers, src, dst))
    if gather is not None:
        steps.append(gather)
    steps = _fuse_all_reduce(steps)
    return Plan(src, dst, dims, sizes, itemsize, tuple(steps), hold, need, reduce_axes)


# -- planning steps ------------------------------------------------------------------------
def _longest_dim(tiling: Tiling, rank: int, ragged: frozenset[str] = frozenset()) -> str | None:
    """The dim along which ``rank``'s region is longest (first on ties): where to cut. A
    ragged dim is never cut (its boundaries are run-time counts); None if only those."""
    extents = [sum(b - a for a, b in seg) for seg in tiling.segments(rank)]
    candidates = [i for i, d in enumerate(tiling.dims) if d not in ragged]
    if not candidates:
        return None
    return tiling.dims[max(candidates, key=lambda i: (extents[i], -i))]


def _reduce_scatter(src: Layout, hold: Tiling, axes: tuple[str, ...], need: Tiling,
                    dst: Layout) -> tuple[Tiling, ReduceScatter, list[Transfer]]:
    """Reduce-scatter inside the partial groups, cut along the dim that gives the least
    peak per-rank traffic (reduction plus what is exchanged after it), then the least
    exchange, then the longest dim: so partial -> TP-sharded on the same dim is one
    reduce-scatter and nothing else."""
    groups = tuple(g for g in src.grid.groups(axes) if src.holds(g[0]))
    ragged = _ragged(src, dst)
    longest = _longest_dim(hold, groups[0][0], ragged)
    extents = dict(zip(hold.dims, (sum(b - a for a, b in seg)
                                   for seg in hold.segments(groups[0][0]))))
    k = len(groups[0])
    hinted = {d for d, run in dst.sharding.items() if set(run) & set(axes)}
    order = sorted(((i, d) for i, d in enumerate(hold.dims) if d not in ragged),
                   key=lambda e: (e[1] not in hinted, e[1] != longest))
    if not order:
        raise MimoFxError(
            f"src {src.describe()!r} is partial over {axes} but every dim is ragged; a "
            f"reduce-scatter cuts a dim of known size: add one, or reduce before moving")
    best = None
    for index, dim in order:
        refined = hold.refine(dim, axes)
        parts = tuple(tuple(refined.boxes(r) for r in g) for g in groups)
        transfers = _exchange(refined, need, dst, dst.partial)
        recv: dict[int, int] = defaultdict(int)
        for group, group_parts in zip(groups, parts):
            for rank, part in zip(group, group_parts):
                recv[rank] += (len(group) - 1) * sum(map(box_volume, part))
        for t in transfers:
            recv[t.dst] += box_volume(t.box)
        exchanged = sum(box_volume(t.box) for t in transfers)
        cost = (max(recv.values(), default=0), exchanged, dim != longest, index)
        if best is None or cost < best[0]:
            best = (cost, refined, parts, transfers)
        if not transfers and extents[dim] % k == 0:
            break  # a balanced reduce-scatter that leaves nothing to move: optimal
    assert best is not None  # k >= 2 candidates were tried
    _, refined, parts, transfers = best
    regions = tuple(hold.boxes(g[0]) for g in groups)
    return refined, ReduceScatter(groups, regions, parts), transfers


def _two_phase(src: Layout, dst: Layout, need: Tiling,
               axes: tuple[str, ...]) -> tuple[Tiling, Gather | None]:
    groups = tuple(g for g in dst.grid.groups(axes) if dst.holds(g[0]))
    dim = _longest_dim(need, groups[0][0], _ragged(src, dst))
    if dim is None:  # only ragged dims: every replica takes the whole box
        return need, None
    refined = need.refine(dim, axes)
    parts = tuple(tuple(refined.boxes(r) for r in g) for g in groups)
    return refined, Gather(groups, parts)


def _exchange(hold: Tiling, need: Tiling, dst: Layout, kept: tuple[str, ...]) -> list[Transfer]:
    """For every needed sub-box a rank does not hold, one sender among the holders.

    The sender is the receiver's own replica when the receiver is on the src grid (so
    colocated exchanges pair up into all-gathers), else the replica that has sent the
    fewest bytes so far, ties going round-robin from the receiver's replica index and
    shard: receivers visiting in rank order then spread each region's readers over its
    holders evenly, whatever the strides of the two grids (a fixed round-robin key can
    land on one holder for every reader when a stride is a multiple of the replicas).
    """
    src_grid, dst_grid = hold.grid, need.grid
    kept_pos = [(src_grid.axis_index(a), dst_grid.axis_index(a)) for a in kept]
    need_free = [dst_grid.axis_index(a) for a in need.free_axes if a not in kept]
    need_owning = [dst_grid.axis_index(a) for t in need.tilings for a in t.axes]
    free = [src_grid.axis_index(a) for a in hold.free_axes if a not in kept]
    free_sizes = [src_grid.sizes[k] for k in free]
    replicas = prod(free_sizes)
    strides, offset = src_grid.strides, src_grid.offset
    shifts = []  # rank offset of replica j from replica 0
    for j in range(replicas):
        shift = 0
        for k, n in zip(free, free_sizes):
            j, c = divmod(j, n)
            shift += c * strides[k]
        shifts.append(shift)
    sent: dict[int, int] = defaultdict(int)
    transfers = []
    for rank in dst.holders:
        coord = dst_grid.coord_tuple(rank)
        own = src_grid.coord_tuple(rank) if hold.holds(rank) else None
        salt = _mixed_index(coord, need_free, dst_grid) + _mixed_index(coord, need_owning,
                                                                        dst_grid)
        ordinal = 0
        for box in need.boxes(rank):
            for sub, fixed in hold.owner_coords(box):
                fixed.extend((k, coord[d]) for k, d in kept_pos)
                if own is not None:
                    if all(own[k] == v for k, v in fixed):
                        continue  # the receiver holds it already
                    sender = rank - sum(own[k] * strides[k] for k, _ in fixed) + sum(
                        v * strides[k] for k, v in fixed)
                else:
                    base = offset + sum(v * strides[k] for k, v in fixed)
                    first = salt + ordinal
                    sender = min((base + shifts[(first + t) % replicas] for t in range(replicas)),
                                 key=sent.__getitem__)
                    sent[sender] += box_volume(sub)
                ordinal += 1
                transfers.append(Transfer(sender, rank, sub))
    return transfers


def _ragged(src: Layout, dst: Layout) -> frozenset[str]:
    return frozenset(src.ragged_dims) | frozenset(dst.ragged_dims)


def _mixed_index(coord: tuple[int, ...], positions: list[int], grid) -> int:
    """Index of ``coord`` over the axes at ``positions``, the first fastest."""
    index, stride = 0, 1
    for k in positions:
        index += coord[k] * stride
        stride *= grid.sizes[k]
    return index


def _classify(transfers: list[Transfer], src: Layout, dst: Layout) -> Step:
    """Disjoint all-gather groups if the transfers form them, else one all-to-all."""
    sends: dict[int, dict[int, list[Box]]] = defaultdict(lambda: defaultdict(list))
    for t in transfers:
        sends[t.src][t.dst].append(t.box)
    groups: dict[tuple[int, ...], dict[int, tuple[Box, ...]]] = {}
    gather = True
    for sender, by_dst in sends.items():
        payloads = {tuple(boxes) for boxes in by_dst.values()}
        group = tuple(sorted({sender, *by_dst}))
        if len(payloads) != 1:
            gather = False
            break
        groups.setdefault(group, {})[sender] = payloads.pop()
    if gather:
        members = [r for g in groups for r in g]
        gather = len(members) == len(set(members)) and all(
            len(contrib) == len(g) for g, contrib in groups.items()
        )
    if gather:
        ordered = sorted(groups)
        return Gather(tuple(ordered), tuple(tuple(groups[g][r] for r in g) for g in ordered))
    union = tuple(sorted(set(src.grid.ranks) | set(dst.grid.ranks)))
    return Exchange(tuple(transfers), union)


def _fuse_all_reduce(steps: list[Step]) -> list[Step]:
    """reduce_scatter then all_gather of the same shares in the same groups = all_reduce."""
    if len(steps) >= 2 and isinstance(steps[0], ReduceScatter) and isinstance(steps[1], Gather):
        rs, ag = steps[0], steps[1]
        if rs.groups == ag.groups and rs.shares == ag.shares:
            return [AllReduce(rs.groups, rs.regions, rs.shares), *steps[2:]]
    return steps
