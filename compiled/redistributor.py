"""The prepared bridge: one ``redistribute(src -> dst)`` for this rank.

A :class:`Redistributor` plans this rank's part of forward and adjoint (no rank plans
another's transfers), creates every process group they need (eagerly, in plan order, on
every rank, listed from the decisions the plans share), lowers both parts to this rank's
programs and binds them to a comm over those groups. A call validates its tensor (see
:mod:`.guard`), then runs the forward program through the custom vjp, whose backward
runs the adjoint program. Everything a call does is tensor ops and ordered collectives,
so it traces under ``torch.compile(fullgraph=True)``.

Sizes. Dims whose sizes the bridge is built with are *fixed*; the others are *free*:
a call gives them (``bridge(x, s=4096)``) or, where it does not, every rank learns
them from the ranks holding src (one small all-gather of int64 shapes, see
:mod:`.learn`). A bridge with free dims plans once, at sizes its layouts choose, a
*template* (:mod:`mimo_fx.sizes`) whose lowered programs hold polynomials in the sizes:
every size the template serves (free even sizes multiples of ``bridge.granules``) runs
those programs with no planning, and under ``torch.compile`` one graph serves them all.
Other sizes (uneven cuts, counts that an even cut splits) are planned one by one and
cached (a bounded cache); under ``torch.compile`` each such size is its own graph.
"""

from __future__ import annotations

import logging
import operator
import os
import warnings
from collections import OrderedDict
from math import lcm
from typing import Any

import torch
import torch.distributed as dist

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import local_shape
from mimo_fx.plan import (
    backward_layouts,
    check_sizes,
    format_bytes,
    plan,
    plan_for_rank,
    plan_groups,
    size_arguments,
)
from mimo_fx.regions import Tiling
from mimo_fx.sizes import Template, canonical_sizes
from mimo_fx.symbolic import Expr
from mimo_fx.vjp import apply

from . import lowering
from .comm import FunctionalComm
from .executor import CompiledExecutor, Numbers
from .groups import CHECK, acquire, check_timeout, check_world, group_name, release, world_token
from .guard import HEADER_LEN, MAGIC, OK, Expect, Header, fingerprint, inspect, problem_text
from .learn import Row, int_tensor, learn_sizes

__all__ = ["Redistributor", "CALL_OPTIONS"]

LOG = logging.getLogger("mimo_fx")
CACHED_SIZES = 64   # sizes whose programs a bridge keeps (least recently used go)
CALL_OPTIONS = ("sizes",)


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_options(dtype, comm_dtype, grad_partial, checked) -> None:
    for name, value in (("dtype", dtype), ("comm_dtype", comm_dtype)):
        if not isinstance(value, torch.dtype) and not (name == "comm_dtype" and value is None):
            raise MimoFxError(f"{name}={value!r} must be a torch.dtype, e.g. torch.bfloat16")
    if not isinstance(checked, bool):
        raise MimoFxError(f"checked={checked!r} must be True or False")
    if isinstance(grad_partial, str) or not all(isinstance(a, str) for a in grad_partial):
        raise MimoFxError(f"grad_partial={grad_partial!r} must be a tuple of axis names, "
                          f"e.g. ('cp',)")


def _size_key(sizes: dict) -> tuple:
    return tuple(sorted(sizes.items()))


