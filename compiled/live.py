"""The live bridges of this process, by name: the one registry of bridge state.

A bridge's state -- its groups, guard, sizing, call counters, description, its
source-only results -- lives on the bridge object. Code that meets only a bridge's name
finds the bridge here: a compiled call (which must reach its bridge through a global,
see :func:`find`), a compiled graph's size gather (its op takes the name, a
constant), a collective's completion or failure (its site string begins with the name,
see :mod:`.timeouts`) and :func:`mimo_fx.joined` (every bridge's source-only results).

Weak: the registry holds a weak reference to each bridge's traced handle (a second
object sharing the bridge's state, see :func:`.redistributor._traced_handle`); a bridge
dropped by its caller leaves the registry when it is collected (its finalizer calls
:func:`forget`), and a new bridge of the same name starts with nothing of the old one's.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["BRIDGES", "register", "forget", "find", "named", "bridges"]

# name -> a weak reference to the bridge's traced handle
BRIDGES: dict[str, weakref.ref[Any]] = {}


def register(name: str, handle: Any) -> None:
    """``handle`` (a bridge's traced handle) is the live bridge called ``name``."""
    BRIDGES[name] = weakref.ref(handle)


def forget(name: str, owner: Any) -> None:
    """``name`` is no longer a live bridge, if it still is ``owner``'s (its handle, or its
    entry here): a later bridge may have taken the name."""
    ref = BRIDGES.get(name)
    if ref is not None and (ref is owner or ref() is owner):
        del BRIDGES[name]


def find(name: str) -> Any:
    """The live bridge called ``name`` (its traced handle), or None. Plain dict and
    weakref reads: a compiled call reaches its bridge through here, a global, so that
    Dynamo keeps the ints it reads from it static."""
    ref = BRIDGES.get(name)
    return None if ref is None else ref()


def named(name: str) -> Any:
    """The live bridge called ``name``; KeyError if there is none (a graph's op naming a
    bridge that was destroyed)."""
    bridge = find(name)
    if bridge is None:
        raise KeyError(name)
    return bridge


def bridges() -> list[Any]:
    """Every live bridge (their traced handles), in the order they were built."""
    # (no generator: joined() reads it under torch.compile, where Dynamo cannot trace one)
    found = [ref() for ref in list(BRIDGES.values())]
    return [b for b in found if b is not None]
