"""Lowering: one rank's share of a plan as a straight-line program of tensor ops.

Done once, eagerly, when a bridge is built: every box is resolved to views of tensors
the rank holds, every collective to the ranks of its group and fixed split sizes. The
program holds only ints, slices and tuples, so the executor's loop over it is all
``torch.compile`` sees: no planner code, no region arithmetic, no dict lookups by layout.
Lowering is pure: it never asks which process group serves a set of ranks (the
executor's comm knows).

Data is described by *blocks*: per dim, a list of global intervals; the block is their
product, stored as one C-order tensor whose dim ``k`` runs through the intervals of dim
``k`` in list order. The src piece is one block (zigzag gives two intervals on a dim).
The wire format of a list of plan boxes is the list of blocks :func:`coalesce` makes of
it -- a pure function of the plan, so sender and receiver agree without talking -- which
packs e.g. two boxes adjacent along ``s`` as one copy instead of two.

Every tensor a program creates or receives is an *entry* (numbered in creation order;
entry 0 is the src piece). Reading a block from entries resolves to a small tree:
a :class:`View` of one entry (no copy), a :class:`Cat` of sub-blocks along one dim (one
copy), or a :class:`Scatter` into a new tensor (one copy, one write per block). The
lowering prefers the newest entries (a received buffer often already *is* the dst piece
in C-order: then the output costs no copy at all), and entries nothing reads are never
materialised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import reduce
from itertools import product
from math import prod
from typing import Any, cast

from mimo_fx.errors import MimoFxError
from mimo_fx.layout import Layout
from mimo_fx.local import box_slices
from mimo_fx.plan import (
    AllReduce,
    Collective,
    Exchange,
    Gather,
    Plan,
    RankPlan,
    Reduce,
    ReduceScatter,
    Step,
    kind_of,
)
from mimo_fx.regions import Box, Interval, Tiling, box_volume
from mimo_fx.rows import RankRoute, RowTiling
from mimo_fx.symbolic import Expr, Undecided, hint, known_ge, smax, smin
from mimo_fx.templates import Symbolizer

__all__ = ["View", "Cat", "Scatter", "Take", "AddAt", "Op", "Program", "lower", "lower_rows",
           "lower_route", "coalesce", "at", "evaluator", "symbolic", "row_variables"]

Block = tuple[tuple[Interval, ...], ...]  # per dim, intervals in storage order


@dataclass(frozen=True)
class View:
    """``entries[entry][index]`` (``index`` None: the whole entry)."""

    entry: int
    index: tuple[slice, ...] | None


@dataclass(frozen=True)
class Cat:
    """``torch.cat`` of the parts along ``dim``."""

    dim: int
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Scatter:
    """A new tensor of ``shape`` written block by block: ``(entry, src, dst)`` triples."""

    shape: tuple[int, ...]
    writes: tuple[tuple[int, tuple[slice, ...], tuple[slice, ...]], ...]


@dataclass(frozen=True)
class Take:
    """``node``'s rows at program input ``index`` (an int64 vector): ``index_select``
    along the first dim (row programs, :func:`lower_rows`)."""

    node: Node
    index: int


@dataclass(frozen=True)
class AddAt:
    """A zero tensor of ``shape`` with ``node``'s rows added at the rows program input
    ``index`` names (``index_add`` along the first dim)."""

    shape: tuple
    index: int
    node: Node


Node = View | Cat | Scatter | Take | AddAt


@dataclass(frozen=True)
class Op:
    """One functional collective and how to pack its input and unpack its output.

    ``pack`` lists the blocks to send (nodes) and zero pads (ints, in elements) in buffer
    order; ``stack`` says the nodes all have one shape and no pad follows (one
    ``torch.stack`` packs them). ``unpack`` gives, for each entry the output creates,
    ``(offset, shape)`` in the output buffer, or None when nothing reads it. ``numel``
    is the packed input's length.
    """

    kind: Collective
    ranks: tuple[int, ...]
    pack: tuple[Node | int, ...]
    stack: bool
    unpack: tuple[tuple[int, tuple[int, ...]] | None, ...]
    numel: int
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()
    # the ranks as text, for the op's site (see timeouts.site)
    ranks_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks_text", ",".join(map(str, self.ranks)))


@dataclass(frozen=True)
class Program:
    """Everything one rank does for one plan."""

    src_expand: tuple[int, ...] | None  # local -> one axis per dim (None: already so)
    src_perm: tuple[int, ...] | None    # -> canonical order (None: already so)
    ops: tuple[Op, ...]
    out: Node | None                    # canonical dst piece; None: this rank holds none
    out_clone: bool                     # the dst piece would alias the input: copy it
    out_perm: tuple[int, ...] | None    # canonical -> dst dim order (None: already so)
    out_local: tuple[int, ...] | None   # the dst local shape (None: already so)
    out_ndim: int                       # dims of the dst local tensor (also when empty)
    src_shape: tuple[int, ...] | None = None  # the src local shape; None: holds none
    # the program as one straight-line function, what a compiled call runs (see
    # .straight; None: not written, the executor interprets the program)
    straight: Any = field(default=None, repr=False, compare=False)

    @property
    def identity(self) -> bool:
        """Whether the dst piece is the src piece itself: nothing to move, nothing to
        rearrange (the call then returns its input)."""
        return (not self.ops and self.out == View(0, None) and self.src_perm is None
                and self.out_perm is None and self.src_shape is not None
                and (self.out_local == self.src_shape if self.src_expand is not None
                     else self.out_local is None))


def _shape(block: Block) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in segs) for segs in block)


def _join(a: tuple[Interval, ...], b: tuple[Interval, ...]) -> tuple[Interval, ...]:
    if a[-1][1] == b[0][0]:
        return a[:-1] + ((a[-1][0], b[0][1]),) + b[1:]
    return a + b


def _concat_dim(a: Block, b: Block, c_order: bool) -> int | None:
    """The one dim along which ``b`` can follow ``a`` as a block; with ``c_order`` only if
    the two C-order tensors laid end to end are the joined block in C-order."""
    diff = [k for k, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(diff) != 1:
        return None
    d = diff[0]
    if c_order and any(_shape(a)[k] != 1 for k in range(d)):
        return None
    return d


def _merge(blocks: list[Block], c_order: bool) -> list[Block]:
    out: list[Block] = []
    for block in blocks:
        out.append(block)
        while len(out) > 1 and (d := _concat_dim(out[-2], out[-1], c_order)) is not None:
            b = out.pop()
            a = out.pop()
            out.append(a[:d] + (_join(a[d], b[d]),) + a[d + 1:])
    return out


def coalesce(boxes) -> list[Block]:
    """Disjoint boxes' wire format: consecutive boxes differing on one dim go as one block."""
    return _merge([tuple((iv,) for iv in box) for box in boxes], c_order=False)


