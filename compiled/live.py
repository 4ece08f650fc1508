"""The live bridges of this process, by name: the one registry of bridge state.

A bridge's state -- its groups, guard, sizing, call counters, description, its
source-only results -- lives on its prepared bridge (:class:`.prepared.Prepared`). Code
that meets only a bridge's name finds it here: a compiled call (which must reach its
bridge through a global, see :func:`find`), a compiled graph's size gather (its op takes
the name, a constant), a collective's completion or failure (the record of its site names
the bridge, see :mod:`.timeouts`) and :func:`mimo_fx.joined` (every bridge's source-only
results). The bridges :func:`mimo_fx.compiled.prepare` makes for the functional API are
kept here too, by their definition (:func:`prepared`).

Weak: the registry holds a weak reference to each prepared bridge; one whose handle its
caller dropped leaves the registry when it is collected (a name given by the caller at
once: the handle's finalizer calls :func:`forget`), and a new bridge of the same name
starts with nothing of the old one's.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["REGISTRY", "register", "forget", "find", "named", "bridges", "prepared", "keep",
           "drop_kept"]


class Registry:
    """The live bridges of this process: by name, a weak reference to each one's prepared
    bridge; by definition, the bridges :func:`mimo_fx.compiled.prepare` keeps alive (the
    functional API's, which no caller holds)."""

    def __init__(self) -> None:
        self.by_name: dict[str, weakref.ref[Any]] = {}
        self.kept: dict[tuple, Any] = {}  # a definition -> its prepared bridge


REGISTRY = Registry()
BRIDGES = REGISTRY.by_name  # (the name index, read by compiled calls as a global)


def register(name: str, handle: Any) -> None:
    """``handle`` (a prepared bridge) is the live bridge called ``name``."""
    BRIDGES[name] = weakref.ref(handle)


def forget(name: str, owner: Any) -> None:
    """``name`` is no longer a live bridge, if it still is ``owner``'s (its handle, or its
    entry here): a later bridge may have taken the name."""
    ref = BRIDGES.get(name)
    if ref is not None and (ref is owner or ref() is owner):
        del BRIDGES[name]


def find(name: str) -> Any:
    """The live bridge called ``name`` (its prepared bridge), or None. Plain dict and
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
    """Every live bridge (their prepared bridges), in the order they were built."""
    # (no generator: joined() reads it under torch.compile, where Dynamo cannot trace one)
    found = [ref() for ref in list(BRIDGES.values())]
    return [b for b in found if b is not None]


def prepared(key: tuple) -> Any:
    """The bridge kept for definition ``key``, or None."""
    return REGISTRY.kept.get(key)


def keep(key: tuple, bridge: Any) -> Any:
    """Keep ``bridge`` alive as the one for definition ``key``; returns it."""
    REGISTRY.kept[key] = bridge
    return bridge


def drop_kept() -> list[Any]:
    """Stop keeping every prepared bridge; returns them (for their caller to destroy)."""
    out = list(REGISTRY.kept.values())
    REGISTRY.kept.clear()
    return out
