"""The prepared bridge: one ``redistribute(src -> dst)`` for this rank.

A :class:`Redistributor` is four parts with one job each, and the call that runs them:

- :class:`~.sizing.Sizing` plans this rank's part of forward and adjoint (no rank plans
  another's transfers), holds the template and the programs for every size;
- :class:`~.lease.Lease` creates every process group those plans need (eagerly, in plan
  order, on every rank) and checks the bridge and its world are alive;
- :class:`~.guard.Guard` validates each call's tensor before any collective (and, in
  checked mode, every rank's together);
- the call learns the sizes it is not given, picks the programs, guards, and runs the
  forward program through the custom vjp (:mod:`mimo_fx.vjp`), whose backward runs the
  adjoint program. Everything it does is tensor ops and ordered collectives, so it
  traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import sys
import warnings
import weakref
from collections import Counter
from typing import Any, cast

import torch
from torch._C._functorch import TransformType, peek_interpreter_stack

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.packed import is_layout, not_a_layout
from mimo_fx.plan import format_bytes
from mimo_fx.vjp import apply

from . import live, timeouts
from .agree import agree
from .comm import host_to
from .executor import CompiledExecutor, Numbers
from .groups import CHECK
from .guard import HEADER_LEN, Guard, fingerprint, raise_now
from .lease import Lease, release_later, require_world
from .ops import define
from .options import Options, require_compiler
from .rows import key_of, sizing_for
from .sizing import CACHED_SIZES, CALL_OPTIONS, _size_key, flat_sizes, read_sizes
from .timeouts import cause, wait_time

__all__ = ["Redistributor", "Pending", "CALL_OPTIONS", "CACHED_SIZES", "placeholder",
           "backward", "joined"]

LOG = logging.getLogger("mimo_fx")


def placeholder(ndim: int, dtype: torch.dtype, device, grad: bool = False) -> torch.Tensor:
    """The empty tensor a rank holding no piece feeds a bridge. Made when the bridge is
    built, not per call (Dynamo cannot trace creating a tensor that requires grad); it
    requires grad so that the backward, and its collectives, run on that rank too."""
    floating = dtype.is_floating_point or dtype.is_complex
    return torch.empty((0,) * ndim, dtype=dtype, device=device,
                       requires_grad=grad and floating)


class Redistributor:
    """One prepared ``redistribute(src -> dst)`` for this rank.

    Args:
        src, dst: the layouts.
        sizes: global sizes of the dims that never change (``None`` or a part of the
            dims: the others are given or learned per call, see :mod:`.sizing`). A ragged
            dim's size is its tuple of counts.
        dtype, grad_partial, comm_dtype, checked, device, frozen, grad_comm_dtype: the
            bridge's options
            (:class:`~.options.Options`; ``frozen``: a source that needs no gradient,
            see :meth:`frozen`). ``checked``: before each call all ranks
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

    _agreed: tuple | None  # the last size gather: (this rank's row, rows, sizes)
    source_result: torch.Tensor | None  # (see joined)
    source_results_in_transform: list[torch.Tensor]

    def __init__(self, src: Layout, dst: Layout, sizes: dict | None = None,
                 dtype=torch.float32, *, grad_partial=(), comm_dtype=None,
                 checked: bool = False, device=None, name: str | None = None,
                 frozen: bool | None = None, grad_comm_dtype=None) -> None:
        self.rank = require_world("Redistributor")
        self._define(src, dst, sizes, Options(dtype, grad_partial, comm_dtype, checked,
                                              device, frozen, grad_comm_dtype), name)
        src, dst, opts = self.src, self.dst, self.options
        self.union, self.involved = self.sizing.union, self.rank in self.sizing.union
        self.device = opts.resolved_device()
        self.sizing.name = self.name
        self._agree()
        # each direction on groups of its own, tagged by the bridge's identity; and a
        # check group over the union, shared, whether checked or not (so ranks that
        # disagree on checked= still create the same groups)
        fwd, bwd = f"{self.name} >", f"{self.name} <"
        tagged = [(fwd, g) for g in self.sizing.groups["forward"]]
        if not opts.frozen:  # (a frozen source's backward moves nothing)
            tagged += [(bwd, g) for g in self.sizing.groups["backward"]]
        checks = [(CHECK, self.union)] if len(self.union) > 1 else []
        meshes = tuple(dict.fromkeys(m for m in (src.grid.mesh, dst.grid.mesh)
                                     if m is not None))  # (their groups reused)
        self.lease = Lease(f"this bridge {src.describe()!r} -> {dst.describe()!r}",
                           (), tagged + checks, self.device, meshes)
        self.source_only = self.involved and not dst.holds(self.rank)
        # a source-only rank's results awaiting joined(): the last call's, or a transform's
        self.source_result, self.source_results_in_transform = None, []
        self.described, self.ran = self._context().rstrip(": "), Counter[str]()  # timeouts
        self._traced_handle = _traced_handle(self)  # (registers the bridge by its name)
        # dropped without destroy(): its groups (and the threads and sockets they hold)
        # are released when the next lease is built (see lease.release_later); given
        # the registry's weak reference (a strong one would keep the bridge alive)
        weakref.finalize(self, _dropped, self.lease, self.name, live.BRIDGES[self.name],
                         self._named)
        self.executor = CompiledExecutor(self.lease.comm(fwd), comm_dtype,
                                         self.lease.comm(bwd), self.name, opts.wires())
        needs_check_comm = (checked or self.sizing.varies) and checks and self.involved
        self._check_comm = self.lease.comm(CHECK) if needs_check_comm else None
        key = (src, dst, sorted(self.fixed.items()), str(opts.dtype), opts.grad_partial,
               str(comm_dtype), str(opts.grad_comm_dtype), self.name)
        self.guard = Guard(src, dst, self.rank, self.union, opts.dtype, self.device, checked,
                           self._check_comm, key, self._context(), self.name,
                           self.sizing.shape)
        self.sizing.print_ = self.guard.prints["src"]
        checks_bwd = checked and self._check_comm is not None
        self.executor.check = self._check_backward if checks_bwd else None
        self._no_src = placeholder(len(src.local_dims), opts.dtype, self.device, grad=True)
        self._no_src_plain = placeholder(len(src.local_dims), opts.dtype, self.device)
        self._label = f"mimo_fx.redistribute {src.describe()} -> {dst.describe()}"
        self._require_compiler()
        _log_plans(self)
        self._warned_func, self._warned_backward, self._agreed = False, False, None
        # the last eager call with every size given: (its shape and sizes, the size gather it
        # agreed on, the sizes) -- the same call again learns nothing and checks nothing new
        self._given_last: tuple | None = None
        # nothing to move either way: a call returns its input (a view of it)
        self._still_last: tuple | None = None  # (see _still)
        self._identity = (not self.sizing.varies and self.sizing.fwd_program.identity
                          and self.sizing.bwd_program.identity)

    def _define(self, src, dst, sizes, opts: Options, name) -> None:
        """The bridge's definition, checked on this rank: its layouts, options, sizes
        (its plans) and name."""
        src, dst = _own("src", src), _own("dst", dst)
        self.src, self.dst, self.options = src, dst, opts
        self._context_text = _message_prefix(src, dst, opts.checked)
        self.sizing = sizing_for(src, dst, sizes, opts.dtype, opts.grad_partial,
                                 self.rank, self._context(), opts.resolved_device())
        self.name, self._named = _identity(src, dst, name), name is not None

    def _agree(self) -> None:
        """A bridge that creates groups is built alike on every rank of its grids: agree
        on its whole definition first (see :mod:`.agree`)."""
        self._decided = cast(bool | None, None)  # (see frozen)
        self._met = False  # whether its ranks met at a call yet
        if self.involved and len(self.union) > 1:
            agree(self.name, self._definition(), "mimo_fx", self.union)

    def _require_compiler(self) -> None:
        """The compiler settings this bridge's traced calls need."""
        if self.sizing.varies:
            # the size gather's rows, a route's counts: read back as ints (.tolist());
            # a row backward's per-row sums, a ragged dim's pieces and their gradients:
            # tensors of run-time length, zero on some ranks
            require_compiler(scalar_outputs=True, unbacked_tensors=self.sizing.unbacked)
        require_compiler(late_waits=True)  # a transfer overlaps the compute after it

    # -- the parts' answers, under the names callers use ---------------------------------
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

    def _definition(self) -> dict[str, str]:
        """What every rank must build this bridge with, field by field (canonical
        strings): everything that decides its groups or what goes on the wire."""
        o = self.options
        return {"kind": type(self).__name__, "src": repr(key_of(self.src)),
                "dst": repr(key_of(self.dst)),
                "sizes": repr(dict(sorted(self.fixed.items()))), "dtype": str(o.dtype),
                "comm_dtype": str(o.comm_dtype), "grad_comm_dtype": str(o.grad_comm_dtype),
                "grad_partial": repr(o.grad_partial),
                "checked": str(o.checked), "device": self.device.type,
                "frozen": str(o.frozen)}

    def _context(self) -> str:
        return self._context_text

    # -- the call -----------------------------------------------------------------------
    def __call__(self, x: torch.Tensor | None, sizes: dict | None = None, *, src=None,
                 dst=None, **dim_sizes) -> torch.Tensor | None:
        """This rank's dst piece (empty where it holds none; None off both grids).

        Sizes of free dims may be given (``sizes={...}`` or keywords); those not given
        are learned from the ranks holding src (every rank gives the same set). A row
        bridge (a packed layout on a side) takes this call's batch as ``src=`` /
        ``dst=``: layouts of the bridge's structure (default: the bridge's own)."""
        if torch.compiler.is_compiling():
            handle = live.find(self.name)
            if handle is None or handle is not self._traced_handle:  # (destroyed)
                raise_now(f"{self.lease.what} was destroyed; build a new one")
            assert handle is not None
            return handle._traced(x, sizes, dim_sizes, src, dst)
        self.lease.check()
        if not self.involved:
            return None
        layouts = self._layouts(src, dst)
        # a labelled span in profiler traces; entering one costs ~6 µs, so only when a
        # profiler is recording
        if self.executor.count:  # MIMO_FX_DEBUG=1: this call's sizes and bytes
            return self._logged(x, sizes, dim_sizes, layouts)
        return self._spanned(x, sizes, dim_sizes, layouts)

    def _spanned(self, x, sizes, dim_sizes: dict, layouts: dict) -> torch.Tensor | None:
        if not torch._C._autograd._profiler_enabled():
            return self._call(x, sizes, dim_sizes, layouts)
        with torch.profiler.record_function(self._label):
            return self._call(x, sizes, dim_sizes, layouts)

    def _logged(self, x, sizes, dim_sizes: dict, layouts: dict) -> torch.Tensor | None:
        """An eager call, logged at DEBUG: its sizes (given, learned or fixed) and the
        bytes its forward sent and received on this rank."""
        moved = self.executor.moved
        moved[:] = [0, 0]
        y = self._spanned(x, sizes, dim_sizes, layouts)
        full = getattr(self, "_last_sizes", {})
        shown = ", ".join(f"{d}={list(n) if isinstance(n, tuple) else n}"
                          for d, n in sorted(full.items(), key=lambda kv: (
                              kv[0] not in self.src.dims,
                              self.src.dims.index(kv[0]) if kv[0] in self.src.dims else 0)))
        n = timeouts.calls(self.name, "forward")
        LOG.debug("rank %d: %s call %d: sizes %s; forward sends %s, receives %s", self.rank,
                  self._label, n, shown or "none", format_bytes(moved[0]),
                  format_bytes(moved[1]))
        return y

    def _traced(self, x, sizes, dim_sizes: dict, src, dst) -> torch.Tensor | None:
        """The call under ``torch.compile``, on this bridge's handle in the registry
        (see :func:`_traced_handle`)."""
        if not self.involved:
            return None
        return self._call(x, sizes, dim_sizes, self._layouts(src, dst))

    def _layouts(self, src, dst) -> dict:
        """A call's batch: the layouts it names, of this bridge's structure."""
        if src is None and dst is None:
            return {}
        return self.sizing.call_batch(src, dst, self._context())

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
        self.lease.check()
        if not self.involved:
            return Pending(None)
        out = self._call(x, sizes, dim_sizes, self._layouts(src, dst), post=True)
        return out if isinstance(out, Pending) else Pending(out)

    def _call(self, x: torch.Tensor | None, sizes, dim_sizes,
              layouts: dict, post: bool = False) -> Any:
        # (not compiling asked first: a trace must not read _decided before _frozen)
        if (not torch.compiler.is_compiling() and self._decided is None
                and self.options.frozen is None and not self.checked):
            # its ranks are about to meet (see frozen): a mistake of this rank's alone is
            # its error, raised before that collective as before any other (where the
            # call's sizes are known without a size gather)
            given = self.sizing.given(sizes, dim_sizes)
            if not self.sizing.gathers_sizes(self.sizing.missing(given)):
                self._check_given(x, {**self.fixed, **given})
        # first, before anything that waits for peers (a size gather), in every mode alike
        # (its first call's ranks may meet: see frozen)
        grad = self._backward_runs(x)
        full, learned = self._sizes(x, sizes, dim_sizes, layouts)
        if self.executor.count and not torch.compiler.is_compiling():
            self._last_sizes = full
        try:
            fwd, bwd, env, index, digest = self.sizing.programs(full, learned, x, **layouts)
        except MimoFxError as err:  # checked: every rank raises with it, none waits
            self.guard.failed(err)
            raise
        shape = fwd.src_shape
        if env is not None and shape is not None:
            shape = Numbers(dict(zip(self.sizing.variables, env))).all(shape)
        print_ = None  # what checked mode compares: with the sizes if free
        if self.free and self.checked and not torch.compiler.is_compiling():
            print_ = fingerprint("src", *self.guard.key, _size_key(full))
        if not self.guard(x, "src", shape, full, print_, grad, digest):
            # (compiled, checked: the check raises on every rank when the graph runs)
            return self._no_src.new_zeros((0,) * len(self.dst.local_dims))
        if x is not None and (self._identity or (
                env is None and not index and self._still(fwd, bwd))):
            return x.view_as(x)  # (a view: its grad passes through)
        if x is None:
            x = self._no_src if grad else self._no_src_plain
            self._warn_none_in_func(bwd)
        elif grad and not x.requires_grad:  # it takes part in the backward all the same
            x = _Joined.apply(x, self._no_src)
        assert x is not None  # the guard rejected None on ranks that hold src
        if post:
            return Pending(None, self, x, fwd, bwd, env, index, grad)
        if not grad and not torch.compiler.is_compiling():
            # no backward on any rank: skip the autograd.Function layer (tens of µs a call)
            env_map = None if env is None else dict(zip(self.sizing.variables, env))
            (y,) = self.executor.run(fwd, (x,), env_map, index)
            return self.sizing.finish(y)
        if torch.compiler.is_compiling():
            # Dynamo traces an autograd.Function's own backward only for inputs it sees as
            # requiring grad, and it does not see that of a tensor a torch.func transform
            # differentiates directly: it would then differentiate through the forward's
            # collectives (wrong gradient, no backward collectives). A view makes the
            # input an op's output, whose requirement Dynamo does see.
            x = x.view(x.shape)
        (y,) = apply(self.executor, fwd, bwd, (x,), env, self.sizing.variables, index)
        return self._keep(self.sizing.finish(y))

    def _still(self, fwd, bwd) -> bool:
        """Whether an eager call of free sizes moves nothing either way at these sizes
        (its programs' answer kept beside them: a step repeats its sizes)."""
        if not self.sizing.varies or torch.compiler.is_compiling():
            return False
        last = self._still_last
        if last is None or last[0] is not fwd or last[1] is not bwd:
            last = self._still_last = (fwd, bwd, fwd.identity and bwd.identity)
        return last[2]

    # -- whether a call's backward runs: a frozen source ---------------------------------
    def _backward_runs(self, x) -> bool:
        """Whether this call's backward runs: on every rank of the bridge alike, under
        autograd, for float data, unless the source is frozen (:meth:`frozen`). A source
        tensor that requires grad on a frozen bridge is refused here, before any
        collective: its gradient would be lost."""
        if not self._no_src.requires_grad:
            return False  # (ints)
        grad, holds = torch.is_grad_enabled(), self.src.holds(self.rank)
        # (a rank holding no piece may pass an empty tensor that requires grad: a torch.func
        # transform's anchor)
        wants = grad and holds and isinstance(x, torch.Tensor) and x.requires_grad
        frozen = self._frozen("g" if wants else "n" if grad else "x")
        if frozen is None:
            return False  # (no rank of the call runs under autograd)
        if not frozen:
            return grad
        if wants:
            how = ("it was built with frozen=True" if self.options.frozen else
                   "no source rank's input required grad at its first call under autograd")
            raise_now(self._context() + f"rank {self.rank}'s input requires grad, but this "
                      f"bridge's source is frozen ({how}): its backward moves nothing, and "
                      f"this gradient would be lost. Pass x.detach() to keep the source "
                      f"frozen, or build the bridge with frozen=False to run its backward "
                      f"on every call")
        return False

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
        return self.options.frozen if self.options.frozen is not None else self._decided

    def _frozen(self, state: str) -> bool | None:
        """:meth:`frozen`, deciding it at this call if it is not decided yet (``state``:
        this rank's, ``g`` its source tensor requires grad, ``n`` it runs under autograd,
        ``x`` under ``no_grad``); None while no rank has run a call under autograd."""
        if self.options.frozen is not None:
            return self.options.frozen
        if torch.compiler.is_compiling():
            from torch._dynamo.comptime import comptime

            name = self.name  # noqa: F841 (read by _decide_traced, with state)
            comptime(_decide_traced)
            # (read only after the decision: Dynamo keeps the value it read first)
            return self._decided
        if self._decided is None and (state != "x" or not self._met):
            self._decide(state)
        return self._decided

    def _decide(self, state: str) -> None:
        """Every rank's ``state`` of this call (see :meth:`_frozen`), through the store:
        the bridge is frozen if some rank runs under autograd and no source rank's
        tensor requires grad."""
        states = [state] if len(self.union) == 1 else self._meet(state)
        self._met = True
        if any(s != "x" for s in states):
            self._decided = "g" not in states

    def _meet(self, state: str) -> list[str]:
        """Every rank's ``state``: one small all-gather over the bridge's check group,
        which the bridges of the same grids share (ranks that call two of them in other
        orders meet there, and their rows name the bridge: an error on every rank). A
        rank that left is named, as in any collective; the one host sync of it (reading
        the rows) is this call's, until the bridge is decided."""
        from mimo_fx.collective import Collective

        n = timeouts.calls(self.name, "forward") + 1
        row = torch.tensor([fingerprint("meet", self.name), "xng".index(state)],
                           dtype=torch.int64, device=self.device)
        # (a failed wait is the standard error of this call's forward, its peer named)
        out = self.lease.comm(CHECK).collective(
            Collective.ALL_GATHER, row, self.union,
            site=timeouts.site(self.name, "forward", -1, self.union))
        rows = out.view(len(self.union), 2).tolist()
        calls: dict[int, list[int]] = {}
        for r, (f, _) in zip(self.union, rows):
            calls.setdefault(f, []).append(r)
        if len(calls) > 1:
            groups = sorted(calls.values(), key=lambda g: (-len(g), g))
            raise MimoFxError(
                self._context() + f"the ranks called different bridges at call {n}: one on "
                + ", another on ".join(map(_named, groups)) + "; every rank of both grids "
                "calls its bridges in the same order")
        return ["xng"[code] for _, code in rows]

    def _keep(self, y: torch.Tensor) -> torch.Tensor:
        if not (self.source_only and y.requires_grad):
            return y
        # a source-only rank: its backward runs through joined (mimo_fx.backward);
        # attributes the bridge was built with (a compiled step guards on no new state)
        if _in_transform():
            self.source_results_in_transform.append(y)
            return y
        if not torch.compiler.is_compiling():
            self._warn_forgotten_backward()
        self.source_result = y
        return y

    def _warn_forgotten_backward(self) -> None:
        """A source-only rank's call while its previous result, dropped by the caller,
        still awaits a backward that has not run: said at once (the ranks that run their
        backward would wait for this one until ``MIMO_FX_TIMEOUT``). A warning, not an
        error: if no rank runs that backward (an evaluation with grad enabled), nothing
        is wrong; once per bridge."""
        last = self.source_result
        # a result the caller still holds may yet get its backward from the caller
        # (several calls before their backwards, as in GPipe): only one that no one but
        # the store holds (3: the store, ``last`` and getrefcount's argument) is lost
        if self._warned_backward or last is None or sys.getrefcount(last) > 3:
            return
        n = timeouts.calls(self.name, "forward")
        if n - 1 <= timeouts.calls(self.name, "backward"):
            return
        self._warned_backward = True
        warnings.warn(
            self._context() + f"rank {self.rank} holds no dst piece of this bridge and ran "
            f"call {n} while the backward of call {n - 1} has not run on it. On such a "
            f"rank a call's backward runs in mimo_fx.backward() (once per step, after the "
            f"step's forwards); if the other ranks run theirs, they now wait for this rank "
            f"and fail after MIMO_FX_TIMEOUT. A forward meant without a backward runs "
            f"under torch.no_grad()", stacklevel=4)

    def _check_backward(self, g, program, num) -> bool:
        """Checked mode's check of a backward call (its cotangent, every rank's)."""
        shape = None if program.src_shape is None else num.all(program.src_shape)
        return self.guard(g, "dst", shape, None, None, True)

    def _sizes(self, x, sizes, dim_sizes, layouts: dict) -> tuple[dict, frozenset]:
        """Every dim's size for this call, and the dims learned by the size gather. A
        bridge whose sizes or batch vary gathers size rows on every call, learning
        what is missing and checking what is given (the rows carry its digest): ranks
        that give different sizes or batches raise, never pair mismatched data."""
        if not self.sizing.varies:
            if sizes is not None or dim_sizes:
                self.sizing.given(sizes, dim_sizes)
            return self.fixed, frozenset()
        given = self.sizing.given(sizes, dim_sizes)
        full = {**self.fixed, **given}
        missing = self.sizing.missing(given)
        if len(self.union) == 1:  # (learned from its own tensor: no one to gather from)
            if not missing:
                return full, frozenset()
            # (its host row, not a tensor of it: under torch.compile the sizes are then
            # its tensor's own, not unbacked reads that no shape of the graph matches)
            return self.sizing.sizes_from([self.sizing.size_values(x)], full), \
                frozenset(missing)
        if not self.sizing.gathers_sizes(missing) and not torch.compiler.is_compiling():
            key = (None if x is None else tuple(x.shape), tuple(full.items()))
            last = self._given_last
            if last is not None and last[0] == key and last[1] is self._agreed:
                return dict(last[2]), frozenset()  # (the gather would be skipped as agreed)
            self._check_given(x, full)
            out = self._learn(x, full, layouts)
            self._given_last = (key, self._agreed, out)
            return out, frozenset()
        return self._learn(x, full, layouts), frozenset(missing)

    def _check_given(self, x, full: dict) -> None:
        """Every size given: this rank's tensor judged against them before the size gather
        (a rank alone in its mistake raises at once, before any collective). Eager
        only: a trace's sizes are symbols, judged when its checks run."""
        self.guard.local(x, "src", self.guard.expect("src", self.rank, full).shape, full)

    def _learn(self, x, known: dict, layouts: dict) -> dict:
        """The size gather: every rank's shape row, then every size from them. Under
        ``torch.compile`` the gather is an ordered op that also judges the rows when
        the graph runs, raising the eager call's error on every rank."""
        values, spec = flat_sizes(known)
        if not torch.compiler.is_compiling():  # (the gather learns them as it judges)
            return _gather_sizes_eager(self, self.sizing.size_values(x), values,
                                       self.sizing.batch_values(layouts), spec)[1]
        batch = self.sizing.batch(layouts)
        rows = _GATHER_SIZES(self.sizing.size_row(x), values, batch, self.name, spec)
        if not self.sizing.missing(known):
            # every size given: the op judges the rows when the graph runs; reading
            # them here would only repeat its checks as run-time asserts
            return dict(known)
        return self.sizing.sizes_from(rows.view(len(self.union), -1), known)

    def _gather_size_rows(self, row: list[int]) -> torch.Tensor:
        """Every rank's size row (``row``: this rank's host values), on the host: the
        one read of the data's device a call that learns its sizes makes."""
        assert self._check_comm is not None
        try:
            mine = host_to(torch.tensor(row, dtype=torch.int64), self.device)
            rows = self._check_comm.all_gather(mine, self.union)
            return rows.view(len(self.union), -1).cpu()
        except (RuntimeError, MimoFxError) as err:  # a timeout or a peer gone
            raise MimoFxError(
                self._context() + f"rank {self.rank} waited in vain for every rank's size "
                f"row ({cause(err)}). Every rank of both grids calls the bridge, giving the "
                f"same set of sizes ({wait_time()})") from None

    def _warn_none_in_func(self, bwd) -> None:
        if self._warned_func or not bwd.ops or not _in_grad_transform():
            return
        self._warned_func = True
        warnings.warn(
            f"rank {self.rank} holds no piece of src {self.src.describe()!r} and called the "
            f"bridge with None inside a torch.func grad transform. The transform "
            f"differentiates only its arguments, so this rank will skip the backward's "
            f"collectives and ranks that run theirs will wait for it. Pass an empty tensor "
            f"that the transform differentiates instead of None, e.g. grad(step, argnums=("
            f"0, 1))(torch.empty({(0,) * len(self.src.local_dims)}), w).", stacklevel=4)

    def destroy(self) -> None:
        """Release this bridge's process groups; safe to call twice."""
        if self.lease.live:
            self.lease.release()
            self.sizing.forget()
            self.source_result = None
            self.source_results_in_transform.clear()
            live.forget(self.name, self._traced_handle)  # (its name, or slot, is free)


