"""Run one rank's lowered program (see :mod:`.lower`) with functional collectives.

The executor decides nothing: it views its src piece as stored boxes, packs each
collective's input buffer, issues the collective from
``torch.distributed._functional_collectives`` on a prepared group, unpacks the output,
and finally assembles the dst piece -- a straight line of tensor ops and collectives
that Dynamo traces without a graph break.
"""

from __future__ import annotations

from math import prod

import torch
import torch.distributed._functional_collectives as fc

from .lower import Op, Piece, Program

__all__ = ["CompiledExecutor"]


def _read(store: list[torch.Tensor], piece: Piece) -> torch.Tensor:
    if piece.whole:
        fill = piece.fills[0]
        return store[fill.index][fill.src].reshape(-1)
    out = store[0].new_empty(piece.shape)
    for fill in piece.fills:
        out[fill.dst] = store[fill.index][fill.src]
    return out.reshape(-1)


def _pack(store, op: Op, like: torch.Tensor, wire) -> torch.Tensor:
    parts = [like.new_zeros(item) if isinstance(item, int) else _read(store, item)
             for item in op.pack]
    if not parts:
        parts = [like.new_zeros(0)]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    return flat.to(wire) if wire is not None else flat


class CompiledExecutor:
    """Runs programs for one rank; ``tensors`` is always ``(local,)``.

    ``local`` is the rank's src piece, or an empty placeholder on ranks holding none;
    the result is the dst piece, or an empty tensor where it holds none. With
    ``comm_dtype`` data moves in that dtype and comes back in the caller's.
    """

    def __init__(self, rank: int, comm_dtype: torch.dtype | None = None) -> None:
        self.rank = rank
        self.comm_dtype = comm_dtype

    def run(self, program: Program, tensors: tuple[torch.Tensor, ...]):
        (local,) = tensors
        dtype = local.dtype
        store: list[torch.Tensor] = []
        if program.src_expand is not None:
            canon = local.reshape(program.src_expand).permute(program.src_perm)
            store = [canon[s] for s in program.src_pieces]
        like = local.detach()
        for op in program.ops:
            flat = self._collective(op, _pack(store, op, like, self.comm_dtype))
            if self.comm_dtype is not None:
                flat = flat.to(dtype)
            new = [flat[o:o + prod(shape)].view(shape) for o, shape in op.unpack]
            store = new if op.replace else store + new
        if program.out_shape is None:
            return (local.new_empty((0,) * program.out_ndim),)
        out = local.new_empty(program.out_shape)
        for fill in program.out_fills:
            out[fill.dst] = store[fill.index][fill.src]
        return (out.permute(program.out_perm).reshape(program.out_local),)

    @staticmethod
    def _collective(op: Op, flat: torch.Tensor) -> torch.Tensor:
        if op.kind == "all_gather":  # all_gather_single is the newer name (torch >= 2.10)
            gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
            return fc.wait_tensor(gather(flat, 0, op.group))
        if op.kind == "reduce_scatter":
            return fc.wait_tensor(fc.reduce_scatter_tensor(flat, "sum", 0, op.group))
        if op.kind == "all_reduce":
            return fc.wait_tensor(fc.all_reduce(flat, "sum", op.group))
        return fc.wait_tensor(fc.all_to_all_single(flat, list(op.out_splits),
                                                   list(op.in_splits), op.group))

