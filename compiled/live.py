"""The live bridges of this process, by name: the one registry of bridge state.

A bridge's state -- its groups, guard, sizing, call counters, description -- lives on
the bridge object. Code that meets only a bridge's name finds the bridge here: a compiled
graph's size exchange (its op takes the name, a constant), and a collective's completion
or failure (its site string begins with the name, see :mod:`.timeouts`). Weak: a bridge
nobody holds is collected, its entry with it, and a new bridge of the same name starts
with nothing of the old one's.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["BRIDGES"]

BRIDGES: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
