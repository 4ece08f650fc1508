"""Per-rank plans: ``plan_for_rank`` against the whole plan and the oracle.

- every rank's part equals the whole plan restricted to that rank, and lowers to the
  same program;
- the whole plan is the union of the ranks' parts: the receivers' transfers in rank
  order are its exchange, the senders' transfers are the same multiset, and the groups
  are the ones the ranks name;
- what a rank's part says it receives is, by the oracle's index sets, what it needs and
  does not hold;
- the exchange is issued as all-gathers exactly when its transfers form disjoint
  all-gather groups (an independent classification of the same transfers);
- receivers on the src grid take every piece from their own replica.

The cases: the shared table, random grid pairs (hypothesis), and the benchmark's bridges
and the dense all-to-all at 64 ranks.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest
import torch
from cases import CASES, RAGGED, Case, case_ids
from harness import box_mask, index_mask
from hypothesis import given
from test_properties import SETTINGS, pairs

from mimo_fx import Collective, Grid, Layout, MimoFxError, backward_plan, plan
from mimo_fx.compiled.lowering import lower
from mimo_fx.plan import (
    AllReduce,
    Exchange,
    Gather,
    RankPlan,
    ReduceScatter,
    _frame,
    _plan,
    _rank_plan,
    backward_layouts,
    plan_for_rank,
    plan_groups,
)


def _plans(case: Case):
    yield plan(case.src, case.dst, case.sizes)
    yield backward_plan(case.src, case.dst, case.sizes)


def _union(p) -> list[int]:
    ranks = set(p.src.grid.ranks) | set(p.dst.grid.ranks)
    return sorted(ranks | {max(ranks) + 1})  # and one rank on neither grid


def _parts(p) -> dict[int, RankPlan]:
    return {r: plan_for_rank(p.src, p.dst, dict(p.sizes), p.itemsize, rank=r)
            for r in _union(p)}


def check_parts(p, lowered: bool = True) -> None:
    """Every rank's part is the plan restricted to it (and lowers alike); the plan is
    the union of the parts."""
    parts = _parts(p)
    for rank, part in parts.items():
        assert part == p.for_rank(rank), f"rank {rank}'s part differs from the plan's"
        if lowered:
            assert lower(part, rank) == lower(p, rank), f"rank {rank} lowers differently"
    for i, step in enumerate(p.steps):
        mine = {r: part.steps[i] for r, part in parts.items()}
        if isinstance(step, Exchange):
            received = [t for r in sorted(mine) for t in mine[r].transfers if t.dst == r]
            assert tuple(received) == step.transfers
            sent = Counter(t for r in mine for t in mine[r].transfers if t.src == r)
            assert sent == Counter(step.transfers)
            assert all(s.ranks == step.ranks for s in mine.values())
        else:
            named = {g: (s.shares[k], getattr(s, "regions", (None,) * len(s.groups))[k])
                     for s in mine.values() for k, g in enumerate(s.groups)}
            assert sorted(named) == list(step.groups)
            regions = getattr(step, "regions", (None,) * len(step.groups))
            assert [named[g] for g in step.groups] == list(zip(step.shares, regions))


def check_received(p, sizes: dict[str, int]) -> None:
    """By each rank's own part: it receives exactly what it needs and does not hold."""
    if p.src.partial:
        return
    case = Case("random", p.src, p.dst, sizes)
    dims = p.dims
    for rank in p.dst.holders:
        part = plan_for_rank(p.src, p.dst, sizes, p.itemsize, rank=rank)
        count = torch.zeros([sizes[d] for d in dims], dtype=torch.int64)
        for step in part.steps:
            for box in _received(step, rank):
                count += box_mask(box, case, dims)
        need = index_mask(p.dst, rank, case, dims)
        held = index_mask(p.src, rank, case, dims)
        assert int(count.max()) <= 1 and torch.equal(count.bool(), need & ~held)


def _received(step, rank: int):
    if isinstance(step, Exchange):
        return [t.box for t in step.transfers if t.dst == rank]
    if isinstance(step, Gather):
        return [b for g, shares in zip(step.groups, step.shares) if rank in g
                for r, share in zip(g, shares) if r != rank for b in share]
    return []