class Pending:
    """A posted bridge call (:meth:`Redistributor.start`); :meth:`wait` gives its
    result, waiting for the transfer if it is still in flight."""

    def __init__(self, result: torch.Tensor | None, bridge: Redistributor | None = None,
                 x=None, fwd=None, bwd=None, env=None, index: tuple = (),
                 grad: bool = False) -> None:
        self._result, self._bridge = result, bridge
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
                y = bridge._keep(bridge.sizing.finish(y))
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


# (kept for the header's length in callers that decode check rows)
__all__ += ["HEADER_LEN"]


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
    for bridge in (live.bridges() if bridges is None else bridges):
        kept = bridge.source_results_in_transform
        if inside:
            out.extend(kept)
            kept.clear()
            continue
        kept.clear()
        y, bridge.source_result = bridge.source_result, None
        if y is not None and (timeouts.calls(bridge.name, "forward")
                              > timeouts.calls(bridge.name, "backward")):
            out.append(y)
    return out


# -- what a compiled call traces ---------------------------------------------------------
# Under torch.compile a call reaches its bridge's state by the bridge's name through the
# registry (:mod:`.live`), a global, and not through the variable the caller holds it in. Dynamo
# specialises the ints it reads from globals, while an int read through a local (a
# step's argument or closure) that changed since the last compile of the same code -- a
# step compiled for one bridge, then for another -- becomes symbolic, and planning code
# cannot take symbolic ints (a grid's ranks, a fingerprint). The registry holds a second
# handle on the bridge, sharing its state (Dynamo reaches an object it has seen through
# the first path it saw it by), weakly: a bridge nobody holds can still be collected.
class _Joined(torch.autograd.Function):
    """``x``, joined to ``anchor`` (a placeholder that requires grad): a source tensor that
    needs no gradient still takes part in its bridge's backward, which every rank runs
    (the gradient it gets is dropped)."""

    @staticmethod
    def forward(x, anchor):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _decide_traced(ctx) -> None:
    """While a compiled call is traced, at trace time: decide whether its bridge's source
    is frozen (:meth:`Redistributor._frozen`; the frame's ``name`` and ``state``)."""
    from .guard import TracedError

    bridge = live.named(ctx.get_local("name").as_python_constant())
    state = ctx.get_local("state").as_python_constant()
    if bridge._decided is None and (state != "x" or not bridge._met):
        try:
            bridge._decide(state)
        except MimoFxError as err:  # (as a user error of the trace, not Dynamo's own)
            raise TracedError(str(err)) from None


