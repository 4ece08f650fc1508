"""The collectives a plan step lowers to: one enum, the only spelling of a kind.

It sits below the planner (``mimo_fx.exchange`` classifies an exchange with it, and
``mimo_fx.plan`` re-exports it) so that every layer names a kind the same way. A kind's
meaning lives where it is interpreted, one table per layer, each keyed by this enum (see
``tests/core/test_kinds.py`` for the list).

>>> Collective.ALL_GATHER.value, str(Collective.ALL_TO_ALL)
('all_gather', 'all_to_all')
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Collective"]


class Collective(str, Enum):
    """The collectives a plan step can lower to; ``str()`` is the torch-style name."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
