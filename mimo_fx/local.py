"""Local tensors <-> canonical region tensors, and size inference.

A rank's local tensor follows its layout's pattern (groups flattened, dims in pattern
order). Executors work on the *canonical* view: one tensor axis per logical dim, in the
plan's dim order, holding the rank's segments of each dim back to back. These helpers
convert between the two with views and permutes only (no copies unless the pattern
permutes dims), and say where a global box sits inside the canonical view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

import torch

from .errors import MimoFxError
from .layout import Layout
from .regions import (
    Box,
    Size,
    Tiling,
    _check_ndim,
    assemble,
    box_slices,
    from_canonical,
    intersect,
    local_shape,
    ragged_bounds,
    relative_slices,
    shard_bounds,
    to_canonical,
    total,
)

__all__ = ["to_canonical", "from_canonical", "local_shape", "box_slices", "infer_sizes",
           "read_box", "assemble", "Store", "local_indices",
           "relative_slices", "int_tensor"]


def _raise(ok, message) -> None:
    if not ok:
        raise MimoFxError(message())


def infer_sizes(
    layout: Layout, shapes: dict[int, tuple[int, ...]], given: Mapping[str, Size],
    check=_raise
) -> dict[str, Size]:
    """Global dim sizes from local shapes, ``given`` first.

    With every shard's shape at hand (the reference backend, or the shapes a call's
    size gather collects) uneven splits are inferred exactly, and a ragged dim's counts
    (one per shard); from one rank's shape a sharded dim is taken as evenly split. A
    group flattening several dims needs all but one of them given. Replicas of one
    shard must agree: a rank whose shape differs is named. ``check(ok, message)``
    rejects what does not hold (a :class:`MimoFxError` with ``message()`` by default;
    the compiled backend passes a run-time check when the shapes are symbolic).
    """
    unknown = [d for d in given if d not in layout.dims]
    if unknown:
        raise MimoFxError(f"sizes name {unknown}, which are not dims of {layout.pattern!r}; "
                          f"its dims are {layout.dims}")
    for rank, shape in shapes.items():
        _check_ndim(shape, layout, rank)
    sizes = dict(given)
    for gi, group in enumerate(layout.local_dims):
        unknown_factors = [f for f in group if f.dim not in sizes]
        if not unknown_factors:
            continue
        if len(unknown_factors) > 1:
            names = [f.dim for f in unknown_factors]
            raise MimoFxError(
                f"layout {layout.pattern!r}: local dim {gi} flattens {names}, so their global "
                f"sizes cannot be told apart from the local shape; pass all but one of them "
                f"as keyword sizes, e.g. {names[-1]}=..."
            )
        sizes[unknown_factors[0].dim] = _infer_one(layout, gi, unknown_factors[0], shapes,
                                                   sizes, check)
    return sizes


@torch.compiler.assume_constant_result
def _shard(grid, axes: tuple[str, ...], rank: int) -> tuple[int, ...]:
    """``rank``'s coordinate on ``axes``: plain Python on constants, which Dynamo calls
    once while tracing instead of tracing the coordinate's arithmetic per rank."""
    coord = grid.coord(rank)
    return tuple(coord[a] for a in axes)