class Redistributor:
    """One prepared ``redistribute(src -> dst)`` for this rank.

    Args:
        src, dst: the layouts.
        sizes: global sizes of the dims that never change (``None`` or a part of the
            dims: the others are given or learned per call, see the module docstring).
            A ragged dim's size is its tuple of counts.
        dtype: the dtype of the tensors moved (the caller's).
        grad_partial: dst replicated axes whose cotangents are summed (see the op).
        comm_dtype: move data in this dtype (e.g. bf16) and return ``dtype``.
        checked: before each call, all ranks exchange what they were called with (on a
            group of their own), so any rank's mistake raises :class:`MimoFxError` on
            every rank instead of hanging (see :mod:`.guard`); a rank waits for the
            others' headers ``MIMO_FX_CHECK_TIMEOUT`` seconds (300). Unchecked calls
            still validate locally: the offending rank raises before any collective.
        device: where data moves and ranks without a src piece create their placeholder
            (default: the current CUDA device under NCCL, else CPU).
    """

    def __init__(self, src: Layout, dst: Layout, sizes: dict | None = None,
                 dtype=torch.float32, *, grad_partial=(), comm_dtype=None,
                 checked: bool = False, device=None) -> None:
        if not dist.is_initialized():
            raise MimoFxError("Redistributor needs torch.distributed initialised first "
                              "(torch.distributed.init_process_group)")
        _check_options(dtype, comm_dtype, grad_partial, checked)
        if not isinstance(src, Layout) or not isinstance(dst, Layout):
            raise MimoFxError(f"Redistributor needs two Layouts, got {src!r} and {dst!r}")
        self.rank = dist.get_rank()
        self.src, self.dst, self.dtype, self.checked = src, dst, dtype, checked
        self.grad_partial = tuple(grad_partial)
        self.fixed = size_arguments(src, dst, sizes, {}, "Redistributor", ()) if sizes else {}
        self.sizes = dict(self.fixed)
        self.free = tuple(d for d in src.dims if d not in self.fixed)
        self.union = tuple(sorted(set(src.grid.ranks) | set(dst.grid.ranks)))
        self.involved = self.rank in self.union
        self.device = torch.device(device) if device is not None else _default_device()
        self.template: Template | None = None
        self._adjoint = backward_layouts(src, dst, self.grad_partial)
        sizes_ = self._plan_shapes()
        # every rank lists the same groups in the same order, from the decisions the
        # plans share (no rank plans another's transfers)
        self._groups = list(dict.fromkeys(plan_groups(src, dst, sizes_)
                                          + plan_groups(*self._adjoint, sizes_)))
        if self.free and len(self.union) > 1 and self.union not in self._groups:
            self._groups.append(self.union)  # for sizes whose gathers find no group
        acquire(self._groups)
        # every bridge has its check group (whether checked or not, see .groups)
        self._check_groups = [self.union] if len(self.union) > 1 else []
        acquire(self._check_groups, CHECK)
        self._world = world_token()
        self._live = True
        mine = [g for g in self._groups if self.rank in g]
        self.executor = CompiledExecutor(FunctionalComm({g: group_name(g) for g in mine}),
                                         comm_dtype)
        needs_check_comm = (checked or self.free) and self._check_groups and self.involved
        self._check_comm = (FunctionalComm({self.union: group_name(self.union, CHECK)})
                            if needs_check_comm else None)
        self._lower_programs()
        self._cache: OrderedDict[tuple, tuple] = OrderedDict()
        self._no_src = self._placeholder(len(src.local_dims), grad=True)
        self._warned_func = False
        key = (src, dst, sorted(self.fixed.items()), str(dtype), self.grad_partial,
               str(comm_dtype))
        self._key = key
        self._prints = {"src": fingerprint("forward", *key), "dst": fingerprint("backward", *key)}
        self._label = f"mimo_fx.redistribute {src.describe()} -> {dst.describe()}"
        if self.free:
            from torch._dynamo import config as dynamo_config

            # the size exchange reads its int64 rows back as Python ints (``.tolist()``),
            # which a compiled graph can only hold as captured scalars
            dynamo_config.capture_scalar_outputs = True
        _BRIDGES[id(self)] = self
        _log_plans(self)

    # -- building ------------------------------------------------------------------------
    def _plan_shapes(self) -> dict:
        """This rank's parts of the plans the bridge is built on: at its sizes when all
        are fixed, else at the template sizes its layouts choose (then also the
        template). Returns those sizes."""
        src, dst, dtype = self.src, self.dst, self.dtype
        sizes: dict
        if not self.free:
            sizes = self.fixed
        else:
            ragged = set(src.ragged_dims) | set(dst.ragged_dims)
            counts = {d: lcm(src.shards(d), dst.shards(d)) for d in self.free if d in ragged}
            sizes = canonical_sizes(src, dst, self.fixed, counts)
        check_sizes(src, dst, sizes)
        self.fwd = plan_for_rank(src, dst, sizes, dtype, rank=self.rank)
        self.bwd = plan_for_rank(*self._adjoint, sizes, dtype, rank=self.rank)
        if self.free:
            self.template = Template.build(src, dst, sizes, dtype.itemsize,
                                           self.grad_partial, self.free, rank=self.rank)
        return sizes

    def _lower_programs(self) -> None:
        t = self.template
        if not self.free:
            self._fwd_program = lowering.lower(self.fwd, self.rank)
            self._bwd_program = lowering.lower(self.bwd, self.rank)
        elif t is not None:
            self._fwd_program = lowering.lower(t.fwd, self.rank, t.fwd_sym)
            self._bwd_program = lowering.lower(t.bwd, self.rank, t.bwd_sym)
            # a new size evaluates only this rank's polynomials
            self._at = (lowering.evaluator(self._fwd_program),
                        lowering.evaluator(self._bwd_program))
        else:
            self._fwd_program = self._bwd_program = None  # type: ignore[assignment]
        self._src_shape = None if self.free else self._fwd_program.src_shape

    @property
    def granules(self) -> dict[str, int]:
        """Per free even dim, the sizes one compiled graph serves are multiples of this
        (empty when the bridge has no template: every size is planned by itself)."""
        return dict(self.template.granules) if self.template else {}

    def _placeholder(self, ndim: int, grad: bool = False) -> torch.Tensor:
        # what ranks holding no src piece feed the op: made here, not per call, because
        # Dynamo cannot trace creating a tensor that requires grad; it requires grad so
        # that the backward (and its collectives) runs on these ranks too
        floating = self.dtype.is_floating_point or self.dtype.is_complex
        return torch.empty((0,) * ndim, dtype=self.dtype, device=self.device,
                           requires_grad=grad and floating)

    # -- sizes and programs --------------------------------------------------------------
    def _given(self, sizes, dim_sizes: dict) -> dict:
        """The sizes a call gives, checked against the fixed ones."""
        if sizes is None and not dim_sizes:
            return {}
        given = size_arguments(self.src, self.dst, sizes, dim_sizes, "bridge call",
                               CALL_OPTIONS)
        for d, n in given.items():
            if d in self.fixed and not _same(n, self.fixed[d]):
                raise MimoFxError(
                    self._context() + f"{d}={n!r} but the bridge was built with {d}="
                    f"{self.fixed[d]!r}; build it without {d!r} to vary it")
        return given

    def _call_sizes(self, x, sizes, dim_sizes) -> tuple[dict, frozenset]:
        """Every dim's size for this call and the dims learned by the exchange."""
        given = self._given(sizes, dim_sizes)
        full = {**self.fixed, **given}
        missing = [d for d in self.free if d not in given]
        if not missing:
            return full, frozenset()
        return self._learn(x, full), frozenset(missing)

    def _learn(self, x, known: dict) -> dict:
        """The exchange: every rank's shape row, then every size from them."""
        assert self._check_comm is not None
        row = self._size_row(x)
        try:
            rows = self._check_comm.all_gather(row, self.union).view(len(self.union), -1)
        except RuntimeError as err:  # gloo/NCCL timeout or a peer gone
            raise MimoFxError(
                self._context() + f"rank {self.rank} waited in vain for every rank's size "
                f"row ({cause(err)}). Every "
                f"rank of both grids calls the bridge, giving the same set of sizes "
                f"(MIMO_FX_CHECK_TIMEOUT={check_timeout():g} s)") from None
        return self._sizes_from(rows, known)

    def _size_row(self, x) -> torch.Tensor:
        """This rank's row of the size exchange (see :mod:`.learn`)."""
        return int_tensor(Row.encode(x, len(self.src.local_dims), self._prints["src"]),
                          self.device)

    def _sizes_from(self, rows: torch.Tensor, known: dict, ranks=None) -> dict:
        """Every size from the rows of ``ranks`` (default: both grids'), ``known`` first."""
        return learn_sizes(rows.tolist(), ranks or self.union, self.src, known,
                           self._prints["src"], self.dtype, self._context())

    def _programs(self, full: dict, learned: frozenset,
                  x=None) -> tuple[Any, Any, tuple | None]:
        """This rank's forward and adjoint programs for ``full`` sizes, and the env a
        template program's numbers are evaluated at (None: a plain program); ``x`` is
        this rank's src tensor (it names learned sizes its shape shows)."""
        if not self.free:
            return self._fwd_program, self._bwd_program, None
        if not torch.compiler.is_compiling():
            return (*self._programs_at(_size_key(full)), None)
        t = self.template
        if t is not None and self._fits_compiled(t, full, learned):
            env = t.env(full)
            values = tuple(env[v] for v in t.variables)
            if learned:
                values = self._fresh(values, t.variables)
                values = self._from_local(x, values, t, full)
            return self._fwd_program, self._bwd_program, values
        if learned:
            raise MimoFxError(
                self._context() + f"sizes learned under torch.compile must fit the bridge's "
                f"template ({t.describe() if t else 'none: its plan depends on the sizes'}); "
                f"give the sizes in the call, or run these sizes eagerly")
        # sizes the template does not serve: a graph of their own (Dynamo specialises)
        key = _size_key({d: _concrete(n) for d, n in full.items()})
        return (*_programs_for(id(self), key), None)

    def _fits_compiled(self, t: Template, full: dict, learned: frozenset) -> bool:
        """Whether traced sizes fit the template: a learned size is asserted to (the
        graph then serves every size that does, and fails on one that does not), a given
        one is tested (Dynamo guards on the test: a size that fails it recompiles)."""
        for d, granule in t.granules.items():
            n = full[d]
            if d in learned:
                message = (f"{self._context()}the learned size of {d!r} must be a multiple "
                           f"of {granule} (bridge.granules) under torch.compile; pad it, or "
                           f"give the sizes in the call")
                _check(n % granule == 0, message)
                _check(n >= granule, message)
            elif n % granule != 0:
                return False
        return all(len(full[d]) == m for d, m in t.counts.items())

    def _fresh(self, values: tuple, variables: tuple) -> tuple:
        """Learned values as fresh symbols: the exchange's sizes are sums and quotients
        of the rows' unbacked entries, which the compiler's shape reasoning handles
        badly (slices of unknown length); one symbol per variable, tied to its value by
        a run-time check, keeps every program number a plain polynomial."""
        fresh = int_tensor(values, self.device).tolist()
        for new, old, var in zip(fresh, values, variables):
            torch._check(new == old)
            torch._check(new >= (1 if var[0] == "u" else 0))
        return tuple(fresh)

    def _from_local(self, x, values: tuple, t: Template, full: dict) -> tuple:
        """On a rank holding src, each variable its own tensor shows -- a local dim that is
        ``c * u[d]``, or its own ragged count -- taken from the tensor's (backed) shape,
        asserted equal to the learned size: the program's slices of that tensor are then
        in the tensor's own sizes, which the compiler can bound."""
        shape = self._fwd_program.src_shape
        if not isinstance(x, torch.Tensor) or shape is None or x.dim() != len(shape):
            return values
        out = list(values)
        message = (f"{self._context()}rank {self.rank}: the local tensor's shape does not fit "
                   f"the learned sizes (sizes learned under torch.compile must be multiples "
                   f"of bridge.granules); run the call eagerly to see why")
        for have, want in zip(x.shape, shape):
            if not isinstance(want, Expr) or len(want.terms) != 1:
                continue
            (mono, coef), = want.terms
            if len(mono) != 1:
                continue
            var = mono[0]
            if have % coef != 0:  # known while tracing (Dynamo guards on it if symbolic)
                raise MimoFxError(message)
            if var[0] == "u":  # have == coef * n / granules, without a quotient
                learned = full[var[1]]
                _check(have * t.granules[var[1]] == coef * learned, message)
            else:
                _check(have == coef * full[var[1]][var[2]], message)
            out[t.variables.index(var)] = have // coef if coef != 1 else have
        return tuple(out)

    def _programs_at(self, key: tuple) -> tuple[Any, Any]:
        """Plain programs for concrete sizes: the template's evaluated, or a plan of their
        own; the least recently used of ``CACHED_SIZES`` sizes are kept."""
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        full = dict(key)
        t = self.template
        if t is not None and t.fits(full):
            env = t.env(full)
            progs = (self._at[0](env), self._at[1](env))
        else:
            check_sizes(self.src, self.dst, full)
            progs = (lowering.lower(self._rank_plan((self.src, self.dst), full), self.rank),
                     lowering.lower(self._rank_plan(self._adjoint, full), self.rank))
        self._cache[key] = progs
        if len(self._cache) > CACHED_SIZES:
            self._cache.popitem(last=False)
        return progs

    def _rank_plan(self, layouts: tuple[Layout, Layout], sizes: dict):
        """This rank's part of the plan at ``sizes``; where it would gather over groups
        the bridge did not create, the exchange is one all-to-all over the union (created
        for this): process groups never depend on sizes, and every rank decides alike."""
        made = set(self._groups)
        missing = not set(plan_groups(*layouts, sizes)) <= made
        return plan_for_rank(*layouts, sizes, self.dtype, rank=self.rank, all_to_all=missing)

    # -- guards ------------------------------------------------------------------------
    def _assert_live(self) -> None:
        if not self._live:
            raise MimoFxError(f"this bridge {self.src.describe()!r} -> "
                              f"{self.dst.describe()!r} was destroyed; build a new one")
        if not torch.compiler.is_compiling():
            check_world(self._world, f"this bridge {self.src.describe()!r} -> "
                                     f"{self.dst.describe()!r}")

    def _expect(self, side: str, rank: int, full: dict) -> Expect:
        layout = self.src if side == "src" else self.dst
        dims = self.fwd.dims
        shape = (local_shape(layout, Tiling.of(layout, dims, full), rank)
                 if layout.holds(rank) else None)
        sizes = ", ".join(f"{d}={full[d]}" for d in dims)
        return Expect(shape, self.dtype, self.device,
                      f"{side} {layout.describe()!r} on {layout.grid!r} ({sizes})")

    def _guard(self, x, side: str, program, env, full: dict) -> None:
        """Validate ``x`` as this rank's ``side`` tensor (``program`` is the one it feeds):
        locally, and in checked mode with every rank of both grids (every rank then
        raises the same error)."""
        shape = program.src_shape
        if env is not None:
            assert self.template is not None  # an env comes from the template
            shape = None if shape is None else Numbers(dict(zip(self.template.variables,
                                                                 env))).all(shape)
        if torch.compiler.is_compiling():
            self._guard_traced(x, side, shape, full)
            return
        if self._check_comm is None or not self.checked:
            self._guard_local(x, side, shape, full)
            return
        mine, print_ = self._header(x, side, shape, full)
        try:
            rows = self._check_comm.all_gather(mine, self.union).view(-1, HEADER_LEN)
        except RuntimeError as err:  # gloo/NCCL timeout or a peer gone
            raise MimoFxError(
                self._context() + f"rank {self.rank} waited in vain for every rank's check "
                f"header ({cause(err)}). A rank "
                f"called this bridge with checked=False, called another bridge or "
                f"collective, or left; every rank must make the same checked call "
                f"(MIMO_FX_CHECK_TIMEOUT={check_timeout():g} s)") from None
        self._verdict(rows, side, print_, full)

    def _guard_local(self, x, side: str, shape, full: dict) -> None:
        """Raise on this rank if ``x`` is not its ``side`` tensor of local ``shape``."""
        code = inspect(x, Expect(shape, self.dtype, self.device, ""))
        if code != OK:
            expect = self._expect(side, self.rank, full)
            raise MimoFxError(self._context() + problem_text(
                code, self.rank, expect, _described(x), getattr(x, "dtype", None),
                getattr(x, "device", None)))

    def _header(self, x, side: str, shape, full: dict) -> tuple[torch.Tensor, int]:
        """This rank's check header for ``x`` (see :mod:`.guard`), and the call's print."""
        code = inspect(x, Expect(shape, self.dtype, self.device, ""))
        print_ = self._prints[side] if not self.free else fingerprint(
            side, *self._key, _size_key(full))
        return int_tensor(Header.encode(x, code, print_), self.device), print_

    def _verdict(self, rows: torch.Tensor, side: str, print_: int, full: dict,
                 ranks=None) -> None:
        """Raise, the same on every rank, if the header of any rank of ``ranks`` (default:
        both grids') shows a problem."""
        ranks = ranks or self.union
        problems = Header.problems(rows.view(-1, HEADER_LEN).tolist(), ranks, print_,
                                   {r: self._expect(side, r, full) for r in ranks})
        if problems:
            raise MimoFxError(self._context() + "the call does not match on every rank:\n  "
                              + "\n  ".join(problems))

    def _guard_traced(self, x, side: str, shape, full: dict) -> None:
        """The guard under ``torch.compile``: what the trace knows is checked now, the
        sizes at run time (``torch._check``); checked mode exchanges headers in-graph."""
        code = OK
        if x is None:
            if shape is not None:
                raise MimoFxError(self._context() + problem_text(
                    1, self.rank, self._expect(side, self.rank, full)))
        elif x.dtype != self.dtype or x.device.type != self.device.type or (
                shape is not None and x.dim() != len(shape)):
            code = inspect(x, Expect(None if shape is None else tuple(x.shape), self.dtype,
                                     self.device, ""))
            if code == OK:
                code = 4  # SHAPE: wrong number of dims
            raise MimoFxError(self._context() + problem_text(
                code, self.rank, self._expect(side, self.rank, full), _described(x),
                x.dtype, x.device))
        elif shape is not None:
            message = (f"{self._context()}rank {self.rank}: the local tensor's shape does not "
                       f"match the sizes; run the call eagerly to see the shapes")
            for have, want in zip(x.shape, shape):
                _check(have == want, message)
        if self.checked and self._check_comm is not None:
            mine = int_tensor(Header.encode(x, code, self._prints[side]), self.device)
            rows = self._check_comm.all_gather(mine, self.union).view(-1, HEADER_LEN)
            ok = ((rows[:, 0] == MAGIC) & (rows[:, 1] == self._prints[side])
                  & (rows[:, 2] == OK)).all()
            torch._assert_async(ok, f"checked redistribute {self.src.describe()} -> "
                                    f"{self.dst.describe()}: a rank's call does not match "
                                    f"(run it eagerly to see which and why)")

    def _context(self) -> str:
        mode = "checked " if self.checked else ""
        return f"{mode}redistribute {self.src.describe()!r} -> {self.dst.describe()!r}: "

    # -- the call -----------------------------------------------------------------------
    def __call__(self, x: torch.Tensor | None, sizes: dict | None = None,
                 **dim_sizes) -> torch.Tensor | None:
        """This rank's dst piece (empty where it holds none; None off both grids).

        Sizes of free dims may be given (``sizes={...}`` or keywords); those not given
        are learned from the ranks holding src (every rank gives the same set)."""
        self._assert_live()
        if not self.involved:
            return None
        # a labelled span in profiler traces; entering one costs ~6 µs, so only when a
        # profiler is recording
        if torch.compiler.is_compiling() or not torch._C._autograd._profiler_enabled():
            return self._call(x, sizes, dim_sizes)
        with torch.profiler.record_function(self._label):
            return self._call(x, sizes, dim_sizes)

    def _call(self, x: torch.Tensor | None, sizes, dim_sizes) -> torch.Tensor | None:
        if self.free:
            full, learned = self._call_sizes(x, sizes, dim_sizes)
        else:
            if sizes is not None or dim_sizes:
                self._given(sizes, dim_sizes)
            full, learned = self.fixed, frozenset()
        fwd, bwd, env = self._programs(full, learned, x)
        self._guard(x, "src", fwd, env, full)
        if x is None:
            x = self._no_src
            self._warn_none_in_func(bwd)
        assert x is not None  # _guard rejected None on ranks that hold src
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # no autograd possible: skip the autograd.Function layer (tens of µs a call)
            (y,) = self.executor.run(fwd, (x,))
            return y
        if torch.compiler.is_compiling():
            # Dynamo traces an autograd.Function's own backward only for inputs it sees as
            # requiring grad, and it does not see that of a tensor a torch.func transform
            # differentiates directly: it would then differentiate through the forward's
            # collectives (wrong gradient, no backward collectives). A view makes the
            # input an op's output, whose requirement Dynamo does see.
            x = x.view(x.shape)
        variables = self.template.variables if self.template is not None else ()
        (y,) = apply(self.executor, fwd, bwd, (x,), env, variables)
        return y

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
        if self._live:
            release(self._groups)
            release(self._check_groups, CHECK)
            self._live = False
            self._cache.clear()
            _BRIDGES.pop(id(self), None)


