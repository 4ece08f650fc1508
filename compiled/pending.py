"""A posted bridge call (:meth:`.redistributor.Redistributor.start`) and its wait."""

from __future__ import annotations

import torch

from mimo_fx.vjp import apply

from .executor import CompiledExecutor

__all__ = ["Pending"]


class Pending:
    """A posted bridge call; :meth:`wait` gives its result, waiting for the transfer if it
    is still in flight."""

    def __init__(self, result: torch.Tensor | None, bridge=None, x=None, fwd=None, bwd=None,
                 env=None, index: tuple = (), grad: bool = False) -> None:
        self._result, self._bridge = result, bridge  # (bridge: its Prepared)
        self._done = bridge is None
        if bridge is not None:
            env_map = None if env is None else dict(zip(bridge.sizing.variables, env))
            self._args = (x, fwd, bwd, env, index)
            self._grad = grad
            self._run = bridge.executor.start(fwd, (x.detach(),), env_map, index)

    def wait(self) -> torch.Tensor | None:
        """This rank's dst piece (as the call returns it); the same tensor if called
        again."""
        if self._done:
            return self._result
        bridge = self._bridge
        assert bridge is not None
        x, fwd, bwd, env, index = self._args
        if not self._grad:
            (y,) = self._run.finish()
            y = bridge.sizing.finish(y)
        else:
            resume = _Resume(bridge.executor, self._run)
            with torch.enable_grad():
                (y,) = apply(resume, fwd, bwd, (x,), env, bridge.sizing.variables, index)
                y = bridge.kept.keep(bridge.sizing.finish(y))
        self._result, self._done = y, True
        del self._args, self._run
        return y


class _Resume:
    """An executor whose forward is a run already started: the custom vjp's forward
    finishes it, its backward runs as usual."""

    def __init__(self, executor: CompiledExecutor, run) -> None:
        self.executor, self.run_ = executor, run

    def run(self, program, tensors, env=None, inputs=(), *, direction: str = "forward"):
        if direction == "forward":
            return self.run_.finish()
        return self.executor.run(program, tensors, env, inputs, direction=direction)
