"""The planner: a pure, cached, deterministic schedule for one redistribution.

``plan(src, dst, sizes, dtype)`` works on index boxes only and never touches
``torch.distributed``; executors (``mimo_fx.reference``, ``mimo_fx.compiled``) run its
steps. The same inputs give the same plan on every rank, so every rank issues the same
collectives in the same order. ``plan_for_rank(..., rank=r)`` is rank ``r``'s part of
that plan (its groups and transfers only), planned without the other ranks' transfers:
what a rank of a 65,536-rank job lowers.

How a plan is built:

1. *Reduce*: partial src axes (unless dst keeps them partial) are reduce-scattered inside
   their group, the region cut along the dim that leaves the least peak traffic after
   it, so each element crosses once.
2. *Exchange*: every dst rank gets, box by box, what it needs and does not hold, each
   piece from one holder: the receiver's own replica when it is on the src grid, else
   the holder its index among the piece's readers names (``mimo_fx.exchange``). When
   the grids are disjoint and dst replicates over some axes, each replica first takes a
   1/k share (round one)...
3. *Gather*: ...and the replicas all-gather their shares (round two), so a piece several
   replicas need crosses between the grids once. A small exchange goes in one round
   instead, each replica taking its whole piece (:func:`_one_round`).
4. The executor assembles every dst rank's local tensor from what it holds.

An exchange whose transfers form disjoint all-gather groups is issued as all-gathers;
a reduce-scatter followed by an all-gather of the same shares is fused into an all-reduce.
Everything else is one uneven all-to-all over the union of the grids' ranks. Those
decisions, which every rank must take alike, are made from the layouts in one pass over
the ranks' coordinates (:func:`_frame`), never from the transfers.

>>> from mimo_fx import Grid, Layout
>>> enc, llm = Grid(tp=2, dp=4), Grid(tp=2, cp=2, dp=2)
>>> p = plan(Layout(enc, "(dp b) s h"), Layout(llm, "(dp b) s h"), {"b": 8, "s": 4, "h": 16})
>>> [step.kind.value for step in p.steps]
['all_gather']
>>> p.max_recv == p.max_lower_bound
True
"""

from __future__ import annotations

import gc
import operator
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache, cached_property, lru_cache
from math import prod
from typing import Any, ClassVar, Protocol, overload

import torch

from .collective import Collective
from .errors import MimoFxError
from .exchange import Geometry, ReduceCosts, Transfer, want_holders
from .layout import Layout
from .regions import Box, Size, Tiling, _digit_column, box_volume, intersect, total
from .text import format_bytes

__all__ = [
    "Collective", "Transfer", "Step", "STEPS", "kind_of", "ReduceScatter", "AllReduce", "Reduce",
    "Gather", "Exchange", "Plan", "RankPlan", "plan", "plan_for_rank", "backward_plan", "row_plans",
    "backward_layouts", "plan_groups", "plan_tilings", "check_sizes", "size_arguments",
    "format_bytes",
]


# -- what a plan asks of its layouts and tilings, whichever their kind ----------------------
class Side(Protocol):
    """A plan's src or dst: a box :class:`~mimo_fx.layout.Layout`, a
    :class:`~mimo_fx.packed.PackedLayout`, or rows given rank by rank
    (:class:`~mimo_fx.rows.RowMap`)."""

    @property
    def grid(self) -> Any: ...
    @property
    def holders(self) -> tuple[int, ...]: ...
    @property
    def partial(self) -> tuple[str, ...]: ...
    def holds(self, rank: int) -> bool: ...
    def describe(self) -> str: ...


class Holdings(Protocol):
    """What every rank of a side holds or needs, in the plan's dims: a
    :class:`~mimo_fx.regions.Tiling` of boxes, or a :class:`~mimo_fx.rows.RowTiling`
    of runs of rows; a rank's piece loads into its boxes and assembles from them."""

    def boxes(self, rank: int) -> tuple[Box, ...]: ...
    def load(self, layout: Any, dims: tuple[str, ...], rank: int,
             local: torch.Tensor) -> list[tuple[Box, torch.Tensor]]: ...
    def assemble(self, layout: Any, dims: tuple[str, ...], rank: int,
                 store: list[tuple[Box, torch.Tensor]], like: torch.Tensor) -> torch.Tensor: ...


# -- the steps: one class per collective kind ----------------------------------------------
Delivery = tuple[int, Box, tuple[int, ...]]  # (receiver, box, senders)
BoxMap = Callable[[Box], Box]

STEPS: dict[Collective, type[Step]] = {}


