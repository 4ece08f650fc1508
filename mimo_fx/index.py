"""Index-mapped bridges: each dst rank receives exactly the rows it needs.

The src side is a tensor of ``n_rows`` global rows (image embeddings, say) cut by rows
over src ranks: ``src_rows[r]`` lists the global rows rank ``r`` holds, in its local
order (encoder DP shards; a row may be held by several ranks, e.g. TP replicas). The dst
side lists, per rank, the global rows it needs in its local order: ``y[r] =
x[dst_rows[r]]``. A row may be needed by several ranks, several times on one rank, or by
none. This is how image tokens go straight to their sequence positions under context
parallelism (:func:`mimo_fx.packed.image_rows` gives the rows), instead of handing every
cp rank all image embeddings and all-reducing their gradient.

:func:`plan_rows` is pure and deterministic (identical on every rank):

- A rank never receives a row it holds itself: it copies it locally.
- Any other needed row reaches a receiver once, however often the receiver uses it, so
  each rank receives exactly its lower bound (its distinct needed rows it does not hold).
- A row held by several src ranks has one *sender*: rows go, heaviest first (most
  receivers), to the holder with the least load so far, ties to the lowest rank.

The backward is the adjoint under DESIGN's rule for replicated src: every holder of a
row gets that row's full gradient (the sum of the cotangents of every dst position it
fed), not a share of it. Each dst rank sums its cotangents per distinct row and sends
that sum to every other holder of the row (to the one holder, for unreplicated rows: the
exact transpose of the forward). Each direction is one uneven ``all_to_all`` over the
ranks of the plan; its per-rank programs (:class:`RankForward`, :class:`RankBackward`)
are part of the plan, so executors decide nothing.

>>> p = plan_rows({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1]}, n_rows=4)
>>> print(p)
IndexPlan: 4 rows over ranks (0, 1); forward all_to_all:
  0 -> 1: rows [1]
  1 -> 0: rows [3]
>>> p.received(), p.lower_bound()
({0: 1, 1: 1}, {0: 1, 1: 1})
>>> p.forward[0].gather  # rank 0's y from cat(its own rows, the rows it receives)
(2, 0, 2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .errors import MimoFxError

__all__ = ["IndexPlan", "RankBackward", "RankForward", "Route", "layout_rows", "plan_rows",
           "seed_bytes"]

Rows = torch.Tensor | Sequence[int]
Ints = tuple[int, ...]


@dataclass(frozen=True)
class RankForward:
    """One rank's forward: ``send = x_local[send_index]`` cut by ``send_counts`` (rows per
    peer, in the plan's rank order); it receives ``recv_counts`` rows per peer; then
    ``y = cat(x_local, received)[gather]``."""

    send_index: Ints
    send_counts: Ints
    recv_counts: Ints
    gather: Ints


@dataclass(frozen=True)
class RankBackward:
    """One rank's backward: its dst cotangent summed per distinct row into ``n_unique``
    slots (``unique[k]`` is position ``k``'s slot); slots ``keep`` add to its own src
    rows ``keep_local``; ``send = sums[send_index]`` cut by ``send_counts``; received
    rows add to its src rows ``recv_local``; ``n_src`` rows of src gradient in all."""

    unique: Ints
    n_unique: int
    keep: Ints
    keep_local: Ints
    send_index: Ints
    send_counts: Ints
    recv_counts: Ints
    recv_local: Ints
    n_src: int


@dataclass(frozen=True)
class IndexPlan:
    """Who sends which rows to whom, both directions (see the module docstring)."""

    n_rows: int
    ranks: Ints
    src_rows: tuple[Ints, ...]
    dst_rows: tuple[Ints, ...]
    sender: tuple[int, ...]      # per global row: the rank that sends it, -1 if nobody does
    sends: tuple[tuple[Ints, ...], ...]  # sends[i][j]: rows ranks[i] sends ranks[j], rising
    forward: tuple[RankForward, ...]
    backward: tuple[RankBackward, ...]

    def index(self, rank: int) -> int:
        """The position of ``rank`` in :attr:`ranks`."""
        if rank not in self.ranks:
            raise MimoFxError(f"rank {rank} takes no part in this plan; its ranks are "
                              f"{self.ranks}")
        return self.ranks.index(rank)

    def received(self, direction: str = "forward") -> dict[int, int]:
        """Rows each rank receives in ``direction`` ("forward" or "backward")."""
        steps = self.steps(direction)
        return {r: sum(s.recv_counts) for r, s in zip(self.ranks, steps)}

    def sent(self, direction: str = "forward") -> dict[int, int]:
        """Rows each rank sends in ``direction``."""
        steps = self.steps(direction)
        return {r: sum(s.send_counts) for r, s in zip(self.ranks, steps)}

    def lower_bound(self) -> dict[int, int]:
        """Per rank, the distinct rows it needs and does not hold: what any scheme must
        bring it forward."""
        return {r: len(set(d) - set(s))
                for r, s, d in zip(self.ranks, self.src_rows, self.dst_rows)}

    def bytes(self, row_bytes: int) -> dict[int, dict[str, int]]:
        """Bytes each rank sends and receives, per direction, for rows of ``row_bytes``."""
        out: dict[int, dict[str, int]] = {}
        for direction in ("forward", "backward"):
            for kind, count in (("sent", self.sent), ("received", self.received)):
                for r, n in count(direction).items():
                    out.setdefault(r, {})[f"{direction}_{kind}"] = n * row_bytes
        return out

    def route(self, rank: int, device: torch.device | str | None = None) -> Route:
        """``rank``'s programs as tensors (see :class:`Route`), indices on ``device``."""
        i = self.index(rank)
        f, b = self.forward[i], self.backward[i]
        # the rank's own rows take the all_to_all's self split: the dst piece is then one
        # gather of the received rows, and the src gradient one scatter-add of them
        own = sorted({k for k in f.gather if k < b.n_src})
        where = {k: n for n, k in enumerate(own)}
        at = sum(f.send_counts[:i])
        send = (*f.send_index[:at], *own, *f.send_index[at:])
        before = sum(f.recv_counts[:i])  # rows from lower ranks come before the own ones
        gather = tuple(before + where[k] if k < b.n_src
                       else k - b.n_src + (len(own) if k - b.n_src >= before else 0)
                       for k in f.gather)
        fsend = (*f.send_counts[:i], len(own), *f.send_counts[i + 1:])
        frecv = (*f.recv_counts[:i], len(own), *f.recv_counts[i + 1:])
        at, before = sum(b.send_counts[:i]), sum(b.recv_counts[:i])
        bsend_index = (*b.send_index[:at], *b.keep, *b.send_index[at:])
        recv_local = (*b.recv_local[:before], *b.keep_local, *b.recv_local[before:])
        bsend = (*b.send_counts[:i], len(b.keep), *b.send_counts[i + 1:])
        brecv = (*b.recv_counts[:i], len(b.keep), *b.recv_counts[i + 1:])
        index = tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in (
            send, gather, b.unique, bsend_index, recv_local))
        for t in index:  # any length, 0 and 1 too, without a recompile
            torch._dynamo.decorators.mark_unbacked(t, 0)
        counts = (*fsend, *frecv, *bsend, *brecv, b.n_unique, b.n_src)
        return Route(self.ranks, index, torch.tensor(counts, dtype=torch.int64))

    def steps(self, direction: str) -> tuple:
        """Every rank's program for ``direction``, in :attr:`ranks` order."""
        if direction not in ("forward", "backward"):
            raise MimoFxError(f"direction must be 'forward' or 'backward', got "
                              f"{direction!r}")
        return self.forward if direction == "forward" else self.backward

    def __str__(self) -> str:
        lines = [f"IndexPlan: {self.n_rows} rows over ranks {self.ranks}; forward all_to_all:"]
        for i, src in enumerate(self.ranks):
            for j, dst in enumerate(self.ranks):
                if self.sends[i][j]:
                    lines.append(f"  {src} -> {dst}: rows {list(self.sends[i][j])}")
        if len(lines) == 1:
            lines.append("  (nothing moves)")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class Route:
    """One rank's part of a plan as tensors: the input a compiled step takes per call, so
    one graph serves every plan (the indices are graph inputs, the counts become symbolic
    ints) instead of one graph per plan with the indices baked in.

    The rank's :class:`RankForward` and :class:`RankBackward` with one change: the rows it
    holds itself travel through the ``all_to_all``'s self split (a local copy, no
    traffic), so the dst piece is one gather of the received rows and the src gradient one
    scatter-add of them, with no concatenation (whose buffer a compiler would have to
    size before the counts are known).

    ``index``: int64 vectors: the forward's ``send_index`` and ``gather`` (into the
    received rows), the backward's ``unique``, ``send_index`` and ``recv_local``.
    ``counts``: one int64 CPU vector, the forward's send and receive counts, the
    backward's send and receive counts (one per rank of ``ranks`` each, the rank's own
    split included), then ``n_unique`` and ``n_src`` (the rows of its src piece).
    The index vectors' lengths are marked unbacked for ``torch.compile``, so no length
    (not even 0 or 1) is specialised on.
    """

    ranks: Ints
    index: tuple[torch.Tensor, ...]
    counts: torch.Tensor

    def split(self, counts: Sequence) -> tuple[Sequence, Sequence, Sequence, Sequence,
                                               object, object]:
        """``counts`` (this route's counts as Python or symbolic ints) as forward send,
        forward receive, backward send, backward receive, ``n_unique``, ``n_src``."""
        n = len(self.ranks)
        return (counts[:n], counts[n:2 * n], counts[2 * n:3 * n], counts[3 * n:4 * n],
                counts[4 * n], counts[4 * n + 1])


