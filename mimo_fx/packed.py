"""Packed sequences (THD) split over context parallelism one sequence at a time.

A language model packs variable-length samples into one sequence of ``T`` tokens
(``T = sum(lengths)``, a tensor ``(T, ...)``, boundaries in ``cu_seqlens``). Context
parallelism then cuts every sequence on its own: the sequence is padded at its end to a
multiple of ``2*cp`` and cut into ``2*cp`` equal chunks, cp rank ``i`` holding chunks
``i`` and ``2*cp-1-i`` (``zigzag=True``, the load balance causal attention needs), or
padded to a multiple of ``cp`` and cut into ``cp`` chunks, rank ``i`` holding chunk ``i``
(``zigzag=False``). A rank stores its tokens sequence by sequence, and within a sequence
its chunks in that order, so each sequence's tokens are contiguous in its storage.

:class:`Packing` answers, per cp rank, what a model needs without sharding an ``arange``:
where each local token sits in the padded packed sequence (:meth:`Packing.positions`),
which unpadded token it is (:meth:`Packing.token_index`, ``-1`` for padding), its position
in its own sequence (:meth:`Packing.position_in_sequence`, for RoPE), its sequence
(:meth:`Packing.segment_ids`, ``-1`` for padding) and the local sequence boundaries for a
varlen attention kernel (:meth:`Packing.local_cu_seqlens`). :func:`pack_shard` and
:func:`pack_unshard` are the oracle between the unpadded packed tensor and the per-rank
pieces; :func:`image_rows` says which image embeddings each cp rank receives and where
they go in its storage. :class:`PackedLayout` lays one packing per dp group over a
grid (:func:`packed_shard` is its oracle), and :func:`plan_to_packed` /
:func:`plan_from_packed` plan the index-mapped bridges from any rows into it and back.
Every index comes as a CPU int64 tensor (``.to(device)`` it, or
``.int()`` for a kernel that wants int32 boundaries).

>>> p = Packing([3, 6], cp=2)
>>> p.padded_lengths, p.cu_seqlens.tolist(), p.cu_seqlens_padded.tolist()
((4, 8), [0, 3, 9], [0, 4, 12])
>>> p.positions(0).tolist(), p.positions(1).tolist()
([0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9])
>>> p.token_index(0).tolist()
[0, -1, 3, 4, -1, -1]
>>> p.position_in_sequence(0).tolist(), p.segment_ids(0).tolist()
([0, 3, 0, 1, 6, 7], [0, -1, 1, 1, -1, -1])
>>> p.local_cu_seqlens(0).tolist(), p.local_cu_seqlens(0, padded=False).tolist()
([0, 2, 6], [0, 1, 3])
>>> import torch
>>> x = torch.arange(10, 19)
>>> {r: t.tolist() for r, t in pack_shard(x, p).items()}
{0: [10, 0, 13, 14, 0, 0], 1: [11, 12, 15, 16, 17, 18]}
>>> pack_unshard(pack_shard(x, p), p).tolist()
[10, 11, 12, 13, 14, 15, 16, 17, 18]
>>> rows = image_rows(p, [5, 4, 3])  # image embedding j goes to unpadded position [5, 4, 3][j]
>>> {r: (m.rows.tolist(), m.local_rows.tolist()) for r, m in rows.items()}
{0: ([2, 1], [2, 3]), 1: ([0], [2])}

The contiguous variant pads to a multiple of ``cp`` only:

>>> c = Packing([3, 5], cp=2, zigzag=False)
>>> c.positions(0).tolist(), c.positions(1).tolist()
([0, 1, 4, 5, 6], [2, 3, 7, 8, 9])
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from math import lcm
from typing import NamedTuple

import torch

from .errors import MimoFxError
from .grid import Grid

__all__ = ["ImageRows", "PackedLayout", "Packing", "image_rows", "pack_shard", "pack_unshard",
           "packed_shard", "plan_from_packed", "plan_to_packed"]


def _int(value: object, what: str, fix: str) -> int:
    """``value`` as a Python int (bools refused: ``True`` is rarely meant as 1 here)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise MimoFxError(f"{what} must be an integer, got {value!r}; {fix}") from None