def _subtract(box: Box, cut: Box) -> list[Box]:
    """``box`` minus ``cut`` (``cut`` inside ``box``) as disjoint boxes (with symbolic
    sizes, those that may be empty for some sizes too)."""
    out, rest = [], list(box)
    for k, ((lo, hi), (a, b)) in enumerate(zip(box, cut)):
        if lo != a:
            out.append(tuple(rest[:k]) + ((lo, a),) + tuple(rest[k + 1:]))
        if b != hi:
            out.append(tuple(rest[:k]) + ((b, hi),) + tuple(rest[k + 1:]))
        rest[k] = (a, b)
    return out


def _intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``; None only when it is empty for every size."""
    out: list[Any] = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = smax(a0, b0), smin(a1, b1)
        if known_ge(lo, hi):
            return None
        out.append((lo, hi))
    return tuple(out)


def _empty(box: Box) -> bool:
    return any(known_ge(lo, hi) for lo, hi in box)


class _Resolver:
    """Reads blocks from the entries a rank holds, preferring the newest."""

    def __init__(self) -> None:
        self.avail: list[tuple[int, Block]] = []  # newest first
        self.blocks: dict[int, Block] = {}
        self.live: set[int] = set()
        self.count = 0

    def new(self, blocks: list[Block], replace_all: bool = False) -> None:
        fresh = [(self.count + k, b) for k, b in enumerate(blocks)]
        self.count += len(blocks)
        self.blocks.update(fresh)
        self.avail = fresh[::-1] + ([] if replace_all else self.avail)

    def read(self, target: Block) -> Node:
        uncovered = list(product(*target))
        writes = []
        for entry, block in self.avail:
            if not uncovered:
                break
            for held in product(*block):
                left = []
                for box in uncovered:
                    inter = _intersect(box, held)
                    if inter is None:
                        left.append(box)
                        continue
                    writes.append((entry, box_slices(block, inter), box_slices(target, inter)))
                    left += _subtract(box, inter)
                uncovered = left
        uncovered = [box for box in uncovered if not _empty(box)]
        if uncovered:
            raise AssertionError(f"lowering: block {target} not held (missing {uncovered})")
        writes = _join_writes(writes)
        self.live.update(w[0] for w in writes)
        return _tree(_shape(target), writes, self.blocks)


def _join_writes(writes: list) -> list:
    """Merge writes of one entry adjacent in both source and target along one dim."""
    changed = True
    while changed:
        changed = False
        for i, j in product(range(len(writes)), repeat=2):
            (e1, s1, d1), (e2, s2, d2) = writes[i], writes[j]
            if i == j or e1 != e2:
                continue
            diff = [k for k in range(len(s1)) if s1[k] != s2[k] or d1[k] != d2[k]]
            if len(diff) == 1:
                k = diff[0]
                if s1[k].stop == s2[k].start and d1[k].stop == d2[k].start:
                    s = s1[:k] + (slice(s1[k].start, s2[k].stop),) + s1[k + 1:]
                    d = d1[:k] + (slice(d1[k].start, d2[k].stop),) + d1[k + 1:]
                    writes = [w for n, w in enumerate(writes) if n not in (i, j)]
                    writes.append((e1, s, d))
                    changed = True
                    break
    return writes


# A Cat inside a Cat copies its elements twice; above this many elements the bytes cost
# more than the ops saved, and the tensor is written block by block instead.
NESTED_CAT_LIMIT = 1 << 15


def _tree(shape: tuple[int, ...], writes: list, blocks: dict[int, Block]) -> Node:
    """A cheap way to build a tensor of ``shape`` from ``writes`` (they tile it)."""
    if len(writes) == 1:
        entry, src, _ = writes[0]
        whole = all(s.start == 0 and s.stop == n for s, n in zip(src, _shape(blocks[entry])))
        return View(entry, None if whole else src)
    for d in range(len(shape)):
        slabs: list[list[int]] = []
        for lo, hi in sorted({(w[2][d].start, w[2][d].stop) for w in writes}):
            if slabs and lo < slabs[-1][1]:
                slabs[-1][1] = max(slabs[-1][1], hi)
            else:
                slabs.append([lo, hi])
        if len(slabs) > 1:
            parts = []
            for lo, hi in slabs:
                sub = [(e, s, dd[:d] + (slice(dd[d].start - lo, dd[d].stop - lo),) + dd[d + 1:])
                       for e, s, dd in writes if lo <= dd[d].start < hi]
                parts.append(_tree(shape[:d] + (hi - lo,) + shape[d + 1:], sub, blocks))
            if hint(prod(shape)) >= NESTED_CAT_LIMIT and any(type(p) is not View for p in parts):
                break
            return Cat(d, tuple(parts))
    return Scatter(shape, tuple(writes))


def _unpack(blocks: list[Block], offsets: list[int]) -> tuple[list[Block], list]:
    """Merge blocks lying end to end in the buffer in C-order; their (offset, shape)."""
    merged: list[tuple[Block, int]] = []
    for block, offset in zip(blocks, offsets):
        if merged:
            last, start = merged[-1]
            if start + prod(_shape(last)) == offset:
                joined = _merge([last, block], c_order=True)
                if len(joined) == 1:
                    merged[-1] = (joined[0], start)
                    continue
        merged.append((block, offset))
    return [b for b, _ in merged], [(o, _shape(b)) for b, o in merged]


def _laid_out(part_blocks: list[list[Block]], slot: int | None = None):
    """Blocks of consecutive parts and their offsets (each part padded to ``slot``)."""
    blocks, offsets, base = [], [], 0
    for blocks_j in part_blocks:
        offset = base
        for b in blocks_j:
            blocks.append(b)
            offsets.append(offset)
            offset += prod(_shape(b))
        base = base + slot if slot is not None else offset
    return blocks, offsets


def _pack(res: _Resolver, blocks: list[Block], pad_to: int = 0) -> tuple[list, bool, int]:
    items: list = [res.read(b) for b in blocks]
    size = sum(prod(_shape(b)) for b in blocks)
    stack = len({_shape(b) for b in blocks}) == 1 and pad_to <= size
    if pad_to > size:
        items.append(pad_to - size)
    return items, stack, max(size, pad_to)


def _member(groups, rank: int):
    return next((g for g, ranks in enumerate(groups) if rank in ranks), None)


def lower(plan: Plan | RankPlan, rank: int, sym: Symbolizer | None = None) -> Program:
    """The program ``rank`` runs for ``plan``: a whole plan, or ``rank``'s part of one
    (``plan_for_rank``), which lowers to the same program. With ``sym`` (a template's
    symbolizer) its numbers are polynomials in the size variables (:mod:`mimo_fx.templates`)."""
    if isinstance(plan, RankPlan) and plan.rank != rank:
        raise MimoFxError(f"lower: this is rank {plan.rank}'s part of the plan, not rank "
                          f"{rank}'s; plan rank {rank}'s part with plan_for_rank(..., rank={rank})")
    src, dst, source, need = _boxes(plan)
    res = _Resolver()
    src_expand, src_perm, src_shape = None, None, None
    if src.holds(rank):
        segments = source.segments(rank)
        if sym is not None:
            segments = sym.segments(segments)
        ext = dict(zip(plan.dims, _shape(segments)))
        expand = tuple(ext[d] for d in src.dims)
        src_shape = tuple(prod(ext[f.dim] for f in g) for g in src.local_dims)
        src_expand = None if expand == src_shape else expand
        perm = tuple(src.dims.index(d) for d in plan.dims)
        src_perm = None if perm == tuple(range(len(perm))) else perm
        res.new([segments])
    else:
        res.count = 1  # entry 0 is the (empty) placeholder
    steps = plan.steps if sym is None else tuple(sym.step(s, rank) for s in plan.steps)
    ops = [op for step in steps if (op := _lower_step(step, rank, res)) is not None]
    out, out_clone, out_perm, out_local = None, False, None, None
    if dst.holds(rank):
        segments = need.segments(rank)
        if sym is not None:
            segments = sym.segments(segments)
        out = res.read(segments)
        out_clone = isinstance(out, View) and out.entry == 0
        perm = tuple(plan.dims.index(d) for d in dst.dims)
        out_perm = None if perm == tuple(range(len(perm))) else perm
        ext = dict(zip(plan.dims, _shape(segments)))
        local = tuple(prod(ext[f.dim] for f in g) for g in dst.local_dims)
        out_local = None if local == tuple(ext[d] for d in dst.dims) else local
    # entries nothing reads are not materialised
    first = 1
    for i, op in enumerate(ops):
        unpack = tuple(u if first + k in res.live else None for k, u in enumerate(op.unpack))
        ops[i] = replace(op, unpack=unpack)
        first += len(op.unpack)
    return Program(src_expand, src_perm, tuple(ops), out, out_clone, out_perm, out_local,
                   len(dst.local_dims), src_shape)


def _boxes(plan: Plan | RankPlan) -> tuple[Layout, Layout, Tiling, Tiling]:
    """A plan between box layouts: its layouts and what src holds and dst needs. A plan
    moving rows (a packed layout on a side) is not lowered here: it runs the row programs
    (:func:`lower_rows`, the same for every batch) at the numbers and indices
    :func:`lower_route` reads from it."""
    src, dst, source, need = plan.src, plan.dst, plan.source, plan.need
    if not (isinstance(src, Layout) and isinstance(dst, Layout)
            and isinstance(source, Tiling) and isinstance(need, Tiling)):
        raise MimoFxError(f"lower() takes a plan between box layouts, not {src.describe()!r} "
                          f"-> {dst.describe()!r}; a plan of rows lowers to the row programs' "
                          f"numbers and indices with lower_route(plan, adjoint, rank) (a "
                          f"mimo_fx.compiled.Redistributor does this)")
    return src, dst, source, need


# one lowering function per step kind, registered with @_lowers(kind)
_LOWER: dict[Collective, Callable[[Any, int, _Resolver], Op | None]] = {}


def _lowers(kind: Collective):
    def register(fn):
        assert kind not in _LOWER, f"{kind.value} is lowered twice"
        _LOWER[kind] = fn
        return fn
    return register


def _lower_step(step: Step, rank: int, res: _Resolver) -> Op | None:
    kind = kind_of(step)
    if kind not in _LOWER:
        raise MimoFxError(f"no lowering for {type(step).__name__} ({kind.value}) steps: "
                          f"register one with @_lowers(Collective.{kind.name}) in "
                          f"compiled/lowering.py")
    return _LOWER[kind](step, rank, res)


@_lowers(Collective.ALL_TO_ALL)
def _lower_exchange(step: Exchange, rank: int, res: _Resolver) -> Op | None:
    if rank not in step.ranks:
        return None
    send: dict[int, list[Box]] = {}
    recv: dict[int, list[Box]] = {}
    for t in step.transfers:
        if t.src == rank:
            send.setdefault(t.dst, []).append(t.box)
        if t.dst == rank:
            recv.setdefault(t.src, []).append(t.box)
    out_parts = [coalesce(recv.get(r, ())) for r in step.ranks]
    send_blocks = [b for r in step.ranks for b in coalesce(send.get(r, ()))]
    pack, stack, numel = _pack(res, send_blocks)
    blocks, unpack = _unpack(*_laid_out(out_parts))
    op = Op(Collective.ALL_TO_ALL, step.ranks, tuple(pack), stack, tuple(unpack), numel,
            tuple(sum(map(box_volume, send.get(r, ()))) for r in step.ranks),
            tuple(sum(map(box_volume, recv.get(r, ()))) for r in step.ranks))
    res.new(blocks)
    return op


@_lowers(Collective.ALL_GATHER)
def _lower_gather(step: Gather, rank: int, res: _Resolver) -> Op | None:
    g = _member(step.groups, rank)
    if g is None:
        return None
    ranks, parts = step.groups[g], step.shares[g]
    volumes: list[Any] = [sum(map(box_volume, part)) for part in parts]
    if len(ranks) == 1 or all(v == 0 for v in volumes):
        return None
    try:
        chunk = reduce(smax, volumes)
    except Undecided:  # shares whose sizes order differently for different counts
        return _gather_as_all_to_all(ranks, parts, volumes, rank, res)
    pack, stack, numel = _pack(res, coalesce(parts[ranks.index(rank)]), chunk)
    blocks, unpack = _unpack(*_laid_out([coalesce(p) for p in parts], chunk))
    op = Op(Collective.ALL_GATHER, ranks, tuple(pack), stack, tuple(unpack), numel)
    res.new(blocks)
    return op


def _gather_as_all_to_all(ranks, parts, volumes, rank: int, res: _Resolver) -> Op:
    """An all-gather of shares with no common largest size (ragged counts): each member
    sends its share to every other member in one all-to-all over the same group, so no
    share is padded to a size the counts do not fix."""
    me = ranks.index(rank)
    own = coalesce(parts[me])
    others = [j for j in range(len(ranks)) if j != me]
    pack, _, _ = _pack(res, own * len(others))
    blocks, unpack = _unpack(*_laid_out([coalesce(parts[j]) for j in others]))
    op = Op(Collective.ALL_TO_ALL, ranks, tuple(pack), False, tuple(unpack),
            volumes[me] * len(others),
            tuple(0 if j == me else volumes[me] for j in range(len(ranks))),
            tuple(0 if j == me else volumes[j] for j in range(len(ranks))))
    res.new(blocks)
    return op


def _reduce_group(step: Reduce, rank: int, res: _Resolver):
    """This rank's group of a reduction, or None where it has nothing to issue. A rank
    outside the groups, or in a group whose region is empty, keeps nothing partial: its
    holdings are replaced by none."""
    g = _member(step.groups, rank)
    if g is None:
        res.new([], replace_all=True)
        return None
    ranks, parts = step.groups[g], step.shares[g]
    volumes: list[Any] = [sum(map(box_volume, part)) for part in parts]
    chunk = reduce(smax, volumes)
    if len(ranks) == 1 and (isinstance(step, AllReduce) or chunk != 0):
        return None  # nothing to sum with
    if chunk == 0:
        res.new([], replace_all=True)
        return None
    return g, ranks, parts, chunk


@_lowers(Collective.ALL_REDUCE)
def _lower_all_reduce(step: AllReduce, rank: int, res: _Resolver) -> Op | None:
    if (group := _reduce_group(step, rank, res)) is None:
        return None
    g, ranks, _, _ = group
    region = coalesce(step.regions[g])
    pack, stack, numel = _pack(res, region)
    blocks, unpack = _unpack(*_laid_out([region]))
    op = Op(Collective.ALL_REDUCE, ranks, tuple(pack), stack, tuple(unpack), numel)
    res.new(blocks, replace_all=True)
    return op


@_lowers(Collective.REDUCE_SCATTER)
def _lower_reduce_scatter(step: ReduceScatter, rank: int, res: _Resolver) -> Op | None:
    if (group := _reduce_group(step, rank, res)) is None:
        return None
    _, ranks, parts, chunk = group
    pack, numel = [], 0
    for part in parts:
        items, _, n = _pack(res, coalesce(part), chunk)
        pack += items
        numel += n
    blocks, unpack = _unpack(*_laid_out([coalesce(parts[ranks.index(rank)])]))
    op = Op(Collective.REDUCE_SCATTER, ranks, tuple(pack), False, tuple(unpack), numel)
    res.new(blocks, replace_all=True)
    return op



# -- numbers of a template program ------------------------------------------------------
def symbolic(program: Program) -> bool:
    """Whether ``program``'s numbers are polynomials (it was lowered from a template)."""
    return any(isinstance(x, Expr) for x in _numbers(program))