def _named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _message_prefix(src, dst, checked: bool) -> str:
    """How a bridge's messages start, made once when it is built: every call passes it
    on, and describing the layouts on every call read a packed layout's batch (its
    selected tokens), which Dynamo then guarded on."""
    return f"{'checked ' if checked else ''}redistribute {src.describe()!r} -> {dst.describe()!r}: "


def _own(side: str, layout):
    """A layout's own copy (equal, not the caller's object); anything else is refused.
    Under ``torch.compile`` the bridge reaches its layouts through its registered
    handle, a global, whose ints Dynamo keeps static; the caller's layout objects may
    live in a closure, whose ints Dynamo makes symbolic when one step function is
    compiled again for other layouts (automatic dynamic shapes), and Dynamo tracks an
    object by its identity whichever way it is reached: sharing them would make the
    bridge's grid ints symbolic too, and planning code cannot take symbolic ints; and a
    packed layout's batch would be guarded on as the caller's input."""
    if not is_layout(layout):
        raise MimoFxError(not_a_layout("Redistributor", side, layout))
    return copy.deepcopy(layout)


def _traced_handle(bridge: Redistributor) -> Redistributor:
    """The bridge's second handle (the bridge keeps it), registered by its name."""
    handle = object.__new__(type(bridge))
    handle.__dict__ = bridge.__dict__  # one state, two handles
    live.register(bridge.name, handle)
    return handle


