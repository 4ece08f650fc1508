"""Lowering: one rank's share of a plan as a straight-line program of tensor ops.

Done once, eagerly, when a bridge is built: every box is resolved to slices of the
rank's stored pieces, every collective to a group name and fixed split sizes. The
program holds only ints, slices, tuples and strings, so the executor's loop over it is
all ``torch.compile`` sees: no planner code, no region arithmetic, no dict lookups by
layout (split sizes baked into a compiled graph come from here, keyed by static values).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod

from mimo_fx.local import box_slices, relative_slices
from mimo_fx.plan import Collective, Exchange, Gather, Plan, Reduce
from mimo_fx.regions import Box, Tiling, box_volume, intersect

from .groups import group_name

__all__ = ["Fill", "Piece", "Op", "Program", "lower"]


@dataclass(frozen=True)
class Fill:
    """Copy ``store[index][src]`` into ``target[dst]``."""

    index: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


@dataclass(frozen=True)
class Piece:
    """One box to pack: a view of one stored piece (``len(fills) == 1`` and whole) or a
    copy assembled from several."""

    shape: tuple[int, ...]
    fills: tuple[Fill, ...]
    whole: bool


@dataclass(frozen=True)
class Op:
    """One functional collective and how to pack its input and unpack its output.

    ``pack`` lists pieces and zero pads (ints, in elements) in buffer order; ``unpack``
    lists ``(offset, shape)`` of the new stored pieces in the output buffer; ``replace``
    says whether they replace the store (reductions) or join it.
    """

    kind: str
    group: str
    pack: tuple[Piece | int, ...]
    unpack: tuple[tuple[int, tuple[int, ...]], ...]
    replace: bool
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()


@dataclass(frozen=True)
class Program:
    """Everything one rank does for one plan."""

    src_expand: tuple[int, ...] | None  # local -> one axis per dim (pattern order)
    src_perm: tuple[int, ...]           # -> canonical order
    src_pieces: tuple[tuple[slice, ...], ...]
    ops: tuple[Op, ...]
    out_shape: tuple[int, ...] | None   # canonical dst piece; None: this rank holds none
    out_fills: tuple[Fill, ...]
    out_perm: tuple[int, ...]
    out_local: tuple[int, ...]          # the dst local shape (groups flattened)
    out_ndim: int                       # dims of the dst local tensor (also when empty)


def _resolve(boxes: list[Box], box: Box) -> Piece:
    """How to read ``box`` from stored pieces whose boxes are ``boxes``."""
    shape = tuple(hi - lo for lo, hi in box)
    for i, held in enumerate(boxes):
        if all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(held, box)):
            return Piece(shape, (Fill(i, relative_slices(held, box), ()),), True)
    fills = []
    for i, held in enumerate(boxes):
        inter = intersect(box, held)
        if inter is not None:
            fills.append(Fill(i, relative_slices(held, inter), relative_slices(box, inter)))
    assert sum(box_volume(_shape_box(f.dst)) for f in fills) >= box_volume(box), box
    return Piece(shape, tuple(fills), False)


def _shape_box(slices: tuple[slice, ...]) -> Box:
    return tuple((s.start, s.stop) for s in slices)


def _pack(boxes: list[Box], wanted, pad_to: int = 0) -> tuple[list, int]:
    items: list = [_resolve(boxes, b) for b in wanted]
    size = sum(box_volume(b) for b in wanted)
    if pad_to > size:
        items.append(pad_to - size)
    return items, max(size, pad_to)


def _unpack(wanted, offset: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    out = []
    for box in wanted:
        out.append((offset, tuple(hi - lo for lo, hi in box)))
        offset += box_volume(box)
    return out


def _member(groups, rank: int):
    return next((g for g, ranks in enumerate(groups) if rank in ranks), None)


def lower(plan: Plan, rank: int) -> Program:
    """The program ``rank`` runs for ``plan`` (groups must be prepared)."""
    sizes = dict(plan.sizes)
    store: list[Box] = []
    src_expand, src_perm, src_pieces = None, (), ()
    if plan.src.holds(rank):
        tiling = Tiling.of(plan.src, plan.dims, sizes)
        segments = tiling.segments(rank)
        ext = dict(zip(plan.dims, (sum(b - a for a, b in s) for s in segments)))
        src_expand = tuple(ext[d] for d in plan.src.dims)
        src_perm = tuple(plan.src.dims.index(d) for d in plan.dims)
        store = list(product(*segments))
        src_pieces = tuple(box_slices(segments, box) for box in store)
    ops = []
    for step in plan.steps:
        op, store = _lower_step(step, rank, store)
        if op is not None:
            ops.append(op)
    out_shape, out_fills, out_perm, out_local = None, (), (), ()
    if plan.dst.holds(rank):
        segments = plan.need.segments(rank)
        out_shape = tuple(sum(b - a for a, b in seg) for seg in segments)
        fills = []
        for box in product(*segments):
            for i, held in enumerate(store):
                inter = intersect(box, held)
                if inter is not None:
                    fills.append(Fill(i, relative_slices(held, inter), box_slices(segments, inter)))
        out_fills = tuple(fills)
        out_perm = tuple(plan.dims.index(d) for d in plan.dst.dims)
        ext = dict(zip(plan.dims, out_shape))
        out_local = tuple(prod(ext[f.dim] for f in g) for g in plan.dst.groups)
    return Program(src_expand, src_perm, src_pieces, tuple(ops), out_shape, out_fills,
                   out_perm, out_local, len(plan.dst.groups))


def _lower_step(step, rank: int, store: list[Box]) -> tuple[Op | None, list[Box]]:
    if isinstance(step, Exchange):
        if rank not in step.ranks:
            return None, store
        send: dict[int, list[Box]] = {}
        recv: dict[int, list[Box]] = {}
        for t in step.transfers:
            if t.src == rank:
                send.setdefault(t.dst, []).append(t.box)
            if t.dst == rank:
                recv.setdefault(t.src, []).append(t.box)
        out_boxes = [b for r in step.ranks for b in recv.get(r, ())]
        pack, _ = _pack(store, [b for r in step.ranks for b in send.get(r, ())])
        op = Op("all_to_all", group_name(step.ranks), tuple(pack), tuple(_unpack(out_boxes)),
                False, tuple(sum(map(box_volume, send.get(r, ()))) for r in step.ranks),
                tuple(sum(map(box_volume, recv.get(r, ()))) for r in step.ranks))
        return op, store + out_boxes
    g = _member(step.groups, rank)
    if g is None:
        return None, ([] if isinstance(step, Reduce) else store)
    ranks, parts = step.groups[g], step.parts[g]
    me = ranks.index(rank)
    chunk = max(sum(map(box_volume, part)) for part in parts)
    if isinstance(step, Gather):
        if chunk == 0 or len(ranks) == 1:
            return None, store
        pack, _ = _pack(store, parts[me], chunk)
        unpack, boxes = [], []
        for j, part in enumerate(parts):
            if j != me:
                unpack += _unpack(part, j * chunk)
                boxes += part
        op = Op("all_gather", group_name(ranks), tuple(pack), tuple(unpack), False)
        return op, store + boxes
    if step.kind is Collective.ALL_REDUCE:
        region = list(step.regions[g])
        pack, _ = _pack(store, region)
        if len(ranks) == 1:
            return None, store
        return Op("all_reduce", group_name(ranks), tuple(pack), tuple(_unpack(region)),
                  True), region
    if chunk == 0:
        return None, []
    if len(ranks) == 1:
        return None, store
    pack = []
    for part in parts:
        pack += _pack(store, part, chunk)[0]
    op = Op("reduce_scatter", group_name(ranks), tuple(pack), tuple(_unpack(parts[me])), True)
    return op, list(parts[me])