def _numbers(obj: Any):
    if isinstance(obj, Expr):
        yield obj
    elif isinstance(obj, slice):
        yield from (obj.start, obj.stop)
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _numbers(item)
    elif isinstance(obj, View | Cat | Scatter | Take | AddAt | Op | Program):
        for name in obj.__dataclass_fields__:
            yield from _numbers(getattr(obj, name))


def at(obj: Any, env) -> Any:
    """``obj`` with every polynomial evaluated at ``env`` (for many sizes: :func:`evaluator`)."""
    return evaluator(obj)(env)


_CONST = object()  # an evaluator's answer for a part with no polynomial in it


def evaluator(obj: Any) -> Callable[[Any], Any]:
    """``env -> at(obj, env)``, visiting only the parts of ``obj`` holding a polynomial (a new
    size costs this rank's own numbers, not every rank's split sizes)."""
    walk = _walker(obj)
    return (lambda env: obj) if walk is _CONST else walk


def _walker(obj: Any):
    if isinstance(obj, Expr):
        return obj.eval
    if isinstance(obj, slice):
        lo, hi = _walker(obj.start), _walker(obj.stop)
        if lo is _CONST and hi is _CONST:
            return _CONST
        start, stop = obj.start, obj.stop
        return lambda env: slice(start if lo is _CONST else lo(env),
                                 stop if hi is _CONST else hi(env))
    if isinstance(obj, tuple):
        parts = [(i, w) for i, w in enumerate(map(_walker, obj)) if w is not _CONST]
        if not parts:
            return _CONST

        return _tuple_walker(list(obj), parts)
    if isinstance(obj, View | Cat | Scatter | Take | AddAt | Op | Program):
        fields = [(n, w) for n in obj.__dataclass_fields__
                  if (w := _walker(getattr(obj, n))) is not _CONST]
        if not fields:
            return _CONST
        if isinstance(obj, Program):  # (its values: not the template's function)
            return lambda env: replace(obj, straight=None, **{n: w(env) for n, w in fields})
        return lambda env: replace(obj, **{n: w(env) for n, w in fields})
    return _CONST


