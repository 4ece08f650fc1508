"""The cost figures every plan reports, derived once from its bytes per rank.

A plan (:class:`mimo_fx.plan.Plan`) counts the bytes every rank sends and receives and
the bytes every dst rank needs and does not hold; the maxima and the total below are
arithmetic on those.
"""

from __future__ import annotations

__all__ = ["Costs"]


class Costs:
    """``max_recv``, ``max_sent``, ``total_bytes`` and ``max_lower_bound`` of a plan from
    its ``bytes_sent``, ``bytes_recv`` and ``lower_bound`` (bytes per rank)."""

    @property
    def bytes_sent(self) -> dict[int, int]:
        raise NotImplementedError

    @property
    def bytes_recv(self) -> dict[int, int]:
        raise NotImplementedError

    @property
    def lower_bound(self) -> dict[int, int]:
        raise NotImplementedError

    @property
    def max_recv(self) -> int:
        """The most bytes any rank receives."""
        return max(self.bytes_recv.values(), default=0)

    @property
    def max_sent(self) -> int:
        """The most bytes any rank sends."""
        return max(self.bytes_sent.values(), default=0)

    @property
    def total_bytes(self) -> int:
        """Bytes sent, summed over every rank."""
        return sum(self.bytes_sent.values())

    @property
    def max_lower_bound(self) -> int:
        """The most bytes any dst rank needs and does not hold."""
        return max(self.lower_bound.values(), default=0)