class Step(ABC):
    """One step of a plan: one collective kind, and everything that kind means.

    A subclass that sets ``kind`` is *the* step of that kind (:data:`STEPS`); the
    interpreters dispatch on it once and ask the step the rest: which ranks it runs on
    (:attr:`rank_groups`), its part for one rank (:meth:`restrict`), what it leaves where
    (:meth:`deliveries`, which the reference executor runs), what crosses the wire
    (:meth:`pairs`, from which :meth:`traffic` and the plan's bytes follow), the
    bandwidth-optimal cost of a reduction (:meth:`reduction_bound`) and how it prints
    (:meth:`describe`, :meth:`summary`). A class of no registered kind is no step:
    :func:`kind_of` names it.
    """

    kind: ClassVar[Collective]
    reduces: ClassVar[bool] = False  # sums partial values: members keep only its deliveries

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return  # a base of several steps (Reduce)
        if not isinstance(kind, Collective) or kind in STEPS:
            taken = f"already {STEPS[kind].__name__}'s" if kind in STEPS else "not a Collective"
            raise TypeError(f"step class {cls.__name__}: kind {kind!r} is {taken}; each "
                            f"Collective has exactly one step class")
        STEPS[kind] = cls

    @property
    @abstractmethod
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups of ranks it runs on, each issuing the collective together."""

    @abstractmethod
    def restrict(self, rank: int, box: BoxMap | None = None) -> Step:
        """The step keeping only the groups or transfers ``rank`` takes part in (its
        boxes mapped by ``box``, e.g. to symbolic ones)."""

    @abstractmethod
    def deliveries(self) -> Iterator[Delivery]:
        """``(receiver, box, senders)``: after the step, ``receiver`` holds ``box``, the sum
        of the senders' values of it (one sender: a copy). A step that :attr:`reduces`
        leaves its members nothing else."""

    @abstractmethod
    def pairs(self) -> Iterator[tuple[int, int, int]]:
        """``(sender, receiver, elements)`` it puts on the wire (pairs may repeat)."""

    def traffic(self) -> Iterator[tuple[int, int, int]]:
        """``(rank, elements sent, elements received)`` per rank in :meth:`pairs`."""
        sent: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for sender, receiver, n in self.pairs():
            sent[sender] += n
            recv[receiver] += n
        for rank in sent.keys() | recv.keys():
            yield rank, sent[rank], recv[rank]

    def reduction_bound(self) -> Iterator[tuple[int, int]]:
        """``(rank, elements)``: the bandwidth-optimal volume of its reduction per member
        (none unless it reduces)."""
        return iter(())

    @abstractmethod
    def describe(self, plan: Plan) -> str:
        """Its line of ``str(plan)``, boxes in ``plan``'s dims."""

    def summary(self) -> str:
        """A short account for the explainer: the kind and its groups' sizes."""
        sizes = sorted({len(g) for g in self.rank_groups})
        return (f"{self.kind.value} in {len(self.rank_groups)} group(s) of "
                f"{'/'.join(map(str, sizes))}")


def kind_of(step: object) -> Collective:
    """``step``'s kind, checked: its class must be the step class of that kind, so an
    unknown step is an error here, never taken for (or printed as) another kind."""
    kind = getattr(type(step), "kind", None)
    if isinstance(kind, Collective) and STEPS.get(kind) is type(step):
        return kind
    known = ", ".join(cls.__name__ for cls in STEPS.values())
    raise MimoFxError(f"{type(step).__qualname__} is not a plan step: a plan's steps are "
                      f"{known} (one class per Collective, each subclassing "
                      f"mimo_fx.plan.Step); got {step!r:.120}")


def _mine(groups: tuple[tuple[int, ...], ...], rank: int) -> list[int]:
    return [g for g, ranks in enumerate(groups) if rank in ranks]


def _mapped(boxes: tuple[Box, ...], box: BoxMap | None) -> tuple[Box, ...]:
    return boxes if box is None else tuple(map(box, boxes))


def _shared_pairs(step: Gather | Reduce, reduce: bool, gather: bool):
    """``(sender, receiver, elements)`` of a step over groups: a reduce-scatter member
    receives every other member's partials of its share, an all-gather member every other
    member's share; an all-reduce is both."""
    for ranks, parts in zip(step.groups, step.shares):
        vols = [sum(map(box_volume, part)) for part in parts]
        for i, sender in enumerate(ranks):
            for j, receiver in enumerate(ranks):
                n = (vols[j] if reduce else 0) + (vols[i] if gather else 0)
                if i != j and n:
                    yield sender, receiver, n


def _shares_text(plan: Plan, step: Gather | Reduce) -> str:
    """The first group's shares (up to four), for :meth:`Step.describe`."""
    return " | ".join(", ".join(plan.describe_box(b) for b in part) or "-"
                      for part in step.shares[0][:4])


@dataclass(frozen=True)
class Reduce(Step):
    """A step that sums partial values inside each group: ``regions[g]`` is the group's
    common region, ``shares[g][i]`` member ``i``'s share of it."""

    groups: tuple[tuple[int, ...], ...]
    regions: tuple[tuple[Box, ...], ...]
    shares: tuple[tuple[tuple[Box, ...], ...], ...]

    reduces = True
    factor: ClassVar[int]  # the bandwidth-optimal volume per member, in (k-1)/k regions
    keeps_region: ClassVar[bool]  # each member keeps the whole region, or only its share

    def deliveries(self) -> Iterator[Delivery]:
        for ranks, region, parts in zip(self.groups, self.regions, self.shares):
            for rank, part in zip(ranks, parts):
                for b in (region if self.keeps_region else part):
                    yield rank, b, ranks

    def pairs(self) -> Iterator[tuple[int, int, int]]:
        return _shared_pairs(self, True, self.keeps_region)

    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups

    def restrict(self, rank: int, box: BoxMap | None = None) -> Reduce:
        keep = _mine(self.groups, rank)
        cls: Any = type(self)  # a dataclass of these three fields
        return cls(tuple(self.groups[g] for g in keep),
                   tuple(_mapped(self.regions[g], box) for g in keep),
                   tuple(tuple(_mapped(p, box) for p in self.shares[g]) for g in keep))

    def reduction_bound(self) -> Iterator[tuple[int, int]]:
        """A reduce-scatter of a region R over k ranks receives (k-1)/k of R per member,
        an all-reduce twice that."""
        for ranks, region in zip(self.groups, self.regions):
            k, volume = len(ranks), sum(map(box_volume, region))
            for rank in ranks:
                yield rank, self.factor * -(-(k - 1) * volume // k)

    def describe(self, plan: Plan) -> str:
        what = " + ".join(plan.describe_box(b) for b in self.regions[0])
        return (f"{self.kind.value} over {_fmt_groups(self.groups)}: region {what}; "
                f"shares {_shares_text(plan, self)}")


@dataclass(frozen=True)
class ReduceScatter(Reduce):
    """Sum partial values inside each group: ``regions[g]`` is the group's common
    region, and member ``i`` of ``groups[g]`` keeps the sum over ``shares[g][i]``."""

    kind = Collective.REDUCE_SCATTER
    factor = 1
    keeps_region = False


@dataclass(frozen=True)
class AllReduce(Reduce):
    """Sum partial values inside each group; every member keeps the sum over the whole
    region ``regions[g]``. It is a reduce-scatter of ``shares[g]`` fused with the
    all-gather of the same shares, and costs both."""

    kind = Collective.ALL_REDUCE
    factor = 2
    keeps_region = True


@dataclass(frozen=True)
class Gather(Step):
    """All-gather inside each group: member ``i`` contributes ``shares[g][i]``."""

    groups: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[tuple[Box, ...], ...], ...]

    kind = Collective.ALL_GATHER

    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups

    def restrict(self, rank: int, box: BoxMap | None = None) -> Gather:
        keep = _mine(self.groups, rank)
        return Gather(tuple(self.groups[g] for g in keep),
                      tuple(tuple(_mapped(p, box) for p in self.shares[g]) for g in keep))

    def deliveries(self) -> Iterator[Delivery]:
        for ranks, parts in zip(self.groups, self.shares):
            for rank in ranks:
                for sender, part in zip(ranks, parts):
                    for b in part:
                        yield rank, b, (sender,)

    def pairs(self) -> Iterator[tuple[int, int, int]]:
        return _shared_pairs(self, False, True)

    def describe(self, plan: Plan) -> str:
        return (f"{self.kind.value} over {_fmt_groups(self.groups)}: shares "
                f"{_shares_text(plan, self)}")


