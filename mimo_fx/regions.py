"""Regions: which index boxes of the logical tensor each rank holds.

A *tiling* describes, per logical dim, a sorted list of disjoint intervals covering the
dim, each owned by a coordinate of the axes that shard that dim. A rank holds, on each
dim, the intervals whose owner matches its coordinate; its region is the product of those
interval lists (one box for plain sharding, several for zigzag). Tilings come from
layouts and can be *refined*: each interval of one dim cut further over extra axes, which
is how the planner describes a partial reduce-scatter's output or the first round of a
two-round exchange.

A box is a tuple of ``(start, stop)`` per dim, in the plan's canonical dim order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import product
from math import prod
from typing import ClassVar

import torch

from .errors import MimoFxError
from .grid import Grid
from .layout import Layout

__all__ = ["split_bounds", "chunk_bounds", "shard_bounds", "ragged_bounds", "DimTiling",
           "Cut", "TensorSplit", "Chunk", "Zigzag", "Ragged",
           "Tiling", "Box", "box_volume", "intersect", "total", "Size", "check_counts",
           "to_canonical", "from_canonical", "local_shape", "box_slices", "relative_slices",
           "assemble"]

Interval = tuple[int, int]
Box = tuple[Interval, ...]
Size = int | tuple[int, ...]  # a dim's global size, or the counts of a ragged dim


def total(size: Size) -> int:
    """A dim's global size: the size itself, or the sum of a ragged dim's counts."""
    return sum(size) if isinstance(size, tuple) else size


def prefix_sums(counts: tuple[int, ...]) -> list[int]:
    out, acc = [0], 0
    for c in counts:
        acc += c
        out.append(acc)
    return out


def ragged_bounds(counts: tuple[int, ...], parts: int) -> tuple[Interval, ...]:
    """Per shard, the interval a ragged cut gives it: shard ``k`` of ``parts`` holds the
    ``k``-th run of ``len(counts) // parts`` consecutive segments (empty if they are)."""
    edges = _ragged_edges(counts, parts)
    return tuple((edges[k], edges[k + 1]) for k in range(parts))


def _ragged_edges(counts: tuple[int, ...], parts: int) -> tuple[int, ...]:
    """The shards' boundaries of a ragged cut (``parts + 1`` of them)."""
    per = len(counts) // parts
    sums = prefix_sums(counts)
    return tuple(sums[k * per] for k in range(parts + 1))


