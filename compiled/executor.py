"""Run one rank's lowered program (see :mod:`.lowering`) through a comm.

The executor decides nothing: it views its src piece as stored boxes, packs each
collective's input buffer, issues the collective through its :class:`~.comm.Comm`
(ordered functional collectives in production, see :mod:`.comm`), unpacks the output,
and finally assembles the dst piece -- a straight line of tensor ops and collectives
that Dynamo traces without a graph break.
"""

from __future__ import annotations

from math import prod

import torch

from .comm import Comm
from .lowering import Cat, Node, Op, Program, View

__all__ = ["CompiledExecutor", "issue"]


def _build(entries: list, node: Node) -> torch.Tensor:
    if isinstance(node, View):
        t = entries[node.entry]
        return t if node.index is None else t[node.index]
    if isinstance(node, Cat):
        return torch.cat([_build(entries, part) for part in node.parts], node.dim)
    out = entries[0].new_empty(node.shape)
    for entry, src, dst in node.writes:
        out[dst] = entries[entry][src]
    return out


def _pack(entries: list, op: Op, wire) -> torch.Tensor:
    items = op.pack
    if len(items) == 1 and not isinstance(items[0], int):
        flat = _build(entries, items[0]).reshape(-1)
    elif op.stack:
        flat = torch.stack([_build(entries, item) for item in items
                            if not isinstance(item, int)]).view(-1)
    elif items:
        flat = torch.cat([entries[0].new_zeros(item) if isinstance(item, int)
                          else _build(entries, item).reshape(-1) for item in items])
    else:
        flat = entries[0].new_zeros(0)
    return flat.to(wire) if wire is not None else flat


def issue(comm: Comm, op: Op, flat: torch.Tensor) -> torch.Tensor:
    """Run ``op``'s collective on its packed input through ``comm``."""
    if op.kind == "all_to_all":
        return comm.all_to_all(flat, op.out_splits, op.in_splits, op.ranks)
    return getattr(comm, op.kind)(flat, op.ranks)


class CompiledExecutor:
    """Runs programs for one rank through ``comm``; ``tensors`` is always ``(local,)``.

    ``local`` is the rank's src piece, or an empty placeholder on ranks holding none;
    the result is the dst piece, or an empty tensor where it holds none. With
    ``comm_dtype`` data moves in that dtype and comes back in the caller's.
    """

    def __init__(self, comm: Comm, comm_dtype: torch.dtype | None = None) -> None:
        self.comm = comm
        self.comm_dtype = comm_dtype

    def run(self, program: Program, tensors: tuple[torch.Tensor, ...]):
        (local,) = tensors
        dtype = local.dtype
        canon = local
        if program.src_expand is not None:
            canon = canon.reshape(program.src_expand)
        if program.src_perm is not None:
            canon = canon.permute(program.src_perm)
        entries: list[torch.Tensor | None] = [canon]
        wire = self.comm_dtype
        for op in program.ops:
            flat = issue(self.comm, op, _pack(entries, op, wire))
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
