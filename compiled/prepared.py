"""What a bridge holds once prepared, on one object, and its call.

A :class:`Prepared` bridge is its definition (layouts, options, fixed sizes, name) and
the parts that serve it, one job each:

- :class:`~.sizing.Sizing` plans this rank's part of forward and adjoint (no rank plans
  another's transfers) and holds the template and the programs for every size;
- :class:`~.lease.Lease` creates every process group those plans need (eagerly, in plan
  order, on every rank) and checks the bridge and its world are alive;
- :class:`~.guard.Guard` validates each call's tensor before any collective (and, in
  checked mode, every rank's together);
- :class:`~.size_gather.SizeGather` learns the sizes a call does not give;
- :class:`~.frozen.Freeze` decides whether the source is frozen;
- :class:`~.source_only.Kept` keeps a source-only rank's results for its step's backward;
- :class:`~.executor.CompiledExecutor` runs a lowered program, traced or eager, posted
  or waited.

:meth:`Prepared.call` learns the sizes, picks the programs, guards, and runs the forward
program through the custom vjp (:mod:`mimo_fx.vjp`), whose backward runs the adjoint
program. Everything it does is tensor ops and ordered collectives, so it traces under
``torch.compile(fullgraph=True)``. The bridge registry (:mod:`.live`) holds the prepared
bridge by its name: a compiled call reaches it there, through a global, never through
the variable its caller holds the bridge in (see :meth:`.redistributor.Redistributor.__call__`).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import warnings
from collections import Counter
from dataclasses import replace
from typing import Any

import torch
from torch._C._functorch import TransformType, peek_interpreter_stack

from mimo_fx.errors import MimoFxError
from mimo_fx.packed import is_layout, not_a_layout
from mimo_fx.plan import format_bytes
from mimo_fx.vjp import apply

from . import live, timeouts
from .agree import agree
from .definition import Definition
from .executor import CompiledExecutor, NumbersAt
from .frozen import Freeze
from .groups import CHECK
from .guard import Guard, fingerprint
from .lease import Lease, require_world
from .options import Options, require_compiler
from .row_sizing import sizing_for
from .size_gather import SizeGather
from .sizing import _size_key
from .source_only import Kept

__all__ = ["Prepared", "placeholder", "LOG"]

LOG = logging.getLogger("mimo_fx")


def placeholder(ndim: int, dtype: torch.dtype, device, grad: bool = False) -> torch.Tensor:
    """The empty tensor a rank holding no piece feeds a bridge. Made when the bridge is
    built, not per call (Dynamo cannot trace creating a tensor that requires grad); it
    requires grad so that the backward, and its collectives, run on that rank too."""
    floating = dtype.is_floating_point or dtype.is_complex
    return torch.empty((0,) * ndim, dtype=dtype, device=device,
                       requires_grad=grad and floating)


class Prepared:
    """One bridge ``src -> dst`` on this rank, prepared: its definition and parts (see the
    module's text), registered by its name. Built by :class:`~.redistributor.Redistributor`
    (its arguments)."""

    def __init__(self, src, dst, sizes: dict | None, opts: Options, name: str | None,
                 kind: str) -> None:
        self.rank = require_world("Redistributor")
        self.owner: Any = None  # (a weak reference to the handle that built it)
        src, dst = _own("src", src), _own("dst", dst)
        d = Definition(src, dst, opts, kind=kind)
        self.src, self.dst, self.options, self.context = src, dst, opts, d.prefix
        self.device = opts.resolved_device()
        self.sizing = sizing_for(src, dst, sizes, opts.dtype, opts.grad_partial,
                                 self.rank, self.context, self.device)
        self.definition = d = replace(d, fixed=tuple(sorted(self.sizing.fixed.items())),
                                      name=_identity(d, name))
        self.name, self.named = d.name, name is not None
        self.union = self.sizing.union
        self.involved = self.rank in self.union
        self.sizing.name = self.name
        if self.involved and len(self.union) > 1:
            # a bridge that creates groups is built alike on every rank of its grids:
            # agree on its whole definition first (see .agree)
            agree(self.name, d.fields(self.device.type), "mimo_fx", self.union)
        self.lease = self._lease()
        self.source_only = self.involved and not dst.holds(self.rank)
        self.described, self.ran = self.context.rstrip(": "), Counter[timeouts.Site]()  # (timeouts)
        live.register(self.name, self)
        fwd, bwd = self.lease.comm(f"{self.name} >"), self.lease.comm(f"{self.name} <")
        self.executor = CompiledExecutor(fwd, opts.comm_dtype, bwd, self.name, opts.wires())
        checks = len(self.union) > 1 and self.involved
        check_comm = (self.lease.comm(CHECK)
                      if checks and (opts.checked or self.sizing.varies) else None)
        self.guard = Guard(src, dst, self.rank, self.union, opts.dtype, self.device,
                           opts.checked, check_comm, d.fingerprint_key, self.context, self.name,
                           self.sizing.shape)
        self.sizing.fingerprint = self.guard.fingerprints["src"]
        if opts.checked and check_comm is not None:
            self.executor.check = self._check_backward
        self.gather, self.kept = SizeGather(self, check_comm), Kept(self)
        self.no_src = placeholder(len(src.local_dims), opts.dtype, self.device, grad=True)
        self.no_src_plain = placeholder(len(src.local_dims), opts.dtype, self.device)
        self.freeze = Freeze(self, opts.frozen, self.no_src.requires_grad)
        self.label = f"mimo_fx.redistribute {d.described}"
        self._require_compiler()
        _log_plans(self)
        self._warned_func = False
        self.logs_calls = LOG.isEnabledFor(logging.DEBUG)  # (MIMO_FX_DEBUG=1: see _log_plans)
        self._still_last: tuple | None = None  # (see _still)
        # nothing to move either way: a call returns its input (a view of it)
        self.moves_nothing = (not self.sizing.varies and self.sizing.fwd_program.identity
                         and self.sizing.bwd_program.identity)

    def _lease(self) -> Lease:
        """Each direction on groups of its own, tagged by the bridge's identity, and a
        check group over the union, shared, whether checked or not (so ranks that
        disagree on checked= still create the same groups)."""
        src, dst, groups = self.src, self.dst, self.sizing.groups
        tagged = [(f"{self.name} >", g) for g in groups["forward"]]
        if not self.options.frozen:  # (a frozen source's backward moves nothing)
            tagged += [(f"{self.name} <", g) for g in groups["backward"]]
        checks = [(CHECK, self.union)] if len(self.union) > 1 else []
        meshes = tuple(dict.fromkeys(m for m in (src.grid.mesh, dst.grid.mesh)
                                     if m is not None))  # (their groups reused)
        return Lease(f"this bridge {src.describe()!r} -> {dst.describe()!r}", (),
                     tagged + checks, self.device, meshes)

    def _require_compiler(self) -> None:
        """The compiler settings this bridge's traced calls need."""
        if self.sizing.varies:
            # the size gather's rows, a route's counts: read back as ints (.tolist());
            # a row backward's per-row sums, a ragged dim's pieces and their gradients:
            # tensors of run-time length, zero on some ranks
            require_compiler(scalar_outputs=True, unbacked_tensors=self.sizing.unbacked)
        require_compiler(late_waits=True)  # a transfer overlaps the compute after it

    def layouts(self, src, dst) -> dict:
        """A call's batch: the layouts it names, of this bridge's structure."""
        if src is None and dst is None:
            return {}
        return self.sizing.call_batch(src, dst, self.context)

    # -- the call -----------------------------------------------------------------------
    def call(self, x, sizes, dim_sizes: dict, layouts: dict, post: bool = False) -> Any:
        """This rank's dst piece (``post``: a :class:`.pending.Pending` posted call)."""
        if not self.involved:
            return None
        if torch.compiler.is_compiling() or not torch._C._autograd._profiler_enabled():
            return self._call(x, sizes, dim_sizes, layouts, post)
        # a labelled span in profiler traces; entering one costs ~6 µs, so only when a
        # profiler is recording
        with torch.profiler.record_function(self.label):
            return self._call(x, sizes, dim_sizes, layouts, post)

    def traced(self, x, sizes, dim_sizes: dict, src, dst) -> torch.Tensor | None:
        """The call under ``torch.compile`` (no profiler span: the trace has none)."""
        if not self.involved:
            return None
        return self._call(x, sizes, dim_sizes, self.layouts(src, dst), False)

    def _call(self, x, sizes, dim_sizes, layouts: dict, post: bool) -> Any:
        sizing, freeze = self.sizing, self.freeze
        # (not compiling asked first: a trace must not read decided before at_call)
        if (not torch.compiler.is_compiling() and freeze.decided is None
                and freeze.built is None and not self.options.checked):
            # its ranks are about to meet (see Freeze): a mistake of this rank's alone is
            # its error, raised before that collective as before any other (where the
            # call's sizes are known without a size gather)
            given = sizing.given(sizes, dim_sizes)
            if not sizing.gathers_sizes(sizing.missing(given)):
                self.gather.check_given(x, {**sizing.fixed, **given})
        # first, before anything that waits for peers (a size gather), in every mode alike
        # (its first call's ranks may meet: see Freeze)
        grad = freeze.backward_runs(x)
        full, learned = self.gather.sizes(x, sizes, dim_sizes, layouts)
        if self.logs_calls and not torch.compiler.is_compiling():
            self.last_sizes = full  # (MIMO_FX_DEBUG=1: logged)
        try:
            fwd, bwd, env, index, digest = sizing.programs(full, learned, x, **layouts)
        except MimoFxError as err:  # checked: every rank raises with it, none waits
            self.guard.failed(err)
            raise
        shape = fwd.src_shape
        if env is not None and shape is not None:
            shape = NumbersAt(dict(zip(sizing.variables, env))).all(shape)
        checked_fingerprint = None  # what checked mode compares: with the sizes if free
        if sizing.free and self.options.checked and not torch.compiler.is_compiling():
            checked_fingerprint = fingerprint("src", *self.guard.key, _size_key(full))
        if not self.guard(x, "src", shape, full, checked_fingerprint, grad, digest):
            # (compiled, checked: the check raises on every rank when the graph runs)
            return self.no_src.new_zeros((0,) * len(self.dst.local_dims))
        if x is not None and (self.moves_nothing or (
                env is None and not index and self._still(fwd, bwd))):
            return x.view_as(x)  # (a view: its grad passes through)
        if x is None:
            x = self.no_src if grad else self.no_src_plain
            self._warn_none_in_func(bwd)
        elif grad and not x.requires_grad:  # it takes part in the backward all the same
            x = _Joined.apply(x, self.no_src)
        assert x is not None  # the guard rejected None on ranks that hold src
        if post:
            from .pending import Pending

            return Pending(None, self, x, fwd, bwd, env, index, grad)
        if not grad and not torch.compiler.is_compiling():
            # no backward on any rank: skip the autograd.Function layer (tens of µs a call)
            env_map = None if env is None else dict(zip(sizing.variables, env))
            (y,) = self.executor.run(fwd, (x,), env_map, index)
            return sizing.finish(y)
        if torch.compiler.is_compiling():
            # Dynamo traces an autograd.Function's own backward only for inputs it sees as
            # requiring grad, and it does not see that of a tensor a torch.func transform
            # differentiates directly: it would then differentiate through the forward's
            # collectives (wrong gradient, no backward collectives). A view makes the
            # input an op's output, whose requirement Dynamo does see.
            x = x.view(x.shape)
        (y,) = apply(self.executor, fwd, bwd, (x,), env, sizing.variables, index)
        return self.kept.keep(sizing.finish(y))

    def logged(self, x, sizes, dim_sizes: dict, layouts: dict) -> torch.Tensor | None:
        """An eager call, logged at DEBUG: its sizes (given, learned or fixed) and the
        bytes its forward plan sends and receives on this rank."""
        y = self.call(x, sizes, dim_sizes, layouts)
        dims = self.src.dims
        shown = ", ".join(f"{d}={list(n) if isinstance(n, tuple) else n}"
                          for d, n in sorted(getattr(self, "last_sizes", {}).items(),
                                             key=lambda kv: (kv[0] not in dims,
                                                             dims.index(kv[0])
                                                             if kv[0] in dims else 0)))
        n = timeouts.calls(self.name, "forward")
        sent, got = self._traffic(getattr(self, "last_sizes", {}), layouts)
        LOG.debug("rank %d: %s call %d: sizes %s; forward sends %s, receives %s", self.rank,
                  self.label, n, shown or "none", format_bytes(sent), format_bytes(got))
        return y

    def _traffic(self, full: dict, layouts: dict) -> tuple[int, int]:
        """The bytes this rank's part of the forward plan at ``full`` sizes sends and
        receives: the plan's own count (each step kind's ``pairs``), in the wire's dtype."""
        from mimo_fx.plan import plan

        wire = self.options.wires()["forward"] or self.options.dtype
        whole = plan(layouts.get("src", self.src), layouts.get("dst", self.dst), full, wire)
        moved = [(s, g) for step in whole.steps for r, s, g in step.traffic() if r == self.rank]
        return sum(s for s, _ in moved) * wire.itemsize, sum(g for _, g in moved) * wire.itemsize

    def _still(self, fwd, bwd) -> bool:
        """Whether an eager call of free sizes moves nothing either way at these sizes
        (its programs' answer kept beside them: a step repeats its sizes)."""
        if not self.sizing.varies or torch.compiler.is_compiling():
            return False
        last = self._still_last
        if last is None or last[0] is not fwd or last[1] is not bwd:
            last = self._still_last = (fwd, bwd, fwd.identity and bwd.identity)
        return last[2]

    def _check_backward(self, g, program, num) -> bool:
        """Checked mode's check of a backward call (its cotangent, every rank's)."""
        shape = None if program.src_shape is None else num.all(program.src_shape)
        return self.guard(g, "dst", shape, None, None, True)

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
            f"0, 1))(torch.empty({(0,) * len(self.src.local_dims)}), w).", stacklevel=5)

    def destroy(self) -> None:
        """Release its process groups and leave the registry; safe to call twice."""
        if self.lease.live:
            self.lease.release()
            self.sizing.forget()
            self.kept.clear()
            live.forget(self.name, self)  # (its name, or slot, is free)


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