# bridges by id, for the compiled path that plans sizes of their own at trace time
_BRIDGES: dict[int, Redistributor] = {}


@torch.compiler.assume_constant_result
def _programs_for(bridge: int, key: tuple) -> tuple[Any, Any]:
    """A bridge's plain programs for sizes its template does not serve: computed while
    tracing (a constant of the graph, which Dynamo then guards on these sizes)."""
    return _BRIDGES[bridge]._programs_at(key)


def _check(ok, message: str) -> None:
    """A run-time check under ``torch.compile`` with a fixed message (the message of
    ``torch._check`` must not close over traced values)."""
    torch._check(ok, lambda: message)


def _concrete(n):
    """A traced size as a Python int (Dynamo specialises the graph to it)."""
    if isinstance(n, tuple):
        return tuple(operator.index(c) for c in n)
    return operator.index(n)


def cause(err: BaseException) -> str:
    """A runtime error in one line, for a message that explains it (gloo and NCCL
    errors run to many lines)."""
    return f"{err.__class__.__name__}: {str(err).splitlines()[0][:200]}"


def _same(a, b) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return True  # a traced size is checked against the tensor, not here
    return tuple(a) == tuple(b) if isinstance(a, tuple | list) else a == b


def _log_plans(bridge: Redistributor) -> None:
    """With ``MIMO_FX_DEBUG=1`` (or the ``mimo_fx`` logger at DEBUG), log this rank's
    collectives and bytes of each plan once, when the bridge is built."""
    if os.environ.get("MIMO_FX_DEBUG", "0") not in ("", "0"):
        _debug_logging()
    if not LOG.isEnabledFor(logging.DEBUG):
        return
    rank = bridge.rank
    if bridge.free:
        t = bridge.template
        LOG.debug("rank %d: %s: sizes of %s learned or given per call; template: %s", rank,
                  bridge._label, ", ".join(bridge.free),
                  t.describe() if t else "none (each size planned by itself)")
        return
    for what, layouts, program in (("forward", (bridge.src, bridge.dst), bridge._fwd_program),
                                   ("backward", bridge._adjoint, bridge._bwd_program)):
        # the bytes need the whole plan: planned here only when someone asks for them
        p = plan(*layouts, bridge.fixed, bridge.dtype)
        calls = ", ".join(f"{op.kind} over {len(op.ranks)} ranks"
                          for op in program.ops) or "no collective"
        LOG.debug("rank %d: %s %s: %s; sends %s, receives %s", rank, bridge._label, what,
                  calls, format_bytes(p.bytes_sent.get(rank, 0)),
                  format_bytes(p.bytes_recv.get(rank, 0)))


def _debug_logging() -> None:
    if not LOG.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        LOG.addHandler(handler)
    LOG.setLevel(logging.DEBUG)


def _described(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _in_grad_transform() -> bool:
    """Whether an eager call runs inside a ``torch.func`` grad/vjp transform (not asked
    under ``torch.compile``, where the question breaks the graph)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    from torch._C._functorch import TransformType, peek_interpreter_stack

    level = peek_interpreter_stack()
    return level is not None and level.key() == TransformType.Grad
