"""The prepared bridge's handle: one ``redistribute(src -> dst)`` for this rank.

A :class:`Redistributor` is what its caller holds: it builds the bridge's
:class:`~.prepared.Prepared` parts (registered by the bridge's name) and answers for
them, and its call runs theirs, eager, posted (:meth:`Redistributor.start`) or traced
under ``torch.compile``.
"""

from __future__ import annotations

import weakref

import torch

from mimo_fx.layout import Layout

from . import live
from .guard import HEADER_LEN, raise_now
from .lease import Lease, release_later
from .options import Options
from .pending import Pending
from .prepared import Prepared, placeholder
from .size_gather import fold_call
from .sizing import CACHED_SIZES, CALL_OPTIONS
from .source_only import backward, joined

__all__ = ["Redistributor", "Pending", "CALL_OPTIONS", "CACHED_SIZES", "placeholder",
           "backward", "joined", "fold_call", "HEADER_LEN"]


class Redistributor:
    """One prepared ``redistribute(src -> dst)`` for this rank.

    Args:
        src, dst: the layouts.
        sizes: global sizes of the dims that never change (``None`` or a part of the
            dims: the others are given or learned per call, see :mod:`.sizing`). A ragged
            dim's size is its tuple of counts.
        dtype, grad_partial, comm_dtype, checked, device, frozen, grad_comm_dtype: the
            bridge's options (:class:`~.options.Options`; ``frozen``: a source that needs
            no gradient, see :meth:`frozen`). ``checked``: before each call all ranks
            gather what they were called with (on a group of their own), so any
            rank's mistake raises :class:`MimoFxError` on every rank instead of hanging;
            a rank waits for the others ``MIMO_FX_TIMEOUT`` seconds (300). Unchecked calls
            still validate locally: the offending rank raises before any collective.
        name: the bridge's identity, the same on every rank and no other live
            bridge's (default: its layouts and its place among the live bridges of
            layouts described alike this rank built, ``#0``, ``#1``, ...: ranks build
            bridges in one order). Two bridges of the same layouts never share a process
            group (their calls cannot pair), and a checked call of one never passes for
            the other's.
    """

    def __init__(self, src: Layout, dst: Layout, sizes: dict | None = None,
                 dtype=torch.float32, *, grad_partial=(), comm_dtype=None,
                 checked: bool = False, device=None, name: str | None = None,
                 frozen: bool | None = None, grad_comm_dtype=None) -> None:
        opts = Options(dtype, grad_partial, comm_dtype, checked, device, frozen,
                       grad_comm_dtype)
        self.prepared = p = Prepared(src, dst, sizes, opts, name, type(self).__name__)
        p.owner = weakref.ref(self)
        # its parts, under the names callers use (one object each, the prepared bridge's)
        self.rank, self.name, self.src, self.dst, self.options = (
            p.rank, p.name, p.src, p.dst, p.options)
        self.sizing, self.lease, self.guard, self.executor = (
            p.sizing, p.lease, p.guard, p.executor)
        self.union, self.involved, self.device, self.context = (
            p.union, p.involved, p.device, p.context)
        # dropped without destroy(): its groups (and the threads and sockets they hold)
        # are released when the next lease is built (see lease.release_later); given
        # the registry's weak reference (a strong one would keep the bridge alive)
        weakref.finalize(self, _dropped, p.lease, p.name, live.BRIDGES[p.name], p.named)

    @property
    def dtype(self) -> torch.dtype:
        return self.options.dtype

    @property
    def checked(self) -> bool:
        return self.options.checked

    @property
    def grad_partial(self) -> tuple[str, ...]:
        return self.options.grad_partial

    @property
    def fixed(self) -> dict:
        """The sizes the bridge was built with."""
        return self.sizing.fixed

    @property
    def free(self) -> tuple[str, ...]:
        """The dims whose sizes each call gives or learns."""
        return self.sizing.free

    @property
    def template(self):
        return self.sizing.template

    @property
    def granules(self) -> dict[str, int]:
        """Per free even dim, the sizes one compiled graph serves are multiples of this."""
        return self.sizing.granules

    @property
    def groups_created(self) -> int:
        """Process groups this bridge created (each costs device memory on NCCL)."""
        return self.lease.created

    @property
    def groups_reused(self) -> int:
        """Groups it took from the meshes its grids were made from, instead of creating
        them (they keep the mesh's timeout, and are shared with the mesh's users)."""
        return self.lease.reused

    def __call__(self, x: torch.Tensor | None, sizes: dict | None = None, *, src=None,
                 dst=None, **dim_sizes) -> torch.Tensor | None:
        """This rank's dst piece (empty where it holds none; None off both grids).

        Sizes of free dims may be given (``sizes={...}`` or keywords); those not given
        are learned from the ranks holding src (every rank gives the same set). A row
        bridge (a packed layout on a side) takes this call's batch as ``src=`` /
        ``dst=``: layouts of the bridge's structure (default: the bridge's own)."""
        if torch.compiler.is_compiling():
            # reached through the registry, a global: Dynamo keeps the ints it reads from
            # there static, while those read through a local (this handle, in a step's
            # closure) that changed since the step's last compile turn symbolic
            p = live.find(self.name)
            if p is None or p is not self.prepared:  # (destroyed)
                raise_now(f"{self.lease.what} was destroyed; build a new one")
            assert p is not None
            return p.traced(x, sizes, dim_sizes, src, dst)
        p = self.prepared
        p.lease.check()
        if not p.involved:
            return None
        layouts = p.layouts(src, dst)
        if p.logs_calls:  # MIMO_FX_DEBUG=1: this call's sizes and bytes
            return p.logged(x, sizes, dim_sizes, layouts)
        return p.call(x, sizes, dim_sizes, layouts)

    def start(self, x: torch.Tensor | None, sizes: dict | None = None, *, src=None,
              dst=None, **dim_sizes) -> Pending:
        """The call, posted: its transfer is in flight when this returns, and
        :meth:`Pending.wait` gives the result (a tensor autograd tracks as the call's).
        Run independent compute between the two: it overlaps the transfer. Eager only:
        under ``torch.compile`` call the bridge itself (the compiler places the wait).
        Every rank posts its calls in the same order (a rank may wait late)."""
        if torch.compiler.is_compiling():
            raise_now(f"{self.lease.what}: start() posts a transfer eagerly; under "
                      f"torch.compile call the bridge itself")
        p = self.prepared
        p.lease.check()
        if not p.involved:
            return Pending(None)
        out = p.call(x, sizes, dim_sizes, p.layouts(src, dst), post=True)
        return out if isinstance(out, Pending) else Pending(out)

    def frozen(self) -> bool | None:
        """Whether the bridge's source is frozen: its backward moves nothing on any rank
        and no rank's result requires grad. ``frozen=`` when it was built; otherwise
        decided by its ranks when they meet (None until then): frozen if some rank runs
        the call under autograd and no rank holding a source piece passed a tensor that
        requires grad. They meet at the bridge's first call, and while it is undecided
        (every rank ran it under ``torch.no_grad()``, an evaluation say) at each later
        call under autograd, in one small all-gather of whether each runs the call under
        autograd and whether its source tensor requires grad (under ``torch.compile``
        while the call is traced). A later source tensor that requires grad is then an
        error; one that needs none, on a bridge that is not frozen, takes part in the
        backward all the same. (A source rank that, after such an evaluation, calls the
        bridge under ``no_grad`` while its receivers run under autograd does not meet
        them: build such a bridge with ``frozen=True``.)"""
        return self.prepared.freeze.frozen()

    def destroy(self) -> None:
        """Release this bridge's process groups; safe to call twice."""
        self.prepared.destroy()


def _dropped(lease: Lease, name: str, ref: weakref.ref, named: bool) -> None:
    """A bridge garbage-collected: its groups go at the next safe point, and a name the
    caller gave leaves the registry (``ref``: its entry, if the name is still its own).
    A slot among bridges described alike stays taken (its entry, now empty, stays):
    ranks collect at different times, and a freed slot would give the next bridge of
    those layouts another name on each rank."""
    if named:
        live.forget(name, ref)
    if lease.live:
        release_later(lease.release)
