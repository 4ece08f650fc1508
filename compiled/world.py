"""The process world: this rank's piece, moved by prepared bridges."""

from __future__ import annotations

from typing import Any

import torch

from mimo_fx.layout import Layout

from .lease import require_world
from .options import Options

__all__ = ["ProcessWorld"]


class ProcessWorld:
    """Runs SPMD code (see :mod:`mimo_fx.mimo.spmd`) as this process's rank.

    Bridges are prepared on first use outside tracing; call :meth:`bridge` for each
    redistribution before ``torch.compile`` (or run the step once eagerly).

    A rank that holds no piece of a bridge's src or dst still takes part in its
    collectives, forward *and* backward. Under autograd its part of the backward only
    runs if the bridge sits on a path from the loss to a tensor being differentiated, so
    a step differentiated on a process world is bracketed by :meth:`begin` and
    :meth:`end`: ``begin(anchor)`` names a tensor being differentiated (any parameter
    piece) from which inputs-less bridge calls take their empty input, and
    ``end(loss)`` is :func:`mimo_fx.joined` over the world's bridges (the one way for
    source-only ranks: zero times every output of the step this rank holds no dst piece
    of, added to the loss). Both are pure tensor ops, so the step stays traceable.
    """

    def __init__(self, dtype=torch.float32, vary: tuple[str, ...] = ()) -> None:
        self.rank = require_world("ProcessWorld")
        self.ranks = (self.rank,)
        self.dtype = dtype
        self.vary = tuple(vary)  # dims whose sizes change from step to step
        self._bridges: dict = {}
        self._anchor: torch.Tensor | None = None
        # set to [] to record eager calls (the bytes a step moves, see bytes_sent)
        self.calls: list[tuple[Any, dict, bool]] | None = None

    def bridge(self, src: Layout, dst: Layout, sizes: dict, grad_partial=(),
               frozen: bool | None = None):
        """The bridge for these layouts (from the one bridge cache): built with the sizes
        of the dims that do not vary; those that do are given in each call (one compiled
        graph serves them)."""
        from . import bridge_for

        fixed = {d: n for d, n in sizes.items() if d not in self.vary}
        opts = Options(self.dtype, grad_partial, frozen=frozen)
        key = (src, dst, opts.grad_partial, opts.frozen)
        if key not in self._bridges:
            self._bridges[key] = bridge_for(src, dst, opts, fixed, "ProcessWorld")
        return self._bridges[key]

    def begin(self, anchor: torch.Tensor | None = None) -> None:
        """Start a step; ``anchor``: a tensor the step is differentiated with respect to."""
        self._anchor = anchor

    def end(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` joined (with weight zero) to the step's source-only bridge outputs
        (:func:`mimo_fx.joined` over this world's bridges)."""
        from .redistributor import joined

        self._anchor = None
        out = joined(loss, list(self._bridges.values()))
        assert out is not None  # (loss is a tensor)
        return out

    def redistribute(self, pieces, src: Layout, dst: Layout, *, grad_partial=(),
                     frozen=None, **sizes):
        bridge = self.bridge(src, dst, sizes, grad_partial, frozen)
        x = pieces.get(self.rank)
        # (asked first, so that a compiled step never looks at the recording list)
        if (not torch.compiler.is_compiling() and self.calls is not None
                and self.rank in bridge.union):
            self.calls.append((bridge, dict(sizes), torch.is_grad_enabled()))
        if x is None and self._anchor is not None and self.rank in bridge.union:
            x = self._anchor.reshape(-1)[:0].reshape((0,) * len(src.local_dims))
        y = bridge(x, {d: n for d, n in sizes.items() if d in self.vary} or None)
        if y is None:
            return {}
        if not dst.holds(self.rank):
            return {}  # (the bridge keeps y for end: see mimo_fx.joined)
        return {self.rank: y}

    def bytes_sent(self, sizes: dict | None = None, calls: list | None = None) -> int:
        """Bytes this rank sent in the recorded calls (``calls``, default those recorded
        now: forward, and backward where autograd was on), from the plans at each call's
        sizes -- or, for the dims that vary, at ``sizes`` (another step of that shape)."""
        from mimo_fx.plan import backward_plan, plan

        total = 0
        for bridge, called, grad in (self.calls or () if calls is None else calls):
            step = {d: (sizes[d] if sizes and d in sizes and d in self.vary else n)
                    for d, n in called.items()}
            args = (bridge.src, bridge.dst, step, bridge.dtype)
            total += plan(*args).bytes_sent.get(self.rank, 0)
            if grad:
                total += backward_plan(*args, bridge.grad_partial).bytes_sent.get(self.rank, 0)
        return total

    def destroy(self) -> None:
        for bridge in self._bridges.values():
            bridge.destroy()
        self._bridges.clear()