def check_classified(p) -> None:
    """The exchange is all-gathers iff its transfers form disjoint all-gather groups."""
    f = _frame(p.src, p.dst, p.sizes)
    if f.kind is None:
        assert not any(f.exchange.receives(r) for r in _union(p))
        return
    transfers = [t for r in p.dst.holders for t in f.exchange.receives(r)]
    groups = _gather_groups(transfers)
    if f.kind is Collective.ALL_GATHER:
        assert groups is not None
        shares = tuple(tuple(groups[g][r] for r in g) for g in sorted(groups))
        if f.fused:  # the reduce-scatter's groups and shares: those, and groups of nothing
            (step,) = [s for s in p.steps if isinstance(s, AllReduce)]
            listed = {g: share for g, share in zip(step.groups, step.shares)}
            assert {g: listed.pop(g) for g in sorted(groups)} == dict(zip(sorted(groups), shares))
            assert all(not box for share in listed.values() for part in share for box in part)
            return
        step = next(s for s in p.steps if isinstance(s, Gather)
                    and s.groups == tuple(sorted(groups)))
        assert step.shares == shares
        reduced = [s for s in p.steps if isinstance(s, ReduceScatter)]
        assert not reduced or (reduced[0].groups, reduced[0].shares) != (step.groups, shares)
    elif groups is not None:  # documented: a receiver that wants none of what it holds
        assert any(not _wants_own(f.exchange, t.dst) for t in transfers)


def _gather_groups(transfers):
    """Groups ``{group: {member: payload}}`` if every sender sends all its receivers the
    same boxes and the groups so formed are disjoint, each member contributing; else
    None. Written from the definition, independent of the planner's classification."""
    sends: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for t in transfers:
        sends[t.src][t.dst].append(t.box)
    groups: dict[tuple[int, ...], dict[int, tuple]] = {}
    for sender, by_dst in sends.items():
        payloads = {tuple(boxes) for boxes in by_dst.values()}
        if len(payloads) != 1:
            return None
        groups.setdefault(tuple(sorted({sender, *by_dst})), {})[sender] = payloads.pop()
    members = [r for g in groups for r in g]
    if len(members) != len(set(members)) or any(len(c) != len(g) for g, c in groups.items()):
        return None
    return groups


def _wants_own(geometry, rank: int) -> bool:
    if not geometry.hold.holds(rank):
        return False
    own = geometry.hold.owners(rank)
    return all(c in geometry.readable(d, o) for d, (o, c) in enumerate(
        zip(geometry.want.owners(rank), own)))


def check_own_replica(p) -> None:
    """A receiver holding src takes every piece from the holder with its free coordinates."""
    f = _frame(p.src, p.dst, p.sizes)
    hold = f.exchange.hold
    free = [hold.grid.axis_index(a) for a in hold.free_axes if a not in p.dst.partial]
    for step in p.steps:
        for t in getattr(step, "transfers", ()):
            if hold.holds(t.dst):
                src, dst = hold.grid.coord_tuple(t.src), hold.grid.coord_tuple(t.dst)
                assert [src[k] for k in free] == [dst[k] for k in free], t


@pytest.mark.parametrize("case", CASES + RAGGED, ids=case_ids(CASES + RAGGED))
def test_rank_parts_are_the_plan_restricted_and_union_to_it(case: Case):
    for p in _plans(case):
        check_parts(p)
        check_classified(p)
        check_own_replica(p)


@SETTINGS
@given(pairs())
def test_rank_parts_on_random_pairs(pair):
    src, dst, sizes = pair
    p = plan(src, dst, sizes)
    check_parts(p, lowered=False)
    check_received(p, sizes)
    check_classified(p)
    check_own_replica(p)


