"""Sizes learned by the ranks that do not know them: the size gather.

A call that does not give every size learns the missing ones from the ranks holding
src: every rank of the two grids contributes one small int64 record -- a marker, the
bridge's fingerprint, the number of dims and the dtype of the tensor it passed (none
for None), the tensor's local shape -- to one
all-gather over the grids' union, on the bridge's check group (its own process group
with its own timeout, so a rank that skipped the gather makes the others fail with an
error, not pair the records with data). Every rank then infers the same sizes from the
same records (uneven splits exactly, a ragged dim's counts one per shard) and raises the
same error if a record is wrong. Under ``torch.compile`` the records become unbacked SymInts
(``.tolist()``, with ``capture_scalar_outputs``) and the checks run-time asserts.

>>> Record.width(3) == HEADER_LEN
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import infer_sizes

from .guard import (
    HEADER_LEN,
    MAGIC,
    MAGIC_SIZES,
    MAX_DIMS,
    calls_differ,
    dtype_code,
    int_tensor,
)

__all__ = ["Record", "learn_sizes", "holder_shapes", "int_tensor"]

HEADER = 4  # marker, fingerprint, 1 + the tensor's dims (0: None), its dtype


class Record:
    """One rank's record of the size gather."""

    @staticmethod
    def width(ndim: int) -> int:
        """A record's length: a check header's (so a size gather that meets a check can
        never be a gather of unequal sizes, which gloo aborts on)."""
        assert ndim <= MAX_DIMS, ndim
        return HEADER_LEN

    @staticmethod
    def encode(x: torch.Tensor | None, ndim: int, fingerprint: int) -> list[Any]:
        if not isinstance(x, torch.Tensor):
            record = [MAGIC_SIZES, fingerprint, 0, 0] + [0] * ndim
        else:
            shape = list(x.shape)[:ndim] + [0] * max(0, ndim - x.dim())
            record = [MAGIC_SIZES, fingerprint, 1 + x.dim(), dtype_code(x.dtype), *shape]
        return record + [0] * (HEADER_LEN - len(record))


def _eager_check(ok, message) -> None:
    if not ok:
        raise MimoFxError(message())


def _compiled_check(ok, message) -> None:
    # the message's values are symbolic here; the eager call names them
    torch._check(ok, lambda: "mimo_fx: the shapes of the size gather disagree with the "
                             "layouts (run the call eagerly to see which rank and why)")


def holder_shapes(records: torch.Tensor | list, ranks: tuple[int, ...], src: Layout,
                  ndim: int) -> dict:
    """The local shapes the src holders sent, one holder per piece, by rank, as SymInts
    under ``torch.compile``: only these entries of the table become unbacked SymInts
    (each costs Dynamo milliseconds to trace and the graph a run-time assert). The rest
    -- the headers, and that replicas of a piece sent its shape -- the gather op
    judges when the graph runs (``_gather_sizes_impl``), raising the eager call's error."""
    at = _holder_rows(ranks, src)
    if not at or not ndim:
        return {ranks[i]: () for i in at}
    if isinstance(records, list):  # host records (a one-rank bridge's own: its shape's sizes)
        table = [records[i][HEADER:HEADER + ndim] for i in at]
    else:
        table = records.view(len(ranks), -1)[at, HEADER:HEADER + ndim].tolist()
    return {ranks[i]: tuple(shape) for i, shape in zip(at, table)}


@torch.compiler.assume_constant_result
def _holder_rows(ranks: tuple[int, ...], src: Layout) -> list[int]:
    """The indices into ``ranks`` of one src holder per piece. Plain Python on constants:
    Dynamo calls it once while tracing (its result guarded on ``src``) instead of
    tracing every rank's coordinate, which cost a dynamic-shape trace seconds."""
    at, pieces = [], set()
    for i, r in enumerate(ranks):
        if src.holds(r):
            coord = src.grid.coord(r)
            piece = tuple(coord[a] for a in src.sharded_axes)
            if piece not in pieces:
                pieces.add(piece)
                at.append(i)
    return at


