"""The process world: this rank's piece, moved by prepared bridges."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mimo_fx.layout import Layout

__all__ = ["ProcessWorld"]


class ProcessWorld:
    """Runs SPMD code (see :mod:`mimo_fx.spmd`) as this process's rank.

    Bridges are prepared on first use outside tracing; call :meth:`prepare` for each
    redistribution before ``torch.compile`` (or run the step once eagerly).
    """

    def __init__(self, dtype=torch.float32) -> None:
        self.rank = dist.get_rank()
        self.ranks = (self.rank,)
        self.dtype = dtype
        self._bridges: dict = {}

    def bridge(self, src: Layout, dst: Layout, sizes: dict[str, int], grad_partial=()):
        from . import Redistributor

        key = (src, dst, tuple(sorted(sizes.items())), tuple(grad_partial))
        if key not in self._bridges:
            self._bridges[key] = Redistributor(src, dst, sizes, self.dtype,
                                               grad_partial=grad_partial)
        return self._bridges[key]

    def redistribute(self, pieces, src: Layout, dst: Layout, *, grad_partial=(), **sizes):
        y = self.bridge(src, dst, sizes, grad_partial)(pieces.get(self.rank))
        return {} if y is None or not dst.holds(self.rank) else {self.rank: y}

    def destroy(self) -> None:
        for bridge in self._bridges.values():
            bridge.destroy()
        self._bridges.clear()
