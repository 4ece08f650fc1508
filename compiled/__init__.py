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

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.plan import size_arguments

from . import live
from .definition import Definition
from .executor import CompiledExecutor
from .groups import live_groups
from .guard import raise_now
from .lease import require_world
from .options import OPTION_NAMES, Options
from .redistributor import Redistributor, backward, joined

__all__ = ["Redistributor", "prepare", "redistribute", "destroy", "live_groups",
           "CompiledExecutor", "OPTIONS", "Options", "backward", "joined"]

OPTIONS = ("sizes", *OPTION_NAMES)

def prepare(src: Layout, dst: Layout, sizes: dict | None = None, dtype=torch.float32, *,
            grad_partial=(), comm_dtype=None, checked: bool = False,
            device=None, frozen: bool | None = None, grad_comm_dtype=None) -> Redistributor:
    """Create (once) the bridge :func:`redistribute` uses for these layouts and options.
    ``sizes`` pins those dims (calls then give them or nothing, and gather nothing for
    them); the others are given or learned per call."""
    opts = Options(dtype, grad_partial, comm_dtype, checked, device, frozen, grad_comm_dtype)
    return bridge_for(src, dst, opts, sizes)


def bridge_for(src: Layout, dst: Layout, opts: Options, sizes: dict | None = None,
               where: str = "prepare") -> Redistributor:
    """The cached bridge for ``src -> dst`` with ``opts``, built on first use; ``sizes``
    pins dims (a bridge already built with other pinned sizes is an error)."""
    # no sizes in the key: the cached bridges take them per call (under torch.compile
    # they may be symbolic, so they could not be a key); a packed layout's batch neither:
    # its structure is the key
    key = Definition(src, dst, opts).cache_key
    # the one cache of prepared bridges, in the bridge registry: mimo_fx.redistribute,
    # prepare, DTensor interop and the SPMD process world all take their bridges there
    bridge = live.prepared(key)
    if bridge is None or not bridge.lease.live:
        if torch.compiler.is_compiling():
            raise_now(
                f"{where} under torch.compile: its process groups must be prepared first: "
                f"call mimo_fx.compiled.prepare(src, dst, dtype=...) on every rank before "
                f"compiling (or use a Redistributor); src {src.describe()!r}, dst "
                f"{dst.describe()!r}")
        bridge = live.keep(key, Redistributor(
            src, dst, sizes, opts.dtype, grad_partial=opts.grad_partial,
            comm_dtype=opts.comm_dtype, checked=opts.checked, device=opts.device,
            frozen=opts.frozen, grad_comm_dtype=opts.grad_comm_dtype))
    elif sizes and size_arguments(src, dst, sizes, {}, where, OPTIONS) != bridge.fixed:
        raise MimoFxError(f"{where}: {src.describe()!r} -> {dst.describe()!r} is already "
                          f"prepared with sizes {bridge.fixed}, not {sizes}; call "
                          f"mimo_fx.compiled.destroy() first, or use a Redistributor")
    return bridge


def redistribute(x: torch.Tensor | None, src: Layout, dst: Layout, *, sizes=None,
                 grad_partial=(), comm_dtype=None, checked: bool = False, dtype=None,
                 frozen: bool | None = None, grad_comm_dtype=None, **dim_sizes):
    """This rank's part of ``redistribute``.

    Global sizes come from ``sizes={dim: n}`` and size keywords (``b=8``); those not
    given are learned from the ranks holding src (one small all-gather of their shapes;
    every rank gives the same set of sizes). Options are keyword-only; a keyword that is
    neither an option nor a dim raises.
    """
    given = size_arguments(src, dst, sizes, dim_sizes, "redistribute", OPTIONS)
    require_world("redistribute on a single tensor")
    if dtype is None:
        dtype = x.dtype if isinstance(x, torch.Tensor) else torch.float32
    opts = Options(dtype, grad_partial, comm_dtype, checked, frozen=frozen,
                   grad_comm_dtype=grad_comm_dtype)
    bridge = bridge_for(src, dst, opts, where="redistribute")
    # the call's batch, where the bridge serves several (see CallSizes.batch_of)
    return bridge(x, given, **bridge.sizing.batch_of(src, dst))


def destroy() -> None:
    """Destroy every bridge :func:`prepare` made; idempotent."""
    for bridge in live.drop_kept():
        bridge.destroy()


from .bridge import Bridge  # noqa: E402  (a Redistributor subclass)

__all__ += ["Bridge"]