def fold_call(row: list, known, spec: str, batch) -> list:
    """``row`` (a size row's host values), its fingerprint folding in the sizes a call
    gives (``known``, flat as :func:`flat_sizes` makes them, with their ``spec``) and
    its batch's data as ints (``batch``): ranks whose calls differ in either send
    different rows."""
    row[1] = fingerprint(int(row[1]), [int(v) for v in known], spec,
                         [list(b) for b in batch])
    return row


def _gather_sizes_impl(row: torch.Tensor, known, batch, bridge: str, spec: str) -> torch.Tensor:
    """Every rank's size row, its fingerprint folding in the sizes the call gives and
    its batch, judged as an eager call judges them (the same error on every rank for a
    bad one)."""
    return _gather_sizes_eager(live.named(bridge), row.tolist(), known,
                               [b.tolist() for b in batch], spec)[0]


def _gather_sizes_eager(self: Redistributor, row: list, known, batch,
                        spec: str) -> tuple[torch.Tensor, dict]:
    """:func:`_gather_sizes_impl`'s rows (on the host), and every size they give."""
    known = [int(v) for v in known]
    mine = fold_call(list(row), known, spec, batch)
    sizes = read_sizes(known, spec)
    key = (tuple(mine), spec)
    agreed = self._agreed
    if agreed is not None and agreed[0] == key and not self.sizing.missing(sizes):
        # every size given, as in the last size gather, whose rows agreed: nothing to learn
        # and nothing new to check (a rank whose sizes changed gathers alone and times
        # out naming the size gather, and its peers time out in their data transfer)
        return agreed[1].clone(), dict(agreed[2])
    rows = self._gather_size_rows(mine)
    learned = self.sizing.sizes_from(rows, sizes)
    out = rows.reshape(-1).clone()
    self._agreed = (key, out, learned)
    return out.clone(), dict(learned)


