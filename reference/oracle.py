"""The oracle: global tensor <-> per-rank pieces by plain full-tensor indexing.

Written independently of the planner's region code: shards come from
``torch.tensor_split`` / ``torch.chunk`` / ``torch.split`` and ``einops.rearrange``, so
tests comparing a plan's result with ``shard(X, dst)`` check the planner against
separate math. Layouts with ``split="chunk"`` are cut as DTensor cuts them:
``torch.chunk`` once per axis, the outermost axis first, shards past the last chunk
empty. A ragged dim is cut by its counts (``torch.split``), each shard taking its run of
consecutive segments: ``shard(x, layout, t=(3, 0, 5, 2))``.

>>> import torch
>>> from mimo_fx import Grid, Layout
>>> layout = Layout(Grid(cp=2), "(cp s)", zigzag="cp")
>>> {r: t.tolist() for r, t in shard(torch.arange(8), layout).items()}
{0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
>>> unshard(shard(torch.arange(8), layout), layout).tolist()
[0, 1, 2, 3, 4, 5, 6, 7]
>>> ragged = Layout(Grid(dp=3), "(dp t)", ragged="dp")
>>> {r: t.tolist() for r, t in shard(torch.arange(5), ragged, t=(2, 0, 3)).items()}
{0: [0, 1], 1: [], 2: [2, 3, 4]}
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import NamedTuple

import einops
import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import infer_sizes
from mimo_fx.regions import total
from mimo_fx.rows import is_row_layout

__all__ = ["shard", "unshard", "shard_index"]


def _shard_index(layout: Layout, rank: int, dim: str, size) -> torch.Tensor:
    """Global indices of ``dim`` that ``rank`` holds, in local order (``size``: a ragged
    dim's counts)."""
    counts = size if isinstance(size, tuple) else None
    index = torch.arange(sum(size) if counts is not None else size)
    axes = layout.sharding[dim]
    if not axes:
        return index
    coord = layout.grid.coord(rank)
    parts = prod(layout.grid.axis_size(a) for a in axes)
    k = 0
    for a in axes:
        k = k * layout.grid.axis_size(a) + coord[a]
    if dim in layout.ragged_dims:
        if counts is None or len(counts) % parts:
            raise MimoFxError(f"in layout {layout.describe()!r}: ragged dim {dim!r} needs "
                              f"counts, a multiple of {parts} of them; got {dim}={size!r}")
        per = len(counts) // parts
        segments = torch.split(index, list(counts))
        return torch.cat([index[:0], *segments[k * per:(k + 1) * per]])
    size = len(index)
    if axes[0] in layout.zigzag:
        if size % (2 * parts):
            raise MimoFxError(f"in layout {layout.pattern!r}: zigzag needs {dim}={size} "
                              f"divisible by 2*{parts}; pad {dim!r}")
        chunks = index.chunk(2 * parts)
        return torch.cat([chunks[k], chunks[2 * parts - 1 - k]])
    if layout.split == "chunk":
        for a in axes:
            chunks = index.chunk(layout.grid.axis_size(a))
            index = chunks[coord[a]] if coord[a] < len(chunks) else index[:0]
        return index
    return torch.tensor_split(index, parts)[k]


def shard_index(layout: Layout, rank: int, sizes: dict) -> list[torch.Tensor]:
    """Per dim (pattern order), the global indices ``rank`` holds."""
    return [_shard_index(layout, rank, d, sizes[d]) for d in layout.dims]


def _counts(dim: str, c) -> tuple[int, ...]:
    """Counts given to :func:`shard`: a non-empty sequence of non-negative integers."""
    import operator

    try:
        out = tuple(operator.index(n) for n in c)
    except TypeError:
        out = ()
    if not out or any(n < 0 for n in out) or any(isinstance(n, bool) for n in c):
        raise MimoFxError(f"shard: counts {dim}={c!r} must be a non-empty tuple of "
                          f"non-negative integers (one per ragged shard, or per sample); "
                          f"a dim cut evenly needs no size: x's shape gives it")
    return out


def _flatten_pattern(layout: Layout) -> str:
    groups = [" ".join(f.dim for f in g) for g in layout.local_dims]
    return " ".join(g if " " not in g else f"({g})" for g in groups)


def _sizes(x: torch.Tensor, layout: Layout, counts: dict) -> dict:
    """Every dim's size for :func:`shard`: ``x``'s shape, a ragged dim's its counts
    (checked against it; a dim cut evenly may be given its size or counts, checked)."""
    sizes: dict = dict(zip(layout.dims, x.shape))
    for dim, c in counts.items():
        if dim not in sizes:
            raise MimoFxError(f"shard: counts {dim}={c!r} name no dim of {layout.pattern!r} "
                              f"(dims: {', '.join(layout.dims)})")
        if isinstance(c, int) and not isinstance(c, bool) and dim not in layout.ragged_dims:
            if c != sizes[dim]:  # (a plain size of a dim cut evenly: x's own, checked)
                raise MimoFxError(f"shard: {dim}={c} but x has size {sizes[dim]} along "
                                  f"{dim!r} (x's shape gives {layout.describe()!r} its sizes; "
                                  f"drop {dim}=)")
            continue
        cs = _counts(dim, c)
        if sum(cs) != sizes[dim]:
            raise MimoFxError(f"shard: counts {dim}={cs!r} must sum to its size {sizes[dim]} "
                              f"in x")
        if dim in layout.ragged_dims:  # (a dim cut evenly here: checked, not needed)
            sizes[dim] = cs
    missing = [d for d in layout.ragged_dims if d not in counts]
    if missing:
        raise MimoFxError(f"shard: {layout.describe()!r} cuts {missing} ragged; give their "
                          f"counts, e.g. {missing[0]}=(...)")
    return sizes


def shard(x: torch.Tensor, layout: Layout, *, rank: int | None = None,
          **counts: tuple[int, ...]):
    """Every holder's piece of the global ``x`` (dims in the pattern's order), or with
    ``rank`` that rank's piece alone (what a training script takes of a global batch:
    e.g. an encoder rank's images, ``rank=r, i=images_per_sample`` for a layout ragged
    over per-sample counts).

    Under a partial layout the piece at partial index 0 holds the values and the other
    members of the partial group hold zeros, so the pieces sum to ``x``. A ragged dim
    needs its counts as a keyword (``t=(3, 0, 5, 2)``, summing to its size; one count
    per shard, or per sample). A packed layout's piece is its rows of ``x`` (rows
    flattened over its token dims), zero at padding (:func:`shard_rows`).

    >>> from mimo_fx import Grid, Layout
    >>> images = Layout(Grid(dp=2), "(dp i) c", ragged="dp")   # 4 samples: 2 per rank
    >>> shard(torch.arange(5.0).unsqueeze(1), images, rank=1, i=(2, 0, 1, 2)).flatten()
    tensor([2., 3., 4.])
    """
    if rank is not None and not layout.holds(rank):
        raise MimoFxError(f"shard: rank {rank} holds no piece of {layout.describe()!r}")
    cut = _cut(layout)
    if rank is not None:  # (one rank's piece costs one rank's work)
        return cut.shard(x, _One(layout, rank), counts)[rank]
    return cut.shard(x, layout, counts)


def _shard_boxes(x: torch.Tensor, layout, counts: dict) -> dict[int, torch.Tensor]:
    if x.dim() != len(layout.dims):
        raise MimoFxError(f"shard: global tensor has {x.dim()} dims {tuple(x.shape)} but "
                          f"layout {layout.pattern!r} names {len(layout.dims)} dims "
                          f"{layout.dims}")
    sizes = _sizes(x, layout, counts)
    lhs, rhs = " ".join(layout.dims), _flatten_pattern(layout)
    out = {}
    for rank in getattr(layout, "_only", layout.holders):
        index = shard_index(layout, rank, sizes)
        piece = x[torch.meshgrid(*index, indexing="ij")] if x.dim() else x.clone()
        piece = einops.rearrange(piece, f"{lhs} -> {rhs}")
        coord = layout.grid.coord(rank)
        if any(coord[a] for a in layout.partial):
            piece = torch.zeros_like(piece)
        out[rank] = piece.contiguous()
    return out


def unshard(
    pieces: dict[int, torch.Tensor], layout: Layout, *, atol: float = 0.0, **sizes: int
) -> torch.Tensor:
    """The global tensor from every holder's piece; replicas must agree (within ``atol``).

    Partial axes are summed. Sizes the local shapes cannot tell are keyword arguments.
    A packed layout's rows are put back in place (its token dims flattened).
    """
    return _cut(layout).unshard(pieces, layout, atol, sizes)


def _unshard_boxes(pieces: dict[int, torch.Tensor], layout, atol: float, sizes: dict
                   ) -> torch.Tensor:
    missing = [r for r in layout.holders if r not in pieces]
    extra = [r for r in pieces if r not in layout.holders]
    if missing or extra:
        raise MimoFxError(f"unshard: layout {layout.describe()!r} on {layout.grid!r} has "
                          f"holders {list(layout.holders)}; missing {missing}, extra {extra}")
    full = infer_sizes(layout, {r: tuple(t.shape) for r, t in pieces.items()}, sizes)
    rhs, lhs = " ".join(layout.dims), _flatten_pattern(layout)
    sample = next(iter(pieces.values()))
    groups = layout.grid.groups(layout.partial) if layout.partial else tuple(
        (r,) for r in layout.grid.ranks)
    out = torch.zeros([total(full[d]) for d in layout.dims], dtype=sample.dtype)
    seen = torch.zeros(out.shape, dtype=torch.bool)
    for group in groups:
        if group[0] not in pieces:
            continue
        summed = pieces[group[0]]
        for r in group[1:]:
            summed = summed + pieces[r]
        index = shard_index(layout, group[0], full)
        local = {d: len(i) for d, i in zip(layout.dims, index)}
        piece = einops.rearrange(summed, f"{lhs} -> {rhs}", **local)
        where = torch.meshgrid(*index, indexing="ij")
        before = out[where]
        overlap = seen[where]
        if overlap.any() and not torch.allclose(before[overlap], piece[overlap], atol=atol,
                                                rtol=0):
            raise MimoFxError(f"unshard: replicas disagree at rank {group[0]} under "
                              f"{layout.describe()!r}")
        out[where] = piece
        seen[where] = True
    if not bool(seen.all()):
        raise MimoFxError(f"unshard: pieces do not cover the tensor under {layout.describe()!r}")
    return out


class _Cut(NamedTuple):
    """How the oracle cuts one kind of layout: ``shard(x, layout, counts)`` gives every
    holder's piece, ``unshard(pieces, layout, atol, sizes)`` the global tensor."""

    shard: Callable[..., dict[int, torch.Tensor]]
    unshard: Callable[..., torch.Tensor]


def _cut(layout) -> _Cut:
    """The oracle's cut for ``layout``, the one place it asks a layout's kind: one given
    row by row (a packed batch) is cut by its rows, any other by its boxes."""
    if is_row_layout(layout):
        return _Cut(lambda x, lay, _: shard_rows(x, lay),
                    lambda pieces, lay, atol, _: unshard_rows(pieces, lay, atol=atol))
    return _Cut(_shard_boxes, _unshard_boxes)


class _One:
    """A layout that answers ``holders`` with one rank (the rest it takes from the
    layout): :func:`shard` of one rank's piece computes no other."""

    def __init__(self, layout, rank: int) -> None:
        self._layout, self._only = layout, (rank,)

    def __getattr__(self, name: str):
        return getattr(self._layout, name)


# -- row layouts (a packed batch) ----------------------------------------------------------
def _rows_of(layout, rank: int) -> torch.Tensor:
    return layout.rows(rank)


def shard_rows(x: torch.Tensor, layout) -> dict[int, torch.Tensor]:
    """Every rank's piece of ``x`` (``(rows, *features)``, the rows flattened over the
    layout's token dims): ``x[rows(rank)]``, zero where a local row holds none."""
    if x.dim() == 0 or x.shape[0] != layout.n_rows:
        raise MimoFxError(f"shard: x has shape {tuple(x.shape)}; its first dim must be the "
                          f"{layout.n_rows} rows of {layout.describe()!r} (token dims "
                          f"flattened)")
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])  # row n: the zero row
    out = {}
    for rank in getattr(layout, "_only", layout.holders):
        rows = _rows_of(layout, rank)
        out[rank] = padded[torch.where(rows >= 0, rows, layout.n_rows).to(x.device)]
    return out


