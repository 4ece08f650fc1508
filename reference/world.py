"""The reference world: every rank's piece in this process."""

from __future__ import annotations

from mimo_fx.layout import Layout

from .executor import redistribute

__all__ = ["ReferenceWorld"]


class ReferenceWorld:
    """Runs SPMD code (see :mod:`mimo_fx.mimo.spmd`) for all ranks at once."""

    ranks: tuple[int, ...] = ()

    def begin(self, anchor=None) -> None:
        """Nothing to anchor: every rank's backward runs in this process."""

    def end(self, loss):
        return loss

    def redistribute(self, pieces, src: Layout, dst: Layout, *, grad_partial=(),
                     frozen=None, **sizes):
        return redistribute(pieces, src, dst, grad_partial=grad_partial, frozen=frozen,
                            **sizes)
