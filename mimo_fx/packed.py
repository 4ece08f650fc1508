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
grid: a layout ``redistribute`` moves rows into and out of (``mimo_fx.reference.shard``
is its oracle).
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

from .constants import constant
from .errors import MimoFxError
from .grid import Grid, is_mesh
from .layout import Layout

__all__ = ["ImageRows", "PackedLayout", "PackedStructure", "Packing", "image_rows",
           "is_layout", "not_a_layout", "pack_shard", "pack_unshard"]


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
        # a token's sequence: how many blocks end at or before it, as a running count of
        # the block ends (not searchsorted or repeat_interleave, which split even a few
        # thousand tokens over the thread pool: milliseconds on a busy machine)
        ended = torch.zeros(self.local_total + 1, dtype=torch.int64)
        seq = ended.index_add_(0, ends, torch.ones_like(ends))[:-1].cumsum(0)
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
def _axis_names(grid, cp: str | None, dp: str | None) -> tuple[str, str]:
    """The cp and dp axis names: a name given must be an axis of ``grid`` (else every
    rank would silently hold every row); left out, ``"cp"`` and ``"dp"``, which a grid
    may lack (one group, no cut).

    >>> _axis_names(Grid(sp=2, dp=2), "sp", None)
    ('sp', 'dp')
    >>> _axis_names(Grid(cp=2, dp=2), "sp", None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mimo_fx.errors.MimoFxError: PackedLayout cp='sp' is not an axis of Grid(cp=2, dp=2) ...
    """
    if isinstance(grid, Grid):
        for what, name, default in (("cp", cp, "cp"), ("dp", dp, "dp")):
            role = ("cuts each packed sequence" if what == "cp" else
                    "splits the batch into groups")
            if name is not None and (not isinstance(name, str) or name not in grid.names):
                names = [a for a in grid.names if a != (dp if what == "cp" else cp)]
                raise MimoFxError(
                    f"PackedLayout {what}={name!r} is not an axis of {grid!r} (its axes: "
                    f"{', '.join(grid.names)}); name the axis that {role}"
                    + (f" ({what}={names[0]!r})" if names else "")
                    + f", or leave {what} out for the default {default!r} (no "
                    + ("cut" if what == "cp" else "split")
                    + " where the grid has no such axis)")
    cp, dp = cp or "cp", dp or "dp"
    if cp == dp:
        raise MimoFxError(f"PackedLayout cp={cp!r} and dp={dp!r} name the same axis; the "
                          f"sequence's cut and the batch's groups are different axes")
    return cp, dp


@constant
@dataclass(frozen=True)
class PackedStructure:
    """What a :class:`PackedLayout` is apart from its batch: the part a bridge is built
    for (one bridge serves every batch; a constant to ``torch.compile``)."""

    grid: Grid
    pattern: str
    zigzag: bool
    cp: str
    dp: str
    selected: bool  # only some tokens (PackedLayout.select)


