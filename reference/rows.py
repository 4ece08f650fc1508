"""A row plan (:mod:`mimo_fx.rows`) for every rank at once, in one process.

Each rank runs the steps a compiled rank's row program runs (its
:class:`~mimo_fx.rows.RankRoute`: index, all-to-all, index), the all-to-all between
them done in this process. Through the project's custom vjp, so
``loss.backward()``, ``torch.func.grad`` and ``torch.func.vjp`` run the plan's adjoint.

>>> from mimo_fx.rows import plan_rows
>>> p = plan_rows({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1, -1]}, n_rows=4)
>>> x = torch.arange(4.0).unsqueeze(1).requires_grad_()
>>> y = run_rows(p, {0: x[:2], 1: x[2:]})
>>> {r: t.flatten().tolist() for r, t in y.items()}
{0: [3.0, 0.0, 3.0], 1: [1.0, 0.0]}
>>> sum(t.sum() for t in y.values()).backward()
>>> x.grad.flatten().tolist()
[1.0, 1.0, 0.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from mimo_fx import vjp
from mimo_fx.errors import MimoFxError
from mimo_fx.rows import RankRoute, RowPlan

__all__ = ["run_rows"]


def _index(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


def _forward_send(route: RankRoute, x: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, _index(route.send_index, x))


def _forward_take(route: RankRoute, got: torch.Tensor) -> torch.Tensor:
    rows = got.index_select(0, _index(route.gather, got))
    out = got.new_zeros((route.n_dst, *got.shape[1:]))
    return out.index_add(0, _index(route.dst_pos, got), rows)


def _backward_send(route: RankRoute, g: torch.Tensor) -> torch.Tensor:
    counted = g.index_select(0, _index(route.bwd_pos, g))
    sums = g.new_zeros((route.n_unique, *g.shape[1:])).index_add(
        0, _index(route.unique, g), counted)
    return sums.index_select(0, _index(route.bsend_index, g))


def _backward_take(route: RankRoute, got: torch.Tensor) -> torch.Tensor:
    out = got.new_zeros((route.n_src, *got.shape[1:]))
    return out.index_add(0, _index(route.recv_local, got), got)


# per direction: what a rank sends, its per-peer counts, and its piece from what it got
_STEPS = MappingProxyType({
    "forward": (_forward_send, lambda r: r.send_counts, _forward_take),
    "backward": (_backward_send, lambda r: r.bsend_counts, _backward_take)})


class _AllRanks:
    """A vjp executor: every rank's piece, in the plan's rank order; the all-to-all
    between them in this process."""

    def run(self, program, tensors, env=None, *, direction: str = "forward"):
        plan, direction = program
        send, counts, take = _STEPS[direction]
        routes = [plan.route(r) for r in plan.ranks]
        parts = [torch.split(send(route, t), list(counts(route)))
                 for route, t in zip(routes, tensors)]
        n = len(plan.ranks)
        got = [torch.cat([parts[i][j] for i in range(n)]) for j in range(n)]
        return tuple(take(route, g) for route, g in zip(routes, got))


def run_rows(plan: RowPlan, pieces: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's dst piece from every rank's src piece (a rank of the plan missing
    from ``pieces`` must hold no src rows). Differentiable."""
    like = next(iter(pieces.values()), None)
    if like is None:
        raise MimoFxError("a row plan in one process needs at least one src piece (for the "
                          "dtype and row shape)")
    strangers = sorted(set(pieces) - set(plan.ranks))
    if strangers:
        raise MimoFxError(f"got pieces for ranks {strangers} that take no part in the plan; "
                          f"its ranks are {plan.ranks}")
    tensors = []
    for r in plan.ranks:
        x = pieces.get(r)
        if x is None:
            x = like.new_zeros((0, *like.shape[1:]))
        want = len(plan.src_rows[plan.index(r)])
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != want:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else x
            raise MimoFxError(f"rank {r} holds {want} src rows under this plan, so its src "
                              f"piece must be ({want}, *row_shape); got {shape}")
        tensors.append(x)
    out = vjp.apply(_AllRanks(), (plan, "forward"), (plan, "backward"), tuple(tensors))
    return dict(zip(plan.ranks, out))
