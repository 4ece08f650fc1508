"""An index plan (:mod:`mimo_fx.index`) for every rank at once, in one process.

:func:`index_bridge_all` takes ``{rank: src piece}`` and returns ``{rank: dst piece}``,
the rows routed in-process by the same per-rank steps the compiled backend runs (each
rank's :class:`~mimo_fx.index.Route`), through the project's custom vjp, so
``loss.backward()``, ``torch.func.grad`` and ``torch.func.vjp`` run the plan's adjoint.

>>> from mimo_fx.index import plan_rows
>>> p = plan_rows({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1]}, n_rows=4)
>>> x = torch.arange(4.0).unsqueeze(1).requires_grad_()
>>> y = index_bridge_all(p, {0: x[:2], 1: x[2:]})
>>> {r: t.flatten().tolist() for r, t in y.items()}
{0: [3.0, 0.0, 3.0], 1: [1.0]}
>>> sum(t.sum() for t in y.values()).backward()
>>> x.grad.flatten().tolist()
[1.0, 1.0, 0.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mimo_fx import vjp
from mimo_fx.errors import MimoFxError
from mimo_fx.index import (
    IndexPlan,
    backward_send,
    backward_take,
    check_piece,
    forward_send,
    forward_take,
)

__all__ = ["index_bridge_all"]


class _AllRanks:
    """A vjp executor: every rank's piece, in the plan's rank order."""

    def run(self, program, tensors, env=None):
        plan, direction = program
        routes = [plan.route(r, tensors[0].device) for r in plan.ranks]
        counts = [rt.split(rt.counts.tolist()) for rt in routes]
        if direction == "forward":
            sent = [forward_send(rt.index, x) for rt, x in zip(routes, tensors)]
            cuts = [c[0] for c in counts]
        else:
            sent = [backward_send(rt.index, g, c[4]) for rt, g, c in zip(routes, tensors, counts)]
            cuts = [c[2] for c in counts]
        parts = [torch.split(t, list(cut)) for t, cut in zip(sent, cuts)]
        n = len(plan.ranks)
        got = [torch.cat([parts[i][j] for i in range(n)]) for j in range(n)]
        if direction == "forward":
            return tuple(forward_take(rt.index, r) for rt, r in zip(routes, got))
        return tuple(backward_take(rt.index, r, len(src))
                     for rt, r, src in zip(routes, got, plan.src_rows))


def index_bridge_all(plan: IndexPlan, pieces: Mapping[int, torch.Tensor]
                     ) -> dict[int, torch.Tensor]:
    """Every rank's dst piece ``x[dst_rows[r]]`` from every rank's src piece (a rank of
    the plan missing from ``pieces`` must hold no src rows). Differentiable."""
    like = next(iter(pieces.values()), None)
    if like is None:
        raise MimoFxError("index_bridge_all needs at least one src piece (for the dtype and "
                          "row shape)")
    strangers = sorted(set(pieces) - set(plan.ranks))
    if strangers:
        raise MimoFxError(f"index_bridge_all got pieces for ranks {strangers} that take no "
                          f"part in the plan; its ranks are {plan.ranks}")
    tensors = []
    for r in plan.ranks:
        x = pieces.get(r)
        if x is None:
            x = like.new_zeros((0, *like.shape[1:]))
        check_piece(len(plan.src_rows[plan.index(r)]), f"rank {r}", x)
        tensors.append(x)
    out = vjp.apply(_AllRanks(), (plan, "forward"), (plan, "backward"), tuple(tensors))
    return dict(zip(plan.ranks, out))