@dataclass(frozen=True)
class Exchange(Step):
    """Point-to-point transfers, issued as one uneven all-to-all over ``ranks``."""

    transfers: tuple[Transfer, ...]
    ranks: tuple[int, ...]

    kind = Collective.ALL_TO_ALL

    @property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        return (self.ranks,)

    def restrict(self, rank: int, box: BoxMap | None = None) -> Exchange:
        """Every rank of the union still issues the all-to-all: only the transfers go."""
        mine = tuple(t if box is None else replace(t, box=box(t.box))
                     for t in self.transfers if rank in (t.src, t.dst))
        return Exchange(mine, self.ranks)

    def deliveries(self) -> Iterator[Delivery]:
        for t in self.transfers:
            yield t.dst, t.box, (t.src,)

    def pairs(self) -> Iterator[tuple[int, int, int]]:
        for t in self.transfers:
            yield t.src, t.dst, box_volume(t.box)

    @property
    def parties(self) -> tuple[tuple[int, ...], ...]:
        """The groups of ranks that exchange data (connected by transfers), each running
        independently of the others: the exchange is issued as point-to-point messages,
        so a rank waits only for its own peers, and a rank in no group for nobody."""
        parent: dict[int, int] = {}

        def root(r: int) -> int:
            while parent.setdefault(r, r) != r:
                parent[r] = parent[parent[r]]
                r = parent[r]
            return r

        for t in self.transfers:
            parent[root(t.src)] = root(t.dst)
        members: dict[int, list[int]] = defaultdict(list)
        for r in sorted(parent):
            members[root(r)].append(r)
        return tuple(sorted(tuple(g) for g in members.values()))

    def describe(self, plan: Plan) -> str:
        pairs = sorted({(t.src, t.dst) for t in self.transfers})
        shown = ", ".join(f"{s}->{d}" for s, d in pairs[:8])
        more = ", ..." if len(pairs) > 8 else ""
        n = len(self.transfers)
        counted = (f"{n} transfer{'s' if n != 1 else ''}" if n == len(pairs) else
                   f"{n} transfers between {len(pairs)} pairs of ranks")
        return (f"{self.kind.value} as messages in {_fmt_groups(self.parties)} of "
                f"{len(self.ranks)} ranks, {counted}: {shown}{more}")

    def summary(self) -> str:
        return (f"{self.kind.value} as messages in {len(self.parties)} group(s) of "
                f"{len(self.ranks)} ranks ({len(self.transfers)} transfers)")


def _fmt_groups(groups) -> str:
    shown = " ".join("(" + ",".join(map(str, g)) + ")" for g in groups[:4])
    more = f" ... {len(groups)} groups" if len(groups) > 4 else ""
    return shown + more


def _check_steps(steps: tuple[Step, ...]) -> None:
    for step in steps:
        kind_of(step)


@dataclass(frozen=True, eq=False)
class _Schedule:
    """What a plan and one rank's part of it both are: the layouts, the sizes, the steps
    in issue order and the tilings of what every rank holds and needs."""

    src: Side
    dst: Side
    dims: tuple[str, ...]
    sizes: tuple[tuple[str, Size], ...]  # ragged dims: their counts
    itemsize: int
    steps: tuple[Step, ...]
    hold: Holdings = field(repr=False)
    need: Holdings = field(repr=False)
    reduced_axes: tuple[str, ...] = ()
    before: Holdings | None = field(default=None, repr=False)  # hold before the reduction
    element: str = "element"  # what one element of ``dims`` is (a row plan's: a row)

    def __post_init__(self) -> None:
        _check_steps(self.steps)

    @property
    def source(self) -> Holdings:
        """What each rank holds under src, before any reduction (:attr:`hold` is after
        it)."""
        return self.hold if self.before is None else self.before


