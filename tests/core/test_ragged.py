"""Ragged cuts (a dim cut into shards of run-time lengths) against full-tensor math.

The oracle cuts a ragged dim with ``torch.split`` by its counts; the reference backend
must give every dst rank ``shard(X, dst, t=counts)`` and every src rank
``shard(G, src*, t=counts)`` back, bitwise, on the ``RAGGED`` table (fan-in, fan-out
with per-sample counts, equal, TP-sharded and partial inputs, disjoint grids, and cuts
that an even dst layout splits) and on random counts, zero-length shards included
(hypothesis). Counts are inferred from the pieces when not given. Every mistake in a
ragged layout or its counts is a :class:`MimoFxError` that names it.
"""

from __future__ import annotations

import pytest
import torch
from cases import RAGGED, Case, case_ids, star
from harness import expected_input_grad, expected_output, mismatch, oracle_data
from hypothesis import given, settings
from hypothesis import strategies as st

from mimo_fx import Grid, Layout, MimoFxError, plan
from mimo_fx.reference import redistribute, shard, unshard


def _roundtrip(case: Case, seed: int) -> list[str]:
    """Forward and backward of ``case`` on the reference backend vs the oracle."""
    x, g = oracle_data(case, seed)
    pieces = {r: t.requires_grad_() for r, t in shard(x, case.src, **case.counts).items()}
    # counts are inferred from the pieces where they are one per src shard
    given = {d: c for d, c in case.counts.items() if len(c) != case.src.shards(d)}
    y = redistribute(pieces, case.src, case.dst, **given)
    want = expected_output(case, x)
    problems = [mismatch(case, y.get(r), want.get(r), f"rank {r}: output")
                for r in set(y) | set(want)]
    cot = shard(g, star(case.dst), **case.counts)
    ranks = sorted(y)
    torch.autograd.backward([y[r] for r in ranks], [cot[r] for r in ranks])
    for r, w in expected_input_grad(case, g).items():
        problems.append(mismatch(case, pieces[r].grad, w, f"rank {r}: input gradient",
                                 exact=not case.src.partial))
    return [p for p in problems if p]


@pytest.mark.parametrize("case", RAGGED, ids=case_ids(RAGGED))
def test_reference_forward_and_backward_equal_the_oracle(case: Case):
    assert not _roundtrip(case, 0)


@st.composite
def _counts(draw, case: Case):
    out = {}
    for dim, old in case.counts.items():
        out[dim] = tuple(draw(st.lists(st.integers(0, 5), min_size=len(old),
                                       max_size=len(old))))
    for lay in (case.src, case.dst):  # zigzag cuts of a ragged dim's total need 2*CP | total
        for dim in out:
            axes = lay.sharding[dim]
            if axes and axes[0] in lay.zigzag:
                k = 2 * lay.shards(dim)
                extra = -sum(out[dim]) % k
                out[dim] = out[dim][:-1] + (out[dim][-1] + extra,)
    return case.with_counts(**out)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(RAGGED).flatmap(_counts), st.integers(0, 1000))
def test_random_counts_including_empty_shards(case: Case, seed: int):
    assert not _roundtrip(case, seed)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(RAGGED).flatmap(_counts))
def test_plans_with_random_counts_reach_the_lower_bound(case: Case):
    p = plan(case.src, case.dst, case.sizes)
    if not case.src.partial:
        assert p.max_recv == p.max_lower_bound


def test_oracle_cuts_by_counts_and_unshard_inverts_it():
    layout = Layout(Grid(tp=2, dp=2), "(dp t) h", ragged="dp")
    x = torch.arange(12.0).reshape(6, 2)
    pieces = shard(x, layout, t=(1, 3, 0, 2))  # per-sample counts, two per dp shard
    assert pieces[0].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert pieces[1].tolist() == pieces[0].tolist()            # tp replica
    assert pieces[2].tolist() == [[8.0, 9.0], [10.0, 11.0]]
    assert torch.equal(unshard(pieces, layout), x)             # counts from the pieces


def test_zero_length_shards_are_empty_pieces():
    layout = Layout(Grid(dp=3), "(dp t) h", ragged="dp")
    pieces = shard(torch.ones(2, 4), layout, t=(0, 2, 0))
    assert [tuple(pieces[r].shape) for r in range(3)] == [(0, 4), (2, 4), (0, 4)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(pattern="(dp t) h", ragged="tp"), "ragged axis 'tp' does not cut any dim"),
    (dict(pattern="(dp cp t) h", ragged="dp"), "name them all, ragged=('dp', 'cp')"),
    (dict(pattern="(dp t) h", ragged="pp"), "ragged= names unknown axis 'pp'"),
    (dict(pattern="(cp t) h", ragged="cp", zigzag="cp"), "both ragged and zigzag"),
])
def test_layout_mistakes_name_the_fix(kwargs, message):
    pattern = kwargs.pop("pattern")
    with pytest.raises(MimoFxError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Layout(Grid(tp=2, cp=2, dp=2), pattern, **kwargs)


@pytest.mark.parametrize("sizes, message", [
    ({"t": 8, "h": 2}, "its size is a tuple of counts: t=8 must be a tuple"),
    ({"t": (1, 2, 3), "h": 2}, "has 3 counts; give a multiple of 4"),
    ({"t": (1, -2, 3, 0), "h": 2}, "must be a non-empty tuple of non-negative integers"),
    ({"t": (), "h": 2}, "must be a non-empty tuple"),
])
def test_count_mistakes_name_the_fix(sizes, message):
    src = Layout(Grid(dp=4), "(dp t) h", ragged="dp")
    dst = Layout(Grid(tp=2), "t (tp h)")
    with pytest.raises(MimoFxError, match=message):
        plan(src, dst, sizes)


def test_oracle_needs_counts_that_sum_to_the_size():
    layout = Layout(Grid(dp=2), "(dp t)", ragged="dp")
    with pytest.raises(MimoFxError, match="give their counts"):
        shard(torch.arange(4), layout)
    with pytest.raises(MimoFxError, match="sum to its size 4"):
        shard(torch.arange(4), layout, t=(1, 2))


def test_oracle_takes_a_plain_size_of_a_dim_cut_evenly():
    """Before: shard(x, "(cp t) h", t=48) said "counts t=48 must be a non-empty tuple"."""
    even = Layout(Grid(cp=2), "(cp t) h")
    x = torch.arange(96.0).reshape(48, 2)
    assert torch.equal(shard(x, even, t=48)[1], x[24:])
    with pytest.raises(MimoFxError, match=r"t=40 but x has size 48 along 't'.*drop t="):
        shard(x, even, t=40)
    with pytest.raises(MimoFxError, match="a dim cut evenly needs no size"):
        shard(x, Layout(Grid(cp=2), "(cp t) h", ragged="cp"), t=48)


def test_describe_and_repr_keep_the_ragged_axes():
    layout = Layout(Grid(tp=2, dp=2), "(dp t) h", ragged="dp")
    assert layout.describe() == "(dp t) h [ragged dp]"
    assert eval(repr(layout), {"Layout": Layout, "Grid": Grid}) == layout
    assert layout.ragged_dims == ("t",)
    assert layout.with_partial("tp").ragged == ("dp",)
