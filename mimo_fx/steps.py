"""The steps of a plan, one class per collective kind, and the plans that hold them.

A :class:`Step` subclass that sets ``kind`` is *the* step of that kind (:data:`STEPS`):
what it moves (:meth:`Step.pairs`, :meth:`Step.traffic`), how it restricts to one rank
and how it prints. :class:`Plan` is every rank's schedule, :class:`RankPlan` one rank's
part; :mod:`mimo_fx.plan` builds them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, ClassVar, Protocol

import torch

from .collective import Collective
from .errors import MimoFxError
from .exchange import Transfer
from .regions import Box, Size, box_volume, intersect, total
from .text import format_bytes

__all__ = ["Side", "Holdings", "Step", "STEPS", "kind_of", "Reduce", "ReduceScatter",
           "AllReduce", "Gather", "Exchange", "Plan", "RankPlan"]


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
        """``(rank, elements)``: each member's bandwidth-optimal reduction volume, if it reduces."""
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
        """What each rank holds under src before any reduction (:attr:`hold` is after it)."""
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
        """``rank``'s src piece as ``(box, values)`` pieces of its tiling, in the plan's dims."""
        return self.source.load(self.src, self.dims, rank, local)

    def assemble(self, rank: int, store: list[tuple[Box, torch.Tensor]],
                 like: torch.Tensor) -> torch.Tensor:
        """``rank``'s dst piece from the boxes it holds, on ``like``'s device (CPU, or ``meta``)."""
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

