"""The prepared bridge: one ``redistribute(src -> dst)`` for this rank.

A :class:`Redistributor` plans forward and adjoint, creates every process group they
need (eagerly, in plan order, on every rank), lowers both plans to this rank's programs
and binds them to a comm over those groups. A call validates its tensor (see
:mod:`.guard`), then runs the forward program through the custom vjp, whose backward
runs the adjoint program. Everything a call does is tensor ops and ordered collectives,
so it traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import local_shape
from mimo_fx.plan import backward_plan, format_bytes, plan
from mimo_fx.regions import Tiling
from mimo_fx.vjp import apply

from . import lowering
from .comm import FunctionalComm
from .executor import CompiledExecutor
from .groups import CHECK, acquire, check_timeout, check_world, group_name, release, world_token
from .guard import HEADER_LEN, MAGIC, OK, Expect, Header, fingerprint, inspect, problem_text

__all__ = ["Redistributor"]

LOG = logging.getLogger("mimo_fx")


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


class Redistributor:
    """One prepared ``redistribute(src -> dst)`` for this rank.

    Args:
        src, dst: the layouts.
        sizes: global size of every dim.
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

    def __init__(self, src: Layout, dst: Layout, sizes: dict[str, int], dtype=torch.float32,
                 *, grad_partial=(), comm_dtype=None, checked: bool = False,
                 device=None) -> None:
        if not dist.is_initialized():
            raise MimoFxError("Redistributor needs torch.distributed initialised first "
                              "(torch.distributed.init_process_group)")
        _check_options(dtype, comm_dtype, grad_partial, checked)
        self.rank = dist.get_rank()
        self.src, self.dst, self.dtype, self.checked = src, dst, dtype, checked
        self.sizes = dict(sizes)
        self.fwd = plan(src, dst, self.sizes, dtype)
        self.bwd = backward_plan(src, dst, self.sizes, dtype, tuple(grad_partial))
        self.union = tuple(sorted(set(src.grid.ranks) | set(dst.grid.ranks)))
        self.involved = self.rank in self.union
        self.device = torch.device(device) if device is not None else _default_device()
        self._groups = list(dict.fromkeys(self.fwd.rank_groups + self.bwd.rank_groups))
        acquire(self._groups)
        # every bridge has its check group (whether checked or not, see .groups)
        self._check_groups = [self.union] if len(self.union) > 1 else []
        acquire(self._check_groups, CHECK)
        self._world = world_token()
        self._live = True
        mine = [g for g in self._groups if self.rank in g]
        self.executor = CompiledExecutor(FunctionalComm({g: group_name(g) for g in mine}),
                                         comm_dtype)
        self._check_comm = (FunctionalComm({self.union: group_name(self.union, CHECK)})
                            if checked and self._check_groups and self.involved else None)
        self._fwd_program = lowering.lower(self.fwd, self.rank)
        self._bwd_program = lowering.lower(self.bwd, self.rank)
        self._expects = {side: self._expect(side, self.rank) for side in ("src", "dst")}
        self._src_shape = self._expects["src"].shape
        # what ranks holding no src piece feed the op: made here, not per call, because
        # Dynamo cannot trace creating a tensor that requires grad; it requires grad so
        # that the backward (and its collectives) runs on these ranks too
        self._no_src = None if self._src_shape is not None else torch.empty(
            (0,) * len(src.local_dims), dtype=dtype, device=self.device,
            requires_grad=dtype.is_floating_point or dtype.is_complex)
        self._warned_func = False
        key = (src, dst, sorted(self.sizes.items()), str(dtype), tuple(grad_partial),
               str(comm_dtype))
        self._prints = {"src": fingerprint("forward", *key), "dst": fingerprint("backward", *key)}
        self._label = f"mimo_fx.redistribute {src.describe()} -> {dst.describe()}"
        _log_plans(self)

    def _expect(self, side: str, rank: int) -> Expect:
        layout = self.src if side == "src" else self.dst
        shape = (local_shape(layout, Tiling.of(layout, self.fwd.dims, self.sizes), rank)
                 if layout.holds(rank) else None)
        sizes = ", ".join(f"{d}={n}" for d, n in self.fwd.sizes)
        return Expect(shape, self.dtype, self.device,
                      f"{side} {layout.describe()!r} on {layout.grid!r} ({sizes})")

    # -- guards ------------------------------------------------------------------------
    def _assert_live(self) -> None:
        if not self._live:
            raise MimoFxError(f"this bridge {self.src.describe()!r} -> "
                              f"{self.dst.describe()!r} was destroyed; build a new one")
        if not torch.compiler.is_compiling():
            check_world(self._world, f"this bridge {self.src.describe()!r} -> "
                                     f"{self.dst.describe()!r}")

    def _guard(self, x, side: str) -> None:
        """Validate ``x`` as this rank's ``side`` tensor: locally, and in checked mode
        with every rank of both grids (every rank then raises the same error)."""
        expect = self._expects[side]
        code = inspect(x, expect)
        if self._check_comm is None:
            if code != OK:
                raise MimoFxError(self._context() + problem_text(
                    code, self.rank, expect, _described(x), getattr(x, "dtype", None),
                    getattr(x, "device", None)))
            return
        mine = torch.tensor(Header.encode(x, code, self._prints[side]), dtype=torch.int64,
                            device=self.device)
        if torch.compiler.is_compiling():
            rows = self._check_comm.all_gather(mine, self.union).view(-1, HEADER_LEN)
            ok = ((rows[:, 0] == MAGIC) & (rows[:, 1] == self._prints[side])
                  & (rows[:, 2] == OK)).all()
            torch._assert_async(ok, f"checked redistribute {self.src.describe()} -> "
                                    f"{self.dst.describe()}: a rank's call does not match "
                                    f"(run it eagerly to see which and why)")
            return
        try:
            rows = self._check_comm.all_gather(mine, self.union).view(-1, HEADER_LEN)
        except RuntimeError as err:  # gloo/NCCL timeout or a peer gone
            raise MimoFxError(
                self._context() + f"rank {self.rank} waited in vain for every rank's check "
                f"header ({err.__class__.__name__}: {str(err).splitlines()[0][:200]}). A rank "
                f"called this bridge with checked=False, called another bridge or "
                f"collective, or left; every rank must make the same checked call "
                f"(MIMO_FX_CHECK_TIMEOUT={check_timeout():g} s)") from None
        problems = Header.problems(rows.tolist(), self.union, self._prints[side],
                                   {r: self._expect(side, r) for r in self.union})
        if problems:
            raise MimoFxError(self._context() + "the call does not match on every rank:\n  "
                              + "\n  ".join(problems))

    def _context(self) -> str:
        mode = "checked " if self.checked else ""
        return f"{mode}redistribute {self.src.describe()!r} -> {self.dst.describe()!r}: "

    # -- the call -----------------------------------------------------------------------
    def __call__(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's dst piece (empty where it holds none; None off both grids)."""
        self._assert_live()
        if not self.involved:
            return None
        # a labelled span in profiler traces; entering one costs ~6 µs, so only when a
        # profiler is recording
        if torch.compiler.is_compiling() or not torch._C._autograd._profiler_enabled():
            return self._call(x)
        with torch.profiler.record_function(self._label):
            return self._call(x)

    def _call(self, x: torch.Tensor | None) -> torch.Tensor | None:
        self._guard(x, "src")
        if x is None:
            x = self._no_src
            self._warn_none_in_func()
        assert x is not None  # _guard rejected None on ranks that hold src
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # no autograd possible: skip the autograd.Function layer (tens of µs a call)
            (y,) = self.executor.run(self._fwd_program, (x,))
            return y
        if torch.compiler.is_compiling():
            # Dynamo traces an autograd.Function's own backward only for inputs it sees as
            # requiring grad, and it does not see that of a tensor a torch.func transform
            # differentiates directly: it would then differentiate through the forward's
            # collectives (wrong gradient, no backward collectives). A view makes the
            # input an op's output, whose requirement Dynamo does see.
            x = x.view(x.shape)
        (y,) = apply(self.executor, self._fwd_program, self._bwd_program, (x,))
        return y

    def _warn_none_in_func(self) -> None:
        if self._warned_func or not self._bwd_program.ops or not _in_grad_transform():
            return
        self._warned_func = True
        warnings.warn(
            f"rank {self.rank} holds no piece of src {self.src.describe()!r} and called the "
            f"bridge with None inside a torch.func grad transform. The transform "
            f"differentiates only its arguments, so this rank will skip the backward's "
            f"collectives and ranks that run theirs will wait for it. Pass an empty tensor "
            f"that the transform differentiates instead of None, e.g. grad(step, argnums=("
            f"0, 1))(torch.empty({(0,) * len(self.src.local_dims)}), w).", stacklevel=3)

    def destroy(self) -> None:
        """Release this bridge's process groups; safe to call twice."""
        if self._live:
            release(self._groups)
            release(self._check_groups, CHECK)
            self._live = False


def _log_plans(bridge: Redistributor) -> None:
    """With ``MIMO_FX_DEBUG=1`` (or the ``mimo_fx`` logger at DEBUG), log this rank's
    collectives and bytes of each plan once, when the bridge is built."""
    if os.environ.get("MIMO_FX_DEBUG", "0") not in ("", "0"):
        _debug_logging()
    if not LOG.isEnabledFor(logging.DEBUG):
        return
    rank = bridge.rank
    for what, p, program in (("forward", bridge.fwd, bridge._fwd_program),
                             ("backward", bridge.bwd, bridge._bwd_program)):
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