# -- one rank's steps on a route (shared by every executor) ------------------------------
def forward_send(route_index: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The rows this rank sends, peer by peer (itself included)."""
    return x.index_select(0, route_index[0])


def forward_take(route_index: Sequence[torch.Tensor], got: torch.Tensor) -> torch.Tensor:
    """This rank's dst piece from the rows it received (its own among them)."""
    return got.index_select(0, route_index[1])


def backward_send(route_index: Sequence[torch.Tensor], g: torch.Tensor, n_unique
                  ) -> torch.Tensor:
    """The dst cotangent summed per distinct row, the sums this rank sends (to itself
    too: the rows it holds)."""
    sums = g.new_zeros((n_unique, *g.shape[1:])).index_add_(0, route_index[2], g)
    return sums.index_select(0, route_index[3])


def backward_take(route_index: Sequence[torch.Tensor], got: torch.Tensor, n_src
                  ) -> torch.Tensor:
    """This rank's src gradient: the sums it received, added at their rows."""
    return got.new_zeros((n_src, *got.shape[1:])).index_add_(0, route_index[4], got)


def check_piece(want: int, who: str, x: object) -> None:
    """Raise unless ``x`` is a src piece of ``want`` rows, ``(want, *row_shape)``; ``who``
    names the rank ("rank 3")."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != want:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else x
        raise MimoFxError(f"{who} holds {want} src rows under this plan, so its src piece "
                          f"must be ({want}, *row_shape); got {shape} (a rank without src "
                          f"rows passes an empty (0, *row_shape) tensor)")


def seed_bytes(n_rows: int, cp_ranks: Sequence[int], row_bytes: int,
               held: Mapping[int, int] | None = None) -> dict[str, int]:
    """Bytes the replicate-then-all-reduce scheme moves, summed over ranks: every cp rank
    receives all ``n_rows`` (less the rows it ``held``), the backward all-reduces the
    whole ``(n_rows, ...)`` gradient over cp (a ring: each rank receives
    ``2*(cp-1)/cp`` of it), then returns each row's gradient to one src holder."""
    held = held or {}
    cp = len(cp_ranks)
    forward = sum(n_rows - held.get(r, 0) for r in cp_ranks)
    reduce = 2 * (cp - 1) * n_rows
    back = n_rows - sum(held.get(r, 0) for r in cp_ranks)
    return {"forward": forward * row_bytes, "backward": (reduce + back) * row_bytes}


# -- rows of a layout -------------------------------------------------------------------
def layout_rows(layout, sizes: Mapping[str, object], rows: Sequence[str]
                ) -> dict[int, list[int]]:
    """Per holder of ``layout``, the global rows its local tensor holds, in local order:
    the src side of an index plan from a dense or ragged layout (an encoder's
    ``(dp b) s h``, or ``(dp t) h`` with ``ragged="dp"``).

    ``rows`` are the layout's leading dims, flattened row-major into global row ids (row
    ``b * S + s`` for ``("b", "s")``); the rest are a row's features and must not be cut
    (an index plan moves whole rows: redistribute to a layout with whole rows first).
    ``sizes`` gives every dim's size (a ragged dim's: its counts). TP replicas list the
    same rows; a plan then sends each from one of them and returns its gradient to each.
    """
    from .layout import Layout
    from .regions import Tiling, total

    if not isinstance(layout, Layout):
        raise MimoFxError(f"layout_rows needs a Layout, got {layout!r}")
    rows = (rows,) if isinstance(rows, str) else tuple(rows)
    dims = layout.dims
    if not rows or dims[:len(rows)] != rows:
        raise MimoFxError(f"layout_rows: rows={rows} must be the leading dims of "
                          f"{layout.describe()!r}, whose dims are {dims}")
    missing = [d for d in dims if d not in sizes]
    if missing:
        raise MimoFxError(f"layout_rows: give the size of every dim of "
                          f"{layout.describe()!r}; missing {missing}")
    cut = [d for d in dims[len(rows):] if layout.sharding[d]]
    if cut or layout.partial:
        raise MimoFxError(f"layout_rows: {layout.describe()!r} cuts a row's features "
                          f"{cut or ''}{' (partial)' if layout.partial else ''}; an index "
                          f"plan moves whole rows, so redistribute to a layout that keeps "
                          f"{list(dims[len(rows):])} whole first")
    tiling = Tiling.of(layout, dims, {d: sizes[d] for d in dims})  # type: ignore[misc]
    extents = [total(sizes[d]) for d in rows]  # type: ignore[arg-type]
    out = {}
    for rank in layout.holders:
        ids = torch.zeros((), dtype=torch.int64)
        for extent, segments in zip(extents, tiling.segments(rank)[:len(rows)]):
            held = torch.cat([torch.arange(a, b) for a, b in segments]) if segments \
                else torch.zeros(0, dtype=torch.int64)
            ids = (ids.unsqueeze(-1) * extent + held).flatten()
        out[rank] = ids.tolist()
    return out


# -- the planner --------------------------------------------------------------------------
def plan_rows(src_rows: Mapping[int, Rows], dst_rows: Mapping[int, Rows],
              n_rows: int) -> IndexPlan:
    """The plan moving the rows ``dst_rows`` needs from the ranks ``src_rows`` says hold
    them (both ``{rank: global rows in local order}``; a rank missing from one mapping
    holds, or needs, nothing)."""
    n = _check_n_rows(n_rows)
    src = {r: _check_rows(rows, n, f"src_rows[{r}]") for r, rows in _check_map(
        src_rows, "src_rows").items()}
    dst = {r: _check_rows(rows, n, f"dst_rows[{r}]") for r, rows in _check_map(
        dst_rows, "dst_rows").items()}
    ranks = tuple(sorted(set(src) | set(dst)))
    srcs = tuple(src.get(r, ()) for r in ranks)
    dsts = tuple(dst.get(r, ()) for r in ranks)
    _check_src_distinct(ranks, srcs)
    holders = _holders(ranks, srcs, n)
    _check_held(ranks, dsts, holders)
    sender = _choose_senders(ranks, srcs, dsts, holders, n)
    sends = tuple(tuple(tuple(sorted({g for g in dsts[j] if sender[g] == s
                                      and g not in set(srcs[j])}))
                        for j in range(len(ranks))) for s in ranks)
    forward = tuple(_rank_forward(i, srcs, dsts, sends) for i in range(len(ranks)))
    backward = tuple(_rank_backward(i, ranks, srcs, dsts, holders)
                     for i in range(len(ranks)))
    return IndexPlan(n, ranks, srcs, dsts, sender, sends, forward, backward)


def _holders(ranks: Ints, srcs: tuple[Ints, ...], n: int) -> list[list[int]]:
    """Per global row, the ranks holding it, rising."""
    holders: list[list[int]] = [[] for _ in range(n)]
    for r, rows in zip(ranks, srcs):
        for g in rows:
            holders[g].append(r)
    return holders


def _choose_senders(ranks: Ints, srcs: tuple[Ints, ...], dsts: tuple[Ints, ...],
                    holders: list[list[int]], n: int) -> tuple[int, ...]:
    """One sender per row some rank needs and lacks: heaviest rows first, each to the
    holder that has the least to send so far (ties: lowest rank)."""
    weight = [0] * n
    for need, have in zip(dsts, srcs):
        for g in set(need) - set(have):
            weight[g] += 1
    load = dict.fromkeys(ranks, 0)
    sender = [-1] * n
    for g in sorted(range(n), key=lambda g: (-weight[g], g)):
        if weight[g]:
            s = min(holders[g], key=lambda r: (load[r], r))
            sender[g] = s
            load[s] += weight[g]
    return tuple(sender)


def _rank_forward(i: int, srcs: tuple[Ints, ...], dsts: tuple[Ints, ...],
                  sends: tuple[tuple[Ints, ...], ...]) -> RankForward:
    local = {g: k for k, g in enumerate(srcs[i])}
    send_index = tuple(local[g] for rows in sends[i] for g in rows)
    recv = [g for s in range(len(sends)) for g in sends[s][i]]  # arrival order
    where = {g: len(srcs[i]) + k for k, g in enumerate(recv)}
    where.update(local)  # a row held here is taken from here
    return RankForward(send_index, tuple(len(rows) for rows in sends[i]),
                       tuple(len(sends[s][i]) for s in range(len(sends))),
                       tuple(where[g] for g in dsts[i]))


def _rank_backward(i: int, ranks: Ints, srcs: tuple[Ints, ...], dsts: tuple[Ints, ...],
                   holders: list[list[int]]) -> RankBackward:
    """Rank ``i`` sends each distinct row it used to every other holder of the row and
    adds what it is sent (and its own uses of rows it holds) to its src gradient."""
    distinct = sorted(set(dsts[i]))
    slot = {g: k for k, g in enumerate(distinct)}
    local = {g: k for k, g in enumerate(srcs[i])}
    keep = tuple(slot[g] for g in distinct if g in local)
    to = [[g for g in distinct if ranks[j] in holders[g] and j != i]
          for j in range(len(ranks))]
    came = [[g for g in sorted(set(dsts[j])) if ranks[i] in holders[g] and j != i]
            for j in range(len(ranks))]
    return RankBackward(
        unique=tuple(slot[g] for g in dsts[i]), n_unique=len(distinct), keep=keep,
        keep_local=tuple(local[distinct[k]] for k in keep),
        send_index=tuple(slot[g] for rows in to for g in rows),
        send_counts=tuple(len(rows) for rows in to),
        recv_counts=tuple(len(rows) for rows in came),
        recv_local=tuple(local[g] for rows in came for g in rows), n_src=len(srcs[i]))


# -- validation ---------------------------------------------------------------------------
def _check_n_rows(n_rows: object) -> int:
    if isinstance(n_rows, bool) or not isinstance(n_rows, int) or n_rows < 0:
        raise MimoFxError(f"n_rows must be a row count >= 0 (the global rows of the src "
                          f"tensor), got {n_rows!r}")
    return n_rows


def _check_map(rows: object, what: str) -> Mapping[int, object]:
    if not isinstance(rows, Mapping):
        raise MimoFxError(f"{what} must map each rank to its global rows, e.g. "
                          f"{{0: [0, 1], 1: [2]}}; got {rows!r}")
    for r in rows:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise MimoFxError(f"{what} has key {r!r}; keys are ranks (integers >= 0)")
    return rows


def _check_rows(rows: object, n: int, what: str) -> Ints:
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.is_floating_point() or rows.is_complex() \
                or rows.dtype == torch.bool:
            raise MimoFxError(f"{what} must be a 1-D integer tensor of global rows, got "
                              f"dtype {rows.dtype} and shape {tuple(rows.shape)}")
        rows = rows.tolist()
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise MimoFxError(f"{what} must be a sequence of global rows, got {rows!r}")
    out = tuple(rows)
    bad = [g for g in out if isinstance(g, bool) or not isinstance(g, int)
           or not 0 <= g < n]
    if bad:
        raise MimoFxError(f"{what} has {bad[:8]}: rows must be integers in 0..{n - 1} "
                          f"(n_rows = {n})")
    return out


def _check_src_distinct(ranks: Ints, srcs: tuple[Ints, ...]) -> None:
    for r, rows in zip(ranks, srcs):
        if len(set(rows)) != len(rows):
            twice = sorted({g for g in rows if rows.count(g) > 1})
            raise MimoFxError(f"src_rows[{r}] lists rows {twice} more than once; a rank "
                              f"holds each of its rows once (a replica lives on another "
                              f"rank)")


def _check_held(ranks: Ints, dsts: tuple[Ints, ...], holders: list[list[int]]) -> None:
    for r, rows in zip(ranks, dsts):
        orphans = sorted({g for g in rows if not holders[g]})
        if orphans:
            raise MimoFxError(f"dst_rows[{r}] needs rows {orphans[:8]} that no src rank "
                              f"holds; every needed row must appear in some src_rows")