@dataclass(frozen=True, eq=False)
class Plan(_Schedule):
    """A schedule of steps plus the tilings that define what every rank holds and needs.

    Compared and hashed by identity: plans are cached, and equal inputs return the same
    object. :meth:`for_rank` is one rank's part of it.
    """

    # -- cost ----------------------------------------------------------------------------
    @cached_property
    def _traffic(self) -> tuple[dict[int, int], dict[int, int]]:
        sent: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for step in self.steps:
            for rank, n_sent, n_recv in step.traffic():
                sent[rank] += n_sent
                recv[rank] += n_recv
        b = self.itemsize
        return ({r: v * b for r, v in sorted(sent.items()) if v},
                {r: v * b for r, v in sorted(recv.items()) if v})

    @property
    def bytes_sent(self) -> dict[int, int]:
        """Bytes each rank sends (ranks that send nothing are absent)."""
        return self._traffic[0]

    @property
    def bytes_recv(self) -> dict[int, int]:
        """Bytes each rank receives (ranks that receive nothing are absent)."""
        return self._traffic[1]

    @cached_property
    def lower_bound(self) -> dict[int, int]:
        """Per dst rank: bytes it needs and does not already hold (partial values don't count)."""
        out = {}
        held_counts = not self.reduced_axes
        for rank in self.dst.holders:
            need = self.need.boxes(rank)
            have = self.hold.boxes(rank) if held_counts else ()
            missing = sum(map(box_volume, need))
            for a in need:
                for h in have:
                    inter = intersect(a, h)
                    if inter:
                        missing -= box_volume(inter)
            out[rank] = missing * self.itemsize
        return out

    @property
    def max_recv(self) -> int:
        """The most bytes any rank receives."""
        return max(self.bytes_recv.values(), default=0)

    @property
    def max_sent(self) -> int:
        """The most bytes any rank sends."""
        return max(self.bytes_sent.values(), default=0)

    @property
    def total_bytes(self) -> int:
        """Bytes sent, summed over every rank."""
        return sum(self.bytes_sent.values())

    @property
    def max_lower_bound(self) -> int:
        """The most bytes any dst rank needs and does not hold."""
        return max(self.lower_bound.values(), default=0)

    @cached_property
    def reduction_bound(self) -> dict[int, int]:
        """Per rank: the bandwidth-optimal volume of the plan's reductions, in bytes.

        Reduce-scatter of a region R over k ranks: each receives (k-1)/k of R; an
        all-reduce: twice that.
        """
        out: dict[int, int] = defaultdict(int)
        for step in self.steps:
            for rank, n in step.reduction_bound():
                out[rank] += n * self.itemsize
        return dict(out)

    @cached_property
    def rank_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups of ranks (two or more) its steps run on, in issue order."""
        out: list[tuple[int, ...]] = []
        for step in self.steps:
            out.extend(g for g in step.rank_groups if len(g) > 1 and g not in out)
        return tuple(out)

    @property
    def collectives(self) -> tuple[tuple[Collective, int], ...]:
        """``(kind, number of groups)`` per step, in issue order."""
        return tuple((s.kind, len(s.rank_groups)) for s in self.steps)

    # -- what the reference executor asks every plan -------------------------------------
    @property
    def inputs(self) -> tuple[int, ...]:
        """The ranks whose pieces the plan takes, in order: src's holders."""
        return self.src.holders

    @property
    def outputs(self) -> tuple[int, ...]:
        """The ranks whose pieces it gives, in order: dst's holders."""
        return self.dst.holders

    def load(self, rank: int, local: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
        """``rank``'s src piece as ``(box, values)`` pieces in the plan's dims (its
        tiling's boxes)."""
        return self.source.load(self.src, self.dims, rank, local)

    def assemble(self, rank: int, store: list[tuple[Box, torch.Tensor]],
                 like: torch.Tensor) -> torch.Tensor:
        """``rank``'s dst piece from the boxes it holds (on ``like``'s device: CPU, or
        ``meta`` for shapes only)."""
        return self.need.assemble(self.dst, self.dims, rank, store, like)

    def for_rank(self, rank: int) -> RankPlan:
        """The part of this plan ``rank`` takes part in (see :class:`RankPlan`)."""
        return RankPlan(self.src, self.dst, self.dims, self.sizes, self.itemsize,
                        tuple(s.restrict(rank) for s in self.steps), self.hold, self.need,
                        self.reduced_axes, self.before, self.element, rank=rank)

    # -- printing ------------------------------------------------------------------------
    @property
    def totals(self) -> dict[str, int]:
        """Every dim's global size (a ragged dim's: the sum of its counts)."""
        return {d: total(n) for d, n in self.sizes}

    def describe_box(self, box: Box) -> str:
        sizes = self.totals
        parts = [f"{d}[{a}:{b}]" for d, (a, b) in zip(self.dims, box) if (a, b) != (0, sizes[d])]
        return " ".join(parts) or "all"

    def __str__(self) -> str:
        sizes = " ".join(f"{d}={n}" for d, n in self.sizes)
        lines = [
            f"plan {self.src.describe()} on {self.src.grid!r}",
            f"  -> {self.dst.describe()} on {self.dst.grid!r}   ({sizes}, {self.itemsize} "
            f"B/{self.element})",
        ]
        if not self.steps:
            lines.append("  1. local: every dst rank slices what it holds (no communication)")
        for i, step in enumerate(self.steps, 1):
            lines.append(f"  {i}. {step.describe(self)}")
        lines.append(
            f"  cost: max recv {format_bytes(self.max_recv)}/rank (lower bound "
            f"{format_bytes(self.max_lower_bound)}), max sent {format_bytes(self.max_sent)}/rank, "
            f"total {format_bytes(self.total_bytes)}, {len(self.steps)} collective(s)"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class RankPlan(_Schedule):
    """One rank's part of a plan: what ``rank`` needs to lower its program.

    The steps are the plan's, in its order, each keeping only what ``rank`` takes part
    in: a group collective only ``rank``'s group (none if it is in none), an
    :class:`Exchange` every rank of the union (each issues the all-to-all) but only the
    transfers ``rank`` sends or receives, in the plan's order. ``hold`` and ``need`` are
    the plan's tilings. Equal to ``plan(...).for_rank(rank)``; computed without planning
    the other ranks' transfers.
    """

    rank: int = 0


# -- entry points --------------------------------------------------------------------------
def plan(src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None, *,
         all_to_all: bool = False) -> Plan:
    """The plan moving a tensor with global ``sizes`` from ``src`` to ``dst`` (a ragged
    dim's size is its tuple of counts).

    ``dtype`` is anything with an ``itemsize`` (a ``torch.dtype``); default 4 bytes.
    ``all_to_all``: issue an exchange that forms all-gathers, or gathers among dst
    replicas after it, as one all-to-all over the union instead (for a caller without
    those groups' process groups). Pure and cached:
    equal arguments return the same object.
    """
    rows = _routed_rows(src, dst, sizes, dtype)
    if rows is not None:
        return rows[0]
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise MimoFxError(f"plan needs two layouts, got {src!r} and {dst!r}; build them "
                          f"with Layout(Grid(...), \"(dp b) s h\") (or PackedLayout)")
    return _plan(src, dst, check_sizes(src, dst, sizes), _itemsize(dtype), all_to_all)


def _itemsize(dtype) -> int:
    itemsize = 4 if dtype is None else getattr(dtype, "itemsize", dtype)
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize <= 0:
        raise MimoFxError(f"dtype={dtype!r}: give a torch.dtype (or a positive number of "
                          f"bytes per element)")
    return itemsize


def plan_for_rank(src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None, *,
                  rank: int, all_to_all: bool = False) -> RankPlan:
    """``rank``'s part of ``plan(src, dst, sizes, dtype)``, planned alone.

    What a rank needs to lower its program (``mimo_fx.compiled.lowering.lower``): the
    same steps with only the groups and transfers it takes part in. Its cost grows with
    that rank's own transfers, not the world's; the decisions every rank must take alike
    take one cheap pass over the ranks. Pure and cached like :func:`plan`.
    """
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise MimoFxError(f"plan_for_rank needs two Layouts, got {src!r} and {dst!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise MimoFxError(f"plan_for_rank: rank={rank!r} must be a non-negative integer (the "
                          f"rank whose part to plan)")
    return _rank_plan(src, dst, check_sizes(src, dst, sizes), _itemsize(dtype), rank,
                      all_to_all)


def backward_plan(
    src: Layout, dst: Layout, sizes: Mapping[str, Size], dtype=None, grad_partial=()
) -> Plan:
    """The adjoint plan: dst cotangents -> src* (src with partial axes replicated).

    Cotangents on dst's replicated axes are taken as consistent, except over the axes in
    ``grad_partial``, where each replica holds a contribution and they are summed.
    """
    rows = _routed_rows(src, dst, sizes, dtype, tuple(grad_partial))
    if rows is not None:
        return rows[1]
    return plan(*backward_layouts(src, dst, grad_partial), sizes, dtype)


def _routed_rows(src, dst, sizes, dtype, grad_partial: tuple[str, ...] = ()
                 ) -> tuple[Plan, Plan] | None:
    """Both plans of a pair with a packed layout on a side, which the row router routes
    (None for a pair of box layouts): the one place the planner asks a layout's kind."""
    from .rows import is_row_pair, plan_layouts

    if not is_row_pair(src, dst):
        return None
    return row_plans(plan_layouts(src, dst, sizes, _itemsize(dtype), grad_partial))


@overload
def row_plans(routing: Any, rank: None = None) -> tuple[Plan, Plan]: ...
@overload
def row_plans(routing: Any, rank: int) -> tuple[RankPlan, RankPlan]: ...
def row_plans(routing: Any, rank: int | None = None
              ) -> tuple[Plan, Plan] | tuple[RankPlan, RankPlan]:
    """Both directions of the row router's ``routing`` (:class:`~mimo_fx.rows.RowRouting`)
    as plans: forward, every rank's src rows to its dst rows; backward, the counted ranks'
    cotangents (each distinct row summed) to every holder of each row. One dim, the rows
    (its element a row of ``routing.row_bytes``; a box, a run of rows), what each rank
    holds a :class:`~mimo_fx.rows.RowTiling`, and one exchange of runs of rows over the
    routing's ranks each way. With ``rank``: that rank's parts (:class:`RankPlan`, equal
    to ``plan.for_rank(rank)``), which list only the transfers it sends or receives."""
    from .rows import RowMap, RowTiling

    r = routing
    src = r.src if r.src is not None else RowMap(dict(zip(r.ranks, r.src_rows)))
    dst = r.dst if r.dst is not None else RowMap(dict(zip(r.ranks, r.dst_rows)))
    held = RowTiling(dict(zip(r.ranks, r.src_rows)))
    used = RowTiling(dict(zip(r.ranks, r.dst_rows)))
    counted = RowTiling({rank: rows if rank in r.counted else (-1,) * len(rows)
                         for rank, rows in zip(r.ranks, r.dst_rows)})
    dims, sizes = (r.dim_name,), ((r.dim_name, r.n_rows),)
    fwd = (_row_exchange(r.ranks, r.sends, rank),)
    bwd = (_row_exchange(r.ranks, r.backward_sends, rank),)
    if rank is None:
        return (Plan(src, dst, dims, sizes, r.row_bytes, fwd, held, used, element="row"),
                Plan(dst, src, dims, sizes, r.row_bytes, bwd, counted, held, element="row"))
    return (RankPlan(src, dst, dims, sizes, r.row_bytes, fwd, held, used, element="row",
                     rank=rank),
            RankPlan(dst, src, dims, sizes, r.row_bytes, bwd, counted, held, element="row",
                     rank=rank))


def _row_exchange(ranks: tuple[int, ...], sends, rank: int | None = None) -> Exchange:
    """``sends[i][j]`` (the rising rows ``ranks[i]`` sends ``ranks[j]``) as one exchange:
    a transfer per run ``[a, b)`` of consecutive rows (with ``rank``: only those it
    sends or receives, in the same order)."""
    from .rows import runs

    return Exchange(tuple(Transfer(s, d, (run,)) for i, s in enumerate(ranks)
                          for j, d in enumerate(ranks) if rank is None or rank in (s, d)
                          for run in runs(sends[i][j])), ranks)


def backward_layouts(src: Layout, dst: Layout, grad_partial=()) -> tuple[Layout, Layout]:
    """The adjoint's (src, dst): dst with ``grad_partial`` partial, and src* (src with
    its partial axes replicated); ``plan_for_rank(*backward_layouts(...), ...)`` is one
    rank's part of :func:`backward_plan`."""
    return _bwd_dst(dst, tuple(grad_partial)), _star(src)


def plan_groups(src: Layout, dst: Layout, sizes: Mapping[str, Size], *,
                all_to_all: bool = False) -> tuple[tuple[int, ...], ...]:
    """The groups of ranks (two or more) the plan's steps run on, in issue order --
    ``plan(...).rank_groups`` -- from the decisions every rank shares, without any
    transfer: what every rank needs to create the same process groups in the same
    order while planning only its own part."""
    f = _frame(src, dst, check_sizes(src, dst, sizes), all_to_all)
    groups: list[tuple[int, ...]] = []
    if f.reduce_axes:
        groups += _groups(f.src, f.reduce_axes, None)
    if f.kind is Collective.ALL_TO_ALL:
        groups.append(f.union)
    elif f.kind is Collective.ALL_GATHER and not f.fused:
        groups += _exchange_gather(f, None).groups
    if f.gather_axes:
        groups += _groups(f.dst, f.gather_axes, None)
    return tuple(dict.fromkeys(g for g in groups if len(g) > 1))


def plan_tilings(src: Layout, dst: Layout, sizes: Mapping[str, Size]) -> tuple[Tiling, ...]:
    """Every tiling the plan's boxes are cut from -- what src holds before and after its
    reduction, what the exchange delivers (dst's need, or its first phase's shares), what
    dst needs -- so every boundary of the plan is one of theirs."""
    f = _frame(src, dst, check_sizes(src, dst, sizes))
    return f.before, f.hold, f.exchange.want, f.need


@cache
def _star(layout: Layout) -> Layout:
    return layout.with_partial() if layout.partial else layout


@cache
def _bwd_dst(dst: Layout, grad_partial: tuple[str, ...]) -> Layout:
    for axis in grad_partial:
        if axis not in dst.replicated:
            raise MimoFxError(
                f"grad_partial={grad_partial}: axis {axis!r} is not replicated in dst "
                f"{dst.describe()!r} (replicated axes: {dst.replicated}); only cotangents "
                f"on replicated axes can be per-replica contributions"
            )
    return dst.with_partial(grad_partial) if grad_partial or dst.partial else dst


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


# -- what every rank's part of a plan derives from ------------------------------------------
@dataclass(frozen=True)
class _Frame:
    """The decisions of a plan that every rank must take alike (tilings, the reduction's
    cut, whether there is an exchange and which collective it is), each computed from
    the layouts alone in at most one cheap pass over the ranks."""

    src: Layout
    dst: Layout
    dims: tuple[str, ...]
    before: Tiling      # what src holds
    hold: Tiling        # what src holds after the reduction (before it if none)
    need: Tiling        # what dst needs
    exchange: Geometry  # what the exchange delivers: need, or its first phase's share
    reduce_axes: tuple[str, ...]
    gather_axes: tuple[str, ...]  # the second phase's axes (disjoint grids only)
    kind: Collective | None  # the exchange: None, ALL_GATHER or ALL_TO_ALL
    fused: bool         # reduce-scatter + all-gather of the same shares: one all-reduce

    @cached_property
    def union(self) -> tuple[int, ...]:
        """The ranks of both grids, in order: every one issues the all-to-all."""
        a, b = sorted((self.src.grid.ranks, self.dst.grid.ranks), key=lambda r: r.start)
        if b.start <= a.stop:
            return tuple(range(a.start, max(a.stop, b.stop)))
        return tuple(a) + tuple(b)


def _disjoint(src: Layout, dst: Layout) -> bool:
    a, b = src.grid.ranks, dst.grid.ranks
    return a.stop <= b.start or b.stop <= a.start


@lru_cache(maxsize=64)
def _frame(src: Layout, dst: Layout, sizes: tuple[tuple[str, Size], ...],
           all_to_all: bool = False) -> _Frame:
    dims = tuple(d for d, _ in sizes)
    size_map = dict(sizes)
    before = hold = Tiling.of(src, dims, size_map)
    need = Tiling.of(dst, dims, size_map)
    kept = dst.partial
    reduce_axes = tuple(a for a in src.partial if a not in kept)
    gather_axes = tuple(a for a in need.free_axes if a not in kept)
    want = need
    ragged = frozenset(src.ragged_dims) | frozenset(dst.ragged_dims)
    k = prod(dst.grid.axis_size(a) for a in gather_axes)
    phase_dim = _share_dim(need, dst, k, ragged)
    if (_disjoint(src, dst) and k > 1 and phase_dim is not None and not all_to_all
            and (reduce_axes or not _one_round(src, dst, dims, size_map, kept))):
        want = need.refine(phase_dim, gather_axes)
    else:  # (every dim ragged, a small exchange, or one all-to-all over the union asked
        gather_axes = ()  # for: each dst rank takes its whole box in one round)
    cut = _reduce_dim(src, dst, hold, want, reduce_axes) if reduce_axes else None
    if cut is not None:
        hold = hold.refine(cut, reduce_axes)
    geometry = Geometry(hold, want, kept)
    kind = geometry.kind()
    if all_to_all and kind is Collective.ALL_GATHER:
        kind = Collective.ALL_TO_ALL
    fused = (cut is not None and kind is Collective.ALL_GATHER
             and _fusable(before, want, cut, reduce_axes))
    return _Frame(src, dst, dims, before, hold, need, geometry, reduce_axes, gather_axes, kind,
                  fused)


ONE_ROUND_ELEMENTS = 1 << 16  # an exchange up to this many elements per receiver: one round
ONE_ROUND_SAMPLE = 256  # src and dst holders whose traffic decides one round or two


def _one_round(src: Layout, dst: Layout, dims: tuple[str, ...], sizes: Mapping[str, Size],
               kept: tuple[str, ...]) -> bool:
    """Whether an exchange across disjoint grids that several dst replicas need goes in
    one round, every dst rank taking its whole piece from the src holders, rather than
    two (a share from them, then the rest all-gathered among the replicas, so that each
    element crosses once). Both give every receiver the same bytes, the lower bound.
    Two rounds spare the link between the grids; one saves a round trip and a
    collective, which is most of the time of a small exchange. One round is taken when
    the busiest receiver takes at most ``ONE_ROUND_ELEMENTS`` and no sender sends more
    than it. Decided at even sizes (a ragged dim's counts equal), so that the sizes of a
    bridge whose sizes change share its template's structure, on the first
    ``ONE_ROUND_SAMPLE`` holders of each side (grids repeat their pattern along their
    outer axes)."""
    even = {d: _even_counts(sizes[d]) for d in dims}
    geometry = Geometry(Tiling.of(src, dims, even), Tiling.of(dst, dims, even), kept)
    recv = 0
    for r in dst.holders[:ONE_ROUND_SAMPLE]:  # (a large exchange is known at its first)
        recv = max(recv, sum(box_volume(t.box) for t in geometry.receives(r)))
        if recv > ONE_ROUND_ELEMENTS:
            return False
    return all(sum(box_volume(t.box) for t in geometry.sends(r)) <= recv
               for r in src.holders[:ONE_ROUND_SAMPLE])


def _even_counts(size: Size) -> Size:
    """``size``; a ragged dim's counts made equal (their mean, at least 1)."""
    if not isinstance(size, tuple):
        return size
    return (max(1, sum(size) // len(size)),) * len(size)


def _longest_dim(tiling: Tiling, rank: int, ragged: frozenset[str] = frozenset()) -> str | None:
    """The dim along which ``rank``'s region is longest (first on ties): where to cut. A
    ragged dim is never cut (its boundaries are run-time counts); None if only those."""
    extents = [sum(b - a for a, b in seg) for seg in tiling.segments(rank)]
    candidates = [i for i, d in enumerate(tiling.dims) if d not in ragged]
    if not candidates:
        return None
    return tiling.dims[max(candidates, key=lambda i: (extents[i], -i))]


def _share_dim(need: Tiling, dst: Layout, k: int, ragged: frozenset[str]) -> str | None:
    """The dim the first phase cuts into ``k`` shares: the outermost of the dst piece
    (its first local dim) that splits evenly, else the outermost at least ``k`` long,
    else the longest. Cut there, each share is a contiguous run of the dst piece: a
    sender sends a view, and the gathered shares laid end to end are the dst piece, with
    no copy on either side. None if every dim is ragged (never cut)."""
    rank = dst.holders[0]
    extents = dict(zip(need.dims, (sum(b - a for a, b in seg) for seg in need.segments(rank))))
    order = [d for d in dst.dims if d not in ragged]
    for fits in (lambda n: n % k == 0 and n >= k, lambda n: n >= k):
        for d in order:
            if fits(extents[d]):
                return d
    return _longest_dim(need, rank, ragged)


def _reduce_dim(src: Layout, dst: Layout, hold: Tiling, want: Tiling,
                axes: tuple[str, ...]) -> str:
    """The dim the reduce-scatter cuts: the least peak per-rank traffic (reduction plus
    what is exchanged after it), then the least exchange, then the longest dim; so
    partial -> TP-sharded on the same dim is one reduce-scatter and nothing else."""
    first = src.holders[0]
    k = len(src.grid.group_of(first, axes))
    ragged = frozenset(src.ragged_dims) | frozenset(dst.ragged_dims)
    longest = _longest_dim(hold, first, ragged)
    extents = dict(zip(hold.dims, (sum(b - a for a, b in seg) for seg in hold.segments(first))))
    hinted = {d for d, run in dst.sharding.items() if set(run) & set(axes)}
    order = sorted(((i, d) for i, d in enumerate(hold.dims) if d not in ragged),
                   key=lambda e: (e[1] not in hinted, e[1] != longest))
    if not order:
        raise MimoFxError(
            f"src {src.describe()!r} is partial over {axes} but every dim is ragged; a "
            f"reduce-scatter cuts a dim of known size: add one, or reduce before moving")
    costs = ReduceCosts(hold, want, axes)
    best = None
    for index, dim in order:
        peak, exchanged = costs.cost(index)
        cost = (peak, exchanged, dim != longest, index)
        if best is None or cost < best[0]:
            best = (cost, dim)
        if not exchanged and extents[dim] % k == 0:
            break  # a balanced reduce-scatter that leaves nothing to move: optimal
    assert best is not None  # k >= 2 candidates were tried
    return best[1]


def _fusable(before: Tiling, want: Tiling, dim: str, axes: tuple[str, ...]) -> bool:
    """Whether the reduce-scatter (into ``dim``, over ``axes``) and the all-gather after
    it are one all-reduce: every src holder wants exactly its group's region, cut as src
    cuts it, and every member's share is non-empty. Then the all-gather's groups are the
    reduce-scatter's and each member sends exactly its share. A column at a time."""
    ranks = before.grid.ranks
    head = range(ranks.start, min(ranks.stop, ranks.start + 64))
    return _fusable_over(head, before, want, dim, axes) and (
        head == ranks or _fusable_over(ranks, before, want, dim, axes))


def _fusable_over(ranks: range, before: Tiling, want: Tiling, dim: str,
                  axes: tuple[str, ...]) -> bool:
    """:func:`_fusable` for the src holders among ``ranks``."""
    k = prod(before.grid.axis_size(a) for a in axes)
    held = before.holds_column(ranks)
    cut = before.dims.index(dim)
    for d, (wanted, owners) in enumerate(zip(want.held_owner_columns(ranks),
                                             before.owner_columns(ranks))):
        w, h = want.tilings[d], before.tilings[d]

        def same(pair: tuple[int, int], w=w, h=h, d=d) -> bool:
            if pair[0] < 0:
                return False  # a src holder that holds no dst piece
            region = h.owned(pair[1])
            return w.owned(pair[0]) == region and (
                d != cut or all(b - a >= k for a, b in region))

        pairs = list(zip(wanted, owners))
        table = {pair: same(pair) for pair in set(pairs)}
        if not all(table[pair] for pair, mine in zip(pairs, held) if mine):
            return False
    return True


# -- the steps, for every rank or for one ---------------------------------------------------
def _steps(f: _Frame, rank: int | None) -> tuple[Step, ...]:
    """The plan's steps; with ``rank``, only the groups and transfers it takes part in."""
    steps: list[Step] = []
    if f.fused:  # the reduce-scatter's shares are then all-gathered in its groups
        rs = _reduce_step(f, rank)
        steps.append(AllReduce(rs.groups, rs.regions, rs.shares))
    elif f.reduce_axes:
        steps.append(_reduce_step(f, rank))
    if f.kind is Collective.ALL_TO_ALL:
        steps.append(Exchange(_transfers(f, rank), f.union))
    elif f.kind is Collective.ALL_GATHER and not f.fused:
        steps.append(_exchange_gather(f, rank))
    if f.gather_axes:
        steps.append(_phase_two(f, rank))
    return tuple(steps)


def _groups(layout: Layout, axes: tuple[str, ...], rank: int | None):
    """The groups of ``layout``'s holders varying ``axes``: all, or ``rank``'s (if any)."""
    if rank is None:
        return tuple(g for g in layout.grid.groups(axes) if layout.holds(g[0]))
    return (layout.grid.group_of(rank, axes),) if layout.holds(rank) else ()


def _reduce_step(f: _Frame, rank: int | None) -> ReduceScatter:
    groups = _groups(f.src, f.reduce_axes, rank)
    regions = tuple(f.before.boxes(g[0]) for g in groups)
    shares = tuple(tuple(f.hold.boxes(r) for r in g) for g in groups)
    return ReduceScatter(groups, regions, shares)


def _phase_two(f: _Frame, rank: int | None) -> Gather:
    groups = _groups(f.dst, f.gather_axes, rank)
    want = f.exchange.want
    return Gather(groups, tuple(tuple(want.boxes(r) for r in g) for g in groups))


def _exchange_gather(f: _Frame, rank: int | None) -> Gather:
    """The exchange issued as all-gathers: every group, or ``rank``'s."""
    geometry = f.exchange
    if rank is None:
        leaders = [r for r in want_holders(geometry.want) if geometry.lacks(r)]
    else:
        leaders = [rank] if geometry.want.holds(rank) and geometry.lacks(rank) else []
    groups, shares = [], []
    listed: set[int] = set()
    for leader in leaders:
        if leader in listed:
            continue  # its group is listed already, by its first member
        group = geometry.group(leader)
        listed.update(group)
        groups.append(group)
        shares.append(tuple(geometry.payload(m, group[0] if m != group[0] else group[1])
                            for m in group))
    return Gather(tuple(groups), tuple(shares))


def _transfers(f: _Frame, rank: int | None) -> tuple[Transfer, ...]:
    """Every receiver's transfers in rank order; or ``rank``'s part of that list."""
    geometry = f.exchange
    if rank is None:
        return tuple(t for r in want_holders(geometry.want) for t in geometry.receives(r))
    sends = geometry.sends(rank)
    cut = next((i for i, t in enumerate(sends) if t.dst > rank), len(sends))
    return tuple(sends[:cut]) + tuple(geometry.receives(rank)) + tuple(sends[cut:])


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Pause the cycle collector while planning: a plan at scale allocates millions of
    small acyclic tuples, which the collector would otherwise walk again and again (more
    than half the planning time of a 65,536-rank all-to-all). The caller's setting is
    restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@lru_cache(maxsize=64)
@_no_cycle_collection()
def _plan(src: Layout, dst: Layout, sizes: tuple[tuple[str, Size], ...], itemsize: int,
          all_to_all: bool = False) -> Plan:
    f = _frame(src, dst, sizes, all_to_all)
    return Plan(src, dst, f.dims, sizes, itemsize, _steps(f, None), f.hold, f.need,
                f.reduce_axes, f.before)


@lru_cache(maxsize=256)
@_no_cycle_collection()
def _rank_plan(src: Layout, dst: Layout, sizes: tuple[tuple[str, Size], ...], itemsize: int,
               rank: int, all_to_all: bool = False) -> RankPlan:
    f = _frame(src, dst, sizes, all_to_all)
    return RankPlan(src, dst, f.dims, sizes, itemsize, _steps(f, rank), f.hold, f.need,
                    f.reduce_axes, f.before, rank=rank)


def clear_caches() -> None:
    """Forget every cached plan (the whole-world ones, the per-rank ones, and the
    decisions both share): for timing cold planning."""
    _plan.cache_clear()
    _rank_plan.cache_clear()
    _frame.cache_clear()
    _digit_column.cache_clear()
