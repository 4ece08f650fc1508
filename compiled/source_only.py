"""A source-only rank's part of its bridges' backwards: :func:`backward` and :func:`joined`.

A rank that holds a source piece and no destination piece (an encoder on ranks of its
own) gets an empty result from each call, so no loss of its own reaches the bridge's
backward. Its bridges keep such results (:class:`Kept`) until the rank's step joins them.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch._C._functorch import peek_interpreter_stack

from . import live, timeouts

__all__ = ["Kept", "backward", "joined"]


class Kept:
    """A source-only rank's results awaiting :func:`joined`: the last call's (``last``),
    or those of calls inside a ``torch.func`` transform (``in_transform``)."""

    def __init__(self, prepared) -> None:
        self.bridge = prepared
        self.last: torch.Tensor | None = None
        self.in_transform: list[torch.Tensor] = []
        self.warned = False

    def keep(self, y: torch.Tensor) -> torch.Tensor:
        """``y``, kept if this rank is source-only and its backward will run."""
        if not (self.bridge.source_only and y.requires_grad):
            return y
        # (attributes the bridge was built with: a compiled step guards on no new state)
        if _in_transform():
            self.in_transform.append(y)
            return y
        if not torch.compiler.is_compiling():
            self._warn_forgotten()
        self.last = y
        return y

    def clear(self) -> None:
        self.last = None
        self.in_transform.clear()

    def _warn_forgotten(self) -> None:
        """A call while the previous result, dropped by the caller, still awaits a
        backward that has not run: said at once (the ranks that run their backward would
        wait for this one until ``MIMO_FX_TIMEOUT``). A warning, not an error: if no
        rank runs that backward (an evaluation with grad enabled), nothing is wrong;
        once per bridge."""
        last, name = self.last, self.bridge.name
        # a result the caller still holds may yet get its backward from the caller
        # (several calls before their backwards, as in GPipe): only one that no one but
        # the keeper holds (3: the keeper, ``last`` and getrefcount's argument) is lost
        if self.warned or last is None or sys.getrefcount(last) > 3:
            return
        n = timeouts.calls(name, "forward")
        if n - 1 <= timeouts.calls(name, "backward"):
            return
        self.warned = True
        warnings.warn(
            self.bridge.context + f"rank {self.bridge.rank} holds no dst piece of this "
            f"bridge and ran call {n} while the backward of call {n - 1} has not run on it. "
            f"On such a rank a call's backward runs in mimo_fx.backward() (once per step, "
            f"after the step's forwards); if the other ranks run theirs, they now wait for "
            f"this rank and fail after MIMO_FX_TIMEOUT. A forward meant without a backward "
            f"runs under torch.no_grad()", stacklevel=5)


def backward(loss: torch.Tensor | None = None) -> None:
    """This rank's backward of a step, ``joined(loss).backward()``: ``loss.backward()``
    where it has a loss, together with the backward of every bridge call whose result
    this rank does not hold (on a source-only rank, an encoder on ranks of its own, the
    only way its part of those backwards runs). Every rank calls it once per step; a rank
    without a loss passes nothing. Eager or after a compiled step, the same call. It
    covers each bridge's last call (several calls of one bridge before their backwards:
    backpropagate through their results yourself); a result whose backward already ran
    is not run again. A source-only rank that calls a bridge again before the last
    call's backward ran warns at that call."""
    pending = _awaiting_backward()  # (joined's, with contiguous zero cotangents)
    tensors = ([loss] if loss is not None else []) + pending
    grads = ([torch.ones_like(loss)] if loss is not None else []) + [
        torch.zeros_like(t) for t in pending]
    if tensors:
        torch.autograd.backward(tensors, grads)


def joined(loss: torch.Tensor | None = None, bridges=None) -> torch.Tensor | None:
    """``loss`` plus zero times every bridge result this rank holds no dst piece of and
    whose backward has not run, taken off the bridges: differentiating it runs this
    rank's part of those bridges' backwards (a source-only rank -- an encoder on ranks of
    its own -- has no other path to them). None where there is neither.

    The one way for source-only ranks. Under autograd, ``mimo_fx.backward(loss)`` is
    ``joined(loss).backward()``. Inside a ``torch.func`` transform, return
    ``joined(loss)`` from the differentiated function: it joins every call made inside
    the transform (whose tensors must not outlive it); pass such a rank a differentiated
    empty tensor as its input instead of None (``ProcessWorld.begin(anchor)``), since a
    transform differentiates only its arguments. Outside a transform it joins each
    bridge's last call. ``bridges``: only these (default: every live bridge)."""
    pending = _awaiting_backward(bridges)
    if not pending:
        return loss
    total = loss if loss is not None else pending[0].new_zeros(())
    for t in pending:
        total = total + t.sum() * 0
    return total


def _awaiting_backward(bridges=None) -> list[torch.Tensor]:
    """The source-only results whose backward has not run, taken off their bridges:
    inside a ``torch.func`` transform, those of calls made in it; outside one, each
    bridge's last (if this rank ran fewer backwards than forwards of it), and results
    a transform left behind are dropped (their transform is over)."""
    out: list[torch.Tensor] = []
    inside = _in_transform()
    found = live.bridges() if bridges is None else [b.prepared for b in bridges]
    for prepared in found:
        kept = prepared.kept
        if inside:
            out.extend(kept.in_transform)
            kept.in_transform.clear()
            continue
        kept.in_transform.clear()
        y, kept.last = kept.last, None
        if y is not None and (timeouts.calls(prepared.name, "forward")
                              > timeouts.calls(prepared.name, "backward")):
            out.append(y)
    return out


def _in_transform() -> bool:
    """Whether the call runs inside a ``torch.func`` transform, eager or traced (there a
    source-only result is the transform's to differentiate, never kept for
    :func:`backward`: a transform's tensor must not outlive it)."""
    # (``!=``, not ``is not``: Dynamo compares the interpreter it wraps by value)
    return peek_interpreter_stack() != None  # noqa: E711