def _bench_cases(n: int) -> list[tuple[str, Layout, Layout, dict[str, int]]]:
    """The benchmark's bridges (bench/plan_quality.py) and the dense all-to-all."""
    def lcm_b(src: Grid, dst: Grid) -> int:
        return math.lcm(src.axis_size("dp"), dst.axis_size("dp"))

    pairs_ = [
        ("fan_in", Grid(tp=2, dp=n // 2), "(dp b) s h", Grid(tp=4, dp=n // 4), "(dp b) s h", {}),
        ("fan_out", Grid(tp=4, dp=n // 4), "(dp b) s h", Grid(tp=2, dp=n // 2), "(dp b) s h", {}),
        ("equal_cp", Grid(tp=4, dp=n // 4), "(dp b) s h", Grid(tp=2, cp=2, dp=n // 4),
         "(dp b) (cp s) h", {"zigzag": "cp"}),
        ("fan_in_cp", Grid(tp=2, dp=n // 2), "(dp b) s h", Grid(tp=2, cp=2, dp=n // 4),
         "(dp b) (cp s) h", {"zigzag": "cp"}),
        ("pipelined_tp4", Grid(tp=2, dp=n // 4), "(dp b) s h",
         Grid(tp=4, dp=n // 8, offset=n // 2), "(dp b) s h", {}),
        ("pipelined_cp", Grid(tp=2, dp=n // 4), "(dp b) s h",
         Grid(tp=2, cp=2, dp=n // 8, offset=n // 2), "(dp b) (cp s) h", {"zigzag": "cp"}),
    ]
    out = [(name, Layout(sg, sp), Layout(dg, dp, **kw), {"b": lcm_b(sg, dg), "s": 8, "h": 4})
           for name, sg, sp, dg, dp, kw in pairs_]
    g = Grid(tp=2, dp=n // 2)
    out.append(("partial_fan_in", Layout(g, "(dp b) s h", partial="tp"),
                Layout(Grid(tp=4, dp=n // 4), "(dp b) s h"), {"b": n // 2, "s": 8, "h": 4}))
    dense = Grid(dp=n)
    out.append(("dense", Layout(dense, "(dp b) s h"), Layout(dense, "b (dp s) h"),
                {"b": n, "s": n, "h": 2}))
    return out


@pytest.mark.parametrize("name, src, dst, sizes", _bench_cases(64),
                         ids=[c[0] for c in _bench_cases(64)])
def test_rank_parts_of_the_benchmark_bridges(name, src, dst, sizes):
    p = plan(src, dst, sizes)
    check_parts(p, lowered=name != "dense")  # dense: 4,032 transfers, lowered per rank
    check_classified(p)
    check_own_replica(p)
    if name == "dense":
        (step,) = p.steps
        assert isinstance(step, Exchange) and len(step.transfers) == 64 * 63
        part = plan_for_rank(src, dst, sizes, rank=5)
        assert lower(part, 5) == lower(p, 5)


def test_rank_parts_cost_no_more_than_their_transfers_to_hold():
    """The dense all-to-all's part holds 2(N-1) transfers, the whole plan N(N-1)."""
    g = Grid(dp=32)
    src, dst = Layout(g, "(dp b) s h"), Layout(g, "b (dp s) h")
    part = plan_for_rank(src, dst, {"b": 32, "s": 32, "h": 1}, rank=7)
    (step,) = part.steps
    assert len(step.transfers) == 2 * 31 and step.ranks == tuple(range(32))
    assert {t.src for t in step.transfers if t.dst == 7} == set(range(32)) - {7}


@pytest.mark.parametrize("rank", [-1, 1.0, "3", True])
def test_plan_for_rank_rejects_a_rank_that_is_not_one(rank):
    g = Grid(dp=2)
    with pytest.raises(MimoFxError, match="must be a non-negative integer"):
        plan_for_rank(Layout(g, "(dp b)"), Layout(g, "b"), {"b": 2}, rank=rank)


def test_lowering_another_ranks_part_is_refused():
    g = Grid(dp=2)
    part = plan_for_rank(Layout(g, "(dp b)"), Layout(g, "b"), {"b": 2}, rank=0)
    with pytest.raises(MimoFxError, match="rank 0's part of the plan, not rank 1's"):
        lower(part, 1)


def test_plan_caches_are_bounded():
    assert _plan.cache_info().maxsize == 64
    assert _rank_plan.cache_info().maxsize is not None
    assert _frame.cache_info().maxsize is not None


def _groups_match(src, dst, sizes) -> None:
    for layouts, p in (((src, dst), plan(src, dst, sizes)),
                       (backward_layouts(src, dst), backward_plan(src, dst, sizes))):
        assert plan_groups(*layouts, sizes) == p.rank_groups


@pytest.mark.parametrize("case", CASES + RAGGED, ids=case_ids(CASES + RAGGED))
def test_plan_groups_are_the_whole_plan_s_groups(case: Case):
    """What a bridge creates its process groups from, on every rank alike."""
    _groups_match(case.src, case.dst, case.sizes)


@SETTINGS
@given(pairs())
def test_plan_groups_on_random_pairs(pair):
    _groups_match(*pair)


# cases whose exchange forms all-gathers (on disjoint grids a gather is the second phase)
GATHERING = [c for c in CASES if "disjoint" not in c.tags
             and any(isinstance(s, Gather) for s in plan(c.src, c.dst, c.sizes).steps)]


@pytest.mark.parametrize("case", GATHERING, ids=case_ids(GATHERING))
def test_an_exchange_issued_as_one_all_to_all_moves_the_same_boxes(case: Case):
    """``all_to_all=True`` (for a bridge without the gathers' process groups): the same
    elements reach the same ranks, over the union, and every rank's part says so."""
    gathered = plan(case.src, case.dst, case.sizes)
    p = plan(case.src, case.dst, case.sizes, all_to_all=True)
    assert all(not isinstance(s, Gather) or s is p.steps[-1] for s in p.steps)
    check_received(p, case.sizes)
    assert p.max_recv == gathered.max_recv
    for rank in sorted(set(case.src.grid.ranks) | set(case.dst.grid.ranks)):
        part = plan_for_rank(case.src, case.dst, case.sizes, rank=rank, all_to_all=True)
        assert lower(part, rank) == lower(p, rank)
