"""Compiled backend: plans lowered to functional collectives, one process per rank.

>>> # on every rank, after torch.distributed.init_process_group:
>>> # bridge = Redistributor(src, dst, {"b": 8, "s": 4096, "h": 4096}, torch.bfloat16)
>>> # y = bridge(x)          # x: this rank's src piece, or None off the src grid
>>> # bridge.destroy()

A :class:`Redistributor` computes the forward and adjoint plans and creates every
process group they need on construction (eagerly, in plan order, on every rank), so the
call itself only issues functional collectives and traces under ``torch.compile``.
:func:`redistribute` is the same through a cache keyed by the arguments; under
``torch.compile`` the cache must have been filled by :func:`prepare` first.
"""

from __future__ import annotations

import warnings
import zlib

import torch
import torch.distributed as dist

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import infer_sizes, local_shape
from mimo_fx.op import apply
from mimo_fx.plan import backward_plan, plan
from mimo_fx.regions import Tiling

from . import lowering
from .executor import CompiledExecutor
from .groups import acquire, group_name, live_groups, plan_groups, release

__all__ = ["Redistributor", "prepare", "redistribute", "destroy", "live_groups",
           "CompiledExecutor"]


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Redistributor:
    """One prepared ``redistribute(src -> dst)`` for this rank.

    Args:
        src, dst: the layouts.
        sizes: global size of every dim.
        dtype: the dtype of the tensors moved (the caller's).
        grad_partial: dst replicated axes whose cotangents are summed (see the op).
        comm_dtype: move data in this dtype (e.g. bf16) and return ``dtype``.
        checked: before each call, exchange a plan fingerprint and the local shape's
            validity over the union of both grids, so a mismatched call raises
            :class:`MimoFxError` on every rank instead of hanging.
        device: where ranks without a src piece create their placeholder
            (default: the current CUDA device under NCCL, else CPU).
    """

    def __init__(self, src: Layout, dst: Layout, sizes: dict[str, int], dtype=torch.float32,
                 *, grad_partial=(), comm_dtype=None, checked: bool = False,
                 device=None) -> None:
        if not dist.is_initialized():
            raise MimoFxError("Redistributor needs torch.distributed initialised first")
        self.rank = dist.get_rank()
        self.src, self.dst, self.dtype = src, dst, dtype
        self.sizes = dict(sizes)
        self.fwd = plan(src, dst, self.sizes, dtype)
        self.bwd = backward_plan(src, dst, self.sizes, dtype, tuple(grad_partial))
        self.union = tuple(sorted(set(src.grid.ranks) | set(dst.grid.ranks)))
        groups = plan_groups(self.fwd)
        groups += [g for g in plan_groups(self.bwd) if g not in groups]
        if checked and len(self.union) > 1 and self.union not in groups:
            groups.append(self.union)
        self._groups = groups
        acquire(groups)
        self._live = True
        self.checked = checked
        self.device = torch.device(device) if device is not None else _default_device()
        self.executor = CompiledExecutor(self.rank, comm_dtype)
        self.involved = self.rank in self.union
        self._fwd_program = lowering.lower(self.fwd, self.rank)
        self._bwd_program = lowering.lower(self.bwd, self.rank)
        self._union_group = group_name(self.union) if checked and len(self.union) > 1 else None
        self._src_shape = (local_shape(src, Tiling.of(src, self.fwd.dims, self.sizes),
                                       self.rank) if src.holds(self.rank) else None)
        # what ranks holding no src piece feed the op: made here, not per call, because
        # Dynamo cannot trace creating a tensor that requires grad; it requires grad so
        # that the backward (and its collectives) runs on these ranks too
        self._no_src = None if self._src_shape is not None else torch.empty(
            (0,) * len(src.groups), dtype=dtype, device=self.device,
            requires_grad=dtype.is_floating_point or dtype.is_complex)
        self._warned_func = False
        self._fingerprint = zlib.crc32(
            repr((src, dst, sorted(self.sizes.items()), str(dtype))).encode()) & 0x7FFFFFFF

    def __call__(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's dst piece (empty where it holds none; None off both grids)."""
        if not self._live:
            raise MimoFxError("this Redistributor was destroyed; build a new one")
        if not self.involved:
            return None
        if self.checked:
            self._check(x)
        if x is None:
            if self._src_shape is not None:
                raise MimoFxError(f"rank {self.rank} holds a piece of src "
                                  f"{self.src.describe()!r} (shape {self._src_shape}) "
                                  f"but passed None")
            x = self._no_src
            if not self._warned_func and self._bwd_program.ops and _in_grad_transform():
                self._warned_func = True
                warnings.warn(
                    f"rank {self.rank} holds no piece of src {self.src.describe()!r} and "
                    f"called the bridge with None inside a torch.func grad transform. The "
                    f"transform differentiates only its arguments, so this rank will skip "
                    f"the backward's collectives and ranks that run theirs will wait for "
                    f"it. Pass an empty tensor that the transform differentiates instead of "
                    f"None, e.g. grad(step, argnums=(0, 1))(torch.empty("
                    f"{(0,) * len(self.src.groups)}), w).", stacklevel=2)
        elif x.dtype != self.dtype:
            raise MimoFxError(f"rank {self.rank}: tensor dtype {x.dtype} differs from the "
                              f"prepared dtype {self.dtype}; prepare with dtype={x.dtype}")
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # no autograd possible: skip the autograd.Function layer (tens of µs a call)
            (y,) = self.executor.run(self._fwd_program, (x,))
            return y
        (y,) = apply(self.executor, self._fwd_program, self._bwd_program, (x,))
        return y

    def _check(self, x: torch.Tensor | None) -> None:
        """Fingerprint and shape exchange: every rank learns of any rank's mistake."""
        import torch.distributed._functional_collectives as fc

        shape_ok = (tuple(x.shape) == self._src_shape if x is not None
                    else self._src_shape is None)
        mine = torch.tensor([self._fingerprint, int(shape_ok)], dtype=torch.int64,
                            device=self.device)
        if self._union_group is not None:
            gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
            every = fc.wait_tensor(gather(mine, 0, self._union_group))
        else:
            every = mine
        every = every.view(-1, 2).tolist()
        bad_plan = [r for r, (f, _) in zip(self.union, every) if f != self._fingerprint]
        bad_shape = [r for r, (_, ok) in zip(self.union, every) if not ok]
        if bad_plan or bad_shape:
            raise MimoFxError(
                f"checked redistribute {self.src.describe()!r} -> {self.dst.describe()!r}: "
                + (f"ranks {bad_plan} called with different layouts/sizes/dtype; "
                   if bad_plan else "")
                + (f"ranks {bad_shape} passed a tensor whose shape does not match src "
                   f"(rank {self.rank} expects {self._src_shape})" if bad_shape else "")
            )

    def destroy(self) -> None:
        """Release this bridge's process groups; safe to call twice."""
        if self._live:
            release(self._groups)
            self._live = False


def _in_grad_transform() -> bool:
    """Whether an eager call runs inside a ``torch.func`` grad/vjp transform (not asked
    under ``torch.compile``, where the question breaks the graph)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    from torch._C._functorch import TransformType, peek_interpreter_stack

    level = peek_interpreter_stack()
    return level is not None and level.key() == TransformType.Grad


_PREPARED: dict[tuple, Redistributor] = {}


def _key(src, dst, sizes, dtype, grad_partial, comm_dtype, checked):
    return (src, dst, tuple(sorted(sizes.items())), dtype, tuple(grad_partial), comm_dtype,
            checked)


def prepare(src: Layout, dst: Layout, sizes: dict[str, int], dtype=torch.float32, *,
            grad_partial=(), comm_dtype=None, checked: bool = False) -> Redistributor:
    """Create (once) the prepared redistribution that :func:`redistribute` will use."""
    key = _key(src, dst, sizes, dtype, grad_partial, comm_dtype, checked)
    if key not in _PREPARED:
        _PREPARED[key] = Redistributor(src, dst, sizes, dtype, grad_partial=grad_partial,
                                       comm_dtype=comm_dtype, checked=checked)
    return _PREPARED[key]


def redistribute(x: torch.Tensor | None, src: Layout, dst: Layout, *, grad_partial=(),
                 comm_dtype=None, checked: bool = False, dtype=None, **sizes):
    """This rank's part of ``redistribute``; sizes not given are inferred from ``x``
    (sharded dims as evenly split: pass uneven sizes explicitly)."""
    if not dist.is_initialized():
        raise MimoFxError("redistribute on a single tensor needs torch.distributed "
                          "initialised; for a whole world in one process pass a dict "
                          "{rank: tensor} (reference backend)")
    rank = dist.get_rank()
    if x is not None and src.holds(rank):
        sizes = infer_sizes(src, {rank: tuple(x.shape)}, sizes)
    missing = [d for d in src.dims if d not in sizes]
    if missing:
        raise MimoFxError(f"rank {rank} holds no piece of src {src.pattern!r}, so it cannot "
                          f"infer sizes: pass {', '.join(f'{d}=...' for d in missing)}")
    dtype = dtype or (x.dtype if x is not None else torch.float32)
    key = _key(src, dst, sizes, dtype, grad_partial, comm_dtype, checked)
    bridge = _PREPARED.get(key)
    if bridge is None:
        if torch.compiler.is_compiling():
            raise MimoFxError(
                "redistribute under torch.compile needs its process groups prepared first: "
                "call mimo_fx.compiled.prepare(src, dst, sizes, dtype) on every rank before "
                "compiling (or use a Redistributor)")
        bridge = prepare(src, dst, sizes, dtype, grad_partial=grad_partial,
                         comm_dtype=comm_dtype, checked=checked)
    return bridge(x)


def destroy() -> None:
    """Destroy every bridge :func:`prepare` made; idempotent."""
    for bridge in _PREPARED.values():
        bridge.destroy()
    _PREPARED.clear()


from .bridge import Bridge  # noqa: E402  (a Redistributor subclass; needs it defined)

__all__ += ["Bridge"]
