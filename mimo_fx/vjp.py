"""The custom vjp every backend runs a bridge through.

The forward runs ``plan(src, dst)``; the backward runs the adjoint plan
``plan(dst*, src*)`` (see :func:`mimo_fx.plan.backward_plan`) under ``torch.no_grad()``,
so no collective's own autograd adds to the gradient and ``torch.func.grad`` /
``torch.func.vjp`` compose with it. An *executor* runs a plan on a tuple of local
tensors; the reference backend passes every rank's piece, the compiled backend one.
This module imports no backend: the backends import it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Executor", "apply"]


class Executor(Protocol):
    """Runs a plan, or its lowered form, on local tensors (one per src holder it serves);
    a template program's numbers at ``env`` (``{variable: value}``, see
    :mod:`mimo_fx.templates`); ``direction`` is ``"forward"`` or ``"backward"``. An executor
    given ``aux`` tensors by :func:`apply` is called as ``run(plan, tensors, env, aux,
    direction=...)`` in both directions."""

    def run(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        ...


class _Redistribute(torch.autograd.Function):
    # ``job`` is (executor, fwd, bwd, variables, values, n_aux): one argument, because
    # apply binds the signature on every call (each parameter costs); the env travels as a
    # tuple of values (ints, or SymInts under torch.compile) beside its variables' constant
    # tuple; the last ``n_aux`` tensors are aux (inputs the programs read, not
    # differentiated), saved for the backward
    @staticmethod
    def forward(job, *tensors):
        executor, fwd, _, variables, values, n_aux = job
        if values is not None and torch.compiler.is_compiling():
            _read(values)
        env = _env(variables, values)
        if not n_aux:
            return tuple(executor.run(fwd, tensors, env, direction="forward"))
        cut = len(tensors) - n_aux
        return tuple(executor.run(fwd, tensors[:cut], env, tensors[cut:],
                                  direction="forward"))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.job = inputs[0]
        n_aux = ctx.job[5]
        ctx.shapes = [t.shape for t in inputs[1:len(inputs) - n_aux]]
        if n_aux:
            ctx.save_for_backward(*inputs[len(inputs) - n_aux:])

    @staticmethod
    def backward(ctx, *grads):
        executor, _, bwd, variables, values, n_aux = ctx.job
        # (lists, not generators: fewer instructions for Dynamo, which traces this too)
        grads = tuple([g.contiguous() for g in grads])
        with torch.no_grad():
            if not n_aux:
                out = executor.run(bwd, grads, _env(variables, values), direction="backward")
            else:
                out = executor.run(bwd, grads, _env(variables, values), ctx.saved_tensors,
                                   direction="backward")
        # a rank holding no piece gets an empty gradient: of its input's shape (whatever
        # empty tensor it passed)
        out = [_like_input(g, s) for g, s in zip(out, ctx.shapes)]
        return (None, *out, *(None,) * n_aux)


def _read(values: tuple) -> None:
    """Read every size value in the traced forward: Dynamo makes what the backward reads
    outputs of the forward's graph, and fails on one the forward never read."""
    for v in values:
        v + 1  # (an expression Dynamo cannot fold away)


def _like_input(g: torch.Tensor, shape) -> torch.Tensor:
    """``g``, or an empty gradient of the input's ``shape`` where ``g`` is empty."""
    if not torch.compiler.is_compiling() and g.shape == shape:  # (plain ints)
        return g
    from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

    if len(g.shape) == len(shape) and all([statically_known_true(a == b)
                                           for a, b in zip(g.shape, shape)]):
        return g
    return g.new_zeros(shape) if guard_or_false(g.numel() == 0) else g


# the autograd.Function's C++ apply, which Function.apply ends in
_APPLY = super(torch.autograd.Function, _Redistribute).apply  # type: ignore[misc]


def _env(variables, values) -> dict | None:
    return None if values is None else dict(zip(variables, values))


def apply(executor: Executor, fwd, bwd, tensors, values: tuple | None = None,
          variables: tuple = (), aux: tuple[torch.Tensor, ...] = ()
          ) -> tuple[torch.Tensor, ...]:
    """Run ``fwd`` through the custom vjp whose backward runs ``bwd`` (plans or their
    lowered per-rank programs, whatever the executor runs); template programs take the
    ``values`` of their ``variables``. ``aux``: tensors both directions read (e.g. a
    route's indices, traced as graph inputs rather than baked-in constants), never
    differentiated."""
    job = (executor, fwd, bwd, variables, values, len(aux))
    if not torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
        # Function.apply binds the arguments to forward's signature on every call (its
        # inspect.signature costs more than the rest of a local call); with no torch.func
        # transform active it then calls this very base method
        return _APPLY(job, *tensors, *aux)
    if torch.compiler.is_compiling() and not (
            torch.is_grad_enabled() and any([t.requires_grad for t in tensors])):
        # nothing to differentiate: Dynamo would trace the forward alone, but it passes it
        # an autograd context for ``job`` when a call has more tensors than forward has
        # named parameters (a row bridge's aux: a compiled no-grad call failed with
        # "'Function' object is not iterable"); the forward is called here instead
        return _Redistribute.forward(job, *tensors, *aux)
    return _Redistribute.apply(job, *tensors, *aux)