def prime(obj: Any) -> None:
    """Compile every polynomial in ``obj`` (a template program) to one Python
    expression (:meth:`~mimo_fx.symbolic.Expr.prime`), before anything traces it."""
    if isinstance(obj, Expr):
        obj.prime()
    elif isinstance(obj, slice):
        prime(obj.start)
        prime(obj.stop)
    elif isinstance(obj, tuple):
        for part in obj:
            prime(part)
    elif isinstance(obj, View | Cat | Scatter | Take | AddAt | Op | Program):
        for name in obj.__dataclass_fields__:
            prime(getattr(obj, name))


def _tuple_walker(base: list, parts: list) -> Callable[[Any], tuple]:
    """A tuple's evaluator: a copy of ``base`` with only the ``parts`` re-evaluated."""
    def tuple_at(env) -> tuple:
        out = base.copy()
        for i, w in parts:
            out[i] = w(env)
        return tuple(out)
    return tuple_at


# -- row programs ------------------------------------------------------------------------
def row_variables(n_ranks: int, features: tuple[str, ...]) -> tuple[tuple, ...]:
    """A row program's variables: route counts ``("n", k)`` and feature sizes ``("f", d)``."""
    return (*(("n", k) for k in range(4 * n_ranks + 3)), *(("f", d) for d in features))