def _check_lengths(lengths: object) -> tuple[int, ...]:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1:
            raise MimoFxError(f"Packing lengths must be 1-D (one length per sequence), got a "
                              f"tensor of shape {tuple(lengths.shape)}")
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise MimoFxError(f"Packing lengths must be a sequence of token counts, one per "
                          f"sequence, e.g. [3, 6]; got {lengths!r}")
    out = tuple(_int(n, f"Packing lengths[{k}]", "give each sequence's token count")
                for k, n in enumerate(lengths))
    for k, n in enumerate(out):
        if n < 0:
            raise MimoFxError(f"Packing lengths[{k}] = {n} is negative; a length is a token "
                              f"count >= 0 (0 for an empty sequence)")
    return out


def _check_cp(cp: object) -> int:
    n = _int(cp, "Packing cp", "give the context-parallel size, e.g. cp=2")
    if n < 1:
        raise MimoFxError(f"Packing cp = {n} must be >= 1 (cp=1 when context parallelism "
                          f"is off)")
    return n


def _check_multiple(multiple: object, chunks: int, zigzag: bool) -> int:
    if multiple is None:
        return chunks
    m = _int(multiple, "Packing multiple", f"e.g. multiple={chunks}")
    if m < 1 or m % chunks:
        cut = f"2*cp = {chunks}" if zigzag else f"cp = {chunks}"
        raise MimoFxError(f"Packing multiple = {m} must be a positive multiple of {cut}, the "
                          f"number of chunks each sequence is cut into; e.g. multiple="
                          f"{lcm(max(m, 1), chunks)}, or leave it unset")
    return m


