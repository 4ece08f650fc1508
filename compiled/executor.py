"""Run one rank's lowered program (see :mod:`.lowering`) with functional collectives.

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

from .lowering import Cat, Node, Op, Program, View

__all__ = ["CompiledExecutor"]


def _build(entries: list, node: Node) -> torch.Tensor:
    if type(node) is View:
        t = entries[node.entry]
        return t if node.index is None else t[node.index]
    if type(node) is Cat:
        return torch.cat([_build(entries, part) for part in node.parts], node.dim)
    out = entries[0].new_empty(node.shape)
    for entry, src, dst in node.writes:
        out[dst] = entries[entry][src]
    return out


def _pack(entries: list, op: Op, wire) -> torch.Tensor:
    items = op.pack
    if len(items) == 1 and type(items[0]) is not int:
        flat = _build(entries, items[0]).reshape(-1)
    elif op.stack:
        flat = torch.stack([_build(entries, item) for item in items]).view(-1)
    elif items:
        flat = torch.cat([entries[0].new_zeros(item) if type(item) is int
                          else _build(entries, item).reshape(-1) for item in items])
    else:
        flat = entries[0].new_zeros(0)
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
        canon = local
        if program.src_expand is not None:
            canon = canon.reshape(program.src_expand)
        if program.src_perm is not None:
            canon = canon.permute(program.src_perm)
        entries = [canon]
        wire = self.comm_dtype
        for op in program.ops:
            flat = self._collective(op, _pack(entries, op, wire))
            if wire is not None:
                flat = flat.to(dtype)
            entries += [None if u is None else flat[u[0]:u[0] + prod(u[1])].view(u[1])
                        for u in op.unpack]
        if program.out is None:
            return (local.new_empty((0,) * program.out_ndim),)
        out = _build(entries, program.out)
        if program.out_clone:
            out = out.clone()
        if program.out_perm is not None:
            out = out.permute(program.out_perm)
        if program.out_local is not None:
            out = out.reshape(program.out_local)
        return (out.contiguous(),)

    @staticmethod
    def _collective(op: Op, flat: torch.Tensor) -> torch.Tensor:
        if op.kind == "all_gather":  # all_gather_single is the newer name (torch >= 2.10)
            gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
            return fc.wait_tensor(gather(flat, 0, op.group))
        if op.kind == "reduce_scatter":
            scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
            return fc.wait_tensor(scatter(flat, "sum", 0, op.group))
        if op.kind == "all_reduce":
            return fc.wait_tensor(fc.all_reduce(flat, "sum", op.group))
        return fc.wait_tensor(fc.all_to_all_single(flat, list(op.out_splits),
                                                   list(op.in_splits), op.group))

