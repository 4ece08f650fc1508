"""The custom vjp every backend runs a bridge through.

The forward runs ``plan(src, dst)``; the backward runs the adjoint plan
``plan(dst*, src*)`` (see :func:`mimo_fx.plan.backward_plan`) under ``torch.no_grad()``,
so no collective's own autograd adds to the gradient and ``torch.func.grad`` /
``torch.func.vjp`` compose with it. An *executor* runs a plan on a tuple of local
tensors; the reference backend passes every rank's piece, the compiled backend one.
This module imports no backend: the backends import it.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["Executor", "apply"]


class Executor(Protocol):
    """Runs a plan, or its lowered form, on local tensors (one per src holder it serves)."""

    def run(self, plan, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        ...


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(executor, fwd, bwd, *tensors):
        return tuple(executor.run(fwd, tensors))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.executor, ctx.bwd = inputs[0], inputs[2]

    @staticmethod
    def backward(ctx, *grads):
        with torch.no_grad():
            out = ctx.executor.run(ctx.bwd, tuple(g.contiguous() for g in grads))
        return (None, None, None, *out)


def apply(executor: Executor, fwd, bwd, tensors) -> tuple[torch.Tensor, ...]:
    """Run ``fwd`` through the custom vjp whose backward runs ``bwd`` (plans or their
    lowered per-rank programs, whatever the executor runs)."""
    return _Redistribute.apply(executor, fwd, bwd, *tensors)
