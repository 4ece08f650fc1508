"""Running an index plan (:mod:`mimo_fx.index`): every rank at once, or one rank per
process over a comm.

Both executors apply the per-rank programs the plan already holds, through the project's
custom vjp (:func:`mimo_fx.vjp.apply`), so ``loss.backward()``, ``torch.func.grad`` and
``torch.func.vjp`` all run the plan's adjoint, under ``torch.no_grad()``.

- :func:`index_bridge_all` (the reference): ``{rank: src piece}`` in, ``{rank: dst piece}``
  out, the rows routed in-process.
- :func:`index_bridge` (one rank): its src piece in, its dst piece out, with ONE uneven
  ``all_to_all`` over the plan's ranks per direction through a comm object (the
  :class:`~mimo_fx.compiled.comm.Comm` protocol: real functional collectives, or the
  thread-emulated world of the tests). Every rank of the plan calls it, in the same
  order, whether or not it holds or needs rows; a rank without src rows passes an empty
  ``(0, *row_shape)`` tensor.

This module never touches ``torch.distributed``; the comm is a parameter.

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

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from . import vjp
from .errors import MimoFxError
from .index import IndexPlan, RankBackward, RankForward

__all__ = ["IndexComm", "index_bridge", "index_bridge_all"]


class IndexComm(Protocol):
    """The one collective an index plan issues (as in the comm seam of the backends)."""

    def all_to_all(self, flat: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int], ranks: tuple[int, ...]) -> torch.Tensor:
        ...


def _ix(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


# -- the per-rank steps (shared by both executors) --------------------------------------
def _forward_send(step: RankForward, x: torch.Tensor) -> torch.Tensor:
    return x[_ix(step.send_index, x)]


def _forward_take(step: RankForward, x: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, got])[_ix(step.gather, x)]


def _backward_send(step: RankBackward, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cotangent summed per distinct row, and the rows to send."""
    sums = g.new_zeros((step.n_unique, *g.shape[1:])).index_add_(0, _ix(step.unique, g), g)
    return sums, sums[_ix(step.send_index, g)]


def _backward_take(step: RankBackward, sums: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    grad = sums.new_zeros((step.n_src, *sums.shape[1:]))
    grad.index_add_(0, _ix(step.keep_local, sums), sums[_ix(step.keep, sums)])
    return grad.index_add_(0, _ix(step.recv_local, sums), got)


def _check_piece(plan: IndexPlan, rank: int, x: torch.Tensor) -> None:
    want = len(plan.src_rows[plan.index(rank)])
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != want:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else x
        raise MimoFxError(f"rank {rank} holds {want} src rows under this plan, so its src "
                          f"piece must be ({want}, *row_shape); got {shape} (a rank without "
                          f"src rows passes an empty (0, *row_shape) tensor)")


# -- executors (mimo_fx.vjp.Executor): a program is (plan, "forward" | "backward") -------
class _Reference:
    """Every rank's piece at once, in the plan's rank order."""

    def run(self, program, tensors, env=None):
        plan, direction = program
        n = len(plan.ranks)
        if direction == "forward":
            sent = [_forward_send(s, x) for s, x in zip(plan.forward, tensors)]
        else:
            sums, sent = zip(*(_backward_send(s, g) for s, g in zip(plan.backward, tensors)))
        cut = [list(torch.split(t, list(step.send_counts)))
               for t, step in zip(sent, plan.steps(direction))]
        got = [torch.cat([cut[i][j] for i in range(n)]) for j in range(n)]
        if direction == "forward":
            return tuple(_forward_take(s, x, r) for s, x, r in zip(plan.forward, tensors, got))
        return tuple(_backward_take(s, m, r) for s, m, r in zip(plan.backward, sums, got))


class _OverComm:
    """One rank's piece; the rows move in one all_to_all over the plan's ranks."""

    def __init__(self, comm: IndexComm, rank: int) -> None:
        self.comm, self.rank = comm, rank

    def run(self, program, tensors, env=None):
        plan, direction = program
        (t,) = tensors
        step = plan.steps(direction)[plan.index(self.rank)]
        if direction == "forward":
            send = _forward_send(step, t)
        else:
            sums, send = _backward_send(step, t)
        row = math.prod(t.shape[1:])
        flat = self.comm.all_to_all(send.contiguous().view(-1),
                                    [n * row for n in step.recv_counts],
                                    [n * row for n in step.send_counts], plan.ranks)
        got = flat.view(-1, *t.shape[1:])
        if direction == "forward":
            return (_forward_take(step, t, got),)
        return (_backward_take(step, sums, got),)


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
        _check_piece(plan, r, x)
        tensors.append(x)
    out = vjp.apply(_Reference(), (plan, "forward"), (plan, "backward"), tuple(tensors))
    return dict(zip(plan.ranks, out))


def index_bridge(plan: IndexPlan, x: torch.Tensor, *, comm: IndexComm, rank: int
                 ) -> torch.Tensor:
    """This rank's dst piece ``x_global[dst_rows[rank]]`` from its src piece ``x``, one
    all_to_all over ``plan.ranks`` per direction through ``comm``. Differentiable; every
    rank of the plan must call it."""
    _check_piece(plan, rank, x)
    (y,) = vjp.apply(_OverComm(comm, rank), (plan, "forward"), (plan, "backward"), (x,))
    return y
