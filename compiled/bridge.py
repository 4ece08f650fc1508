"""A bridge between two modules, for functional steps and imperative pipeline schedules.

``Bridge(src, dst, sizes)`` is a :class:`Redistributor` (call it inside a traced or
eager step; autograd carries the gradient back) that also offers the pipelined bridge's
imperative calls. Every call is a collective over the union of the two grids, so both
sides issue them in the same order:

=====================================  =====================================
src (sending) ranks                    dst (receiving) ranks
=====================================  =====================================
``send_forward(x)``                    ``y = recv_forward()``
``g = recv_backward()``                ``send_backward(grad_y)``
``g = send_forward_recv_backward(x)``  ``y = send_backward_recv_forward(grad)``
=====================================  =====================================

The combined calls issue forward then backward (on src) and backward then forward (on
dst): in a 1F1B schedule src's ``send_forward_recv_backward(out_i)`` pairs its forward
with dst's ``send_backward_recv_forward(grad_{i-1})``'s forward, and its backward with
the next such call's backward, so both sides see the same sequence
``fwd_i, bwd_i, fwd_i+1, ...``. A rank on both grids runs both halves in one call.

Sizes: on a bridge with free dims each forward learns its sizes (the receivers too:
this is the pipelined bridge's shape exchange) or takes them from the call, and each
backward runs at the sizes of the oldest forward whose backward has not run yet --
backwards come in the order of their forwards, as in 1F1B and GPipe.
"""

from __future__ import annotations

from collections import deque

import torch

from mimo_fx.errors import MimoFxError

from .redistributor import Redistributor

__all__ = ["Bridge"]


class Bridge(Redistributor):
    """A prepared redistribution between two modules with imperative send/recv calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight: deque[dict] = deque()  # sizes of forwards awaiting their backward

    def _run(self, program, tensor: torch.Tensor, env) -> torch.Tensor:
        variables = self.template.variables if self.template is not None else ()
        with torch.no_grad():
            (out,) = self.executor.run(program, (tensor,),
                                       None if env is None else dict(zip(variables, env)))
        return out

    def _forward(self, x: torch.Tensor | None, sizes: dict | None = None) -> torch.Tensor:
        """Validate ``x`` (this rank's src piece or None) and run the forward program."""
        self._assert_live()
        full, learned = (self._call_sizes(x, sizes, {}) if self.free
                         else (self.fixed, frozenset()))
        fwd, _, env = self._programs(full, learned, x)
        self._guard(x, "src", fwd, env, full)
        if self.free:
            self._in_flight.append(full)
        x = self._placeholder(len(self.src.local_dims)) if x is None else x.detach()
        return self._run(fwd, x, env)

    def _backward(self, grad: torch.Tensor | None) -> torch.Tensor:
        """Validate ``grad`` (this rank's dst cotangent or None) and run the adjoint at the
        sizes of the oldest forward still waiting for it."""
        self._assert_live()
        if self.free and not self._in_flight:
            raise MimoFxError(self._context() + f"rank {self.rank}: a backward with no "
                              f"forward waiting for it; every backward follows its forward")
        full = self._in_flight.popleft() if self.free else self.fixed
        _, bwd, env = self._programs(full, frozenset())
        self._guard(grad, "dst", bwd, env, full)
        grad = self._placeholder(len(self.dst.local_dims)) if grad is None else grad.detach()
        return self._run(bwd, grad, env)

    def send_forward(self, x: torch.Tensor | None, sizes: dict | None = None) -> torch.Tensor:
        """Send this rank's src piece; returns what it receives under dst (often empty)."""
        return self._forward(x, sizes)

    def recv_forward(self, x: torch.Tensor | None = None,
                     sizes: dict | None = None) -> torch.Tensor:
        """This rank's dst piece, as a leaf that requires grad (a stage input)."""
        y = self._forward(x, sizes)
        return y.requires_grad_(torch.is_floating_point(y))

    def send_backward(self, grad: torch.Tensor | None) -> torch.Tensor:
        """Send the gradient of this rank's dst piece; returns its src gradient if any."""
        return self._backward(grad)

    def recv_backward(self, grad: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient of this rank's src piece (``shard(G, src*)``)."""
        return self._backward(grad)

    def send_forward_recv_backward(self, x: torch.Tensor | None,
                                   grad: torch.Tensor | None = None,
                                   sizes: dict | None = None) -> torch.Tensor:
        """Forward ``x``, then receive its gradient (src side of a 1F1B step)."""
        self._forward(x, sizes)
        return self._backward(grad)

    def send_backward_recv_forward(self, grad: torch.Tensor | None,
                                   x: torch.Tensor | None = None,
                                   sizes: dict | None = None) -> torch.Tensor:
        """Send ``grad`` back, then receive the next activation (dst side of a 1F1B step)."""
        self._backward(grad)
        return self.recv_forward(x, sizes)
