"""Values ``torch.compile`` treats as constants.

Grids, layouts, plans and options are frozen, hashable values. Registered here, Dynamo
treats each instance as a constant of the graph: it guards on its equality, and never
turns the ints inside it into symbolic sizes, whatever else a compiled function was
compiled for before (without this, a step compiled for one bridge and then another
could see a grid's ints made dynamic, and planning code cannot take symbolic ints).
"""

from __future__ import annotations

__all__ = ["constant"]


def constant(cls: type) -> type:
    """Register ``cls`` (frozen, hashable) as a compile-time constant; returns it."""
    try:
        from torch.utils._pytree import register_constant
    except ImportError:  # torch < 2.7: no registry; Dynamo then guards on the fields
        return cls
    register_constant(cls)
    return cls
