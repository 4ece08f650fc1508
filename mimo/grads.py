"""Gradients of every module a rank runs: accumulate, synchronise once, zero.

A multimodal rank may run several modules (colocated encoder and LLM), each with its own
DP (and CP) group. :class:`ModuleGrads` keeps one accumulation buffer per parameter
piece and gives the three operations a training loop needs over *all* of them at once:

- ``with grads.no_sync():`` -- accumulate micro-batch gradients locally, no collective;
- ``grads.accumulate(g)`` outside ``no_sync`` -- add, then synchronise every module over
  its own data axes (:func:`finalize_grads`: a sum over dp, and cp where
  the module has it; never an average, never a per-module rescale);
- ``grads.zero_grad()`` -- clear every module's buffers for the next step.

The sums are right because every micro-batch loss is normalised by the *global* token
count of the step (a constant all ranks know), so the synchronised sum is the gradient
of the step's loss for every module, whatever its DP size.

>>> import torch
>>> from mimo_fx import Grid, Layout
>>> from mimo_fx.reference import ReferenceWorld
>>> w = Layout(Grid(dp=2), "i o")                # replicated over dp
>>> grads = ModuleGrads(ReferenceWorld(), {"enc.w": w}, {"i": 1, "o": 1})
>>> with grads.no_sync():
...     grads.accumulate({"enc.w": {0: torch.ones(1, 1), 1: torch.ones(1, 1)}})
>>> grads.accumulate({"enc.w": {0: torch.ones(1, 1), 1: 2 * torch.ones(1, 1)}})
>>> grads.synced, grads.grads["enc.w"][1].item()   # (1 + 1) + (1 + 2), on every replica
(True, 5.0)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout

from .spmd import Pieces, World

__all__ = ["ModuleGrads", "finalize_grads"]


class ModuleGrads:
    """Gradient buffers of all modules on this process (see the module docstring).

    Args:
        world: where the pieces live (reference or process world).
        layouts: every parameter's layout, by name (``"module.param"``).
        sizes: global dim sizes of the parameters.
    """

    def __init__(self, world: World, layouts: dict[str, Layout], sizes: dict[str, int]) -> None:
        self.world, self.layouts, self.sizes = world, dict(layouts), dict(sizes)
        self.grads: dict[str, Pieces] = {}
        self.synced = False
        self._no_sync = 0

    @property
    def modules(self) -> tuple[str, ...]:
        """Module names (the prefix before the first dot of each parameter name)."""
        return tuple(dict.fromkeys(n.split(".", 1)[0] for n in self.layouts))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate without synchronising, over every module at once."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def accumulate(self, grads: dict[str, Pieces]) -> None:
        """Add this micro-batch's gradients; synchronise unless inside :meth:`no_sync`."""
        if self.synced:
            raise MimoFxError("gradients were already synchronised this step; call "
                              "zero_grad() before accumulating the next step's")
        unknown = sorted(set(grads) - set(self.layouts))
        if unknown:
            raise MimoFxError(f"gradients for unknown parameters {unknown}; known: "
                              f"{sorted(self.layouts)}")
        with torch.no_grad():
            for name, pieces in grads.items():
                held = self.grads.setdefault(name, {})
                for rank, g in pieces.items():
                    held[rank] = g.detach().clone() if rank not in held else held[rank] + g
        if not self._no_sync:
            self.sync()

    def sync(self) -> dict[str, Pieces]:
        """Sum every parameter's gradient over its module's data axes (once per step)."""
        if self.synced:
            raise MimoFxError("gradients were already synchronised this step")
        missing = sorted(set(self.layouts) - set(self.grads))
        if missing:
            raise MimoFxError(f"no gradient accumulated for {missing}: every module's "
                              f"parameters must take part in the step")
        self.grads = finalize_grads(self.world, self.grads, self.layouts, self.sizes)
        self.synced = True
        return self.grads

    def zero_grad(self) -> None:
        """Forget every module's gradients (start of a step)."""
        self.grads = {}
        self.synced = False


def finalize_grads(world: World, grads: dict[str, Pieces], layouts: dict[str, Layout],
                   sizes: dict[str, int]) -> dict[str, Pieces]:
    """Sum each parameter's gradient over the axes that split its module's data.

    A parameter replicated over dp (and cp) holds, on each replica, the gradient of the
    tokens that replica saw; the true gradient is their sum -- an all-reduce, written
    as a redistribute from partial to replicated.
    """
    out = {}
    for name, g in grads.items():
        layout = layouts[name]
        axes = tuple(a for a in ("dp", "cp") if a in layout.replicated
                     and layout.grid.axis_size(a) > 1)
        if not axes:
            out[name] = g
            continue
        partial = layout.with_partial(axes)
        with torch.no_grad():
            out[name] = world.redistribute(g, partial, layout,
                                           **{d: sizes[d] for d in layout.dims})
    return out