def learn_sizes(records: torch.Tensor | list, ranks: tuple[int, ...], src: Layout, given: dict,
                fingerprint: int, dtype: torch.dtype, context: str) -> dict:
    """Every dim's size from the gathered ``records`` (a table, one record per rank of
    ``ranks``), ``given`` first. Eagerly a bad record raises :class:`MimoFxError` on every
    rank, naming the rank."""
    compiling = torch.compiler.is_compiling()
    check: Callable[[Any, str], None] = _compiled_check if compiling else _eager_check
    ndim = len(src.local_dims)
    if compiling:
        shapes = holder_shapes(records, ranks, src, ndim)
    else:
        listed = records if isinstance(records, list) else records.view(len(ranks), -1).tolist()
        problems = _record_problems(listed, ranks, src, fingerprint, ndim, dtype)
        if problems:
            raise MimoFxError(context + "the size gather found:\n  " + "\n  ".join(problems))
        shapes = {r: tuple(record[HEADER:HEADER + ndim]) for r, record in zip(ranks, listed)
                  if src.holds(r)}
    try:
        sizes = infer_sizes(src, shapes, dict(given), check)
    except MimoFxError as err:
        raise MimoFxError(context + str(err)) from None
    if not compiling:  # every holder's shape at the sizes, seen by every rank
        wrong = _wrong_shapes(src, shapes, sizes)
        if wrong:
            raise MimoFxError(context + "the size gather found:\n  " + "\n  ".join(wrong))
    return sizes


def _wrong_shapes(src: Layout, shapes: dict, sizes: dict) -> list[str]:
    """Holders whose local shape is not their piece's at ``sizes`` (a size given in the
    call that a holder's tensor contradicts)."""
    from mimo_fx.local import local_shape
    from mimo_fx.regions import Tiling

    try:
        tiling = Tiling.of(src, src.dims, sizes)
    except MimoFxError as err:
        return [str(err)]
    out = []
    text = ", ".join(f"{d}={sizes[d]}" for d in src.dims)
    for rank, shape in shapes.items():
        want = local_shape(src, tiling, rank)
        if tuple(shape) != tuple(want):
            out.append(f"rank {rank}: local tensor has shape {tuple(shape)} but src "
                       f"{src.describe()!r} gives it shape {want} at {text}; pass its piece, "
                       f"or the sizes it has")
    return out


def _record_problems(records, ranks, src: Layout, fingerprint: int, ndim: int,
                  dtype: torch.dtype) -> list[str]:
    split = calls_differ(records, ranks, "layouts, dtype, options, or the sizes or batch a "
                         "call gives", MAGIC_SIZES)
    out = [split] if split else []
    for rank, record in zip(ranks, records):
        magic, _, dims, code = record[:HEADER]
        shape = tuple(record[HEADER:HEADER + ndim])
        if magic == MAGIC:
            out.append(f"rank {rank} sent a check header instead of a size record: it gave "
                       f"every size (then no size gather runs) and checks its call; every rank "
                       f"must give the same set of sizes")
        elif magic != MAGIC_SIZES:
            out.append(f"rank {rank} sent no size record: it gave every size (then no "
                       f"size gather runs), called another collective, or left; every rank "
                       f"must give the same set of sizes")
        elif split:
            continue
        elif src.holds(rank) and not dims:
            out.append(f"rank {rank} holds a piece of src {src.describe()!r} but passed "
                       f"None; pass its piece")
        elif dims and dims - 1 != ndim:
            out.append(f"rank {rank} passed a tensor of {dims - 1} dims but src "
                       f"{src.pattern!r} has {ndim} local dims")
        elif dims and code != dtype_code(dtype):
            out.append(f"rank {rank} passed a tensor of another dtype than {dtype}")
        elif dims and not src.holds(rank) and 0 not in shape:
            out.append(f"rank {rank} holds no piece of src {src.describe()!r} but passed a "
                       f"tensor of shape {shape}; pass None")
    return out