def split_bounds(size: int, parts: int) -> tuple[Interval, ...]:
    """``torch.tensor_split`` intervals: the first ``size % parts`` get one more."""
    q, r = divmod(size, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + q + (1 if k < r else 0)
        out.append((start, stop))
        start = stop
    return tuple(out)


def chunk_bounds(size: int, sizes: list[int] | tuple[int, ...]) -> tuple[Interval, ...]:
    """DTensor's split over several axes, the first outermost: each axis cuts the
    interval the previous axes left into ``torch.chunk`` pieces of ``ceil(n / k)``, the
    trailing ones smaller or empty (an empty interval starts where its interval ends).
    One interval per flat shard index (first axis slowest). ``size`` may be a symbol
    under ``torch.compile`` (``torch.sym_min``: the bounds are its expressions, no guard).
    """
    out: list[Interval] = [(0, size)]
    for parts in sizes:
        nxt: list[Interval] = []
        for lo, hi in out:
            step = -(-(hi - lo) // parts)
            nxt.extend((torch.sym_min(lo + k * step, hi), torch.sym_min(lo + (k + 1) * step, hi))
                       for k in range(parts))
        out = nxt
    return tuple(out)


def shard_bounds(size: int, sizes: list[int] | tuple[int, ...], split: str) -> tuple[Interval, ...]:
    """Per flat shard index, the interval of a dim of ``size`` cut over axes of ``sizes``
    under a layout's ``split`` rule (see :class:`~mimo_fx.layout.Layout`)."""
    if split == "chunk":
        return chunk_bounds(size, sizes)
    return split_bounds(size, prod(sizes))


def zigzag_bounds(size: int, parts: int) -> tuple[tuple[Interval, ...], ...]:
    """Per shard k, chunks k and 2*parts-1-k of ``2*parts`` equal chunks."""
    chunk = size // (2 * parts)
    return tuple(
        ((k * chunk, (k + 1) * chunk), ((2 * parts - 1 - k) * chunk, (2 * parts - k) * chunk))
        for k in range(parts)
    )


def box_volume(box: Box) -> int:
    return prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _split_interval(size: int, parts: int, k: int) -> Interval:
    """Shard ``k`` of ``split_bounds(size, parts)``, computed rather than listed."""
    q, r = divmod(size, parts)
    start = k * q + min(k, r)
    return start, start + q + (k < r)


def _split_index(size: int, parts: int, x: int) -> int:
    """The shard of ``split_bounds(size, parts)`` holding position ``x``."""
    q, r = divmod(size, parts)
    big = r * (q + 1)  # the first r shards are one longer
    return x // (q + 1) if x < big else r + (x - big) // q


def _chunk_interval(size: int, parts: tuple[int, ...], k: int) -> Interval:
    """Shard ``k`` of ``chunk_bounds(size, parts)``, walking the axes outermost first."""
    lo, hi = 0, size
    for c, n in zip(_unflatten(k, parts), parts):
        step = -(-(hi - lo) // n)
        lo, hi = min(lo + c * step, hi), min(lo + (c + 1) * step, hi)
    return lo, hi


def _chunk_locate(size: int, parts: tuple[int, ...], x: int) -> tuple[int, int, int]:
    """``(start, stop, shard)`` of the ``chunk_bounds(size, parts)`` interval holding ``x``."""
    lo, hi, k = 0, size, 0
    for n in parts:
        step = -(-(hi - lo) // n)
        c = (x - lo) // step
        lo, hi, k = lo + c * step, min(lo + (c + 1) * step, hi), k * n + c
    return lo, hi, k


# -- cut rules: how a layout's axes cut one dim ------------------------------------------
@dataclass(frozen=True)
class Cut:
    """How the axes sharding a dim cut it into one interval per owner ``k`` of the
    axes' ``base`` sizes (before any refinement), each rule a small type answering the
    same questions, so a tiling never asks which rule it has. ``monotone``: owners rise
    along the dim, one interval each (all but zigzag)."""

    monotone: ClassVar[bool] = True

    def owned(self, size: int, base: tuple[int, ...], k: int) -> tuple[Interval, ...]:
        """The intervals owner ``k`` holds."""
        raise NotImplementedError

    def locate(self, size: int, base: tuple[int, ...], x: int) -> tuple[int, int, int]:
        """``(start, stop, owner)`` of the interval holding position ``x``."""
        raise NotImplementedError

    def starts(self, size: int, base: tuple[int, ...], ks: list[int]
               ) -> tuple[list[int], list[int]]:
        """The one interval of each of owners ``ks``, a column at a time (monotone)."""
        table = {k: self.owned(size, base, k)[0] for k in set(ks)}
        return [table[k][0] for k in ks], [table[k][1] for k in ks]

    def shortest(self, size: int, n: int) -> int | None:
        """The shortest of the ``n`` owners' intervals' lengths; None: some may be empty."""
        raise NotImplementedError

    def owners_at(self, size: int, base: tuple[int, ...], xs: list[int]) -> list[int] | None:
        """The owner of each position of ``xs`` in closed form; None: locate each."""
        return None

    def spans(self, size: int, base: tuple[int, ...], start: int, stop: int
              ) -> list[tuple[int, int, int]] | None:
        """``(owner, lo, hi)`` of the owners meeting ``[start, stop)``; None: locate them."""
        return None


@dataclass(frozen=True)
class TensorSplit(Cut):
    """``torch.tensor_split``'s rule, over the product of the axes: the first
    ``size % n`` shards one longer."""

    def owned(self, size, base, k):
        return (_split_interval(size, prod(base), k),)

    def locate(self, size, base, x):
        parts = prod(base)
        k = _split_index(size, parts, x)
        return (*_split_interval(size, parts, k), k)

    def starts(self, size, base, ks):
        q, r = divmod(size, prod(base))
        lo = [k * q + (k if k < r else r) for k in ks]
        return lo, [a + q + (k < r) for a, k in zip(lo, ks)]

    def shortest(self, size, n):
        return size // n

    def owners_at(self, size, base, xs):
        q, r = divmod(size, prod(base))
        big = r * (q + 1)
        return [x // (q + 1) if x < big else r + (x - big) // q for x in xs]

    def spans(self, size, base, start, stop):
        parts = prod(base)
        q, r = divmod(size, parts)
        first, last = (_split_index(size, parts, x) for x in (start, stop - 1))
        out = []
        for k in range(first, last + 1):
            lo = k * q + (k if k < r else r)
            out.append((k, lo, lo + q + (k < r)))
        return out


@dataclass(frozen=True)
class Chunk(Cut):
    """DTensor's ``torch.chunk`` rule, axis by axis outermost first (uneven sizes may
    leave empty shards after full ones)."""

    def owned(self, size, base, k):
        return (_chunk_interval(size, base, k),)

    def locate(self, size, base, x):
        return _chunk_locate(size, base, x)

    def shortest(self, size, n):
        return None if size % n else size // n


@dataclass(frozen=True)
class Zigzag(Cut):
    """Context parallelism's load balance over one axis of ``n``: owner k holds chunks
    k and 2n-1-k of 2n equal chunks."""

    monotone: ClassVar[bool] = False

    def owned(self, size, base, k):
        (n,) = base
        c = size // (2 * n)
        return (k * c, (k + 1) * c), ((2 * n - 1 - k) * c, (2 * n - k) * c)

    def locate(self, size, base, x):
        (n,) = base
        c = size // (2 * n)
        j = x // c
        return j * c, (j + 1) * c, j if j < n else 2 * n - 1 - j

    def shortest(self, size, n):
        return size // (2 * n)


@dataclass(frozen=True)
class Ragged(Cut):
    """Shards at run-time counts: ``edges``, the shards' boundaries."""

    edges: tuple[int, ...] = ()

    def owned(self, size, base, k):
        return ((self.edges[k], self.edges[k + 1]),)

    def locate(self, size, base, x):  # (the one non-empty shard holding x)
        k = bisect_right(self.edges, x) - 1
        return self.edges[k], self.edges[k + 1], k

    def starts(self, size, base, ks):
        return [self.edges[k] for k in ks], [self.edges[k + 1] for k in ks]

    def shortest(self, size, n):
        return min(b - a for a, b in zip(self.edges, self.edges[1:]))


@dataclass(frozen=True)
class DimTiling:
    """How one dim is cut into intervals, and which coordinate of ``axes`` owns each.

    The intervals follow from the rule and are computed on demand, never listed: a dim
    cut over 65,536 ranks costs nothing to build and O(1) per lookup. An *owner* is the
    flat index of a coordinate of ``axes`` (the first axis outermost); the last
    ``refined`` axes cut every interval of the others once more (``tensor_split``).
    Owners whose shard is empty, as uneven splits may leave, own no interval.
    """

    size: int
    axes: tuple[str, ...]
    parts: tuple[int, ...]  # the sizes of ``axes``
    rule: Cut = TensorSplit()  # how the layout's axes cut it
    refined: int = 0

    @cached_property
    def _sub(self) -> int:
        """Parts each interval of the layout's cut is refined into (1: not refined)."""
        return prod(self.parts[len(self.parts) - self.refined:])

    @cached_property
    def _base(self) -> tuple[int, ...]:
        return self.parts[:len(self.parts) - self.refined]

    @property
    def owners(self) -> int:
        """How many owner indices there are (``prod(parts)``)."""
        return prod(self.parts)

    @cached_property
    def _owned(self) -> dict[int, tuple[Interval, ...]]:
        return {}  # owner -> its intervals, as asked for (at most one entry per owner)

    def owned(self, owner: int) -> tuple[Interval, ...]:
        """The intervals ``owner`` holds, in order (none when its shard is empty)."""
        found = self._owned.get(owner)
        if found is None:
            found = self._owned[owner] = self._compute_owned(owner)
        return found

    def _compute_owned(self, owner: int) -> tuple[Interval, ...]:
        k, sub = divmod(owner, self._sub)
        out = []
        for lo, hi in self.rule.owned(self.size, self._base, k):
            if self.refined:
                a, b = _split_interval(hi - lo, self._sub, sub)
                lo, hi = lo + a, lo + b
            if hi > lo:
                out.append((lo, hi))
        return tuple(out)

    def bounds(self, owners: list[int]) -> tuple[list[int], list[int]] | None:
        """``(starts, stops)`` of the one interval each of ``owners`` holds (start = stop
        when it holds none), a column at a time; None under zigzag (two intervals)."""
        if not self.rule.monotone:
            return None
        distinct = set(owners)
        if 8 * len(distinct) < len(owners):  # few owners, many rows: look them up
            held = {o: self.owned(o) or ((0, 0),) for o in distinct}
            return [held[o][0][0] for o in owners], [held[o][0][1] for o in owners]
        sub = self._sub
        base = owners if sub == 1 else [o // sub for o in owners]
        lo, hi = self.rule.starts(self.size, self._base, base)
        if sub > 1:  # each cut into ``sub`` tensor_split parts: few lengths, few parts
            keys = list(zip([b - a for a, b in zip(lo, hi)], [o % sub for o in owners]))
            cuts = {key: _split_interval(key[0], sub, key[1]) for key in set(keys)}
            pieces = [cuts[key] for key in keys]
            lo, hi = [a + c[0] for a, c in zip(lo, pieces)], [a + c[1] for a, c in zip(lo, pieces)]
        return lo, hi

    def owners_at(self, xs: list[int]) -> list[int]:
        """The owner of the interval holding each position of ``xs`` (see :meth:`locate`),
        in closed form for an unrefined ``tensor_split``."""
        found = None if self.refined else self.rule.owners_at(self.size, self._base, xs)
        return [self.locate(x)[2] for x in xs] if found is None else found

    def locate(self, x: int) -> tuple[int, int, int]:
        """``(start, stop, owner)`` of the interval holding position ``x``."""
        lo, hi, k = self.rule.locate(self.size, self._base, x)
        if not self.refined:
            return lo, hi, k
        sub = _split_index(hi - lo, self._sub, x - lo)
        a, b = _split_interval(hi - lo, self._sub, sub)
        return lo + a, lo + b, k * self._sub + sub

    def split(self, start: int, stop: int) -> list[tuple[Interval, Interval, int]]:
        """Cut ``[start, stop)`` at this tiling's bounds: ``(piece, its interval, owner)``."""
        spans = None if self.refined else self.rule.spans(self.size, self._base, start, stop)
        if spans is not None:  # consecutive owners, in closed form
            out = []
            owned = self._owned
            for k, lo, hi in spans:
                # the owner's own interval object: whole-world plans share it, not copy it
                whole = owned[k][0] if k in owned else owned.setdefault(k, ((lo, hi),))[0]
                piece = whole if start <= lo and hi <= stop else (max(start, lo), min(stop, hi))
                out.append((piece, whole, k))
            return out
        out = []
        while start < stop:
            lo, hi, owner = self.locate(start)
            piece_stop = min(hi, stop)
            out.append(((start, piece_stop), (lo, hi), owner))
            start = piece_stop
        return out

    @cached_property
    def _all_owned(self) -> bool:
        """Whether every owner holds some interval (no empty shard): then the owners
        meeting a range are consecutive, except under zigzag."""
        shortest = self.rule.shortest(self.size, prod(self._base))
        return shortest is not None and shortest >= self._sub

    def owners_meeting(self, start: int, stop: int) -> range | tuple[int, ...]:
        """The owners whose intervals meet ``[start, stop)``, ascending: a ``range`` when
        they are consecutive (compared, hashed and searched in O(1)), else a tuple."""
        if self.rule.monotone and self._all_owned:
            return range(self.locate(start)[2], self.locate(stop - 1)[2] + 1)
        return _canonical(sorted({owner for _, _, owner in self.split(start, stop)}))

    def owner_span(self, start: int, stop: int) -> tuple[int, int]:
        """The least and greatest owner of the intervals meeting ``[start, stop)``.

        Owners rise along the dim, except under zigzag, where the chunks' owners rise
        over the first half and fall over the second.
        """
        first, last = self.locate(start)[2], self.locate(stop - 1)[2]
        if self.rule.monotone:
            return first, last
        (n,) = self._base
        c = self.size // (2 * n)
        ends = [first, last, self.locate(min(stop, (start // c + 1) * c) - 1)[2],
                self.locate(max(start, (stop - 1) // c * c))[2]]
        inner = range(start // c + 1, (stop - 1) // c)  # whole chunks between the ends
        if inner:
            chunks = {inner[0], inner[-1], *(j for j in (n - 1, n) if j in inner)}
            ks = [j if j < n else 2 * n - 1 - j for j in chunks]
            sub = self._sub
            ends += [min(ks) * sub, max(ks) * sub + min(c, sub) - 1]
        return min(ends), max(ends)

    def refine(self, axes: tuple[str, ...], sizes: list[int]) -> DimTiling:
        """Cut every interval into ``prod(sizes)`` parts (tensor_split) owned by ``axes``."""
        if self.refined:
            raise AssertionError("a dim tiling is refined once (by a reduction or a phase)")
        return DimTiling(self.size, self.axes + axes, self.parts + tuple(sizes), self.rule,
                         len(axes))


def _dim_tiling(size: Size, axes: tuple[str, ...], grid: Grid, zigzag: bool,
                split: str = "tensor_split", ragged: bool = False) -> DimTiling:
    parts = tuple(grid.axis_size(a) for a in axes)
    if ragged and axes:
        assert isinstance(size, tuple)
        return DimTiling(total(size), axes, parts, Ragged(_ragged_edges(size, prod(parts))))
    rule = Zigzag() if zigzag else (Chunk() if split == "chunk" and axes else TensorSplit())
    return DimTiling(total(size), axes, parts, rule)


def _canonical(owners) -> range | tuple[int, ...]:
    """Sorted distinct owners as a ``range`` if consecutive, else a tuple: one form per
    set, so equal sets compare and hash equal."""
    if owners and owners[-1] - owners[0] == len(owners) - 1:
        return range(owners[0], owners[-1] + 1)
    return tuple(owners)


@lru_cache(maxsize=16)
def _digit_column(local: range, stride: int, size: int) -> list[int]:
    """``(i // stride) % size`` for every ``i`` of ``local``, by repeating one period
    (remembered: one plan's passes over the ranks ask for the same ones; read only)."""
    period = stride * size
    block = [c for c in range(size) for _ in range(stride)]
    start = local.start % period
    reps = -(-(start + len(local)) // period)
    return (block * reps)[start:start + len(local)]


def _unflatten(k: int, sizes) -> tuple[int, ...]:
    """Shard index -> axis coordinates, the first axis outermost (slowest)."""
    out = []
    for size in reversed(sizes):
        k, c = divmod(k, size)
        out.append(c)
    return tuple(reversed(out))


@dataclass(frozen=True)
class Tiling:
    """Per-dim tilings over a grid plus the pinned coordinates; ``dims`` is canonical order."""

    grid: Grid
    dims: tuple[str, ...]
    tilings: tuple[DimTiling, ...]
    pinned: tuple[tuple[str, int], ...]

    @staticmethod
    def of(layout: Layout, dims: tuple[str, ...], sizes: Mapping[str, Size]) -> Tiling:
        """The tiling ``layout`` gives a tensor of ``sizes`` (ragged dims: their counts)."""
        zig = set(layout.zigzag)
        tilings = []
        for dim in dims:
            axes = layout.sharding[dim]
            is_zigzag = bool(axes) and axes[0] in zig
            if is_zigzag:
                parts = prod(layout.grid.axis_size(a) for a in axes)
                n = total(sizes[dim])
                if n % (2 * parts):
                    raise MimoFxError(
                        f"in layout {layout.pattern!r}: zigzag over {axes[0]!r} cuts dim "
                        f"{dim!r} into 2*{parts}={2 * parts} equal chunks, but {dim}="
                        f"{n} is not divisible by {2 * parts}; pad {dim!r} to a "
                        f"multiple of {2 * parts} or drop zigzag"
                    )
            ragged = dim in layout.ragged_dims
            if ragged:
                check_counts(layout, dim, sizes[dim])
            tilings.append(_dim_tiling(sizes[dim], axes, layout.grid, is_zigzag, layout.split,
                                       ragged))
        return Tiling(layout.grid, dims, tuple(tilings), layout.at)

    def load(self, layout: Layout, dims: tuple[str, ...], rank: int, local) -> list:
        """``rank``'s piece of ``layout`` as ``(box, values)`` pieces in canonical
        ``dims``, one per box it holds."""
        canon = to_canonical(local, layout, self, rank)
        segments = self.segments(rank)
        return [(box, canon[box_slices(segments, box)]) for box in product(*segments)]

    def assemble(self, layout: Layout, dims: tuple[str, ...], rank: int, store: list, like):
        """``rank``'s piece of ``layout`` from stored ``(box, values)`` pieces holding
        what it needs (on ``like``'s dtype and device)."""
        out = assemble(store, self.segments(rank), like.dtype, like.device, check=True)
        return from_canonical(out, layout, dims)

    @cached_property
    def owning_axes(self) -> frozenset[str]:
        return frozenset(a for t in self.tilings for a in t.axes)

    @cached_property
    def free_axes(self) -> tuple[str, ...]:
        """Axes along which holders replicate."""
        pinned = {a for a, _ in self.pinned}
        return tuple(a for a in self.grid.names if a not in self.owning_axes and a not in pinned)

    @cached_property
    def _positions(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, int], ...]]:
        """Grid positions of every dim's owning axes, and of the pinned axes."""
        index = self.grid.axis_index
        return (tuple(tuple(index(a) for a in t.axes) for t in self.tilings),
                tuple((index(a), i) for a, i in self.pinned))

    @cached_property
    def _digits(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per dim, ``(grid stride, axis size, owner weight)`` of each owning axis: an
        owner index is the sum of the axes' coordinates times their weights."""
        out = []
        for positions, t in zip(self._positions[0], self.tilings):
            weights = [prod(t.parts[i + 1:]) for i in range(len(t.parts))]
            out.append(tuple((self.grid.strides[k], n, w)
                             for k, n, w in zip(positions, t.parts, weights)))
        return tuple(out)

    def holds(self, rank: int) -> bool:
        if rank not in self.grid:
            return False
        if not self.pinned:
            return True
        coord = self.grid.coord_tuple(rank)
        return all(coord[k] == i for k, i in self._positions[1])

    def owners(self, rank: int) -> tuple[int, ...]:
        """Per dim, the owner index of ``rank``'s coordinate (``rank`` in the grid)."""
        local = rank - self.grid.offset
        return tuple(sum((local // stride) % n * w for stride, n, w in axes)
                     for axes in self._digits)

    def offset(self, dim: int, owner: int) -> int:
        """The rank offset of owner ``owner`` of dim ``dim`` (its coordinates times strides)."""
        axes = self._digits[dim]
        if len(axes) == 1:  # the common case: one axis, owner = coordinate
            return owner * axes[0][0]
        return sum((owner // w) % n * stride for stride, n, w in axes)

    def owner_columns(self, ranks: range) -> list[list[int]]:
        """Per dim, the owner index of every rank of ``ranks`` (inside the grid): what
        :meth:`owners` gives, a column at a time, for passes over all ranks."""
        local = range(ranks.start - self.grid.offset, ranks.stop - self.grid.offset)
        columns = []
        for axes in self._digits:
            if len(axes) == 1 and axes[0][2] == 1:  # one axis: the owner is its coordinate
                columns.append(_digit_column(local, *axes[0][:2]))
                continue
            column = [0] * len(local)
            for stride, n, w in axes:
                column = [a + b * w for a, b in zip(column, _digit_column(local, stride, n))]
            columns.append(column)
        return columns

    def held_owner_columns(self, ranks: range) -> list[list[int]]:
        """:meth:`owner_columns` for any range of ranks: -1 where a rank holds nothing."""
        inside = range(max(ranks.start, self.grid.ranks.start),
                       min(ranks.stop, self.grid.ranks.stop))
        before = max(0, min(inside.start, ranks.stop) - ranks.start)
        after = len(ranks) - before - len(inside)
        held = self.holds_column(ranks)
        columns = self.owner_columns(inside) if len(inside) else [[] for _ in self.tilings]
        return [[o if h else -1 for o, h in zip([-1] * before + c + [-1] * after, held)]
                for c in columns]

    def axes_column(self, ranks: range, axes: tuple[str, ...]) -> list[int]:
        """Per rank of ``ranks`` (inside the grid), the flat index of its coordinates on
        ``axes`` (the first outermost): the owner a refinement over ``axes`` adds."""
        local = range(ranks.start - self.grid.offset, ranks.stop - self.grid.offset)
        column = [0] * len(local)
        for a in axes:
            k = self.grid.axis_index(a)
            n = self.grid.sizes[k]
            digits = _digit_column(local, self.grid.strides[k], n)
            column = [c * n + d for c, d in zip(column, digits)]
        return column

    def holds_column(self, ranks: range) -> list[bool]:
        """Per rank of ``ranks``, whether it holds (in the grid and on the pinned index)."""
        grid = self.grid
        inside = range(max(ranks.start, grid.ranks.start), min(ranks.stop, grid.ranks.stop))
        column = [True] * len(inside)
        local = range(inside.start - grid.offset, inside.stop - grid.offset)
        for k, i in self._positions[1]:
            digits = _digit_column(local, grid.strides[k], grid.sizes[k])
            column = [a and b == i for a, b in zip(column, digits)]
        before = max(0, min(inside.start, ranks.stop) - ranks.start)
        return [False] * before + column + [False] * (len(ranks) - before - len(column))

    def segments(self, rank: int) -> tuple[tuple[Interval, ...], ...]:
        """Per dim, the intervals ``rank`` holds, in local order (empty if it holds none)."""
        return tuple(t.owned(o) for t, o in zip(self.tilings, self.owners(rank)))

    def boxes(self, rank: int) -> tuple[Box, ...]:
        """The boxes ``rank`` holds (empty if it is off the pinned index)."""
        if not self.holds(rank):
            return ()
        return tuple(product(*self.segments(rank)))

    def refine(self, dim: str, axes: tuple[str, ...]) -> Tiling:
        i = self.dims.index(dim)
        tilings = list(self.tilings)
        tilings[i] = tilings[i].refine(axes, [self.grid.axis_size(a) for a in axes])
        return Tiling(self.grid, self.dims, tuple(tilings), self.pinned)


def check_counts(layout: Layout, dim: str, size: Size) -> None:
    """``size`` must be counts ``layout`` can cut ``dim`` by: a tuple of non-negative ints
    whose length is a multiple of the dim's shards."""
    parts = layout.shards(dim)
    if not isinstance(size, tuple):
        raise MimoFxError(
            f"in layout {layout.describe()!r}: dim {dim!r} is cut ragged over "
            f"{layout.sharding[dim]}, so its size is a tuple of counts, one per shard (or "
            f"per segment, a multiple of {parts} of them), e.g. "
            f"{dim}={(size,) + (0,) * (parts - 1)}; got {dim}={size!r}")
    if len(size) % parts or not size:
        raise MimoFxError(
            f"in layout {layout.describe()!r}: dim {dim!r} is cut into {parts} ragged shards "
            f"but {dim}={size!r} has {len(size)} counts; give a multiple of {parts} counts "
            f"(shard k holds the k-th run of len/{parts} consecutive counts)")
    for c in size:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise MimoFxError(f"in layout {layout.describe()!r}: counts {dim}={size!r} must "
                              f"be non-negative integers")


# -- a rank's local tensor as a canonical view, and back -----------------------------------
def _extents(tiling: Tiling, rank: int) -> dict[str, int]:
    return {d: sum(b - a for a, b in seg) for d, seg in zip(tiling.dims, tiling.segments(rank))}


def local_shape(layout: Layout, tiling: Tiling, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s local tensor under ``layout``."""
    ext = _extents(tiling, rank)
    return tuple(prod(ext[f.dim] for f in group) for group in layout.local_dims)


def _check_ndim(shape: tuple[int, ...], layout: Layout, rank: int) -> None:
    if len(shape) != len(layout.local_dims):
        raise MimoFxError(
            f"rank {rank}: local tensor has {len(shape)} dims {tuple(shape)} but layout "
            f"pattern {layout.pattern!r} has {len(layout.local_dims)} local dims; give one tensor "
            f"dim per pattern group"
        )


def _check_shape(local: torch.Tensor, layout: Layout, tiling: Tiling, rank: int) -> None:
    _check_ndim(tuple(local.shape), layout, rank)
    expected = local_shape(layout, tiling, rank)
    if tuple(local.shape) != expected:
        sizes = {d: t.size for d, t in zip(tiling.dims, tiling.tilings)}
        raise MimoFxError(
            f"rank {rank}: local tensor has shape {tuple(local.shape)} but layout "
            f"{layout.describe()!r} with global sizes {sizes} "
            f"gives it shape {expected}; check the layout, the sizes, or the tensor"
        )


def to_canonical(local: torch.Tensor, layout: Layout, tiling: Tiling, rank: int) -> torch.Tensor:
    """View ``rank``'s local tensor with one axis per dim, in ``tiling.dims`` order."""
    _check_shape(local, layout, tiling, rank)
    ext = _extents(tiling, rank)
    expanded = local.reshape([ext[d] for d in layout.dims])
    order = [layout.dims.index(d) for d in tiling.dims]
    return expanded.permute(order)


def from_canonical(canon: torch.Tensor, layout: Layout, dims: tuple[str, ...]) -> torch.Tensor:
    """Inverse of :func:`to_canonical`: permute to pattern order and flatten groups."""
    expanded = canon.permute([dims.index(d) for d in layout.dims])
    ext = dict(zip(layout.dims, expanded.shape))
    return expanded.reshape([prod(ext[f.dim] for f in g) for g in layout.local_dims])


def box_slices(segments: tuple[tuple[tuple[int, int], ...], ...], box: Box) -> tuple[slice, ...]:
    """Where the global ``box`` sits in a canonical view holding ``segments``.

    The box must lie inside one segment per dim (plans guarantee it).
    """
    out = []
    for segs, (lo, hi) in zip(segments, box):
        offset = 0
        for a, b in segs:
            if a <= lo and hi <= b:
                out.append(slice(offset + lo - a, offset + hi - a))
                break
            offset += b - a
        else:
            raise AssertionError(f"box {box} not inside segments {segments}")
    return tuple(out)


def relative_slices(outer: Box, inner: Box) -> tuple[slice, ...]:
    """Where ``inner`` sits inside a tensor holding ``outer``."""
    return tuple(slice(lo - a, hi - a) for (a, _), (lo, hi) in zip(outer, inner))


def assemble(store: list[tuple[Box, torch.Tensor]], segments, dtype: torch.dtype, device,
             check: bool = False):
    """A canonical tensor holding ``segments`` (per dim), filled from ``store``.

    With ``check`` every element must be covered (an executor's self-test).
    """
    shape = [sum(b - a for a, b in seg) for seg in segments]
    out = torch.empty(shape, dtype=dtype, device=device)
    filled = torch.zeros(shape, dtype=torch.bool) if check else None
    for box in product(*segments):
        for held, tensor in store:
            inter = intersect(box, held)
            if inter is None:
                continue
            where = box_slices(segments, inter)
            out[where] = tensor[relative_slices(held, inter)]
            if filled is not None:
                filled[where] = True
    if filled is not None:
        assert bool(filled.all()), "plan left part of a dst piece unfilled"
    return out
