"""Local tensors <-> canonical region tensors, and size inference.

A rank's local tensor follows its layout's pattern (groups flattened, dims in pattern
order). Executors work on the *canonical* view: one tensor axis per logical dim, in the
plan's dim order, holding the rank's segments of each dim back to back. These helpers
convert between the two with views and permutes only (no copies unless the pattern
permutes dims), and say where a global box sits inside the canonical view.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import product
from math import prod

import torch

from .errors import MimoFxError
from .layout import Layout
from .regions import Box, Size, Tiling, intersect, ragged_bounds, shard_bounds, total

__all__ = ["to_canonical", "from_canonical", "local_shape", "box_slices", "infer_sizes",
           "take", "assemble", "Store", "local_indices",
           "relative_slices"]


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


def relative_slices(outer: Box, inner: Box) -> tuple[slice, ...]:
    """Where ``inner`` sits inside a tensor holding ``outer``."""
    return tuple(slice(lo - a, hi - a) for (a, _), (lo, hi) in zip(outer, inner))


def take(store: Store, box: Box) -> torch.Tensor:
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


def assemble(store: Store, segments, dtype: torch.dtype, device, check: bool = False):
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


def local_indices(layout: Layout, rank: int, dim: str, size: Size) -> list[int]:
    """The global indices of ``dim`` that ``rank`` holds, in local order (e.g. the
    positions of a zigzag CP chunk, for a causal mask)."""
    sizes: dict[str, Size] = {d: (size if d == dim else 1) for d in layout.dims}
    tiling = Tiling.of(layout, (dim,), sizes)
    return [i for a, b in tiling.segments(rank)[0] for i in range(a, b)]
