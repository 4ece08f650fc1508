"""Who sends which box to whom in an exchange, computed one rank at a time.

An exchange gives every holder of ``want`` (a tiling over the dst grid) the part of its
region it does not hold under ``hold`` (a tiling over the src grid). Both regions are
products of per-dim interval lists, so everything here is arithmetic on per-dim *owner*
indices (see :class:`~mimo_fx.regions.DimTiling`), never a search over other ranks:

- :meth:`Geometry.receives` cuts each box a rank wants at the hold tiling's bounds; every
  piece it lacks comes from one holder of its *cell* (one hold interval per dim).
- :meth:`Geometry.sends` walks the other way: for each cell a rank holds, the want
  tiling's owners meeting it are the cell's *readers*; the rank keeps the readers whose
  rule names it.

The sender rule, which both sides evaluate from coordinates alone:

1. a reader that holds src takes the piece from its *own replica* (the holder with its
   free coordinates): colocated exchanges then pair up into all-gathers, and a rank that
   holds a piece is never sent it;
2. any other reader takes it from replica ``(i + o) mod k`` of the cell's ``k`` holders,
   ``i`` being the reader's index among the cell's readers (free axes fastest, then the
   per-dim owner offsets) and ``o`` the cell's index among the cells its holders hold.
   Consecutive readers of a cell land on different holders whatever the grids' strides,
   so the holders of a cell share its readers evenly.

Each piece has one sender, so every receiver gets exactly what it lacks once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product
from math import prod
from operator import itemgetter

from .collective import Collective
from .regions import Box, DimTiling, Interval, Tiling, _canonical

__all__ = ["Transfer", "Geometry", "want_holders"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``src`` sends ``box`` (canonical dim order) to ``dst``."""

    src: int
    dst: int
    box: Box


Piece = tuple[Interval, Interval, int]  # (piece, the tiling interval holding it, its owner)


