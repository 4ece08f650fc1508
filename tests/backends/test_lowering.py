"""Lowered programs run for every rank at once, with collectives emulated in threads.

The compiled backend's lowering (wire formats, coalesced blocks, entries read as views,
concatenations or scatters) is checked here on the whole shared table, world sizes up to
16, without processes: each rank runs its own program in a thread and the collectives
meet in an in-process rendezvous that computes them with plain tensor math. Outputs and
input gradients are compared with the oracle (bitwise for pure data movement). The gloo
tests in ``test_compiled.py`` then check the same programs on real functional
collectives for a sample.
"""

from __future__ import annotations

import pytest
import torch
from cases import CASES, Case, case_ids, star
from harness import expected_input_grad, mismatch, oracle_data
from threads import run_plan

from mimo_fx import Collective, Grid, Layout, plan
from mimo_fx.compiled import lowering as lower_mod
from mimo_fx.compiled.lowering import Cat, Scatter, View, coalesce
from mimo_fx.plan import backward_plan
from mimo_fx.reference import shard, unshard

# the table's sizes are small; these take the large-tensor paths of the lowering
LARGE = [Case("large_fan_in_zigzag", Layout(Grid(tp=2, dp=4), "(dp b) s h"),
              Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag=("cp",)),
              {"b": 8, "s": 256, "h": 64})]


@pytest.mark.parametrize("how", ["interpreted", "straight"])
@pytest.mark.parametrize("case", CASES + LARGE, ids=case_ids(CASES + LARGE))
def test_program_forward_and_adjoint_match_oracle(case: Case, how: str):
    """Each rank's program, interpreted (an eager call) or as its straight-line function
    (what a compiled call traces)."""
    x, g = oracle_data(case, 1)
    fwd = plan(case.src, case.dst, case.sizes, torch.float64)
    ys = run_plan(fwd, shard(x, case.src), len(case.src.local_dims), how)
    x_dst = x.permute([case.src.dims.index(d) for d in case.dst.dims])
    if case.dst.partial:  # the partial pieces sum to the input
        held = {r: y for r, y in ys.items() if case.dst.holds(r)}
        torch.testing.assert_close(unshard(held, case.dst, **case.sizes), x_dst)
    else:
        expected = shard(x_dst, case.dst)
        for rank, y in ys.items():
            assert not mismatch(case, y, expected.get(rank), f"rank {rank}: output")
    bwd = backward_plan(case.src, case.dst, case.sizes, torch.float64)
    grads = run_plan(bwd, shard(g, star(case.dst)), len(case.dst.local_dims), how)
    for rank, want in expected_input_grad(case, g).items():
        assert not mismatch(case, grads[rank], want, f"rank {rank}: input gradient", exact=True)


def test_coalesce_joins_neighbours_along_any_one_dim():
    # two boxes adjacent along s -> one interval; then a third differing along b joins
    boxes = [((0, 2), (4, 8), (0, 3)), ((0, 2), (8, 12), (0, 3)), ((2, 4), (4, 12), (0, 3))]
    assert coalesce(boxes) == [(((0, 4),), ((4, 12),), ((0, 3),))]
    # zigzag chunks are not adjacent: kept as two intervals of one block, in list order
    boxes = [((0, 2), (12, 16)), ((0, 2), (0, 4))]
    assert coalesce(boxes) == [(((0, 2),), ((12, 16), (0, 4)))]
    # differing on two dims: not joinable
    boxes = [((0, 2), (0, 4)), ((2, 4), (4, 8))]
    assert len(coalesce(boxes)) == 2


def _nodes(node):
    yield node
    if isinstance(node, Cat):
        for part in node.parts:
            yield from _nodes(part)


def test_received_buffer_in_dst_order_is_the_output_without_a_copy():
    """TP2xDP4 -> TP4xDP2 gathers along b: the gathered buffer is the dst piece."""
    src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    dst = Layout(Grid(tp=4, dp=2), "(dp b) s h")
    p = plan(src, dst, {"b": 8, "s": 4, "h": 3})
    for rank in range(8):
        prog = lower_mod.lower(p, rank)
        assert isinstance(prog.out, View) and prog.out.index is None and prog.out.entry > 0
        assert (prog.src_expand, prog.src_perm, prog.out_perm, prog.out_local) == (None,) * 4


def test_pieces_along_an_inner_dim_are_concatenated_not_scattered():
    src = Layout(Grid(tp=2, dp=4), "(dp b) s (tp h)")
    dst = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    p = plan(src, dst, {"b": 8, "s": 4, "h": 6})
    prog = lower_mod.lower(p, 0)
    assert isinstance(prog.out, Cat) and prog.out.dim == 2
    assert not any(isinstance(n, Scatter) for n in _nodes(prog.out))


def test_unread_entries_are_not_materialised():
    """Fan-in zigzag: a rank never reads back its own all-gather slot."""
    src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag=("cp",))
    prog = lower_mod.lower(plan(src, dst, {"b": 8, "s": 16, "h": 4}), 0)
    (op,) = prog.ops
    assert op.kind is Collective.ALL_GATHER and None in op.unpack


def test_large_nested_pieces_are_written_once_not_concatenated_twice():
    """Fan-in zigzag at 1 MiB: the own half is not copied by an inner and an outer cat."""
    src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag=("cp",))
    small = lower_mod.lower(plan(src, dst, {"b": 8, "s": 16, "h": 4}), 0)
    assert isinstance(small.out, Cat) and isinstance(small.out.parts[0], Cat)
    big = lower_mod.lower(plan(src, dst, LARGE[0].sizes), 0)
    assert isinstance(big.out, Scatter) and len(big.out.writes) == 3
