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
"""

from __future__ import annotations

import torch

from .redistributor import Redistributor

__all__ = ["Bridge"]


class Bridge(Redistributor):
    """A prepared redistribution between two modules with imperative send/recv calls."""

    def _run(self, program, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            (out,) = self.executor.run(program, (tensor,))
        return out

    def _placeholder(self, ndim: int) -> torch.Tensor:
        return torch.empty((0,) * ndim, dtype=self.dtype, device=self.device)

    def _forward(self, x: torch.Tensor | None) -> torch.Tensor:
        """Validate ``x`` (this rank's src piece or None) and run the forward program."""
        self._assert_live()
        self._guard(x, "src")
        x = self._placeholder(len(self.src.local_dims)) if x is None else x.detach()
        return self._run(self._fwd_program, x)

    def _backward(self, grad: torch.Tensor | None) -> torch.Tensor:
        """Validate ``grad`` (this rank's dst cotangent or None) and run the adjoint."""
        self._assert_live()
        self._guard(grad, "dst")
        grad = self._placeholder(len(self.dst.local_dims)) if grad is None else grad.detach()
        return self._run(self._bwd_program, grad)

    def send_forward(self, x: torch.Tensor | None) -> torch.Tensor:
        """Send this rank's src piece; returns what it receives under dst (often empty)."""
        return self._forward(x)

    def recv_forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's dst piece, as a leaf that requires grad (a stage input)."""
        y = self._forward(x)
        return y.requires_grad_(torch.is_floating_point(y))

    def send_backward(self, grad: torch.Tensor | None) -> torch.Tensor:
        """Send the gradient of this rank's dst piece; returns its src gradient if any."""
        return self._backward(grad)

    def recv_backward(self, grad: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient of this rank's src piece (``shard(G, src*)``)."""
        return self._backward(grad)

    def send_forward_recv_backward(self, x: torch.Tensor | None,
                                   grad: torch.Tensor | None = None) -> torch.Tensor:
        """Forward ``x``, then receive its gradient (src side of a 1F1B step)."""
        self._forward(x)
        return self._backward(grad)

    def send_backward_recv_forward(self, grad: torch.Tensor | None,
                                   x: torch.Tensor | None = None) -> torch.Tensor:
        """Send ``grad`` back, then receive the next activation (dst side of a 1F1B step)."""
        self._backward(grad)
        return self.recv_forward(x)