def _infer_one(layout: Layout, gi: int, factor, shapes, sizes, check=_raise) -> Size:
    """The global size of ``factor`` (the one unknown dim of local dim ``gi``); a ragged
    dim's counts, one per shard in flat shard order."""
    per_shard: dict[tuple[int, ...], tuple[int, int]] = {}  # shard -> (extent, rank)
    for rank, shape in shapes.items():
        others = 1
        for f in layout.local_dims[gi]:
            if f is not factor:
                others *= _local_extent(layout, f, sizes[f.dim], rank)
        if isinstance(others, int) and others == 0:
            continue
        key = _shard(layout.grid, tuple(factor.axes), rank)
        extent = shape[gi] // others
        check(extent * others == shape[gi], lambda r=rank, n=shape[gi], o=others: (
              f"rank {r}: local dim {gi} of {layout.pattern!r} has {n} elements, "
              f"not a multiple of {o} (the other dims it flattens); check the sizes"))
        seen = per_shard.setdefault(key, (extent, rank))
        check(seen[0] == extent, lambda r=rank, n=shape[gi], o=others, s=seen: (
              f"ranks {s[1]} and {r} hold the same shard of {factor.dim!r} under "
              f"{layout.pattern!r} but their local dim {gi} has {s[0] * o} and "
              f"{n} elements; one of them passed the wrong tensor"))
    parts = 1
    for a in factor.axes:
        parts *= layout.grid.axis_size(a)
    if factor.dim in layout.ragged_dims:
        if len(per_shard) < parts:
            raise MimoFxError(
                f"cannot infer the counts of ragged dim {factor.dim!r} in "
                f"{layout.describe()!r}: only {len(per_shard)} of its {parts} shards have a "
                f"piece here; pass {factor.dim}=(c0, c1, ...)")
        return tuple(per_shard[key][0] for key in sorted(per_shard.keys()))
    if len(per_shard) == parts:
        keys = sorted(per_shard.keys())
        total_ = per_shard[keys[0]][0]
        for key in keys[1:]:
            total_ = total_ + per_shard[key][0]
        return total_
    if per_shard:
        return max([extent for extent, _ in per_shard.values()]) * parts
    raise MimoFxError(f"cannot infer the size of {factor.dim!r} in {layout.pattern!r}; pass "
                      f"{factor.dim}=...")


def _local_extent(layout: Layout, factor, size: Size, rank: int) -> int:
    if not factor.axes:
        return total(size)
    coord = layout.grid.coord(rank)
    sizes = [layout.grid.axis_size(a) for a in factor.axes]
    k = 0
    for a, n in zip(factor.axes, sizes):
        k = k * n + coord[a]
    parts = prod(sizes)
    if factor.dim in layout.ragged_dims:
        assert isinstance(size, tuple)
        lo, hi = ragged_bounds(size, parts)[k]
        return hi - lo
    size = total(size)
    if factor.axes[0] in layout.zigzag:
        return 2 * (size // (2 * parts))
    lo, hi = shard_bounds(size, sizes, layout.split)[k]
    return hi - lo


Store = list[tuple[Box, torch.Tensor]]


def read_box(store: Store, box: Box) -> torch.Tensor:
    """The values of ``box`` from stored ``(box, tensor)`` pieces: a view of the one piece
    containing it, else a copy assembled from several."""
    for held, tensor in store:
        if all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(held, box)):
            return tensor[relative_slices(held, box)]
    sample = store[0][1]
    out = sample.new_empty([hi - lo for lo, hi in box])
    for held, tensor in store:
        inter = intersect(box, held)
        if inter is not None:
            out[relative_slices(box, inter)] = tensor[relative_slices(held, inter)]
    return out


def local_indices(layout: Layout, rank: int, dim: str, size: Size) -> list[int]:
    """The global indices of ``dim`` that ``rank`` holds, in local order (e.g. the
    positions of a zigzag CP chunk, for a causal mask)."""
    sizes: dict[str, Size] = {d: (size if d == dim else 1) for d in layout.dims}
    tiling = Tiling.of(layout, (dim,), sizes)
    return [i for a, b in tiling.segments(rank)[0] for i in range(a, b)]


def int_tensor(values: Sequence[Any], device) -> torch.Tensor:
    """An int64 vector of ``values`` (ints, or SymInts under ``torch.compile``), a sum with
    zeros so the compiler cannot constant-fold it and run the op it feeds while tracing."""
    const = torch.tensor(list(values), dtype=torch.int64, device=device)
    return torch.zeros(len(values), dtype=torch.int64, device=device) + const
