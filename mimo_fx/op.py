"""The facade: ``mimo_fx.redistribute`` picks the backend from what it is given.

A dict ``{rank: tensor}`` runs the reference backend for every rank in this process; a
tensor (or None) runs the compiled backend for this rank. DTensors have their own entry
point, :func:`mimo_fx.interop.dtensor.redistribute_dtensor` (a mesh and placements, not layouts).
The backends never import this module (they share :mod:`mimo_fx.vjp`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch

from .errors import MimoFxError

__all__ = ["redistribute", "is_dtensor"]


def is_dtensor(x) -> bool:
    """Whether ``x`` is a DTensor (without importing DTensor if nobody has)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def _check_layout(side: str, layout) -> None:
    """A layout where one belongs, else the error that says how to make one."""
    from .packed import is_layout, not_a_layout

    if not is_layout(layout):
        raise MimoFxError(not_a_layout("redistribute", side, layout))


def redistribute(x, src, dst, *, sizes=None, grad_partial=(), comm_dtype=None,
                 checked: bool = False, dtype=None, frozen: bool | None = None, **dim_sizes):
    """Move a tensor from layout ``src`` to layout ``dst``; differentiable.

    ``x`` is either this rank's local tensor (``None`` on ranks holding no src piece)
    inside an initialised process group -- the compiled backend, see
    :mod:`mimo_fx.compiled` -- or a dict ``{rank: local tensor}`` holding every src
    rank's piece, which the reference backend runs for the whole world in this process,
    returning a dict for the dst ranks. (A DTensor goes to
    :func:`mimo_fx.interop.dtensor.redistribute_dtensor` instead.)

    Global dim sizes the local shapes cannot tell are size keywords (``b=30``) or
    ``sizes={"b": 30}`` (for a dim named like an option); any other keyword raises.
    ``grad_partial`` names dst replicated axes whose cotangents are per-replica
    contributions to be summed (e.g. a zero-padding CP ``index_select``). ``frozen=True``:
    the source needs no gradient (a frozen encoder), so the backward moves nothing and
    no result requires grad (:meth:`mimo_fx.compiled.Redistributor.frozen`). The compiled
    backend's options: ``comm_dtype`` (move data in this dtype), ``checked`` (every rank
    raises on any rank's mistake), ``dtype`` (for ranks passing None).

    >>> import torch
    >>> from mimo_fx import Grid, Layout
    >>> from mimo_fx.reference import shard
    >>> src = Layout(Grid(tp=2, dp=2), "(dp b) h")
    >>> dst = Layout(Grid(tp=2, dp=2), "b (tp h)")
    >>> x = torch.arange(8.0).reshape(4, 2)
    >>> y = redistribute(shard(x, src), src, dst)
    >>> sorted(y), y[1].tolist()
    ([0, 1, 2, 3], [[1.0], [3.0], [5.0], [7.0]])
    """
    if is_dtensor(x):
        raise MimoFxError("redistribute takes layouts; to move a DTensor to another mesh "
                          "call mimo_fx.redistribute_dtensor(x, dst_mesh, dst_placements)")
    for side, layout in (("src", src), ("dst", dst)):
        _check_layout(side, layout)
    if isinstance(x, Mapping):
        compiled_only = {"comm_dtype": comm_dtype, "checked": checked, "dtype": dtype}
        given = [k for k, v in compiled_only.items() if v not in (None, False)]
        if given:
            raise MimoFxError(f"redistribute of a dict {{rank: tensor}} runs the reference "
                              f"backend, which takes no {given}; those are options of the "
                              f"compiled backend (one tensor per process)")
        from .reference import redistribute as reference_redistribute

        return reference_redistribute(x, src, dst, sizes=sizes, grad_partial=grad_partial,
                                      frozen=frozen, **dim_sizes)
    if x is not None and not isinstance(x, torch.Tensor):
        raise MimoFxError(f"redistribute takes a tensor, None, or a dict {{rank: tensor}}; "
                          f"got {type(x).__name__}")
    from .compiled import redistribute as compiled_redistribute

    return compiled_redistribute(x, src, dst, sizes=sizes, grad_partial=grad_partial,
                                 comm_dtype=comm_dtype, checked=checked, dtype=dtype,
                                 frozen=frozen, **dim_sizes)
