"""Regions: which index boxes of the logical tensor each rank holds.

A *tiling* describes, per logical dim, a sorted list of disjoint intervals covering the
dim, each owned by a coordinate of the axes that shard that dim. A rank holds, on each
dim, the intervals whose owner matches its coordinate; its region is the product of those
interval lists (one box for plain sharding, several for zigzag). Tilings come from
layouts and can be *refined*: each interval of one dim cut further over extra axes, which
is how the planner describes a partial reduce-scatter's output or the first phase of a
two-phase transfer.

A box is a tuple of ``(start, stop)`` per dim, in the plan's canonical dim order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import product
from math import prod

from .errors import MimoFxError
from .grid import Grid
from .layout import Layout

__all__ = ["split_bounds", "chunk_bounds", "shard_bounds", "ragged_bounds", "DimTiling",
           "Tiling", "Box", "box_volume", "intersect", "total", "Size"]

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
    per = len(counts) // parts
    edges = prefix_sums(counts)
    return tuple((edges[k * per], edges[(k + 1) * per]) for k in range(parts))


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
    One interval per flat shard index (first axis slowest)."""
    out: list[Interval] = [(0, size)]
    for parts in sizes:
        nxt: list[Interval] = []
        for lo, hi in out:
            step = -(-(hi - lo) // parts)
            nxt.extend((min(lo + k * step, hi), min(lo + (k + 1) * step, hi))
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


@dataclass(frozen=True)
class DimTiling:
    """Intervals of one dim and, for each, the coordinate of ``axes`` owning it."""

    size: int
    axes: tuple[str, ...]
    intervals: tuple[Interval, ...]  # sorted by start, non-empty, disjoint, covering
    # (owners whose shard is empty, as uneven splits may leave, own no interval)
    owners: tuple[tuple[int, ...], ...]

    @cached_property
    def starts(self) -> tuple[int, ...]:
        return tuple(start for start, _ in self.intervals)

    @cached_property
    def by_owner(self) -> dict[tuple[int, ...], tuple[Interval, ...]]:
        out: dict[tuple[int, ...], list[Interval]] = {}
        for interval, owner in zip(self.intervals, self.owners):
            out.setdefault(owner, []).append(interval)
        return {k: tuple(v) for k, v in out.items()}

    def split(self, start: int, stop: int) -> list[tuple[Interval, tuple[int, ...]]]:
        """Cut ``[start, stop)`` at this tiling's bounds: ``[(piece, owner), ...]``."""
        out = []
        i = bisect_right(self.starts, start) - 1
        while start < stop:
            lo, hi = self.intervals[i]
            piece_stop = min(hi, stop)
            out.append(((start, piece_stop), self.owners[i]))
            start = piece_stop
            i += 1
        return out

    def refine(self, axes: tuple[str, ...], sizes: list[int]) -> DimTiling:
        """Cut every interval into ``prod(sizes)`` parts (tensor_split) owned by ``axes``."""
        intervals, owners = [], []
        for (lo, hi), owner in zip(self.intervals, self.owners):
            for k, (a, b) in enumerate(split_bounds(hi - lo, prod(sizes))):
                if b > a:
                    intervals.append((lo + a, lo + b))
                    owners.append((*owner, *_unflatten(k, sizes)))
        return DimTiling(self.size, self.axes + axes, tuple(intervals), tuple(owners))


def _dim_tiling(size: Size, axes: tuple[str, ...], grid: Grid, zigzag: bool,
                split: str = "tensor_split", ragged: bool = False) -> DimTiling:
    counts, size = size, total(size)
    if not axes:
        return DimTiling(size, (), ((0, size),) if size else (), ((),) if size else ())
    sizes = [grid.axis_size(a) for a in axes]
    parts = prod(sizes)
    per_shard: tuple[tuple[Interval, ...], ...]
    if ragged:
        assert isinstance(counts, tuple) and len(counts) % parts == 0
        per_shard = tuple((iv,) for iv in ragged_bounds(counts, parts))
    elif zigzag:
        per_shard = zigzag_bounds(size, parts)
    else:
        per_shard = tuple((iv,) for iv in shard_bounds(size, sizes, split))
    pieces: list = []
    for k, intervals in enumerate(per_shard):
        owner = _unflatten(k, sizes)
        pieces.extend((iv, owner) for iv in intervals if iv[1] > iv[0])
    pieces.sort()
    return DimTiling(size, axes, tuple(p[0] for p in pieces), tuple(p[1] for p in pieces))


def _unflatten(k: int, sizes: list[int]) -> tuple[int, ...]:
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

    def holds(self, rank: int) -> bool:
        if rank not in self.grid:
            return False
        if not self.pinned:
            return True
        coord = self.grid.coord_tuple(rank)
        return all(coord[k] == i for k, i in self._positions[1])

    def segments(self, rank: int) -> tuple[tuple[Interval, ...], ...]:
        """Per dim, the intervals ``rank`` holds, in local order (empty if it holds none)."""
        coord = self.grid.coord_tuple(rank)
        return tuple(
            tiling.by_owner.get(tuple(coord[k] for k in positions), ())
            for tiling, positions in zip(self.tilings, self._positions[0])
        )

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

    def owner_coords(self, box: Box) -> list[tuple[Box, list[tuple[int, int]]]]:
        """Cut ``box`` at this tiling's bounds: ``[(sub_box, [(axis position, index)])]``.

        The fixed coordinates cover the owning and pinned axes; holders of the sub-box
        are all ranks with those coordinates, whatever their free axes.
        """
        per_dim = [t.split(lo, hi) for t, (lo, hi) in zip(self.tilings, box)]
        positions, pinned = self._positions
        out = []
        for combo in product(*per_dim):
            fixed = list(pinned)
            for pos, (_, owner) in zip(positions, combo):
                fixed.extend(zip(pos, owner))
            out.append((tuple(iv for iv, _ in combo), fixed))
        return out


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