_GATHER_SIZES = define(
    "gather_sizes(Tensor row, SymInt[] known, Tensor[] batch, str bridge, str spec) -> Tensor",
    _gather_sizes_impl,
    lambda row, known, batch, bridge, spec: row.new_empty(
        row.numel() * len(live.named(bridge).union)), ordered=True)


def _identity(src, dst, name: str | None) -> str:
    """A bridge's identity: ``name``, else its layouts' description and its slot among
    the bridges described alike in the registry (:mod:`.live`; the lowest free one:
    ranks that build and destroy bridges in one order give every bridge the same slot).
    Two live bridges never have one identity: their groups, size gathers and
    source-only backwards would be taken for each other's (bridges of other grids or
    options may be described alike)."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise MimoFxError(f"name={name!r} must be a non-empty string naming the bridge "
                              f"(the same on every rank)")
        if _live(name):
            raise MimoFxError(f"name={name!r} is the name of a live bridge; give every "
                              f"bridge a name of its own (or destroy that one first)")
        return name
    base = f"{src.describe()} -> {dst.describe()}"
    k = next(i for i in itertools.count() if f"{base} #{i}" not in live.BRIDGES)
    return f"{base} #{k}"


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


def _live(name: str) -> bool:
    bridge = live.find(name)
    return bridge is not None and bridge.lease.live


def _log_plans(bridge: Redistributor) -> None:
    """With ``MIMO_FX_DEBUG=1`` (or the ``mimo_fx`` logger at DEBUG), log this rank's
    collectives and bytes of each plan once, when the bridge is built."""
    if os.environ.get("MIMO_FX_DEBUG", "0") not in ("", "0"):
        _debug_logging()
    if not LOG.isEnabledFor(logging.DEBUG):
        return
    bridge.executor.count = True  # every call logs its sizes and bytes (Redistributor._logged)
    rank = bridge.rank
    LOG.debug("rank %d: %s: %d process group(s) created, %d taken from device meshes",
              rank, bridge._label, bridge.groups_created, bridge.groups_reused)
    for line in bridge.sizing.summary():
        LOG.debug("rank %d: %s%s", rank, bridge._label, line)


def _debug_logging() -> None:
    if not LOG.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        LOG.addHandler(handler)
    LOG.setLevel(logging.DEBUG)


def _in_transform() -> bool:
    """Whether the call runs inside a ``torch.func`` transform, eager or traced (there a
    source-only result is the transform's to differentiate, never kept for
    :func:`backward`: a transform's tensor must not outlive it)."""
    # (``!=``, not ``is not``: Dynamo compares the interpreter it wraps by value)
    return peek_interpreter_stack() != None  # noqa: E711


def _in_grad_transform() -> bool:
    """Whether an eager call runs inside a ``torch.func`` grad/vjp transform (not asked
    under ``torch.compile``, where the question breaks the graph)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    level = peek_interpreter_stack()
    return level is not None and level.key() == TransformType.Grad
