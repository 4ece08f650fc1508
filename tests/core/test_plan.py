"""Plan properties over the shared table, checked with the oracle's index sets.

- nothing a rank already holds is sent to it, and nobody receives an element twice;
- every rank receives exactly its lower bound (bytes it needs and does not hold),
  computed here independently from ``shard_index``;
- partial inputs cost no more than the bandwidth-optimal reduce-scatter / all-reduce;
- across disjoint grids each element crosses once, unless the exchange is small: then
  every dst replica takes its piece in one round, no sender sending more than the
  busiest receiver takes;
- the collectives are the ones the case calls for.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from cases import CASES, RAGGED, Case, by_name, case_ids
from harness import box_mask, index_mask, received

from mimo_fx import Collective, Grid, Layout, plan
from mimo_fx.plan import Exchange, Gather, Reduce
from mimo_fx.plan import _plan as plan_cache
from mimo_fx.regions import box_volume

ITEM = 4  # float32
plan_module = importlib.import_module("mimo_fx.plan")  # (the package's ``plan`` is the function)


@pytest.mark.parametrize("case", CASES + RAGGED, ids=case_ids(CASES + RAGGED))
def test_receivers_get_exactly_what_they_miss(case: Case):
    p = plan(case.src, case.dst, case.sizes)
    dims = case.src.dims
    got = received(p)
    reduced = bool(set(case.src.partial) - set(case.dst.partial))
    for rank in case.dst.holders:
        need = index_mask(case.dst, rank, case, dims)
        held = torch.zeros_like(need) if reduced else index_mask(case.src, rank, case, dims)
        count = torch.zeros(need.shape, dtype=torch.int64)
        for box in got.get(rank, []):
            count += box_mask(box, case, dims)
        if not reduced:
            assert not (count.bool() & held).any(), f"rank {rank} is sent what it holds"
            assert int(count.max()) <= 1, f"rank {rank} receives an element twice"
            assert torch.equal(count.bool(), need & ~held), f"rank {rank} misses data"
        lower = int((need & ~held).sum()) * ITEM
        assert p.lower_bound[rank] == lower
        if reduced:
            assert p.bytes_recv.get(rank, 0) <= lower + p.reduction_bound.get(rank, 0)
        else:
            assert p.bytes_recv.get(rank, 0) == lower
    if not case.src.partial:
        assert p.max_recv == p.max_lower_bound


DISJOINT = [c for c in CASES + RAGGED if "disjoint" in c.tags]


@pytest.mark.parametrize("case", DISJOINT, ids=case_ids(DISJOINT))
def test_disjoint_grids_each_element_crosses_once(case: Case, two_rounds):
    p = plan(case.src, case.dst, case.sizes)
    src_ranks = set(case.src.grid.ranks)
    crossing = 0
    for step in p.steps:
        if isinstance(step, Exchange):
            for t in step.transfers:
                assert t.src in src_ranks and t.dst not in src_ranks
                crossing += int(box_mask(t.box, case, case.src.dims).sum())
    total = 1
    for n in case.totals.values():
        total *= n
    assert crossing == total
    if any(case.dst.grid.axis_size(a) > 1 for a in case.dst.replicated):
        assert p.steps[-1].kind is Collective.ALL_GATHER  # phase two inside the dst replicas


@pytest.mark.parametrize("n, dst_grid, dst_pattern, zigzag", [
    (8, dict(tp=4), "(dp b) s h", ()),
    (64, dict(tp=4), "(dp b) s h", ()),
    (64, dict(tp=2, cp=2), "(dp b) (cp s) h", ("cp",)),
    (128, dict(tp=2, cp=2), "(dp b) (cp s) h", ("cp",)),
])
def test_disjoint_senders_share_the_exchange_evenly(n, dst_grid, dst_pattern, zigzag,
                                                    two_rounds):
    """Pipelined TP2 x DP(n/4) -> dst x DP(n/8) on the other half: each src TP pair holds
    the same samples, so the bytes crossing should leave from all src ranks alike, not
    from one rank of each pair (which would double the slowest sender's time)."""
    src = Layout(Grid(tp=2, dp=n // 4), "(dp b) s h")
    dst = Layout(Grid(**dst_grid, dp=n // 8, offset=n // 2), dst_pattern, zigzag=zigzag)
    sizes = {"b": n // 4, "s": 32, "h": 8}
    p = plan(src, dst, sizes)
    (exchange,) = [s for s in p.steps if isinstance(s, Exchange)]
    sent = dict.fromkeys(src.grid.ranks, 0)
    for t in exchange.transfers:
        sent[t.src] += box_volume(t.box)
    total = sizes["b"] * sizes["s"] * sizes["h"]  # every element crosses once
    assert sum(sent.values()) == total
    assert max(sent.values()) == min(sent.values()) == total // len(sent)


REPLICATED_DISJOINT = [c for c in DISJOINT if "ragged" not in c.tags]


@pytest.mark.parametrize("case", REPLICATED_DISJOINT, ids=case_ids(REPLICATED_DISJOINT))
def test_a_small_exchange_across_disjoint_grids_takes_one_round(case: Case):
    """The table's exchanges are small. Where two rounds would gather among dst replicas,
    the plan takes one round instead exactly when one round's busiest sender sends no
    more than its busiest receiver takes (the one-round plan: ``all_to_all=True``); its
    receivers still take their lower bound, as every plan's do."""
    p = plan(case.src, case.dst, case.sizes)
    one = plan(case.src, case.dst, case.sizes, all_to_all=True)
    plan_module.clear_caches()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_module, "ONE_ROUND_ELEMENTS", 0)
        two = plan(case.src, case.dst, case.sizes)
    plan_module.clear_caches()
    if not any(isinstance(s, Gather) for s in two.steps[1:]):
        return  # (no replicas to gather among: one plan either way)
    took_one = not any(isinstance(s, Gather) for s in p.steps[1:])
    assert took_one == (one.max_sent <= one.max_recv), f"{p}\none round:\n{one}"
    assert p.max_recv == two.max_recv == p.max_lower_bound


@pytest.mark.parametrize("elements, rounds", [(4096, 1), (4097, 2)])
def test_one_round_up_to_the_threshold_then_two(elements, rounds, monkeypatch):
    """VLM-like: two encoder ranks, each holding half the rows, to a TP2 pair that needs
    every row (``h`` = 64, so a receiver takes ``64 * t`` elements)."""
    plan_module.clear_caches()
    monkeypatch.setattr(plan_module, "ONE_ROUND_ELEMENTS", 4096)
    try:
        src = Layout(Grid(dp=2), "(dp t) h")
        dst = Layout(Grid(tp=2, offset=2), "t h")
        t = 64 if elements == 4096 else 66
        p = plan(src, dst, {"t": t, "h": 64})
        assert len(p.steps) == rounds, str(p)
        assert p.max_recv == p.max_lower_bound == 4 * 64 * t
        if rounds == 2:
            assert isinstance(p.steps[1], Gather) and p.max_sent < p.max_recv
    finally:
        plan_module.clear_caches()


EXPECTED_KINDS = {
    "local": [],
    "gather": [Collective.ALL_GATHER],
    "all_reduce": [Collective.ALL_REDUCE],
    "reduce_scatter": [Collective.REDUCE_SCATTER],
}


@pytest.mark.parametrize("case", [c for c in CASES if set(c.tags) & set(EXPECTED_KINDS)],
                         ids=case_ids([c for c in CASES if set(c.tags) & set(EXPECTED_KINDS)]))
def test_collectives_match_the_case(case: Case):
    p = plan(case.src, case.dst, case.sizes)
    tag = next(t for t in case.tags if t in EXPECTED_KINDS)
    assert [s.kind for s in p.steps] == EXPECTED_KINDS[tag]


def test_fan_in_gathers_pairs_of_dp_siblings():
    enc, llm = Grid(tp=2, dp=4), Grid(tp=2, cp=2, dp=2)
    p = plan(Layout(enc, "(dp b) s h"), Layout(llm, "(dp b) s h"), {"b": 8, "s": 4, "h": 4})
    (step,) = p.steps
    # rank r holds encoder block r // 2 and needs LLM block r // 4 = encoder blocks
    # {2k, 2k+1}: it pairs with the rank two away holding the other block.
    assert step.groups == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_partial_reduce_volume_is_bandwidth_optimal():
    g = Grid(tp=4, dp=2)
    p = plan(Layout(g, "(dp b) h", partial="tp"), Layout(g, "(dp b) (tp h)"), {"b": 4, "h": 8})
    (step,) = p.steps
    assert isinstance(step, Reduce) and step.kind is Collective.REDUCE_SCATTER
    region = 2 * 8  # each tp group reduces its b block: 2 x 8 elements
    for rank in g.ranks:
        assert p.bytes_recv[rank] == (4 - 1) * region // 4 * ITEM


def test_plan_is_cached_and_deterministic():
    case = by_name("fan_in_cp_zigzag")
    first = plan(case.src, case.dst, case.sizes)
    assert plan(case.src, case.dst, dict(case.sizes)) is first
    plan_cache.cache_clear()
    again = plan(case.src, case.dst, case.sizes)
    assert again is not first and again.steps == first.steps


def test_plan_prints_one_step_per_line():
    case = next(c for c in CASES if c.name == "pp_disjoint_to_cp")
    p = plan(case.src, case.dst, case.sizes)
    text = str(p)
    steps = re.findall(r"^\s+\d+\. (\w+)", text, flags=re.M)
    assert steps == [s.kind.value for s in p.steps] == ["all_to_all", "all_gather"]
    assert "(dp b) (cp s) h [zigzag cp]" in text and "lower bound" in text


def test_local_plan_prints_local_step():
    case = next(c for c in CASES if c.name == "fan_out")
    text = str(plan(case.src, case.dst, case.sizes))
    assert re.search(r"^\s+1\. local", text, flags=re.M)


def test_dtype_scales_bytes():
    case = by_name("fan_in")
    p32 = plan(case.src, case.dst, case.sizes, torch.float32)
    p16 = plan(case.src, case.dst, case.sizes, torch.bfloat16)
    assert p32.max_recv == 2 * p16.max_recv > 0
