"""Whether a bridge's source is frozen: decided once, by its ranks together.

A frozen source needs no gradient: the bridge's backward moves nothing on any rank and
no rank's result requires grad (an encoder trained no more). ``frozen=`` says so when the
bridge is built; otherwise its ranks decide when they meet (:meth:`Freeze.frozen`).
"""

from __future__ import annotations

import torch

from mimo_fx.collective import Collective
from mimo_fx.errors import MimoFxError

from . import live, timeouts
from .groups import CHECK
from .guard import fingerprint, raise_now

__all__ = ["Freeze"]

STATES = "xng"  # a rank's state at a call: under no_grad, autograd, its source requires grad


class Freeze:
    """One bridge's frozen source, decided (``prepared``: the bridge's parts)."""

    def __init__(self, prepared, frozen: bool | None, floats: bool) -> None:
        self.bridge, self.built, self.floats = prepared, frozen, floats
        self.decided: bool | None = None
        self.met = False  # whether its ranks met at a call yet

    def frozen(self) -> bool | None:
        """See :meth:`.redistributor.Redistributor.frozen`."""
        return self.built if self.built is not None else self.decided

    def backward_runs(self, x) -> bool:
        """Whether this call's backward runs: on every rank of the bridge alike, under
        autograd, for float data, unless the source is frozen. A source tensor that
        requires grad on a frozen bridge is refused here, before any collective: its
        gradient would be lost."""
        if not self.floats:
            return False
        b = self.bridge
        grad, holds = torch.is_grad_enabled(), b.src.holds(b.rank)
        # (a rank holding no piece may pass an empty tensor that requires grad: a torch.func
        # transform's anchor)
        wants = grad and holds and isinstance(x, torch.Tensor) and x.requires_grad
        frozen = self.at_call("g" if wants else "n" if grad else "x")
        if frozen is None:
            return False  # (no rank of the call runs under autograd)
        if not frozen:
            return grad
        if wants:
            how = ("it was built with frozen=True" if self.built else
                   "no source rank's input required grad at its first call under autograd")
            raise_now(b.context + f"rank {b.rank}'s input requires grad, but this "
                      f"bridge's source is frozen ({how}): its backward moves nothing, and "
                      f"this gradient would be lost. Pass x.detach() to keep the source "
                      f"frozen, or build the bridge with frozen=False to run its backward "
                      f"on every call")
        return False

    def at_call(self, state: str) -> bool | None:
        """:meth:`frozen`, deciding it at this call if it is not decided yet (``state``:
        this rank's, one of :data:`STATES`); None while no rank ran a call under
        autograd."""
        if self.built is not None:
            return self.built
        if torch.compiler.is_compiling():
            from torch._dynamo.comptime import comptime

            name = self.bridge.name  # noqa: F841 (read by _decide_traced, with state)
            comptime(_decide_traced)
            # (read only after the decision: Dynamo keeps the value it read first)
            return self.decided
        if self.decided is None and (state != "x" or not self.met):
            self.decide(state)
        return self.decided

    def decide(self, state: str) -> None:
        """Every rank's ``state`` of this call: the bridge is frozen if some rank runs
        under autograd and no source rank's tensor requires grad."""
        states = [state] if len(self.bridge.union) == 1 else self._meet(state)
        self.met = True
        if any(s != "x" for s in states):
            self.decided = "g" not in states

    def _meet(self, state: str) -> list[str]:
        """Every rank's ``state``: one small all-gather over the bridge's check group,
        which the bridges of the same grids share (ranks that call two of them in other
        orders meet there, and their rows name the bridge: an error on every rank). A
        rank that left is named, as in any collective; the one host sync of it (reading
        the rows) is this call's, until the bridge is decided."""
        b = self.bridge
        n = timeouts.calls(b.name, "forward") + 1
        row = torch.tensor([fingerprint("meet", b.name), STATES.index(state)],
                           dtype=torch.int64, device=b.device)
        # (a failed wait is the standard error of this call's forward, its peer named)
        out = b.lease.comm(CHECK).collective(
            Collective.ALL_GATHER, row, b.union,
            site=timeouts.site(b.name, "forward", -1, b.union))
        rows = out.view(len(b.union), 2).tolist()
        calls: dict[int, list[int]] = {}
        for r, (f, _) in zip(b.union, rows):
            calls.setdefault(f, []).append(r)
        if len(calls) > 1:
            groups = sorted(calls.values(), key=lambda g: (-len(g), g))
            raise MimoFxError(
                b.context + f"the ranks called different bridges at call {n}: one on "
                + ", another on ".join(map(_named, groups)) + "; every rank of both grids "
                "calls its bridges in the same order")
        return [STATES[code] for _, code in rows]


def _decide_traced(ctx) -> None:
    """While a compiled call is traced, at trace time: decide whether its bridge's source
    is frozen (:meth:`Freeze.at_call`; the frame's ``name`` and ``state``)."""
    from .guard import TracedError

    freeze = live.named(ctx.get_local("name").as_python_constant()).freeze
    state = ctx.get_local("state").as_python_constant()
    if freeze.decided is None and (state != "x" or not freeze.met):
        try:
            freeze.decide(state)
        except MimoFxError as err:  # (as a user error of the trace, not Dynamo's own)
            raise TracedError(str(err)) from None


def _named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
