"""SPMD code written once for both backends: tensors as ``{rank: local tensor}``.

A model step written against a :class:`World` runs unchanged on the reference world
(every rank in this process: the dicts hold all ranks' pieces) and on a process world
(one rank per process: the dicts hold this rank's piece only). Local math maps over the
dict with :func:`local`; movement between layouts goes through ``world.redistribute``.

>>> import torch
>>> from mimo_fx import Grid, Layout
>>> from mimo_fx.reference import ReferenceWorld, shard
>>> world = ReferenceWorld()
>>> src, dst = Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(tp=2), "b (tp h)")
>>> x = shard(torch.arange(8.0).reshape(2, 4), src)
>>> y = world.redistribute(local(lambda t: t * 10, x), src, dst)
>>> y[1].tolist()
[[20.0, 30.0], [60.0, 70.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from mimo_fx.layout import Layout

__all__ = ["World", "Pieces", "local"]

Pieces = dict[int, torch.Tensor]


class World(Protocol):
    """Where per-rank pieces live and how they move."""

    ranks: tuple[int, ...]  # the ranks whose pieces this process holds

    def begin(self, anchor: torch.Tensor | None = None) -> None:
        """Start a differentiated step (see ``ProcessWorld``)."""

    def end(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss, joined to any bridge outputs this process holds none of."""

    def redistribute(self, pieces: Pieces, src: Layout, dst: Layout, *,
                     grad_partial=(), frozen=None, **sizes) -> Pieces:
        """``src`` -> ``dst`` of the pieces this process holds (``frozen=True``: the
        source needs no gradient, see :func:`mimo_fx.redistribute`)."""


def local(fn: Callable[..., torch.Tensor], *pieces: Pieces, rank_arg: bool = False) -> Pieces:
    """Apply ``fn`` rank by rank to the pieces the first dict holds.

    With ``rank_arg`` the rank is passed first (for rank-dependent math such as the
    global positions of a CP chunk).
    """
    out = {}
    for rank in pieces[0]:
        args = [p[rank] for p in pieces]
        out[rank] = fn(rank, *args) if rank_arg else fn(*args)
    return out
