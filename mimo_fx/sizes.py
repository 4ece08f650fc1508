"""The global sizes a redistribution is given: checked against its layouts, merged from a
call's arguments, with errors that say which dim and what to pass."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from .errors import MimoFxError
from .layout import Layout
from .regions import Size

__all__ = ["size_arguments", "as_int", "check_sizes"]


def size_arguments(src: Layout, dst: Layout, sizes, dim_sizes: dict, where: str,
                   options: tuple[str, ...]) -> dict[str, int]:
    """The global sizes a call gives: ``sizes=`` merged with size keywords. Every name
    must be a dim of the layouts (a misspelt option is not a size)."""
    if sizes is not None and not isinstance(sizes, Mapping):
        raise MimoFxError(f"{where}: sizes={sizes!r} must be a dict {{dim: global size}}")
    merged = dict(sizes or {})
    # (lists, not sets: a compiled call traces this, and Dynamo steps through set ops)
    twice = sorted([d for d in dim_sizes if d in merged])
    if twice:
        raise MimoFxError(f"{where}: sizes of {twice} are given twice (in sizes= and as "
                          f"keywords); give each once")
    merged.update(dim_sizes)
    dims = tuple(dict.fromkeys(src.dims + dst.dims))
    unknown = [n for n in merged if n not in dims]
    if unknown:
        raise MimoFxError(
            f"{where}: {', '.join(map(repr, unknown))} is not a dim of src {src.pattern!r} or "
            f"dst {dst.pattern!r} (dims: {', '.join(dims)}) nor an option ("
            f"{', '.join(options)}); size keywords name dims only (a dim named like an "
            f"option goes in sizes={{...}})")
    ragged = src.ragged_dims + dst.ragged_dims
    # in the layouts' dim order, whatever order they were given in (two ranks giving the
    # same sizes in another order make the same call), numpy and torch integers as ints
    return {d: _check_size(d, merged[d], d in ragged, f"{where}: ")
            for d in dims if d in merged}


def _symbolic(n) -> bool:
    """A ``torch.SymInt`` (a size under ``torch.compile``): checked at run time."""
    return type(n).__name__ == "SymInt"


def as_int(n):
    """``n`` as an ``int`` where it is an integer scalar of another type (a numpy or a
    0-dim torch integer: ``operator.index`` takes it); anything else as it is."""
    if isinstance(n, int) or isinstance(n, bool) or _symbolic(n):
        return n
    if isinstance(n, torch.Tensor) and (n.dim() != 0 or n.is_floating_point()):
        return n
    try:
        return operator.index(n)
    except TypeError:
        return n


def _check_size(dim: str, n, ragged: bool = False, prefix: str = ""):
    """A size is a positive int; a ragged dim's is its counts (non-negative ints). The
    size, numpy or torch integer scalars as ints (a ragged dim's counts a tuple).

    >>> import numpy as np; _check_size("b", np.int64(4)), _check_size("t", [np.int32(2), 0], True)
    (4, (2, 0))
    """
    if isinstance(n, list):
        n = tuple(n)
    if _symbolic(n):
        return n
    if ragged:
        if isinstance(n, tuple):
            n = tuple(as_int(c) for c in n)
        # (while Dynamo traces, counts pass here: the compiled bridge checks them, with
        # words made from their example values, which traced code cannot format)
        if isinstance(n, tuple) and n and all(
                _symbolic(c) or (not isinstance(c, bool) and isinstance(c, int)
                                 and (torch.compiler.is_compiling() or c >= 0))
                for c in n):
            return n
        what = "a tuple" if not isinstance(n, tuple) else "a non-empty tuple"
        raise MimoFxError(f"{prefix}dim {dim!r} is cut ragged, so its size is a tuple of "
                          f"counts: {dim}={n!r} must be {what} of non-negative integers "
                          f"(one per ragged shard, or per segment)")
    n = as_int(n)
    # (while Dynamo traces, a call's size may be symbolic: the compiled bridge checks it
    # and makes the words from its example value; traced code cannot format it)
    if isinstance(n, bool) or not isinstance(n, int) or (
            not torch.compiler.is_compiling() and n <= 0):
        raise MimoFxError(f"{prefix}size {dim}={n!r} must be a positive integer (the global "
                          f"size)")
    return n


def check_sizes(src: Layout, dst: Layout,
                sizes: Mapping[str, Size]) -> tuple[tuple[str, Size], ...]:
    """Validate dims and sizes; return the sizes as a hashable tuple in src's dim order
    (a ragged dim keeps its counts as a tuple)."""
    if set(src.dims) != set(dst.dims):
        raise MimoFxError(
            f"src {src.pattern!r} and dst {dst.pattern!r} must name the same dims; "
            f"only in src: {sorted(set(src.dims) - set(dst.dims))}, only in dst: "
            f"{sorted(set(dst.dims) - set(src.dims))}"
        )
    unknown = sorted(set(sizes) - set(src.dims))
    if unknown:
        raise MimoFxError(f"sizes name dims {unknown} that {src.pattern!r} does not have; "
                          f"its dims are {src.dims}")
    missing = [d for d in src.dims if d not in sizes]
    if missing:
        raise MimoFxError(f"sizes miss dims {missing} of {src.pattern!r}; pass the global "
                          f"size of every dim, e.g. {missing[0]}=...")
    ragged = set(src.ragged_dims) | set(dst.ragged_dims)
    checked = {d: _check_size(d, sizes[d], d in ragged) for d in src.dims}
    if dst.partial:
        if dst.grid != src.grid or not set(dst.partial) <= set(src.partial):
            raise MimoFxError(
                f"dst {dst.describe()!r} is partial over {dst.partial}; a redistribute can "
                f"only keep partial axes that src {src.describe()!r} already has, on the same "
                f"grid. Make dst replicated (the values are then summed) instead"
            )
    return tuple((d, checked[d]) for d in src.dims)

