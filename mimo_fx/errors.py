"""The one error type of mimo_fx.

Every user-facing mistake (a bad grid, a malformed pattern, layouts that do not fit
together, a tensor of the wrong shape) raises :class:`MimoFxError`, a ``ValueError``.
Messages state the rule, show the offending value and say how to fix it.
"""

from __future__ import annotations

__all__ = ["MimoFxError"]


class MimoFxError(ValueError):
    """Raised for every invalid input to mimo_fx."""
