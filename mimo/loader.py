"""A step's samples on every rank: each data loader's samples shared by one all-gather.

Balanced placement (:func:`mimo_fx.placement.place`) needs every loader's samples -- how
many text and image tokens, in which order -- on every rank, once per step, so that
every rank computes the same placement. :func:`share_samples` is that sample gather: one
``all_gather`` of a fixed-width int64 row per rank (``8 * width`` bytes sent by each,
``8 * width * world`` received) over the default process group. A row that does not fit
is flagged in the row itself, so every rank raises the same error after the gather
rather than one rank raising and the others waiting.

A loader is a dp index of the ``loaders`` grid; its replicas over the grid's other axes
(tp ranks that read the same batch) hold the same samples, and the first of them speaks
for it. Ranks outside the grid call it too, with ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.grid import Grid
from mimo_fx.placement import Sample, decode_samples, encode_samples

__all__ = ["WIDTH", "share_samples", "sample_rows"]

WIDTH = 1024  # int64 values per rank's row: a loader's samples must encode within it
_NONE, _TOO_LONG = -1, -2  # a row's first value: no loader speaks here; did not fit


def sample_rows(samples: Sequence[Sample] | None, loaders: Grid, rank: int,
                width: int = WIDTH) -> torch.Tensor:
    """This rank's row of the sample gather: ``-1`` if it does not speak for a loader, ``-2``
    and the length needed if its samples do not fit ``width``, else their encoding.

    >>> from mimo_fx import Grid
    >>> sample_rows([Sample((2, 1), (8,))], Grid(dp=2), rank=1, width=8).tolist()
    [6, 1, 1, 2, 1, 8, 0, 0]
    >>> sample_rows([Sample((2, 1), (8,))], Grid(dp=2), rank=1, width=4).tolist()
    [-2, 6, 0, 0]
    """
    row = torch.zeros(width, dtype=torch.int64)
    if rank not in loaders or any(v for a, v in loaders.coord(rank).items() if a != "dp"):
        row[0] = _NONE
        return row
    if samples is None or isinstance(samples, Sample):
        raise MimoFxError(f"rank {rank} is loader {loaders.coord(rank).get('dp', 0)} of "
                          f"{loaders}: pass its list of Sample (an empty list if it has "
                          f"none), not {samples!r}")
    values = encode_samples(samples)
    if 1 + len(values) > width:
        row[:2] = torch.tensor([_TOO_LONG, 1 + len(values)])
    else:
        row[0] = 1 + len(values)
        row[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return row


def share_samples(samples: Sequence[Sample] | None, loaders: Grid, *,
                  width: int = WIDTH) -> tuple[tuple[Sample, ...], ...]:
    """Every loader's samples, on every rank of the world (call it on every rank, each
    with its own loader's samples, or ``None`` outside the ``loaders`` grid): one
    all-gather of ``width`` int64 values per rank. Returns per loader (dp index) its
    samples."""
    import torch.distributed as dist

    if isinstance(width, bool) or not isinstance(width, int) or width < 2:
        raise MimoFxError(f"width = {width!r} must be an integer >= 2 (int64 values per "
                          f"rank's row)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if max(loaders.ranks) >= world:
        raise MimoFxError(f"the loaders grid {loaders} needs ranks up to "
                          f"{max(loaders.ranks)}, the world has {world}")
    rows = torch.empty(world * width, dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(rows, sample_rows(samples, loaders, rank, width))
    return _decode(rows.view(world, width).tolist(), loaders, width)


def _decode(rows: list[list[int]], loaders: Grid, width: int
            ) -> tuple[tuple[Sample, ...], ...]:
    """Per loader its samples, from every rank's row (the same on every rank)."""
    too_long = [(r, row[1]) for r, row in enumerate(rows) if row[0] == _TOO_LONG]
    if too_long:
        need = max(n for _, n in too_long)
        raise MimoFxError(f"the samples of rank(s) {[r for r, _ in too_long]} need {need} "
                          f"int64 values in the sample gather, more than width = {width}; pass "
                          f"share_samples(..., width={need}) (or more) on every rank")
    n = loaders.axis_size("dp") if "dp" in loaders.names else 1
    out: list[tuple[Sample, ...] | None] = [None] * n
    for r, row in enumerate(rows):
        if row[0] != _NONE:
            out[loaders.coord(r).get("dp", 0)] = decode_samples(row[1:row[0]])
    assert all(s is not None for s in out)  # every loader's first replica spoke
    return tuple(s for s in out if s is not None)
