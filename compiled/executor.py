"""Run one rank's share of a plan with functional collectives.

Every step becomes one functional collective on a prepared group (all-gather,
reduce-scatter, all-reduce, or one uneven ``all_to_all_single``); boxes are packed into
contiguous buffers in plan order and unpacked after. All sizes come from the plan, so
they are constants in a traced graph and no shape handshake is needed. Only
``torch.distributed._functional_collectives`` is called, so Dynamo sees a straight line
of collectives.
"""

from __future__ import annotations

from itertools import product

import torch
import torch.distributed._functional_collectives as fc

from mimo_fx.local import Store, assemble, box_slices, from_canonical, take, to_canonical
from mimo_fx.plan import Exchange, Gather, Plan, Reduce
from mimo_fx.regions import Box, Tiling, box_volume

from .groups import group_name

__all__ = ["CompiledExecutor"]


def _pack(store: Store, boxes, pad_to: int, wire, like: torch.Tensor) -> torch.Tensor:
    """The boxes' values flattened back to back, zero-padded to ``pad_to`` elements."""
    pieces = [take(store, box).reshape(-1) for box in boxes]
    size = sum(p.numel() for p in pieces)
    if pad_to > size or not pieces:
        pieces.append(like.new_zeros(pad_to - size))
    flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return flat.to(wire) if wire is not None else flat


def _unpack(flat: torch.Tensor, boxes, dtype) -> Store:
    out, offset = [], 0
    for box in boxes:
        n = box_volume(box)
        piece = flat[offset:offset + n]
        if dtype is not None:
            piece = piece.to(dtype)
        out.append((box, piece.reshape([hi - lo for lo, hi in box])))
        offset += n
    return out


class CompiledExecutor:
    """Executes plans for one rank; ``tensors`` is always ``(local,)``.

    ``local`` is the rank's src piece, or an empty placeholder on ranks that hold none;
    the result is the rank's dst piece, or an empty tensor where it holds none.
    ``comm_dtype`` moves data in a narrower dtype and returns the caller's.
    """

    def __init__(self, rank: int, comm_dtype: torch.dtype | None = None) -> None:
        self.rank = rank
        self.comm_dtype = comm_dtype

    def run(self, plan: Plan, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        (local,) = tensors
        rank, dtype = self.rank, local.dtype
        store: Store = []
        if plan.src.holds(rank):
            tiling = Tiling.of(plan.src, plan.dims, dict(plan.sizes))
            canon = to_canonical(local, plan.src, tiling, rank)
            segments = tiling.segments(rank)
            store = [(box, canon[box_slices(segments, box)]) for box in product(*segments)]
        for step in plan.steps:
            if isinstance(step, Reduce):
                store = self._reduce(step, store, dtype, local)
            elif isinstance(step, Gather):
                store = store + self._gather(step, store, dtype, local)
            else:
                store = store + self._exchange(step, store, dtype, local)
        if not plan.dst.holds(rank):
            return (local.new_empty((0,) * len(plan.dst.groups)),)
        out = assemble(store, plan.need.segments(rank), dtype, local.device)
        return (from_canonical(out, plan.dst, plan.dims),)

    def _member(self, groups) -> int | None:
        for g, ranks in enumerate(groups):
            if self.rank in ranks:
                return g
        return None

    def _reduce(self, step: Reduce, store: Store, dtype, like) -> Store:
        g = self._member(step.groups)
        if g is None:
            return store
        ranks, parts = step.groups[g], step.parts[g]
        comm = self.comm_dtype
        if step.kind.value == "all_reduce":
            flat = _pack(store, step.regions[g], 0, comm, like)
            if len(ranks) > 1:
                flat = fc.wait_tensor(fc.all_reduce(flat, "sum", group_name(ranks)))
            return _unpack(flat, step.regions[g], dtype if comm else None)
        chunk = max(sum(map(box_volume, part)) for part in parts)
        me = ranks.index(self.rank)
        if chunk == 0:
            return []
        flat = torch.cat([_pack(store, part, chunk, comm, like) for part in parts])
        if len(ranks) > 1:
            flat = fc.wait_tensor(fc.reduce_scatter_tensor(flat, "sum", 0, group_name(ranks)))
        else:
            flat = flat[:chunk]
        return _unpack(flat, parts[me], dtype if comm else None)

    def _gather(self, step: Gather, store: Store, dtype, like) -> Store:
        g = self._member(step.groups)
        if g is None:
            return []
        ranks, parts = step.groups[g], step.parts[g]
        chunk = max(sum(map(box_volume, part)) for part in parts)
        if chunk == 0:
            return []
        me = ranks.index(self.rank)
        comm = self.comm_dtype
        flat = _pack(store, parts[me], chunk, comm, like)
        gathered = fc.wait_tensor(fc.all_gather_tensor(flat, 0, group_name(ranks)))
        out: Store = []
        for j, part in enumerate(parts):
            if j != me:
                out.extend(_unpack(gathered[j * chunk:(j + 1) * chunk], part,
                                   dtype if comm else None))
        return out

    def _exchange(self, step: Exchange, store: Store, dtype, like: torch.Tensor) -> Store:
        if self.rank not in step.ranks:
            return []
        send: dict[int, list[Box]] = {}
        recv: dict[int, list[Box]] = {}
        for t in step.transfers:
            if t.src == self.rank:
                send.setdefault(t.dst, []).append(t.box)
            if t.dst == self.rank:
                recv.setdefault(t.src, []).append(t.box)
        comm = self.comm_dtype
        wire = comm or dtype
        like = like.detach()
        in_splits = [sum(map(box_volume, send.get(r, ()))) for r in step.ranks]
        out_splits = [sum(map(box_volume, recv.get(r, ()))) for r in step.ranks]
        boxes = [b for r in step.ranks for b in send.get(r, ())]
        flat = _pack(store, boxes, 0, wire, like)
        got = fc.wait_tensor(fc.all_to_all_single(flat, out_splits, in_splits,
                                                  group_name(step.ranks)))
        return _unpack(got, [b for r in step.ranks for b in recv.get(r, ())],
                       dtype if comm else None)