@dataclass(frozen=True, eq=False, init=False)
class PackedLayout:
    """Packed sequences over a grid: dp group ``d`` packs its samples (``lengths[d]``)
    into one sequence, cut over the ``cp`` axis per sequence (:class:`Packing`); every
    other axis replicates.

    ``pattern`` names the dims: the first (a name, or a parenthesised group flattened
    row-major) is the packed token dim, the others a token's features, whole on every
    rank (``"t h"``). The global tensor is every group's unpadded packed tokens, group
    after group (sample order, as an encoder's ``(dp b) s h`` flattens, or a ragged
    ``(dp t) h``): global row ``offset[d] + i`` is token ``i`` of group ``d``'s packing. A
    rank's piece is its cp rank's storage of its group's packing, ``(packing.local_total,
    ...)``, zero at padding. A grid without a ``dp`` (or ``cp``) axis has one group (or
    cp = 1). :meth:`select` keeps only some tokens (image tokens, say).

    It is a row layout (:mod:`mimo_fx.rows`): ``redistribute(x, src, packed)`` moves rows
    into it, and ``redistribute(y, packed, dst)`` out of it.

    >>> from mimo_fx import Grid
    >>> lay = PackedLayout(Grid(cp=2, dp=2), "t h", [[3], [2, 1]], zigzag=False)
    >>> {r: lay.rows(r).tolist() for r in range(4)}
    {0: [0, 1], 1: [2, -1], 2: [3, 5], 3: [4, -1]}
    >>> img = lay.select([4, 0])       # global row j of img is token [4, 0][j]
    >>> {r: img.rows(r).tolist() for r in range(4)}, img.positions(3).tolist()
    ({0: [1], 1: [], 2: [], 3: [0]}, [0])
    """

    structure: PackedStructure
    lengths: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...] | None  # the selected tokens (global rows), or None: all
    packings: tuple[Packing, ...]   # per dp group
    data: torch.Tensor              # the batch as one int64 vector (see from_data)
    values: tuple[int, ...]         # data's ints

    def __init__(self, grid, pattern: str, lengths: Sequence[Sequence[int]],
                 zigzag: bool = True, *, cp: str | None = None,
                 dp: str | None = None) -> None:
        if is_mesh(grid):  # a DeviceMesh: its grid (see Grid.from_mesh)
            grid = Grid.from_mesh(grid)
        cp, dp = _axis_names(grid, cp, dp)
        self._build(grid, pattern, lengths, zigzag, cp, dp, None)

    def _build(self, grid, pattern, lengths, zigzag, cp, dp, tokens) -> None:
        if is_mesh(grid):  # a DeviceMesh: its grid (see Grid.from_mesh)
            grid = Grid.from_mesh(grid)
        if not isinstance(grid, Grid):
            raise MimoFxError(f"PackedLayout needs a Grid, got {grid!r}")
        groups = grid.axis_size(dp) if dp in grid.names else 1
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) \
                or len(lengths) != groups:
            raise MimoFxError(f"PackedLayout lengths must give one list of sample lengths "
                              f"per {dp} group ({groups} of them), got {lengths!r}")
        if not isinstance(zigzag, bool):
            raise MimoFxError(f"PackedLayout zigzag must be True or False, got {zigzag!r}")
        structure = PackedStructure(grid, _check_pattern(pattern), zigzag, cp, dp,
                                    tokens is not None)
        set_ = object.__setattr__
        set_(self, "structure", structure)
        set_(self, "lengths", tuple(_check_lengths(g) for g in lengths))
        n_cp = grid.axis_size(cp) if cp in grid.names else 1
        set_(self, "packings", tuple(Packing(g, n_cp, zigzag) for g in self.lengths))
        set_(self, "tokens", tokens)
        data = [len(self.lengths), *(len(g) for g in self.lengths),
                *(n for g in self.lengths for n in g), *(tokens or ())]
        tensor = torch.tensor(data, dtype=torch.int64)
        # a new batch is new data, not a new graph: no length of it is specialised on
        torch._dynamo.decorators.mark_unbacked(tensor, 0)
        set_(self, "data", tensor)
        set_(self, "values", tuple(data))  # (the same, on the host: read without a tensor)

    @staticmethod
    def from_data(structure: PackedStructure, data: Sequence[int]) -> PackedLayout:
        """The layout of ``structure`` whose :attr:`data` is ``data`` (as ints)."""
        groups = data[0]
        counts = data[1:1 + groups]
        at = 1 + groups
        lengths = []
        for n in counts:
            lengths.append(tuple(data[at:at + n]))
            at += n
        out = PackedLayout.__new__(PackedLayout)
        tokens = tuple(data[at:]) if structure.selected else None
        s = structure
        out._build(s.grid, s.pattern, lengths, s.zigzag, s.cp, s.dp, tokens)
        return out

    def select(self, tokens: Sequence[int] | torch.Tensor) -> PackedLayout:
        """The same batch holding only ``tokens`` (global rows of this layout, e.g. the
        image tokens): global row ``j`` of the result is token ``tokens[j]``; each rank
        holds the selected tokens its chunks hold, in storage order, and no padding
        (:meth:`positions` says where they sit in its full storage)."""
        if self.tokens is not None:
            raise MimoFxError("select() of a layout that is already a selection: select "
                              "from the full PackedLayout")
        picked = _check_tokens(tokens, self.total)
        s = self.structure
        out = PackedLayout.__new__(PackedLayout)
        out._build(s.grid, s.pattern, self.lengths, s.zigzag, s.cp, s.dp, picked)
        return out

    # -- the layout interface ------------------------------------------------------------
    @property
    def grid(self) -> Grid:
        return self.structure.grid

    @property
    def pattern(self) -> str:
        return self.structure.pattern

    @property
    def dims(self) -> tuple[str, ...]:
        """The logical dims: the token dim's names, then the features."""
        return tuple(_pattern_dims(self.pattern)[0] + _pattern_dims(self.pattern)[1])

    @property
    def row_dims(self) -> tuple[str, ...]:
        """The dims the rows flatten (the first pattern group)."""
        return tuple(_pattern_dims(self.pattern)[0])

    @property
    def local_dims(self) -> tuple[tuple[str, ...], ...]:
        """The local tensor's dims: the token dim (its names), then each feature."""
        rows, features = _pattern_dims(self.pattern)
        return (tuple(rows), *((f,) for f in features))

    @property
    def ragged_dims(self) -> tuple[str, ...]:
        """None: a packed batch's token count is its data, not a size."""
        return ()

    @property
    def holders(self) -> tuple[int, ...]:
        return tuple(self.grid.ranks)

    def holds(self, rank: int) -> bool:
        return rank in self.grid

    @property
    def partial(self) -> tuple[str, ...]:
        """None: a packed batch holds values, never partial sums."""
        return ()

    @property
    def replicated(self) -> tuple[str, ...]:
        """Axes over which every rank holds the same rows (all but dp and cp)."""
        return tuple(a for a in self.grid.names if a not in (self.structure.cp,
                                                              self.structure.dp))

    def describe(self) -> str:
        what = f"{len(self.tokens)} selected tokens of " if self.tokens is not None else ""
        zig = "zigzag" if self.structure.zigzag else "contiguous"
        return (f"{self.pattern} ({what}packed sequences over {self.structure.dp} x "
                f"{self.structure.cp}, {zig})")

    def __repr__(self) -> str:
        sel = f".select({list(self.tokens)})" if self.tokens is not None else ""
        return (f"PackedLayout({self.grid!r}, {self.pattern!r}, "
                f"{[list(g) for g in self.lengths]}, zigzag={self.structure.zigzag})" + sel)

    @property
    def total(self) -> int:
        """Tokens of the packed batch (every group's, unpadded)."""
        return sum(p.total for p in self.packings)

    @property
    def n_rows(self) -> int:
        """Rows of the global tensor: every token, or the selected ones."""
        return self.total if self.tokens is None else len(self.tokens)

    def _where(self, rank: int) -> tuple[int, int]:
        if rank not in self.grid:
            raise MimoFxError(f"rank {rank} is not in this PackedLayout's grid {self.grid}")
        coord = self.grid.coord(rank)
        return coord.get(self.structure.dp, 0), coord.get(self.structure.cp, 0)

    def packing(self, rank: int) -> Packing:
        """The packing of ``rank``'s dp group."""
        return self.packings[self._where(rank)[0]]

    def _token_rows(self, rank: int) -> torch.Tensor:
        """Per local token of ``rank``'s storage, its token (global row of the full
        layout), -1 at padding."""
        d, c = self._where(rank)
        offset = sum(p.total for p in self.packings[:d])
        token = self.packings[d].token_index(c)
        return torch.where(token >= 0, token + offset, -1)

    def rows(self, rank: int) -> torch.Tensor:
        """Per local row of ``rank``'s piece, its global row (-1 at padding)."""
        tokens = self._token_rows(rank)
        if self.tokens is None:
            return tokens
        where = self._selected_at(tokens)
        return where[where >= 0]

    # -- as a side of a row plan (the protocol mimo_fx.rows.BoxRows lists) ---------------
    def row_map(self, sizes: Mapping[str, object], rows: tuple[str, ...]
                ) -> dict[int, list[int]]:
        """Per rank, the global row of each local row (its batch's: no size needed)."""
        return {r: self.rows(r).tolist() for r in self.holders}

    def check_side(self, rows: tuple[str, ...]) -> None:
        """Nothing to check: a packed layout holds whole rows by construction."""

    def count_rows(self, sizes: dict, rows: tuple[str, ...]) -> dict:
        """``sizes`` with the row dim's size this batch gives (one row dim), checked
        against the batch's rows: the row dims' sizes must multiply to :attr:`n_rows`."""
        out = dict(sizes)
        if len(rows) == 1 and rows[0] not in out:
            out[rows[0]] = self.n_rows
        n = 1
        for d in rows:
            if d not in out:
                raise MimoFxError(f"the size of {d!r} is needed: {rows} flatten into the "
                                  f"rows of {self.describe()!r}; give it (e.g. {d}=...)")
            size = out[d]
            n *= sum(size) if isinstance(size, tuple) else size  # type: ignore[arg-type]
        if n != self.n_rows:
            raise MimoFxError(
                f"{self.describe()!r} holds {self.n_rows} rows but the sizes of {rows} give "
                f"{n} ({', '.join(f'{d}={out[d]}' for d in rows)}); both sides must hold the "
                f"same rows")
        return out

    def implied(self, rows: tuple[str, ...]) -> tuple[str, ...]:
        """The row dim whose size every batch gives (its rows), if there is one."""
        return rows if len(rows) == 1 else ()

    def sizes_shown(self, learn_shapes, learn_features) -> dict:
        """What a gather of the holders' local shapes shows: the features (``learn_features()``)."""
        return learn_features()

    def for_call(self, layout: PackedLayout) -> PackedLayout:
        """The side of a call that brings ``layout`` (a batch of this structure): that batch."""
        return layout

    def batch(self) -> list[torch.Tensor]:
        """A call's batch as tensors: its :attr:`data`."""
        return [self.data]

    def batch_values(self) -> list[tuple[int, ...]]:
        """:meth:`batch` as host ints (what an eager call folds in, reading no tensor)."""
        return [self.values]

    def batch_key(self, full: Mapping[str, object], rows: tuple[str, ...]) -> tuple:
        """What makes a call's batch this one: its lengths and selected tokens."""
        return (self.lengths, self.tokens)

    def batch_data(self, flat: list) -> torch.Tensor:
        """A call's batch as one int64 vector: :attr:`data`."""
        return self.data

    def from_batch(self, values: list[int], sizes: dict) -> tuple[PackedLayout, dict]:
        """The batch of this structure whose :attr:`data` is ``values``, and no sizes."""
        return PackedLayout.from_data(self.structure, values), {}

    def positions(self, rank: int) -> torch.Tensor:
        """Where ``rank``'s rows sit in its full packed storage (of ``local_total``
        tokens): all positions, or a selection's (``storage.index_copy(0, positions,
        piece)`` puts a selection's piece in place)."""
        tokens = self._token_rows(rank)
        if self.tokens is None:
            return torch.arange(len(tokens))
        return torch.nonzero(self._selected_at(tokens) >= 0).flatten()

    def _selected_at(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per local token, its row in the selection (-1 if not selected)."""
        assert self.tokens is not None
        pick = torch.full((self.total + 1,), -1, dtype=torch.int64)
        selected = self.data[self.data.numel() - len(self.tokens):]  # (data ends with them)
        pick[selected] = torch.arange(len(self.tokens))
        return pick[torch.where(tokens >= 0, tokens, self.total)]


def _check_pattern(pattern: object) -> str:
    if not isinstance(pattern, str):
        raise MimoFxError(f"PackedLayout pattern must be a string naming the token dim and "
                          f"the features, e.g. 't h'; got {pattern!r}")
    rows, features = _pattern_dims(pattern)
    names = rows + features
    if not rows or len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
        raise MimoFxError(f"PackedLayout pattern {pattern!r} must name the token dim (or a "
                          f"parenthesised group of dims it flattens) and then the features, "
                          f"each once, e.g. 't h' or '(b s) h'")
    first = f"({' '.join(rows)})" if len(rows) > 1 else rows[0]
    return " ".join([first, *features])


def _pattern_dims(pattern: str) -> tuple[list[str], list[str]]:
    text = pattern.strip()
    if text.startswith("("):
        close = text.find(")")
        if close < 0:
            return [], []
        return text[1:close].split(), text[close + 1:].split()
    names = text.split()
    return names[:1], names[1:]


def _check_tokens(tokens: object, total: int) -> tuple[int, ...]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() \
                or tokens.dtype == torch.bool:
            raise MimoFxError(f"select takes a 1-D integer tensor (or list) of tokens, got "
                              f"dtype {tokens.dtype} and shape {tuple(tokens.shape)}")
        out = tuple(tokens.tolist())  # integers already: no check per token
    elif isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise MimoFxError(f"select takes a sequence of tokens (global rows), got {tokens!r}")
    else:
        out = tuple(_int(g, "a selected token", "give token indices") for g in tokens)
    bad = [g for g in out if not 0 <= g < total]
    if bad:
        raise MimoFxError(f"selected tokens {bad[:8]} fall outside the batch's {total} "
                          f"tokens (0..{total - 1})")
    if len(set(out)) != len(out):
        raise MimoFxError(f"selected tokens repeat "
                          f"{sorted({g for g in out if out.count(g) > 1})[:8]}; each "
                          f"global row is one token")
    return out


def is_layout(value: object) -> bool:
    """Whether ``value`` is a :class:`~mimo_fx.layout.Layout` or a :class:`PackedLayout`."""
    return isinstance(value, Layout | PackedLayout)


def not_a_layout(where: str, name: str, value: object) -> str:
    """The message for something that is not a layout where one belongs."""
    example = (f"Layout(Grid(...), {value!r})" if isinstance(value, str)
               else 'Layout(Grid(tp=2, dp=4), "(dp b) s h")')
    return (f"{where}: {name} must be a layout, got {type(value).__name__} {value!r}; build "
            f"one with {example} (a grid and a pattern), or a PackedLayout for a packed "
            f"batch")