@dataclass(frozen=True, init=False)
class Packing:
    """Variable-length sequences packed into one, each split over ``cp`` ranks on its own.

    Args:
        lengths: the token count of each sequence (0 allowed), in packing order.
        cp: the context-parallel size.
        zigzag: pad each sequence to a multiple of ``2*cp``, cut it in ``2*cp`` chunks and
            give cp rank ``i`` chunks ``i`` and ``2*cp-1-i``; if False, pad to a multiple of
            ``cp``, cut in ``cp`` chunks and give rank ``i`` chunk ``i``.
        multiple: pad each sequence to a multiple of this instead (a multiple of the chunk
            count, e.g. ``2*cp*tp`` when sequence parallelism also cuts the local tokens).

    Padding goes at the end of each sequence. A rank holds ``padded_len / cp`` tokens of
    every sequence, ``total_padded / cp`` in all.
    """

    lengths: tuple[int, ...]
    cp: int
    zigzag: bool
    multiple: int

    def __init__(self, lengths: Sequence[int], cp: int, zigzag: bool = True, *,
                 multiple: int | None = None) -> None:
        if not isinstance(zigzag, bool):
            raise MimoFxError(f"Packing zigzag must be True or False, got {zigzag!r}")
        cp = _check_cp(cp)
        object.__setattr__(self, "lengths", _check_lengths(lengths))
        object.__setattr__(self, "cp", cp)
        object.__setattr__(self, "zigzag", zigzag)
        object.__setattr__(self, "multiple",
                           _check_multiple(multiple, 2 * cp if zigzag else cp, zigzag))

    # -- the packed global sequence ------------------------------------------------------
    @property
    def chunks(self) -> int:
        """How many chunks each sequence is cut into (``2*cp`` or ``cp``)."""
        return 2 * self.cp if self.zigzag else self.cp

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        """Each sequence's length rounded up to a multiple of ``multiple``."""
        m = self.multiple
        return tuple(-(-n // m) * m for n in self.lengths)

    @property
    def total(self) -> int:
        """Tokens of the unpadded packed sequence, ``sum(lengths)``."""
        return sum(self.lengths)

    @property
    def total_padded(self) -> int:
        """Tokens of the padded packed sequence, ``sum(padded_lengths)``."""
        return sum(self.padded_lengths)

    @property
    def local_total(self) -> int:
        """Tokens each cp rank stores, padding included (the same on every rank)."""
        return self.total_padded // self.cp

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Sequence boundaries in the unpadded packed sequence, ``[0, l0, l0+l1, ...]``."""
        return torch.tensor([0, *accumulate(self.lengths)], dtype=torch.int64)

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """Sequence boundaries in the padded packed sequence."""
        return torch.tensor([0, *accumulate(self.padded_lengths)], dtype=torch.int64)

    # -- one cp rank's tokens ------------------------------------------------------------
    def positions(self, rank: int) -> torch.Tensor:
        """Where each of ``rank``'s tokens sits in the padded packed sequence, in storage
        order (rising: sequence by sequence, earlier chunk first)."""
        seq, offset = self._local(rank)
        return self.cu_seqlens_padded[seq] + offset

    def token_index(self, rank: int) -> torch.Tensor:
        """Each of ``rank``'s tokens' index in the unpadded packed sequence, -1 for padding."""
        seq, offset, real = self._tokens(rank)
        return torch.where(real, self.cu_seqlens[:-1][seq] + offset, -1)

    def position_in_sequence(self, rank: int) -> torch.Tensor:
        """Each of ``rank``'s tokens' position in its own sequence (RoPE's position).
        Padding continues its sequence's count (``>= length``), so it still indexes a
        table of ``max(padded_lengths)`` rows."""
        return self._local(rank)[1]

    def segment_ids(self, rank: int) -> torch.Tensor:
        """Which sequence each of ``rank``'s tokens belongs to, -1 for padding."""
        seq, _, real = self._tokens(rank)
        return torch.where(real, seq, -1)

    def local_cu_seqlens(self, rank: int, *, padded: bool = True) -> torch.Tensor:
        """Sequence boundaries in ``rank``'s storage, for a varlen attention kernel.

        ``padded=True``: where each sequence's tokens start and end in the storage
        (``cu_seqlens_padded // cp``, padding included; the same on every rank).
        ``padded=False``: the running count of the rank's real tokens per sequence. A
        sequence's real tokens come first in its block (padding sits at the sequence's
        end, and the later chunk is all padding whenever the earlier one has any)."""
        seq, _, real = self._tokens(rank)
        if padded:
            return self.cu_seqlens_padded // self.cp
        counts = torch.zeros(len(self.lengths), dtype=torch.int64).index_add_(
            0, seq, real.to(torch.int64))
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def _tokens(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per local token: its sequence, its place in the padded sequence, whether real."""
        seq, offset = self._local(rank)
        return seq, offset, offset < torch.tensor(self.lengths, dtype=torch.int64)[seq]

    def _local(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per local token: its sequence and its position within the padded sequence."""
        self._check_rank(rank)
        block = torch.tensor(self.padded_lengths, dtype=torch.int64) // self.cp
        ends = torch.cumsum(block, 0)
        local = torch.arange(self.local_total)
        # not repeat_interleave: on a busy machine its thread pool costs milliseconds
        seq = torch.searchsorted(ends, local, right=True)
        j = local - (ends - block)[seq]  # place within the sequence's block
        chunk = (block // 2 if self.zigzag else block)[seq]
        if not self.zigzag:
            return seq, rank * chunk + j
        later = (2 * self.cp - 1 - rank) * chunk + (j - chunk)
        return seq, torch.where(j < chunk, rank * chunk + j, later)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.cp:
            raise MimoFxError(f"rank = {rank!r} is not a cp rank of this Packing (cp = "
                              f"{self.cp}); use an index in 0..{self.cp - 1}")


# -- the oracle between the packed tensor and per-rank pieces ---------------------------
def pack_shard(x: torch.Tensor, packing: Packing) -> dict[int, torch.Tensor]:
    """Cut the unpadded packed tensor ``x`` ``(T, ...)`` into each cp rank's ``(T_r, ...)``
    piece, padding rows zero. Differentiable (a gather)."""
    if not isinstance(packing, Packing):
        raise MimoFxError(f"pack_shard needs a Packing, got {packing!r}")
    if x.dim() == 0 or x.shape[0] != packing.total:
        raise MimoFxError(f"pack_shard: x has shape {tuple(x.shape)}; its first dim must be "
                          f"the packed tokens, sum(lengths) = {packing.total}")
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])  # row T: the zero row
    out = {}
    for rank in range(packing.cp):
        index = packing.token_index(rank)
        out[rank] = padded[torch.where(index >= 0, index, packing.total).to(x.device)]
    return out


def pack_unshard(pieces: Mapping[int, torch.Tensor], packing: Packing) -> torch.Tensor:
    """The unpadded packed tensor ``(T, ...)`` from every cp rank's piece (padding dropped).
    Differentiable (a gather)."""
    if not isinstance(packing, Packing):
        raise MimoFxError(f"pack_unshard needs a Packing, got {packing!r}")
    ranks = range(packing.cp)
    if sorted(pieces) != list(ranks):
        raise MimoFxError(f"pack_unshard needs one piece per cp rank 0..{packing.cp - 1}, got "
                          f"pieces for ranks {sorted(pieces)}")
    rest = pieces[0].shape[1:] if pieces[0].dim() else None
    for rank in ranks:
        shape = tuple(pieces[rank].shape)
        if not shape or shape[0] != packing.local_total or shape[1:] != rest:
            raise MimoFxError(f"pack_unshard: the piece of rank {rank} has shape {shape}; "
                              f"every piece must be ({packing.local_total}, ...) with the "
                              f"same trailing dims as rank 0's, {tuple(pieces[0].shape)}")
    source = torch.empty(packing.total, dtype=torch.int64)  # row in the concatenated pieces
    for rank in ranks:
        index = packing.token_index(rank)
        real = index >= 0
        source[index[real]] = rank * packing.local_total + torch.nonzero(real).flatten()
    stacked = torch.cat([pieces[r] for r in ranks])
    return stacked[source.to(stacked.device)]


# -- image tokens -----------------------------------------------------------------------
class ImageRows(NamedTuple):
    """A cp rank's image tokens: ``local[local_rows] = image_embeddings[rows]``."""

    rows: torch.Tensor
    """Indices into the image-embedding tensor (the order of ``image_positions``)."""
    local_rows: torch.Tensor
    """Where those embeddings go in the rank's storage, rising."""


def image_rows(packing: Packing, image_positions: Sequence[int] | torch.Tensor
               ) -> dict[int, ImageRows]:
    """Per cp rank, which image embeddings it receives and where they go in its storage.

    ``image_positions[j]`` is the position, in the unpadded packed sequence, of the token
    that image embedding ``j`` replaces; the positions need not be sorted (embedding ``j``
    is simply row ``j``) but must be distinct. Each rank's entries come in its storage
    order, which is also the order of rising position; a rank without image tokens gets
    two empty tensors. Positions may be a list or a 1-D integer tensor.
    """
    positions = _check_image_positions(packing, image_positions)
    owner = torch.empty(packing.total, dtype=torch.int64)
    row = torch.empty(packing.total, dtype=torch.int64)
    for rank in range(packing.cp):
        index = packing.token_index(rank)
        real = index >= 0
        owner[index[real]] = rank
        row[index[real]] = torch.nonzero(real).flatten()
    out = {}
    for rank in range(packing.cp):
        mine = torch.nonzero(owner[positions] == rank).flatten()
        mine = mine[torch.argsort(row[positions[mine]])]
        out[rank] = ImageRows(mine, row[positions[mine]])
    return out


def _check_image_positions(packing: Packing, image_positions: object) -> torch.Tensor:
    if not isinstance(image_positions, torch.Tensor):
        try:
            image_positions = torch.tensor(image_positions)  # no dtype=: it would floor 1.5
        except (TypeError, ValueError, RuntimeError):
            raise MimoFxError(f"image_positions must be integer positions, got "
                              f"{image_positions!r}") from None
    t = image_positions
    if t.numel() == 0 and t.dim() == 1:
        t = t.to(torch.int64)  # torch.tensor([]) is float32
    if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise MimoFxError(f"image_positions must be a 1-D integer tensor (one position per "
                          f"image embedding), got dtype {t.dtype} and shape {tuple(t.shape)}")
    t = t.to(torch.int64).cpu()
    bad = (t < 0) | (t >= packing.total)
    if bad.any():
        raise MimoFxError(f"image_positions {t[bad].tolist()} fall outside the unpadded "
                          f"packed sequence 0..{packing.total - 1} (sum(lengths) = "
                          f"{packing.total}); positions exclude padding")
    if len(torch.unique(t)) != len(t):
        values, counts = torch.unique(t, return_counts=True)
        raise MimoFxError(f"image_positions repeat {values[counts > 1].tolist()}; each image "
                          f"embedding replaces one distinct token")
    return t


# -- packed layouts over a grid -----------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PackedLayout:
    """A packed token dim ``(tokens, ...)`` over a grid: dp group ``d`` packs its samples
    (``lengths[d]``) into one sequence, cut over the ``cp`` axis per sequence
    (:class:`Packing`); every other axis replicates.

    The global tensor is every group's unpadded packed tokens, group after group (sample
    order, as an encoder's ``(dp b) s h`` flattens, or a ragged ``(dp t) h``): global row
    ``offset[d] + i`` is token ``i`` of group ``d``'s packing. A rank's piece is its cp
    rank's storage of its group's packing, ``(packing.local_total, ...)``, zero at padding.
    A grid without a ``dp`` (or ``cp``) axis has one group (or cp = 1).

    >>> from mimo_fx import Grid
    >>> lay = PackedLayout(Grid(cp=2, dp=2), [[3], [2, 1]], zigzag=False)
    >>> {r: lay.rows(r).tolist() for r in range(4)}
    {0: [0, 1], 1: [2, -1], 2: [3, 5], 3: [4, -1]}
    """

    grid: Grid
    lengths: tuple[tuple[int, ...], ...]
    zigzag: bool = True
    cp: str = "cp"
    dp: str = "dp"
    packings: tuple[Packing, ...] = ()  # per dp group

    def __init__(self, grid, lengths: Sequence[Sequence[int]], zigzag: bool = True, *,
                 cp: str = "cp", dp: str = "dp") -> None:
        if not isinstance(grid, Grid):
            raise MimoFxError(f"PackedLayout needs a Grid, got {grid!r}")
        groups = grid.axis_size(dp) if dp in grid.names else 1
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) \
                or len(lengths) != groups:
            raise MimoFxError(f"PackedLayout lengths must give one list of sample lengths "
                              f"per {dp} group ({groups} of them), got {lengths!r}")
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "lengths", tuple(_check_lengths(g) for g in lengths))
        object.__setattr__(self, "zigzag", zigzag)
        object.__setattr__(self, "cp", cp)
        object.__setattr__(self, "dp", dp)
        n_cp = grid.axis_size(cp) if cp in grid.names else 1
        object.__setattr__(self, "packings",
                           tuple(Packing(g, n_cp, zigzag) for g in self.lengths))

    @property
    def total(self) -> int:
        """Rows of the global (unpadded) tensor."""
        return sum(p.total for p in self.packings)

    def _where(self, rank: int) -> tuple[int, int]:
        if rank not in self.grid:
            raise MimoFxError(f"rank {rank} is not in this PackedLayout's grid {self.grid}")
        coord = self.grid.coord(rank)
        return coord.get(self.dp, 0), coord.get(self.cp, 0)

    def packing(self, rank: int) -> Packing:
        """The packing of ``rank``'s dp group."""
        return self.packings[self._where(rank)[0]]

    def rows(self, rank: int) -> torch.Tensor:
        """Per local row of ``rank``'s piece, its global row (-1 at padding)."""
        d, c = self._where(rank)
        offset = sum(p.total for p in self.packings[:d])
        token = self.packings[d].token_index(c)
        return torch.where(token >= 0, token + offset, -1)


def packed_shard(x: torch.Tensor, layout: PackedLayout) -> dict[int, torch.Tensor]:
    """The oracle: every rank's piece of the global packed tensor ``x`` ``(total, ...)``,
    cut group by group with :func:`pack_shard`. Differentiable."""
    if x.dim() == 0 or x.shape[0] != layout.total:
        raise MimoFxError(f"packed_shard: x has shape {tuple(x.shape)}; its first dim must be "
                          f"the layout's {layout.total} packed tokens")
    groups = torch.split(x, [p.total for p in layout.packings])
    cut = [pack_shard(g, p) for g, p in zip(groups, layout.packings)]
    out = {}
    for rank in layout.grid.ranks:
        d, c = layout._where(rank)
        out[rank] = cut[d][c]
    return out


def _real_rows(layout: PackedLayout) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
    """Per rank of ``layout``'s grid, the global rows of its real (non-padding) tokens and
    where those sit in its piece."""
    rows, where = {}, {}
    for rank in layout.grid.ranks:
        ids = layout.rows(rank)
        real = ids >= 0
        rows[rank], where[rank] = ids[real].tolist(), torch.nonzero(real).flatten()
    return rows, where


def plan_to_packed(src_rows: Mapping[int, Sequence[int]], layout: PackedLayout):
    """The index plan from src ranks holding global rows (``src_rows``, e.g.
    :func:`mimo_fx.index.layout_rows` of an encoder's layout) to ``layout``, and per rank
    where its received rows go: ``piece = zeros(local_total, ...).index_copy(0,
    where[rank], received)``. Returns ``(plan, where)``."""
    from .index import plan_rows

    dst, where = _real_rows(layout)
    return plan_rows(src_rows, dst, layout.total), where


def plan_from_packed(layout: PackedLayout, dst_rows: Mapping[int, Sequence[int]]):
    """The index plan from ``layout`` back to ranks needing global rows (``dst_rows``, e.g.
    :func:`mimo_fx.index.layout_rows` of a loss layout); a rank's src piece is its real
    rows, ``piece.index_select(0, real[rank])`` (replicas over other axes each hold them;
    the plan sends each row from one). Returns ``(plan, real)``."""
    from .index import plan_rows

    src, real = _real_rows(layout)
    return plan_rows(src, dst_rows, layout.total), real
