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

import threading

import pytest
import torch
from cases import CASES, Case, case_ids, star
from harness import expected_input_grad, mismatch, oracle_data

from mimo_fx import Grid, Layout, plan
from mimo_fx.compiled import lowering as lower_mod
from mimo_fx.compiled.executor import CompiledExecutor
from mimo_fx.compiled.lowering import Cat, Scatter, View, coalesce
from mimo_fx.plan import backward_plan
from mimo_fx.reference import shard, unshard


class _Rendezvous:
    """Collectives between threads: each group's n-th call meets the members' n-th calls."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.posts: dict[tuple[tuple[int, ...], int], dict[int, tuple]] = {}
        self.results: dict[tuple[tuple[int, ...], int], dict[int, torch.Tensor]] = {}
        self.calls: dict[tuple[int, tuple[int, ...]], int] = {}

    def collective(self, rank: int, members: tuple[int, ...], post: tuple) -> torch.Tensor:
        with self.cond:
            n = self.calls.get((rank, members), 0)
            self.calls[(rank, members)] = n + 1
            key = (members, n)
            self.posts.setdefault(key, {})[rank] = post
            if len(self.posts[key]) == len(members):
                self.results[key] = _compute(members, self.posts[key])
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: key in self.results, timeout=20):
                raise AssertionError(f"rank {rank}: collective {post[0]} on {members} never "
                                     f"met its peers (mismatched programs)")
            return self.results[key][rank]


class ThreadComm:
    """The comm of one rank (a thread) of a :class:`_Rendezvous`."""

    def __init__(self, world: _Rendezvous, rank: int) -> None:
        self.world, self.rank = world, rank

    def _post(self, kind, ranks, flat, out_splits=(), in_splits=()):
        post = (kind, flat.clone(), tuple(out_splits), tuple(in_splits))
        return self.world.collective(self.rank, ranks, post)

    def all_gather(self, flat, ranks):
        return self._post("all_gather", ranks, flat)

    def reduce_scatter(self, flat, ranks):
        return self._post("reduce_scatter", ranks, flat)

    def all_reduce(self, flat, ranks):
        return self._post("all_reduce", ranks, flat)

    def all_to_all(self, flat, out_splits, in_splits, ranks):
        return self._post("all_to_all", ranks, flat, out_splits, in_splits)


def _compute(members, posts) -> dict[int, torch.Tensor]:
    kinds = {posts[r][0] for r in members}
    flats = [posts[r][1] for r in members]
    assert len(kinds) == 1, f"members {members} issued different collectives {kinds}"
    kind = kinds.pop()
    n = len(members)
    if kind == "all_gather":
        assert len({f.numel() for f in flats}) == 1, "all_gather inputs differ in size"
        return {r: torch.cat(flats) for r in members}
    if kind == "all_reduce":
        total = torch.stack(flats).sum(0)
        return {r: total.clone() for r in members}
    if kind == "reduce_scatter":
        total = torch.stack(flats).sum(0)
        return {r: c.clone() for r, c in zip(members, total.chunk(n))}
    assert kind == "all_to_all"
    out = {}
    for j, r in enumerate(members):
        pieces = []
        for i, s in enumerate(members):
            splits = posts[s][3]
            assert posts[r][2][i] == splits[j], "all_to_all split sizes disagree"
            start = sum(splits[:j])
            pieces.append(flats[i][start:start + splits[j]])
        out[r] = torch.cat(pieces)
    return out


def _run(p, inputs: dict[int, torch.Tensor], ndim: int) -> dict[int, torch.Tensor]:
    """Run ``p`` for every rank of both grids; inputs are the src pieces."""
    ranks = sorted(set(p.src.grid.ranks) | set(p.dst.grid.ranks))
    world = _Rendezvous()
    outs, errors = {}, []

    def one(rank):
        try:
            ex = CompiledExecutor(ThreadComm(world, rank))
            x = inputs.get(rank)
            if x is None:
                x = torch.empty((0,) * ndim, dtype=torch.float64)
            (outs[rank],) = ex.run(lower_mod.lower(p, rank), (x,))
        except BaseException as err:  # reported below
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "\n".join(errors)
    return outs



# the table's sizes are small; these take the large-tensor paths of the lowering
LARGE = [Case("large_fan_in_zigzag", Layout(Grid(tp=2, dp=4), "(dp b) s h"),
              Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag=("cp",)),
              {"b": 8, "s": 256, "h": 64})]


@pytest.mark.parametrize("case", CASES + LARGE, ids=case_ids(CASES + LARGE))
def test_program_forward_and_adjoint_match_oracle(case: Case):
    x, g = oracle_data(case, 1)
    fwd = plan(case.src, case.dst, case.sizes, torch.float64)
    ys = _run(fwd, shard(x, case.src), len(case.src.local_dims))
    x_dst = x.permute([case.src.dims.index(d) for d in case.dst.dims])
    if case.dst.partial:  # the partial pieces sum to the input
        held = {r: y for r, y in ys.items() if case.dst.holds(r)}
        torch.testing.assert_close(unshard(held, case.dst, **case.sizes), x_dst)
    else:
        expected = shard(x_dst, case.dst)
        for rank, y in ys.items():
            assert not mismatch(case, y, expected.get(rank), f"rank {rank}: output")
    bwd = backward_plan(case.src, case.dst, case.sizes, torch.float64)
    grads = _run(bwd, shard(g, star(case.dst)), len(case.dst.local_dims))
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
    assert op.kind == "all_gather" and None in op.unpack


def test_large_nested_pieces_are_written_once_not_concatenated_twice():
    """Fan-in zigzag at 1 MiB: the own half is not copied by an inner and an outer cat."""
    src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag=("cp",))
    small = lower_mod.lower(plan(src, dst, {"b": 8, "s": 16, "h": 4}), 0)
    assert isinstance(small.out, Cat) and isinstance(small.out.parts[0], Cat)
    big = lower_mod.lower(plan(src, dst, LARGE[0].sizes), 0)
    assert isinstance(big.out, Scatter) and len(big.out.writes) == 3