def _own(side: str, layout):
    """A layout's own copy (equal, not the caller's object); anything else is refused.
    The caller's layouts may live in a closure, whose ints Dynamo makes symbolic when a
    step is compiled again for other layouts, and Dynamo tracks an object by identity:
    shared, the bridge's grid ints would turn symbolic too (planning takes none), and a
    packed layout's batch would be guarded on as the caller's input."""
    if not is_layout(layout):
        raise MimoFxError(not_a_layout("Redistributor", side, layout))
    return copy.deepcopy(layout)


def _identity(definition: Definition, name: str | None) -> str:
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
        found = live.find(name)
        if found is not None and found.lease.live:
            raise MimoFxError(f"name={name!r} is the name of a live bridge; give every "
                              f"bridge a name of its own (or destroy that one first)")
        return name
    base = definition.described
    k = next(i for i in itertools.count() if f"{base} #{i}" not in live.BRIDGES)
    return f"{base} #{k}"


def _log_plans(bridge: Prepared) -> None:
    """With ``MIMO_FX_DEBUG=1`` (or the ``mimo_fx`` logger at DEBUG), log this rank's
    collectives and bytes of each plan once, when the bridge is built."""
    if os.environ.get("MIMO_FX_DEBUG", "0") not in ("", "0"):
        _debug_logging()
    if not LOG.isEnabledFor(logging.DEBUG):
        return
    LOG.debug("rank %d: %s: %d process group(s) created, %d taken from device meshes",
              bridge.rank, bridge.label, bridge.lease.created, bridge.lease.reused)
    for line in bridge.sizing.summary():
        LOG.debug("rank %d: %s%s", bridge.rank, bridge.label, line)


def _debug_logging() -> None:
    if not LOG.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        LOG.addHandler(handler)
    LOG.setLevel(logging.DEBUG)


def _in_grad_transform() -> bool:
    """Whether an eager call runs inside a ``torch.func`` grad/vjp transform (not asked
    under ``torch.compile``, where the question breaks the graph)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    level = peek_interpreter_stack()
    return level is not None and level.key() == TransformType.Grad
