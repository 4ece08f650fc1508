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
    """Runs a plan, or its lowered form, on local tensors (one per src holder it serves);
    a template program's numbers at ``env`` (``{variable: value}``, see
    :mod:`mimo_fx.sizes`)."""

    def run(self, plan, tensors: tuple[torch.Tensor, ...],
            env: dict | None = None) -> tuple[torch.Tensor, ...]:
        ...


class _Redistribute(torch.autograd.Function):
    # ``job`` is (executor, fwd, bwd, variables, values): one argument, because apply binds
    # the signature on every call (each parameter costs); the env travels as a tuple of
    # values (ints, or SymInts under torch.compile) beside its variables' constant tuple
    @staticmethod
    def forward(job, *tensors):
        executor, fwd, _, variables, values = job
        return tuple(executor.run(fwd, tensors, _env(variables, values)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.job = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        executor, _, bwd, variables, values = ctx.job
        with torch.no_grad():
            out = executor.run(bwd, tuple(g.contiguous() for g in grads),
                               _env(variables, values))
        return (None, *out)


def _env(variables, values) -> dict | None:
    return None if values is None else dict(zip(variables, values))


def apply(executor: Executor, fwd, bwd, tensors, values: tuple | None = None,
          variables: tuple = ()) -> tuple[torch.Tensor, ...]:
    """Run ``fwd`` through the custom vjp whose backward runs ``bwd`` (plans or their
    lowered per-rank programs, whatever the executor runs); template programs take the
    ``values`` of their ``variables``."""
    return _Redistribute.apply((executor, fwd, bwd, variables, values), *tensors)