def unshard_rows(pieces: dict[int, torch.Tensor], layout, *, atol: float = 0.0
                 ) -> torch.Tensor:
    """The rows ``(n_rows, *features)`` from every rank's piece (padding dropped);
    replicas of a row must agree within ``atol``; every row must be held."""
    missing = [r for r in layout.holders if r not in pieces]
    if missing:
        raise MimoFxError(f"unshard: {layout.describe()!r} needs every rank's piece; "
                          f"missing {missing}")
    sample = next(iter(pieces.values()))
    out = sample.new_zeros((layout.n_rows, *sample.shape[1:]))
    seen = torch.zeros(layout.n_rows, dtype=torch.bool)
    for rank in layout.holders:
        rows, piece = _rows_of(layout, rank), pieces[rank]
        if piece.shape[0] != len(rows):
            raise MimoFxError(f"unshard: rank {rank}'s piece has {piece.shape[0]} rows, its "
                              f"layout gives it {len(rows)}")
        real = rows >= 0
        for g, row in zip(rows[real].tolist(), piece[real.to(piece.device)]):
            if seen[g] and not torch.allclose(out[g], row, atol=atol, rtol=0):
                raise MimoFxError(f"unshard: replicas disagree on row {g}")
            out[g], seen[g] = row, True
    if not bool(seen.all()):
        raise MimoFxError(f"unshard: rows {torch.nonzero(~seen).flatten().tolist()[:8]} are "
                          f"held by no rank")
    return out