def lower_rows(ranks: tuple[int, ...], features: tuple[str, ...], holds_src: bool = True,
               holds_dst: bool = True) -> tuple[Program, Program]:
    """The forward and adjoint programs of every row plan over ``ranks`` (one rank's;
    the same for every rank and every plan): its numbers are the route's counts and the
    feature sizes (:func:`row_variables`), its program inputs the route's index vectors
    (:data:`mimo_fx.rows.ROUTE_INDEX` order). Forward: the rows it sends, one
    all-to-all, its dst piece from what it received; backward: its counted cotangent
    rows summed per distinct row, one all-to-all, added into its src gradient. A rank
    off a side gets an empty result on it (as box programs give)."""
    p = len(ranks)
    n: list[Any] = [Expr.var(("n", k), 1) for k in range(4 * p + 3)]
    fsend, frecv, bsend, brecv = n[:p], n[p:2 * p], n[2 * p:3 * p], n[3 * p:4 * p]
    n_unique, n_src, n_dst = n[4 * p], n[4 * p + 1], n[4 * p + 2]
    feat: tuple[Any, ...] = tuple(Expr.var(("f", d), 1) for d in features)
    width: Any = reduce(lambda a, b: a * b, feat, 1)
    whole = View(0, None)

    def exchange(pack: Node | None, send: list, recv: list) -> Op:
        # (a rank off the sending side sends nothing: no op on its empty placeholder,
        # which a compiler could not index)
        received: Any = reduce(lambda a, b: a + b, recv)
        return Op(Collective.ALL_TO_ALL, ranks, (pack,) if pack is not None else (), False,
                  ((0, (received, *feat)),),
                  reduce(lambda a, b: a + b, send) * width,
                  tuple(k * width for k in send), tuple(k * width for k in recv))

    fwd = Program(None, None, (exchange(Take(whole, 0) if holds_src else None, fsend, frecv),),
                  AddAt((n_dst, *feat), 2, Take(View(1, None), 1)) if holds_dst
                  else AddAt((0, *feat), 2, View(1, None)),  # empty, of the row width
                  False, None, None, 1 + len(feat), (n_src, *feat) if holds_src else None)
    sums = AddAt((n_unique, *feat), 4, Take(whole, 3))
    bwd = Program(None, None, (exchange(Take(sums, 5) if holds_dst else None, bsend, brecv),),
                  AddAt((n_src, *feat), 6, View(1, None)) if holds_src else None, False,
                  None, None, 1 + len(feat), (n_dst, *feat) if holds_dst else None)
    return fwd, bwd