class Geometry:
    """The two tilings of an exchange and the grid arithmetic between them.

    ``kept`` are partial axes dst keeps: a piece then comes from the holder with the
    receiver's own coordinate on them. Remembers the per-dim lookups it made (bounded by
    the owners asked about), so one geometry serves a whole plan or one rank's part.
    """

    def __init__(self, hold: Tiling, want: Tiling, kept: tuple[str, ...] = ()) -> None:
        src, dst = hold.grid, want.grid
        self.hold, self.want = hold, want
        self.kept = tuple((src.axis_index(a), dst.axis_index(a)) for a in kept)
        free = [src.axis_index(a) for a in hold.free_axes if a not in kept]
        self.src_free = tuple((k, src.sizes[k], src.strides[k]) for k in free)
        self.replicas = prod(src.sizes[k] for k in free)
        self.shifts = [_mixed_offset(j, self.src_free) for j in range(self.replicas)]
        free = [dst.axis_index(a) for a in want.free_axes if a not in kept]
        self.dst_free = tuple((k, dst.sizes[k], dst.strides[k]) for k in free)
        self.src_base = src.offset + sum(i * src.strides[k] for k, i in hold._positions[1])
        self.dst_base = dst.offset + sum(i * dst.strides[k] for k, i in want._positions[1])
        # (stride, size) of every axis owning a dim of hold: a rank's coordinates on them
        # times strides is what its replicas' ranks differ by from its own
        self.owning = tuple((stride, n) for axes in hold._digits for stride, n, _ in axes)
        self._spans: dict[tuple[int, Interval], tuple[int, int]] = {}
        self._readable: dict[tuple[int, int], range | tuple[int, ...]] = {}

    def _owning_part(self, rank: int) -> int:
        """The part of ``rank`` (on the src grid) its coordinates on owning axes make."""
        local = rank - self.hold.grid.offset
        return sum((local // stride) % n * stride for stride, n in self.owning)

    # -- what a rank receives --------------------------------------------------------------
    def receives(self, rho: int) -> list[Transfer]:
        """What ``rho`` receives, in plan order: its wanted boxes in order, each cut at the
        hold tiling's bounds, less what it holds."""
        want, hold = self.want, self.hold
        if not want.holds(rho):
            return []
        wanted = want.owners(rho)
        segments = [t.owned(o) for t, o in zip(want.tilings, wanted)]
        if not all(segments):
            return []
        own = hold.owners(rho) if hold.holds(rho) else None
        cuts = [[[(p, w, o, hold.offset(d, o), own is not None and o == own[d])
                  for p, w, o in t.split(*seg)] for seg in segs]
                for d, (t, segs) in enumerate(zip(hold.tilings, segments))]
        base = rho - self._owning_part(rho) if own is not None else 0
        out = []
        for cell in product(*cuts):
            for pieces in product(*cell):
                if own is None:
                    sender = self._rule_sender(rho, wanted, pieces)
                elif all(map(_IS_OWN, pieces)):
                    continue  # it holds this piece
                else:
                    sender = base + sum(map(_OFFSET, pieces))
                out.append(Transfer(sender, rho, tuple(map(_PIECE, pieces))))
        return out

    def _rule_sender(self, rho: int, wanted: tuple[int, ...], pieces) -> int:
        """The holder a reader that holds no src takes a piece from (rule 2)."""
        coord = self.want.grid.coord_tuple(rho)
        src_strides = self.hold.grid.strides
        base = self.src_base + sum(map(_OFFSET, pieces)) + sum(
            coord[d] * src_strides[k] for k, d in self.kept)
        if self.replicas == 1:
            return base
        cell = tuple(p[1] for p in pieces)
        index = self._reader_index(coord, wanted, cell)
        ordinal = self._ordinal(tuple(p[2] for p in pieces), cell)
        return base + self.shifts[(index + ordinal) % self.replicas]

    def _reader_index(self, coord: tuple[int, ...], wanted: tuple[int, ...],
                      cell: tuple[Interval, ...]) -> int:
        """The reader's index among the readers of ``cell``: its free coordinates, then
        per dim its owner's offset from the cell's least reading owner."""
        index, radix = 0, 1
        for k, n, _ in self.dst_free:
            index += coord[k] * radix
            radix *= n
        for d, interval in enumerate(cell):
            lo, hi = self._span(d, interval)
            index += (wanted[d] - lo) * radix
            radix *= hi - lo + 1
        return index

    def _span(self, d: int, interval: Interval) -> tuple[int, int]:
        key = (d, interval)
        span = self._spans.get(key)
        if span is None:
            span = self._spans[key] = self.want.tilings[d].owner_span(*interval)
        return span

    def _ordinal(self, owners: tuple[int, ...], cell: tuple[Interval, ...]) -> int:
        """The cell's index among the cells its holders hold (their product order)."""
        index = 0
        for t, o, interval in zip(self.hold.tilings, owners, cell):
            held = t.owned(o)
            index = index * len(held) + held.index(interval)
        return index

    def replica(self, rank: int) -> int:
        """``rank``'s index among the replicas of what it holds (its free coordinates)."""
        coord = self.hold.grid.coord_tuple(rank)
        index, radix = 0, 1
        for k, n, _ in self.src_free:
            index += coord[k] * radix
            radix *= n
        return index

    # -- what a rank sends -------------------------------------------------------------------
    def sends(self, s: int) -> list[Transfer]:
        """What ``s`` sends, in plan order: by receiver, then as the receiver lists it."""
        hold = self.hold
        if not hold.holds(s):
            return []
        own = hold.owners(s)
        held = [t.owned(o) for t, o in zip(hold.tilings, own)]
        if not all(held):
            return []
        keyed: list[tuple[tuple[int, ...], Transfer]] = []
        for ordinal, cell in enumerate(product(*held)):
            keyed += self._cell_sends(s, ordinal, cell)
        keyed.sort(key=_KEY)
        return [t for _, t in keyed]

    def _cell_sends(self, s: int, ordinal: int,
                    cell: tuple[Interval, ...]) -> list[tuple[tuple[int, ...], Transfer]]:
        """``(order key, transfer)`` for every reader of ``cell`` that takes it from ``s``."""
        want = self.want
        readers = [[(o, want.offset(d, o), entries) for o, entries in _by_owner(t, iv)]
                   for d, (t, iv) in enumerate(zip(want.tilings, cell))]
        coord = self.hold.grid.coord_tuple(s)
        base = self.dst_base + sum(coord[k] * want.grid.strides[d] for k, d in self.kept)
        free = [(_mixed_offset(j, self.dst_free), j)
                for j in range(prod(n for _, n, _ in self.dst_free))]
        rule = (self.replica(s), ordinal, [self._span(d, iv) for d, iv in enumerate(cell)])
        mine = s - self._owning_part(s)
        out = []
        for combo in product(*readers):
            offset = base + sum(map(_OFFSET_OF_READER, combo))
            for shift, j in free:
                rho = offset + shift
                if not self._picks(rho, s, mine, combo, j, rule):
                    continue
                for pieces in product(*map(_ENTRIES, combo)):
                    box = tuple(map(_PIECE, pieces))
                    key = (rho, *(w[0] for _, w in pieces), *(p[0] for p in box))
                    out.append((key, Transfer(s, rho, box)))
        return out

    def _picks(self, rho: int, s: int, mine: int, combo, free_index: int, rule) -> bool:
        """Whether reader ``rho`` takes the cell ``s`` holds from ``s``: by rule 1 when it
        holds src (its replica of ``s``, ``mine`` less the owning part, is ``s``'s), else by
        rule 2."""
        hold = self.hold
        if rho in hold.grid:
            base = rho - self._owning_part(rho)
            if base == mine:
                return rho != s  # same free, kept and pinned coordinates as s: rule 1
            if not hold.pinned or hold.holds(rho):
                return False  # another replica's reader
        replica, ordinal, spans = rule
        index, radix = free_index, prod(n for _, n, _ in self.dst_free)
        for (o, _, _), (lo, hi) in zip(combo, spans):
            index += (o - lo) * radix
            radix *= hi - lo + 1
        return (index + ordinal) % self.replicas == replica

    # -- the whole exchange at a glance --------------------------------------------------------
    def readable(self, d: int, owner: int) -> range | tuple[int, ...]:
        """The hold owners of dim ``d`` whose intervals meet want owner ``owner``'s,
        ascending (a ``range`` when consecutive)."""
        key = (d, owner)
        found = self._readable.get(key)
        if found is None:
            t = self.hold.tilings[d]
            met = [t.owners_meeting(*iv) for iv in self.want.tilings[d].owned(owner)]
            found = met[0] if len(met) == 1 else _canonical(sorted({o for m in met for o in m}))
            self._readable[key] = found
        return found

    def _readables(self, d: int, owners: set[int]) -> dict[int, range | tuple[int, ...]]:
        """:meth:`readable` of each of ``owners``, a column at a time where the wanted
        owners hold one interval each and the hold owners' intervals are consecutive."""
        want, hold = self.want.tilings[d], self.hold.tilings[d]
        todo = [o for o in owners if (d, o) not in self._readable]
        bounds = want.bounds(todo) if hold.rule.monotone and hold._all_owned else None
        if bounds is not None and len(todo) > 64:
            firsts = hold.owners_at(bounds[0])
            lasts = hold.owners_at([b - 1 for b in bounds[1]])
            for o, a, b, first, last in zip(todo, *bounds, firsts, lasts):
                self._readable[d, o] = range(first, last + 1) if b > a else ()
        return {o: self.readable(d, o) for o in owners}

    def lacks(self, rho: int) -> bool:
        """Whether want holder ``rho`` lacks anything it wants."""
        readings = [self.readable(d, o) for d, o in enumerate(self.want.owners(rho))]
        if not all(readings):
            return False  # it wants nothing
        if not self.hold.holds(rho):
            return True
        own = self.hold.owners(rho)
        return not all(len(r) == 1 and r[0] == c for r, c in zip(readings, own))

    def group(self, rho: int) -> tuple[int, ...]:
        """The holders, among ``rho``'s replicas, of what ``rho`` wants (``rho`` holds src)."""
        offsets = [rho - self._owning_part(rho)]
        for d, o in enumerate(self.want.owners(rho)):
            offsets = [x + self.hold.offset(d, c) for x in offsets for c in self.readable(d, o)]
        return tuple(sorted(offsets))

    def payload(self, sender: int, rho: int) -> tuple[Box, ...]:
        """The boxes ``sender`` sends ``rho`` (a member of its group), in ``rho``'s order."""
        wanted, own = self.want.owners(rho), self.hold.owners(sender)
        per_dim = []
        for t, h, o, c in zip(self.want.tilings, self.hold.tilings, wanted, own):
            mine = h.owned(c)
            per_dim.append([[(max(a, x), min(b, y)) for x, y in mine if max(a, x) < min(b, y)]
                            for a, b in t.owned(o)])
        return tuple(box for cell in product(*per_dim) for box in product(*cell))

    def kind(self) -> Collective | None:
        """None if no rank lacks anything; ``ALL_GATHER`` if the transfers form disjoint
        all-gather groups, else ``ALL_TO_ALL``: the first want holders one by one (most
        all-to-alls show in the first two), then every rank a column at a time.

        A receiver that holds src and wants part of what it holds has the group
        :meth:`group` (rule 1 makes its senders the holders of its cells among its
        replicas). The groups are disjoint all-gathers iff each has as many members as
        ranks that name it, and each sender sends all its receivers the same boxes: wants
        of distinct owners are disjoint, so in a group of three or more every member
        wants the same owners.
        """
        ranks = self.want.grid.ranks
        head = range(ranks.start, min(ranks.stop, ranks.start + 64))
        found = self._kind(head) if len(head) < len(ranks) else None
        return found if found is Collective.ALL_TO_ALL else self._kind(ranks)

    def _kind(self, ranks: range) -> Collective | None:
        """:meth:`kind` over the want holders among ``ranks``."""
        wanted = self.want.owner_columns(ranks)
        owners = self.hold.held_owner_columns(ranks)
        readings = [[table[o] for o in column] for table, column in (
            (self._readables(d, set(column)), column) for d, column in enumerate(wanted))]
        rows = _receivers(self.want.holds_column(ranks), readings, owners)
        if not rows:
            return None
        for column, own in zip(readings, owners):  # a receiver must hold what it sends
            if not all(own[i] in column[i] for i in rows):
                return Collective.ALL_TO_ALL

        def pick(column: list) -> list:
            return column if len(rows) == len(ranks) else [column[i] for i in rows]

        bases = [r - o for r, o in zip(ranks, self._owning_parts(ranks, owners))]
        groups, sizes = _group_ids(pick(bases), [pick(c) for c in readings], ranks.stop)
        counts = Counter(groups)
        if any(n != sizes[g] for g, n in counts.items()):
            return Collective.ALL_TO_ALL  # a group some of whose members do not name it
        big = [i for i, g in enumerate(groups) if sizes[g] > 2]
        for column in map(pick, wanted):  # members of groups of three or more want alike
            column = [column[i] for i in big]
            first = dict(zip(reversed([groups[i] for i in big]), reversed(column)))
            if [first[groups[i]] for i in big] != column:
                return Collective.ALL_TO_ALL  # a sender would send its receivers different boxes
        return Collective.ALL_GATHER

    def _owning_parts(self, ranks: range, owners: list[list[int]]) -> list[int]:
        """Per rank, the rank offset its hold owners make (see :meth:`_owning_part`)."""
        parts = [0] * len(ranks)
        for d, column in enumerate(owners):
            table = {o: self.hold.offset(d, o) for o in set(column) if o >= 0}
            parts = [p + table.get(o, 0) for p, o in zip(parts, column)]
        return parts


def _receivers(wants: list[bool], readings: list[list], owners: list[list[int]]) -> list[int]:
    """The rows of the ranks that want something they do not hold."""
    wanting = wants
    for column in readings:
        wanting = [w and len(r) > 0 for w, r in zip(wanting, column)]
    fits = wanting
    for column, own in zip(readings, owners):
        fits = [f and len(r) == 1 and r[0] == c for f, r, c in zip(fits, column, own)]
    return [i for i, (w, f) in enumerate(zip(wanting, fits)) if w and not f]


def _group_ids(bases: list[int], readings: list[list], radix: int) -> tuple[list[int], dict]:
    """Each row's group as one integer (its replica, ``bases`` < ``radix``, and the owner
    sets it reads per dim, numbered) and every group's size (the product of those sets'
    sizes)."""
    groups, sizes = bases, {}
    lengths: list[int] = [1]  # per combination of owner-set numbers, the group's size
    for column in readings:
        ids = {r: i for i, r in enumerate(set(column))}
        groups = [g + ids[r] * radix for g, r in zip(groups, column)]
        radix *= len(ids)
        per_id = [0] * len(ids)
        for r, i in ids.items():
            per_id[i] = len(r)
        lengths = [a * b for a in per_id for b in lengths]
    first = radix // len(lengths)  # the radix of the first owner-set number
    for g in set(groups):
        sizes[g] = lengths[g // first]
    return groups, sizes


class ReduceCosts:
    """What each candidate cut of a reduce-scatter costs: ``(peak elements a rank
    receives, elements exchanged after it)``. Each member receives the others' partials
    of its share, then each want holder what it lacks. Per-dim columns over the ranks
    are computed once and shared by the candidates, which differ in one dim."""

    def __init__(self, hold: Tiling, want: Tiling, axes: tuple[str, ...]) -> None:
        self.hold, self.want, self.axes = hold, want, axes
        src, ranks = hold.grid.ranks, want.grid.ranks
        self.src_holds = hold.holds_column(src)
        self.src_owners = hold.owner_columns(src)
        self.src_sub = hold.axes_column(src, axes)
        self.wants = want.holds_column(ranks)
        self.wanted = want.owner_columns(ranks)
        if ranks == src and not hold.pinned:  # the same ranks: the same columns
            self.owners, self.sub = self.src_owners, self.src_sub
        else:
            self.owners = hold.held_owner_columns(ranks)
            inside = range(max(ranks.start, src.start), min(ranks.stop, src.stop))
            before = max(0, min(inside.start, ranks.stop) - ranks.start)
            self.sub = ([0] * before + (hold.axes_column(inside, axes) if len(inside) else [])
                        + [0] * (len(ranks) - before - len(inside)))
        self.total = _multiply([_lengths(t, c) for t, c in zip(want.tilings, self.wanted)])
        self._lengths = [_lengths(t, c) for c, t in zip(self.src_owners, hold.tilings)]
        self._meets: dict[int, list[int]] = {}
        self._bounds: dict[int, tuple[list[int], tuple | None]] = {}

    def cost(self, dim: int) -> tuple[int, int]:
        """The cost when dim ``dim`` is cut."""
        hold = self.hold
        refined = hold.refine(hold.dims[dim], self.axes).tilings[dim]
        k = prod(hold.grid.axis_size(a) for a in self.axes)
        src = hold.grid.ranks
        owners = [c * k + s for c, s in zip(self.src_owners[dim], self.src_sub)]
        bounds = refined.bounds(owners)
        lengths = list(self._lengths)
        lengths[dim] = (_lengths(refined, owners) if bounds is None
                        else [b - a for a, b in zip(*bounds)])
        reduced = [(k - 1) * v if h else 0 for v, h in zip(_multiply(lengths), self.src_holds)]
        meets = [self._meet_column(d) for d in range(len(hold.dims))]
        aligned = [c * k + s if c >= 0 else -1 for c, s in zip(self.owners[dim], self.sub)]
        same = self.want.grid.ranks == src and bounds is not None
        meets[dim] = _meets(self.want.tilings[dim], self._wanted_bounds(dim), refined, aligned,
                            bounds if same else None)
        missing = [n - m if w else 0 for w, n, m in zip(self.wants, self.total, _multiply(meets))]
        ranks = self.want.grid.ranks
        if ranks == src:
            return max(map(sum, zip(reduced, missing)), default=0), sum(missing)
        first = min(src.start, ranks.start)
        recv = [0] * (max(src.stop, ranks.stop) - first)
        for start, column in ((src.start, reduced), (ranks.start, missing)):
            at = start - first
            recv[at:at + len(column)] = [a + b for a, b in zip(recv[at:], column)]
        return max(recv, default=0), sum(missing)

    def _meet_column(self, d: int) -> list[int]:
        if d not in self._meets:
            self._meets[d] = _meets(self.want.tilings[d], self._wanted_bounds(d),
                                    self.hold.tilings[d], self.owners[d])
        return self._meets[d]

    def _wanted_bounds(self, d: int) -> tuple[list[int], tuple | None]:
        """The want owners of dim ``d`` and, if single intervals, their bounds."""
        if d not in self._bounds:
            self._bounds[d] = self.wanted[d], self.want.tilings[d].bounds(self.wanted[d])
        return self._bounds[d]


def _lengths(tiling: DimTiling, owners: list[int]) -> list[int]:
    """The length of dim ``tiling`` each of ``owners`` holds."""
    bounds = tiling.bounds(owners)
    if bounds is None:
        return _lookup(owners, lambda o: sum(b - a for a, b in tiling.owned(o)))
    return [b - a for a, b in zip(*bounds)]


def _meets(want: DimTiling, wanted_bounds, hold: DimTiling, owners: list[int],
           held=None) -> list[int]:
    """Per row, the length of the dim a want owner and hold owner ``owners`` (-1: none)
    both cover; ``wanted_bounds`` is the want owners and their :meth:`bounds`, ``held``
    the hold owners' if known."""
    wanted, bounds = wanted_bounds
    if held is None:
        held = hold.bounds([max(o, 0) for o in owners])
    if bounds is None or held is None:
        return _lookup(list(zip(wanted, owners)), lambda pair: _meet(want, hold, *pair))
    return [max(0, min(y, v) - max(x, u)) if o >= 0 else 0
            for x, y, u, v, o in zip(*bounds, *held, owners)]


def _meet(want: DimTiling, hold: DimTiling, wanted: int, owner: int) -> int:
    """Length of the dim both want owner ``wanted`` and hold owner ``owner`` cover."""
    if owner < 0:
        return 0
    held = hold.owned(owner)
    return sum(max(0, min(b, y) - max(a, x)) for a, b in want.owned(wanted) for x, y in held)


def _lookup(column: list, value) -> list:
    """``value`` of every entry, computed once per distinct entry."""
    table = {x: value(x) for x in set(column)}
    return [table[x] for x in column]


def _multiply(columns: list[list[int]]) -> list[int]:
    out = columns[0]
    for column in columns[1:]:
        out = [a * b for a, b in zip(out, column)]
    return out


def _by_owner(tiling, interval: Interval) -> list[tuple[int, list[tuple[Interval, Interval]]]]:
    """``interval`` cut at ``tiling``'s bounds, the pieces grouped by owner (owners in
    order of first appearance; only zigzag gives an owner two)."""
    pieces = tiling.split(*interval)
    if tiling.rule.monotone:
        return [(owner, [(piece, whole)]) for piece, whole, owner in pieces]
    out: dict[int, list[tuple[Interval, Interval]]] = {}
    for piece, whole, owner in pieces:
        out.setdefault(owner, []).append((piece, whole))
    return list(out.items())


def _mixed_offset(j: int, axes) -> int:
    """Rank offset of index ``j`` over ``(position, size, stride)`` axes, the first fastest."""
    offset = 0
    for _, n, stride in axes:
        j, c = divmod(j, n)
        offset += c * stride
    return offset


def want_holders(tiling: Tiling) -> Iterator[int]:
    """The ranks of ``tiling``'s grid on its pinned index, in rank order."""
    if not tiling.pinned:
        return iter(tiling.grid.ranks)
    ranks = tiling.grid.ranks
    return (r for r, h in zip(ranks, tiling.holds_column(ranks)) if h)


_PIECE, _OFFSET, _IS_OWN, _KEY = itemgetter(0), itemgetter(3), itemgetter(4), itemgetter(0)
_OFFSET_OF_READER, _ENTRIES = itemgetter(1), itemgetter(2)
