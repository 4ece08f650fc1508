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
import torch.distributed as dist

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.plan import size_arguments

from .executor import CompiledExecutor
from .groups import live_groups
from .redistributor import Redistributor

__all__ = ["Redistributor", "prepare", "redistribute", "destroy", "live_groups",
           "CompiledExecutor", "OPTIONS"]

OPTIONS = ("sizes", "grad_partial", "comm_dtype", "checked", "dtype")

_PREPARED: dict[tuple, Redistributor] = {}


def _key(src, dst, dtype, grad_partial, comm_dtype, checked):
    # no sizes: the facade's bridges take them per call (under torch.compile they may be
    # symbolic, so they could not be a key)
    return (src, dst, dtype, tuple(grad_partial), comm_dtype, checked)


def prepare(src: Layout, dst: Layout, sizes: dict | None = None, dtype=torch.float32, *,
            grad_partial=(), comm_dtype=None, checked: bool = False) -> Redistributor:
    """Create (once) the bridge :func:`redistribute` uses for these layouts and options.
    ``sizes`` pins those dims (calls then give them or nothing, and exchange nothing for
    them); the others are given or learned per call."""
    key = _key(src, dst, dtype, grad_partial, comm_dtype, checked)
    bridge = _PREPARED.get(key)
    if bridge is None:
        bridge = _PREPARED[key] = Redistributor(
            src, dst, sizes, dtype, grad_partial=grad_partial, comm_dtype=comm_dtype,
            checked=checked)
    elif sizes and size_arguments(src, dst, sizes, {}, "prepare", OPTIONS) != bridge.fixed:
        raise MimoFxError(f"prepare: {src.describe()!r} -> {dst.describe()!r} is already "
                          f"prepared with sizes {bridge.fixed}, not {sizes}; call "
                          f"mimo_fx.compiled.destroy() first, or use a Redistributor")
    return bridge


def redistribute(x: torch.Tensor | None, src: Layout, dst: Layout, *, sizes=None,
                 grad_partial=(), comm_dtype=None, checked: bool = False, dtype=None,
                 **dim_sizes):
    """This rank's part of ``redistribute``.

    Global sizes come from ``sizes={dim: n}`` and size keywords (``b=8``); those not
    given are learned from the ranks holding src (one small all-gather of their shapes;
    every rank gives the same set of sizes). Options are keyword-only; a keyword that is
    neither an option nor a dim raises.
    """
    given = size_arguments(src, dst, sizes, dim_sizes, "redistribute", OPTIONS)
    if not dist.is_initialized():
        raise MimoFxError("redistribute on a single tensor needs torch.distributed "
                          "initialised; for a whole world in one process pass a dict "
                          "{rank: tensor} (reference backend)")
    if dtype is None:
        dtype = x.dtype if isinstance(x, torch.Tensor) else torch.float32
    key = _key(src, dst, dtype, grad_partial, comm_dtype, checked)
    bridge = _PREPARED.get(key)
    if bridge is None:
        if torch.compiler.is_compiling():
            raise MimoFxError(
                "redistribute under torch.compile needs its process groups prepared first: "
                "call mimo_fx.compiled.prepare(src, dst, dtype=...) on every rank before "
                "compiling (or use a Redistributor)")
        bridge = prepare(src, dst, None, dtype, grad_partial=grad_partial,
                         comm_dtype=comm_dtype, checked=checked)
    return bridge(x, given)


def destroy() -> None:
    """Destroy every bridge :func:`prepare` made; idempotent."""
    for bridge in _PREPARED.values():
        bridge.destroy()
    _PREPARED.clear()


from .bridge import Bridge  # noqa: E402  (a Redistributor subclass)

__all__ += ["Bridge"]