def lower_route(fwd: Plan | RankPlan, bwd: Plan | RankPlan, rank: int) -> RankRoute:
    """``rank``'s part of a row plan (``fwd``) and its adjoint (``bwd``) as the row
    programs' numbers and index inputs (:func:`lower_rows`): read from the two plans'
    tilings (:class:`~mimo_fx.rows.RowTiling`: each local row's global row) and their one
    exchange each (transfers of runs of rows). A rank copies the rows it holds and needs
    itself (its own split of the all-to-all); a cotangent row counts where ``bwd``'s
    source tiling lists it, summed per distinct row before it is sent."""
    (step,), (bstep,) = cast(tuple[Exchange], fwd.steps), cast(tuple[Exchange], bwd.steps)
    ranks = step.ranks
    src = cast(RowTiling, fwd.source).rows.get(rank, ())
    dst = cast(RowTiling, fwd.need).rows.get(rank, ())
    local = {g: k for k, g in enumerate(src) if g >= 0}
    own = sorted({g for g in dst if g in local})
    sends, recvs = _peer_rows(step, rank, ranks, own)
    where = {g: k for k, g in enumerate(g for rows in recvs for g in rows)}  # arrival order
    real = [k for k, g in enumerate(dst) if g >= 0]
    # backward: the counted cotangent rows, one slot per distinct row
    cot = cast(RowTiling, bwd.source).rows.get(rank, ())
    counted = [k for k, g in enumerate(cot) if g >= 0]
    distinct = sorted({cot[k] for k in counted})
    slot = {g: k for k, g in enumerate(distinct)}
    bsends, bcame = _peer_rows(bstep, rank, ranks, [g for g in distinct if g in local])
    return RankRoute(
        send_index=tuple(local[g] for rows in sends for g in rows),
        send_counts=tuple(map(len, sends)), recv_counts=tuple(map(len, recvs)),
        gather=tuple(where[dst[k]] for k in real), dst_pos=tuple(real), n_dst=len(dst),
        bwd_pos=tuple(counted), unique=tuple(slot[cot[k]] for k in counted),
        n_unique=len(distinct), bsend_index=tuple(slot[g] for rows in bsends for g in rows),
        bsend_counts=tuple(map(len, bsends)), brecv_counts=tuple(map(len, bcame)),
        recv_local=tuple(local[g] for rows in bcame for g in rows), n_src=len(src))


def _peer_rows(step: Exchange, rank: int, ranks: tuple[int, ...], own: list[int]
               ) -> tuple[list[list[int]], list[list[int]]]:
    """Per rank of ``ranks``, the rows ``rank`` sends it and receives from it in
    ``step`` (rising; its own split: ``own``, the rows it copies itself)."""
    at = {r: j for j, r in enumerate(ranks)}
    sends: list[list[int]] = [[] for _ in ranks]
    recvs: list[list[int]] = [[] for _ in ranks]
    for t in step.transfers:
        (a, b), = t.box
        if t.src == rank:
            sends[at[t.dst]] += range(a, b)
        if t.dst == rank:
            recvs[at[t.src]] += range(a, b)
    i = at[rank]
    sends[i], recvs[i] = list(own), list(own)
    return [sorted(rows) for rows in sends], [sorted(rows) for rows in recvs]
