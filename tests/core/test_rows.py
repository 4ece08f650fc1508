"""Row plans and packed layouts (mimo_fx.rows, mimo_fx.packed.PackedLayout) against
full-tensor math.

The oracle is ``x[idx]`` and autograd of it: each dst rank's piece is the global rows it
holds under its layout (zero at padding), and every src holder of a row gets that row's
full gradient (DESIGN's rule for replicated src), from the counted dst ranks' cotangents
(one replica per replicated axis, unless ``grad_partial``). Checked: each plan sits at
the lower bound (every rank receives exactly its distinct needed rows it does not hold,
once); the reference backend, every rank's lowered row program in a thread of an
emulated world (one all_to_all per direction) and 4 gloo processes (``redistribute`` to
a packed layout, a new batch every step, eager, aot_eager and inductor, ONE compiled
graph for every batch) give exact values and gradients; checked mode on a packed bridge
catches, on every rank, a rank passing rows of another width, another dtype or another
batch.
"""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threads import EXECUTORS, ThreadComm, _Rendezvous

from mimo_fx import Grid, Layout, MimoFxError, plan, redistribute
from mimo_fx.compiled.lowering import lower, lower_route, lower_rows, row_variables
from mimo_fx.packed import PackedLayout, Packing, image_rows, pack_shard
from mimo_fx.plan import Plan, backward_plan, row_plans
from mimo_fx.reference import shard, unshard
from mimo_fx.reference.executor import run_rows
from mimo_fx.rows import layout_rows, plan_rows, route_tensors, seed_bytes

FAST = settings(max_examples=60, deadline=None)
H = 3  # row width


# -- the oracle and helpers ---------------------------------------------------------------
def _rows(rows, n):
    return torch.tensor([g if g >= 0 else n for g in rows], dtype=torch.int64)


def oracle(x, p, weights):
    """Full-tensor math: dst pieces ``x[idx]`` (zero at padding), and each src piece's
    gradient for ``sum_r (y_r * w_r).sum()`` over the counted dst ranks, from autograd."""
    n = p.n_rows
    x = x.detach().requires_grad_()
    padded = torch.cat([x, x.new_zeros(1, H)])
    ys = {r: padded[_rows(rows, n)] for r, rows in zip(p.ranks, p.dst_rows)}
    loss = sum((ys[r] * weights[r]).sum() for r in ys if r in p.counted)
    (g,) = torch.autograd.grad(loss, x) if torch.is_tensor(loss) else (torch.zeros_like(x),)
    g = torch.cat([g, g.new_zeros(1, H)])
    grads = {r: g[_rows(rows, n)] for r, rows in zip(p.ranks, p.src_rows)}
    return {r: y.detach() for r, y in ys.items()}, grads


def pieces_of(x, p):
    padded = torch.cat([x, x.new_zeros(1, H)])
    return {r: padded[_rows(rows, p.n_rows)].clone() for r, rows in zip(p.ranks, p.src_rows)}


def weights_for(p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randn(len(rows), H, generator=gen, dtype=torch.float64)
            for r, rows in zip(p.ranks, p.dst_rows)}


def check_lower_bound(p):
    for i, r in enumerate(p.ranks):
        held = {g for g in p.src_rows[i] if g >= 0}
        needed = {g for g in p.dst_rows[i] if g >= 0}
        got = [g for s in range(len(p.ranks)) for g in p.sends[s][i]]
        assert len(got) == len(set(got)), f"rank {r} receives a row twice: {got}"
        assert set(got) == needed - held, f"rank {r} receives {got}, needs {needed - held}"
        assert p.received()[r] == p.needed_rows()[r] == len(needed - held)
        for s in range(len(p.ranks)):
            assert set(p.sends[s][i]) <= set(p.src_rows[s]), "a sender lacks a row"


def run_reference(p, x, weights):
    pieces = {r: t.requires_grad_() for r, t in pieces_of(x, p).items()}
    ys = run_rows(p, pieces)
    loss = sum((ys[r] * weights[r]).sum() for r in p.ranks)
    grads = torch.autograd.grad(loss, [pieces[r] for r in p.ranks], allow_unused=True)
    return ({r: y.detach() for r, y in ys.items()},
            {r: g if g is not None else torch.zeros_like(pieces[r])
             for r, g in zip(p.ranks, grads)})


class CountingComm(ThreadComm):
    """A thread's comm that records the collectives it issues."""

    def __init__(self, world, rank):
        super().__init__(world, rank)
        self.issued = []

    def _post(self, kind, ranks, flat, out_splits=(), in_splits=()):
        self.issued.append((kind, ranks))
        return super()._post(kind, ranks, flat, out_splits, in_splits)


def run_threads(p, x, weights, how="interpreted"):
    """Every rank's lowered row programs (the compiled backend's executor; ``how``: see
    ``threads.run_programs``) in its own thread, the all_to_alls met in-process: one
    all_to_all over the plan's ranks per direction on every rank, through the project's
    custom vjp."""
    from mimo_fx import vjp

    world, out, errors = _Rendezvous(), {}, []
    fwd, bwd = lower_rows(p.ranks, ("h",))

    def one(rank):
        try:
            piece = pieces_of(x, p)[rank].requires_grad_()
            comm = CountingComm(world, rank)
            route = lower_route(*row_plans(p), rank)
            index, _ = route_tensors(route)
            values = (*route.counts, H)
            (y,) = vjp.apply(EXECUTORS[how](comm), fwd, bwd, (piece,), values,
                             row_variables(len(p.ranks), ("h",)), index)
            (g,) = torch.autograd.grad((y * weights[rank]).sum(), piece, allow_unused=True)
            out[rank] = (y.detach(), torch.zeros_like(piece) if g is None else g)
            assert [k for k, _ in comm.issued] == ["all_to_all"] * 2, comm.issued
        except BaseException as err:  # reported below
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in p.ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "\n".join(errors)
    return {r: out[r][0] for r in p.ranks}, {r: out[r][1] for r in p.ranks}


def assert_matches(p, got, want):
    ys, grads = got
    want_y, want_g = want
    for r in p.ranks:
        assert torch.equal(ys[r], want_y[r]), f"rank {r}: values"
        torch.testing.assert_close(grads[r], want_g[r], atol=1e-6, rtol=1e-6)


def check_all(src_rows, dst_rows, n_rows, threads=True, seed=0, counted=None):
    p = plan_rows(src_rows, dst_rows, n_rows, counted=counted)
    check_lower_bound(p)
    x = torch.randn(n_rows, H, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    weights = weights_for(p, seed)
    want = oracle(x, p, weights)
    assert_matches(p, run_reference(p, x, weights), want)
    if threads:
        for how in EXECUTORS:
            assert_matches(p, run_threads(p, x, weights, how), want)
    return p


# -- hand-written plans ----------------------------------------------------------------------
def test_two_ranks_swap_and_reuse():
    p = check_all({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1, 1, 2]}, 4)
    assert p.sends == (((), (1,)), ((3,), ()))
    assert p.received() == {0: 1, 1: 1} and p.sent("backward") == {0: 1, 1: 1}


def test_a_row_held_twice_is_sent_once_and_both_holders_get_its_full_gradient():
    # rows 0..3 replicated on ranks 0 and 1 (TP replicas); ranks 2 and 3 need them
    src, dst = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, {2: [0, 1, 3], 3: [2, 3, 3]}
    p = check_all(src, dst, 4)
    # row 3 goes to both ranks: 5 rows to send, shared 3 and 2 between the replicas
    assert p.sent() == {0: 3, 1: 2, 2: 0, 3: 0}
    assert p.received() == {0: 0, 1: 0, 2: 3, 3: 2}


def test_padding_rows_hold_nothing_and_get_no_gradient():
    check_all({0: [-1, 0, 1], 1: [2, -1]}, {0: [2, -1], 1: [-1, 0, -1, 1]}, 3)


def test_only_counted_ranks_cotangents_return():
    """dst replicas (ranks 2 and 3 need the same rows): the cotangent counts once."""
    p = check_all({0: [0, 1, 2]}, {2: [0, 1, 2], 3: [0, 1, 2]}, 3, counted={2})
    assert p.sent("backward") == {0: 0, 2: 3, 3: 0}


def test_empty_ranks_and_rows_nobody_needs():
    check_all({0: [4, 0], 2: [1, 2, 3]}, {1: [], 2: [0, 0], 3: [4, 2]}, 6)


def test_nothing_to_move():
    p = check_all({0: [0, 1], 1: [2]}, {0: [1, 0], 1: [2, 2]}, 3)
    assert "(nothing moves)" in str(p) and p.received() == {0: 0, 1: 0}


def test_torch_func_grad_runs_the_adjoint():
    p = plan_rows({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1, 2]}, 4)
    x = torch.randn(4, H, dtype=torch.float64)
    weights = weights_for(p)
    _, want = oracle(x, p, weights)

    def loss(a, b):
        ys = run_rows(p, {0: a, 1: b})
        return sum((ys[r] * weights[r]).sum() for r in p.ranks)

    ga, gb = torch.func.grad(loss, argnums=(0, 1))(x[:2], x[2:])
    assert torch.allclose(ga, want[0]) and torch.allclose(gb, want[1])


@pytest.mark.parametrize("src, dst, n, says", [
    ({0: [0, 0]}, {0: [0]}, 1, "more than once"),
    ({0: [0]}, {1: [1]}, 2, "no src rank holds"),
    ({0: [0]}, {0: [2]}, 2, "0..1"),
    ({0: [0.5]}, {}, 2, "integers"),
    ([0], {}, 1, "map each rank"),
    ({0: [0]}, {0: [0]}, -1, "n_rows"),
])
def test_mistakes_are_explained(src, dst, n, says):
    with pytest.raises(MimoFxError, match=says):
        plan_rows(src, dst, n)


def test_a_piece_of_the_wrong_size_is_refused():
    p = plan_rows({0: [0, 1]}, {0: [1]}, 2)
    with pytest.raises(MimoFxError, match=r"\(2, \*row_shape\)"):
        run_rows(p, {0: torch.zeros(3, H)})
    with pytest.raises(MimoFxError, match=r"ranks \[5\]"):
        run_rows(p, {0: torch.zeros(2, H), 5: torch.zeros(0, H)})


# -- random ownership and needs -----------------------------------------------------------
@st.composite
def row_maps(draw):
    n_ranks = draw(st.integers(1, 4))
    n_rows = draw(st.integers(0, 10))
    holders = [draw(st.sets(st.integers(0, n_ranks - 1), max_size=n_ranks))
               for _ in range(n_rows)]
    src = {}
    for r in range(n_ranks):
        mine = [g for g in range(n_rows) if r in holders[g]]
        mine += [-1] * draw(st.integers(0, 2))  # padding rows
        src[r] = draw(st.permutations(mine)) if mine else []
    held = [g for g in range(n_rows) if holders[g]] + [-1]
    dst = {r: draw(st.lists(st.sampled_from(held), max_size=8)) for r in range(n_ranks)}
    counted = draw(st.sets(st.integers(0, n_ranks - 1)))
    return src, dst, n_rows, counted


@FAST
@given(row_maps(), st.integers(0, 3))
def test_random_plans_are_minimal_and_exact(case, seed):
    src, dst, n, counted = case
    check_all(src, dst, n, threads=False, seed=seed, counted=counted)


@settings(max_examples=15, deadline=None)
@given(row_maps())
def test_random_plans_over_an_emulated_world(case):
    src, dst, n, counted = case
    check_all(src, dst, n, threads=True, counted=counted)


# -- packed layouts through the op (reference backend) --------------------------------------
def packed_case(llm_offset):
    """Image embeddings of a packed, per-sequence zigzag CP=2 batch: encoder DP2 on ranks
    0-1 holds contiguous blocks of image rows, the LLM on CP2 from ``llm_offset``."""
    lengths = [7, 12, 5, 16]
    # image spans in sequences 0, 1 and 3; each cp rank holds 10 of the 20 tokens
    positions = [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 18, 28, 29, 30, 31, 32, 33, 36, 37]
    enc = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    tokens = PackedLayout(Grid(cp=2, offset=llm_offset), "t h", [lengths])
    return lengths, positions, enc, tokens


@pytest.mark.parametrize("offset", [0, 2], ids=["colocated", "pipelined"])
def test_images_land_on_their_tokens(offset):
    """``redistribute`` to a selection of a packed layout, against full-tensor math: the
    packed text with the images at their tokens, cut over cp (``pack_shard``)."""
    lengths, positions, enc, tokens = packed_case(offset)
    images = tokens.select(positions)
    n = len(positions)
    x = torch.randn(n, H, dtype=torch.float64)
    text = torch.randn(sum(lengths), H, dtype=torch.float64)
    ys = redistribute(shard(x, enc, t=(10, 10)), enc, images)
    full = text.clone()
    full[torch.tensor(positions)] = x
    want = pack_shard(full, Packing(lengths, cp=2))
    for c in range(2):
        rank = offset + c
        local = pack_shard(text, Packing(lengths, cp=2))[c].clone()
        local[images.positions(rank)] = ys[rank]
        assert torch.equal(local, want[c])
        assert torch.equal(ys[rank], shard(x, images)[rank])


def test_packed_plans_print_and_cost_as_plans_do():
    """``plan()`` takes a packed destination: bytes per rank at the lower bound, CP times
    below the seeds' replicate-and-all-reduce scheme."""
    _, positions, enc, tokens = packed_case(2)
    n, row_bytes = len(positions), H * 8
    dst, sizes = tokens.select(positions), {"t": (10, 10), "h": H}
    p = plan(enc, dst, sizes, torch.float64)
    assert type(p) is Plan and p.max_recv == p.max_lower_bound == 10 * row_bytes
    assert "1. all_to_all as messages in (0,1,2,3) of 4 ranks" in str(p)
    assert "(lower bound 240 B)" in str(p)
    from mimo_fx.explain import explain, transfer_matrix

    text = explain(p)
    assert "recv/bound" in text and re.search(r"^[23] +- +nothing +cp[01] +t\[", text,
                                              flags=re.M)
    assert sum(transfer_matrix(p).values()) == sum(p.bytes_sent.values()) == n * row_bytes
    back = backward_plan(enc, dst, sizes, torch.float64)
    assert type(back) is Plan
    moved = {"forward": sum(p.bytes_recv.values()), "backward": sum(back.bytes_recv.values())}
    seed = seed_bytes(n, (2, 3), row_bytes)
    assert moved == {"forward": n * row_bytes, "backward": n * row_bytes}
    assert seed["forward"] >= 2 * moved["forward"]
    assert seed["forward"] + seed["backward"] >= 2 * (moved["forward"] + moved["backward"])


@st.composite
def packed_layouts(draw):
    """A packed layout over dp x cp (and tp replicas), whole or a selection."""
    dp, cp, tp = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    lengths = [draw(st.lists(st.integers(0, 7), max_size=3)) for _ in range(dp)]
    lay = PackedLayout(Grid(tp=tp, cp=cp, dp=dp), "t h", lengths, draw(st.booleans()))
    if draw(st.booleans()) and lay.total:
        picked = draw(st.lists(st.integers(0, lay.total - 1), unique=True, max_size=6))
        lay = lay.select(picked)
    return lay


@st.composite
def encoders(draw, n: int):
    """A ragged encoder layout holding ``n`` rows, with TP replicas or not, and counts."""
    dp, tp = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=dp - 1, max_size=dp - 1)))
    counts = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n]))
    return Layout(Grid(tp=tp, dp=dp), "(dp t) h", ragged="dp"), counts


@FAST
@given(packed_layouts(), st.data())
def test_into_and_out_of_packed_layouts_equal_the_oracle(lay, data):
    """Rows from a ragged encoder into any packed layout and back out, values and
    gradients against ``shard`` and autograd of it (tp replicas' cotangents count once,
    or summed with grad_partial)."""
    enc, counts = data.draw(encoders(lay.n_rows))
    partial = data.draw(st.sampled_from([(), ("tp",)] if "tp" in lay.replicated else [()]))
    x = torch.randn(lay.n_rows, H, dtype=torch.float64)
    pieces = {r: t.requires_grad_() for r, t in shard(x, enc, t=counts).items()}
    ys = redistribute(pieces, enc, lay, grad_partial=partial)
    want = shard(x, lay)
    assert all(torch.equal(ys[r], want[r]) for r in lay.holders)
    assert torch.equal(unshard(ys, lay), x)
    g = {r: torch.randn_like(ys[r]) for r in ys}
    got = torch.autograd.grad([ys[r] for r in ys], [pieces[r] for r in enc.holders],
                              [g[r] for r in ys], allow_unused=True)
    # the oracle: autograd through shard, counting one tp replica (or every one); every
    # src replica gets the full gradient
    xr = x.detach().requires_grad_()
    ref = shard(xr, lay)
    counted = [r for r in lay.holders if partial or lay.grid.coord(r).get("tp", 0) == 0]
    (full,) = torch.autograd.grad([ref[r] for r in counted], xr, [g[r] for r in counted],
                                  allow_unused=True)
    wanted = shard(torch.zeros_like(x) if full is None else full, enc, t=counts)
    for r, gr in zip(enc.holders, got):
        torch.testing.assert_close(torch.zeros_like(pieces[r]) if gr is None else gr,
                                   wanted[r])
    back = redistribute(ys, lay, enc, t=counts)  # the way back, a packed source
    assert all(torch.equal(back[r], pieces[r].detach()) for r in enc.holders)


def test_every_pair_of_layouts_plans_one_plan_type():
    """Box or packed on either side: ``plan`` and ``backward_plan`` give a ``Plan``, and
    the reference backend runs both through its one executor, exact."""
    enc = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    lay = PackedLayout(Grid(cp=2, offset=2), "t h", [[3, 4]], zigzag=False)
    again = PackedLayout(Grid(cp=2), "t h", [[3, 4]])  # zigzag, on other ranks
    sizes = {"t": (3, 4), "h": H}
    x = torch.randn(7, H, dtype=torch.float64)
    for src, dst, pieces in ((enc, lay, shard(x, enc, t=(3, 4))), (lay, enc, shard(x, lay)),
                             (lay, again, shard(x, lay))):
        assert type(plan(src, dst, sizes)) is Plan
        assert type(backward_plan(src, dst, sizes)) is Plan
        want = shard(x, dst, t=(3, 4)) if dst is enc else shard(x, dst)
        got = redistribute(pieces, src, dst, t=(3, 4)) if src is lay and dst is enc \
            else redistribute(pieces, src, dst)
        assert all(torch.equal(got[r], want[r]) for r in dst.holders)


def test_a_ranks_row_plans_are_its_part_of_the_plans():
    """``row_plans(routing, rank)`` (what a compiled bridge lowers) lists the transfers
    ``rank`` sends or receives, in order, and the same tilings: ``plan.for_rank(rank)``
    of each direction."""
    src = {0: [0, 1, 2], 1: [3, 4], 2: [5, 6, 7]}
    dst = {0: [7, 0, -1], 1: [1, 2, 3, 5], 2: [4, 6, 0], 3: [6, 6, 2]}
    p = plan_rows(src, dst, n_rows=8, counted=[0, 1, 3])
    whole = row_plans(p)
    for rank in p.ranks:
        for part, full in zip(row_plans(p, rank), whole):
            want = full.for_rank(rank)
            assert part.steps == want.steps and part.rank == rank
            assert part.steps[0].transfers, "every rank here sends or receives"
            assert all(rank in (t.src, t.dst) for t in part.steps[0].transfers)
            assert dict(part.source.rows) == dict(want.source.rows)
            assert dict(part.need.rows) == dict(want.need.rows)


def test_lowering_a_packed_plan_names_the_row_programs():
    """``lower()`` lowers plans between box layouts; a packed pair's plan is refused with
    a MimoFxError naming the layouts (its bridge runs the row programs)."""
    enc = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    lay = PackedLayout(Grid(cp=2, offset=2), "t h", [[3, 4]])
    with pytest.raises(MimoFxError, match=r"takes a plan between box layouts, not "
                                          r"'\(dp t\) h \[ragged dp\]' -> 't h .*row programs"):
        lower(plan(enc, lay, {"t": (3, 4), "h": H}), 0)


def test_packed_layout_mistakes():
    lay = PackedLayout(Grid(cp=2), "t h", [[3, 4]])
    enc = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    with pytest.raises(MimoFxError, match="one list of sample lengths per dp group"):
        PackedLayout(Grid(cp=2, dp=2), "t h", [[3, 4]])
    with pytest.raises(MimoFxError, match="needs a Grid"):
        PackedLayout("cp=2", "t h", [[3]])
    with pytest.raises(MimoFxError, match="pattern"):
        PackedLayout(Grid(cp=2), "t t", [[3]])
    with pytest.raises(MimoFxError, match="outside the batch's 7 tokens"):
        lay.select([7])
    with pytest.raises(MimoFxError, match="repeat"):
        lay.select([1, 1])
    with pytest.raises(MimoFxError, match="7 rows but the sizes of .* give 6"):
        plan(enc, lay, {"t": (3, 3), "h": 2})
    with pytest.raises(MimoFxError, match="whole rows"):
        plan(Layout(Grid(tp=2), "t (tp h)"), lay, {"t": 7, "h": 4})
    with pytest.raises(MimoFxError, match="whole rows"):
        plan(Layout(Grid(dp=2), "(dp b) s h"), PackedLayout(Grid(cp=2), "(b s) h", [[6]]),
             {"b": 2, "s": 3, "h": 4})
    with pytest.raises(MimoFxError, match="first dim must be the 7 rows"):
        shard(torch.zeros(6, 2), lay)


# -- src rows from a box layout (dense or ragged encoders) -----------------------------------
ROW_LAYOUTS = [  # (layout, sizes, rows)
    (Layout(Grid(dp=4), "(dp b) s h"), {"b": 6, "s": 3, "h": H}, ("b", "s")),
    (Layout(Grid(tp=2, dp=2), "(dp b) s h"), {"b": 3, "s": 2, "h": H}, ("b", "s")),
    (Layout(Grid(cp=2, dp=2), "(dp b) (cp s) h", zigzag="cp"), {"b": 2, "s": 8, "h": H},
     ("b", "s")),
    (Layout(Grid(dp=3), "(dp t) h", ragged="dp"), {"t": (4, 0, 3), "h": H}, ("t",)),
    (Layout(Grid(dp=4), "(dp t) h", split="chunk"), {"t": 5, "h": H}, ("t",)),
    (Layout(Grid(pp=2, dp=2), "(dp b) s h", at={"pp": 1}), {"b": 4, "s": 2, "h": H},
     ("b", "s")),
]


@pytest.mark.parametrize("layout,sizes,rows", ROW_LAYOUTS,
                         ids=[lay.describe() for lay, _, _ in ROW_LAYOUTS])
def test_layout_rows_are_the_rows_the_oracle_gives_each_holder(layout, sizes, rows):
    """Each holder's rows, against the oracle's piece of a tensor holding its global row
    id in every feature."""
    shape = [sum(sizes[d]) if isinstance(sizes[d], tuple) else sizes[d] for d in layout.dims]
    n = math.prod(shape[:len(rows)])
    ids = torch.arange(n).reshape(*shape[:len(rows)], 1).expand(*shape).contiguous()
    counts = {d: sizes[d] for d in layout.ragged_dims}
    want = {r: t.reshape(-1, H)[:, 0].tolist() for r, t in shard(ids, layout, **counts).items()}
    assert layout_rows(layout, sizes, rows) == want


def test_a_flattened_encoder_output_to_a_packed_cp_layout():
    """Encoder output ``(dp b s) h`` (every sample s tokens) to a packed LLM on CP2 with
    per-sequence zigzag: each cp rank gets ``pack_shard`` of the flattened batch (zero
    padding rows), and the gradient is autograd's of the full-tensor version."""
    enc = Layout(Grid(dp=2, offset=2), "(dp b s) h")  # ranks 2, 3; the LLM on ranks 0, 1
    b, s = 4, 3
    packed = PackedLayout(Grid(cp=2), "(b s) h", [[s] * b])
    x = torch.randn(b, s, H, dtype=torch.float64)
    full = x.reshape(-1, H).clone().requires_grad_()
    pieces = {r: p.detach().requires_grad_() for r, p in shard(x, enc).items()}
    ys = redistribute(pieces, enc, packed, b=b, s=s)
    want = pack_shard(full, Packing([s] * b, cp=2))
    weights = {c: torch.randn(want[c].shape, dtype=torch.float64) for c in range(2)}
    for c in range(2):
        assert torch.equal(ys[c], want[c])
    sum((ys[c] * weights[c]).sum() for c in range(2)).backward()
    sum((want[c] * weights[c]).sum() for c in range(2)).backward()
    rows = layout_rows(enc, {"b": b, "s": s, "h": H}, ("b", "s"))
    for r, p in pieces.items():
        torch.testing.assert_close(p.grad, full.grad[rows[r]])


def test_layout_rows_mistakes():
    lay = Layout(Grid(tp=2, dp=2), "(dp b) (tp h)")
    with pytest.raises(MimoFxError, match="cuts a row's features"):
        layout_rows(lay, {"b": 2, "h": 4}, ("b",))
    with pytest.raises(MimoFxError, match="leading dims"):
        layout_rows(lay, {"b": 2, "h": 4}, ("h",))
    with pytest.raises(MimoFxError, match="missing"):
        layout_rows(lay, {"b": 2}, ("b",))


def test_image_rows_agree_with_a_selection():
    """``image_rows`` (per cp rank: which embeddings, where) is what a selection of the
    packed layout holds and where its rows sit."""
    lengths, positions, _, tokens = packed_case(0)
    rows = image_rows(Packing(lengths, cp=2), positions)
    images = tokens.select(positions)
    for c in range(2):
        assert images.rows(c).tolist() == rows[c].rows.tolist()
        assert images.positions(c).tolist() == rows[c].local_rows.tolist()


# -- four gloo processes ------------------------------------------------------------------
STEPS = 3


def gloo_case(step):
    """Step ``step``'s random packed batch on 4 ranks: sequences of random lengths (some
    empty, some without images) packed over CP=2 on ranks 2 and 3, image rows held by
    encoder ranks 0, 1, 2 in uneven contiguous blocks (rank 2 is encoder and LLM)."""
    gen = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 14, (4,), generator=gen).tolist()
    tokens = PackedLayout(Grid(cp=2, offset=2), "t h", [lengths])
    positions = torch.nonzero(torch.rand(tokens.total, generator=gen) < 0.4).flatten()
    n = len(positions)
    cuts = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
    counts = (cuts[0], cuts[1] - cuts[0], n - cuts[1])
    x = torch.randn(n, H, dtype=torch.float64, generator=gen)
    return tokens.select(positions), counts, x


ENC = Layout(Grid(dp=3), "(dp t) h", ragged="dp")


def _gloo_rank(rank, world):
    """Per mode (eager, aot_eager, inductor): this rank's dst piece and src gradient at
    every step, via ``loss.backward()``, and the graphs compiled for all the steps; then
    mistakes, unchecked and checked."""
    from torch._dynamo.utils import counters

    from mimo_fx.compiled import Redistributor, destroy, prepare

    out = {}
    prepare(ENC, gloo_case(0)[0], {"h": H}, torch.float64)
    for mode in ("eager", "aot_eager", "inductor"):
        def step(piece, images, weight):
            y = redistribute(piece, ENC, images, h=H)
            return (y * weight).sum(), y

        fn = step if mode == "eager" else torch.compile(step, fullgraph=True, backend=mode)
        torch._dynamo.reset()
        counters.clear()
        got = []
        for k in range(STEPS):
            images, counts, x = gloo_case(k)
            piece = (shard(x, ENC, t=counts)[rank] if rank < 3
                     else torch.zeros(0, H, dtype=torch.float64)).requires_grad_()
            weight = torch.randn(shard(x, images)[rank].shape if rank >= 2 else (0, H),
                                 dtype=torch.float64, generator=torch.Generator().manual_seed(k))
            for t in (piece, weight):  # 0 or 1 rows too: no recompile
                torch._dynamo.decorators.mark_unbacked(t, 0)
            loss, y = fn(piece, images, weight)
            loss.backward()
            got.append((y.detach(), piece.grad, weight))
        out[mode] = (got, counters["stats"]["unique_graphs"])
    # back out of the packed layout, eagerly, without h: every rank learns it from the
    # packed holders' pieces (a row side's feature sizes), the rows from the call's t
    images, counts, x = gloo_case(1)
    back = redistribute(shard(x, images)[rank] if images.holds(rank) else None, images, ENC,
                        t=counts, dtype=torch.float64)  # (a rank passing None: its dtype)
    out["back"] = None if back is None else back.detach()
    out["mistakes"] = _mistakes(rank, Redistributor)
    out["example"] = _example().step(rank, world)
    destroy()
    return out


def _raises(fn) -> str | None:
    try:
        fn()
    except MimoFxError as err:
        return str(err)
    return None


def _mistakes(rank, Redistributor):
    """Every rank makes the same mistake unchecked (each raises before any collective);
    checked, one rank's mistake raises on every rank."""
    images, counts, x = gloo_case(1)
    mine = shard(x, ENC, t=counts)[rank] if rank < 3 else None
    bridge = Redistributor(ENC, images, {"h": H}, torch.float64, checked=True)
    other = PackedLayout(images.grid, "t h", [list(reversed(images.lengths[0]))]).select(
        list(range(images.n_rows)))  # another batch of as many images
    wide = torch.zeros(len(mine), H + 1, dtype=torch.float64) if mine is not None else None
    out = {
        # the size gather (t is learned) shows every rank's mistakes to every rank
        "width": _raises(lambda: redistribute(
            torch.zeros(counts[rank], H + 1, dtype=torch.float64) if rank < 3 else None,
            ENC, images, h=H, dtype=torch.float64)),
        "not_src": _raises(lambda: redistribute(
            mine if rank < 3 else torch.zeros(1, H, dtype=torch.float64), ENC, images, h=H)),
        "checked_width": _raises(lambda: bridge(wide if rank == 1 else mine, t=counts)),
        "checked_dtype": _raises(lambda: bridge(mine.float() if rank == 0 else mine,
                                                t=counts)),
        "checked_plan": _raises(lambda: bridge(mine, t=counts,
                                               dst=other if rank == 3 else images)),
        "checked_ok": bridge(mine, t=counts).detach(),
    }
    bridge.destroy()
    return out


def _example():
    """docs/examples/packed_images.py, the README's example."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "examples" / "packed_images.py"
    spec = importlib.util.spec_from_file_location("packed_images", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gloo_world(worlds):
    """Every rank's results of ``_gloo_rank`` (on the shared 4-process world)."""
    return worlds.run(4, _gloo_rank, timeout=900)


@pytest.mark.slow  # a 4-process world compiling with inductor
def test_four_gloo_processes_one_graph_for_every_batch(gloo_world):
    """A new batch every step, one compiled graph for all of them on every rank,
    eager, aot_eager and inductor, exact against the oracle (values and gradients)."""
    for k in range(STEPS):
        images, counts, x = gloo_case(k)
        for mode in ("eager", "aot_eager", "inductor"):
            xr = x.clone().requires_grad_()
            ref = shard(xr, images)
            weights = {r: gloo_world[r][mode][0][k][2] for r in (2, 3)}
            (full,) = torch.autograd.grad([ref[r] for r in (2, 3)], xr,
                                          [weights[r] for r in (2, 3)])
            want_g = shard(full, ENC, t=counts)
            for r in range(4):
                y, g, _ = gloo_world[r][mode][0][k]
                if r >= 2:
                    assert torch.equal(y, ref[r].detach()), (mode, k, r)
                if r < 3:
                    torch.testing.assert_close(g, want_g[r])
    for mode in ("aot_eager", "inductor"):
        assert [out[mode][1] for out in gloo_world] == [1] * 4, f"{mode}: one graph per rank"


@pytest.mark.slow  # a 4-process world compiling with inductor
def test_a_packed_source_gives_its_feature_size(gloo_world):
    """A call out of a packed layout that does not give ``h`` learns it from the packed
    holders' pieces, and every encoder rank gets its rows (the oracle's pieces)."""
    images, counts, x = gloo_case(1)
    want = shard(x, ENC, t=counts)
    for r in range(3):
        assert torch.equal(gloo_world[r]["back"], want[r]), r


@pytest.mark.slow  # a 4-process world compiling with inductor
def test_mistakes_raise_before_any_collective_or_on_every_rank(gloo_world):
    for out in gloo_world:
        m = out["mistakes"]
        assert m["width"] and all(f"rank {s}: local tensor has shape" in m["width"]
                                  for s in range(3)), m["width"]
        assert m["not_src"] and "rank 3 holds no piece of src" in m["not_src"], m["not_src"]
        # (the call's size gather sees them first: a row bridge's sizes vary per call)
        assert m["checked_width"] and "rank 1: local tensor has shape" in m["checked_width"]
        assert m["checked_dtype"] and "rank 0" in m["checked_dtype"] \
            and "dtype" in m["checked_dtype"], m["checked_dtype"]
        assert m["checked_plan"] and "rank 3" in m["checked_plan"] \
            and "batch" in m["checked_plan"], m["checked_plan"]
    images, counts, x = gloo_case(1)
    for r in (2, 3):
        assert torch.equal(gloo_world[r]["mistakes"]["checked_ok"], shard(x, images)[r])


@pytest.mark.slow  # a 4-process world compiling with inductor
def test_the_readme_example_puts_image_rows_at_their_tokens(gloo_world):
    """The README's packed-images example (run in the world above, under inductor): each
    LLM rank's input is the packed text with every image row at its token, cut over cp
    (``pack_shard`` of the full-tensor result), and the encoder gradient summed over the
    ranks is the full one, ``2 F^T F``, at every step."""
    example = _example()
    for k in range(3):
        lengths, is_image, features, text = example.batch(k)
        full = text.clone()
        full[is_image] = features
        want = pack_shard(full, Packing(lengths, cp=2))
        for c, rank in enumerate((2, 3)):
            torch.testing.assert_close(gloo_world[rank]["example"][k][0], want[c])
        grad = sum(out["example"][k][1] for out in gloo_world)
        torch.testing.assert_close(grad, 2 * features.T @ features)


# -- one row-side protocol -------------------------------------------------------------------
ROW_SIDE = ("row_dims", "row_map", "check_side", "count_rows", "implied", "sizes_shown",
            "for_call", "batch", "batch_key", "batch_data", "from_batch")


def test_box_and_packed_layouts_answer_one_row_side_protocol():
    """A box layout's row side (BoxRows) and a PackedLayout answer the same questions, with
    the same parameters, and each one's row map is what full-tensor math gives: the oracle's
    pieces of a column of global row ids (+1, so padding's zero reads -1)."""
    import inspect

    from mimo_fx.rows import BoxRows, is_row_layout, is_row_pair, row_dims, row_side

    box = Layout(Grid(tp=2, dp=2), "(dp t) h")
    packed = PackedLayout(Grid(cp=2, dp=2), "t h", [[3, 2], [4]])
    sides = (row_side(box), row_side(packed))
    assert isinstance(sides[0], BoxRows) and sides[1] is packed
    for name in ROW_SIDE:
        members = [getattr(type(side), name, None) for side in sides]
        assert all(m is not None for m in members), (name, members)
        if callable(members[0]):
            params = [list(inspect.signature(m).parameters) for m in members]
            assert params[0] == params[1], (name, params)
    assert (is_row_layout(box), is_row_layout(packed)) == (False, True)
    assert is_row_pair(box, packed) and is_row_pair(packed, box)
    assert not is_row_pair(box, box)
    assert row_dims(box, packed) == row_dims(packed, box) == ("t",)
    n = packed.n_rows
    ids = torch.arange(1, n + 1, dtype=torch.float64).unsqueeze(1)
    for layout, side in zip((box, packed), sides):
        want = {r: (p[:, 0].long() - 1).tolist() for r, p in shard(ids, layout).items()}
        assert side.row_map({"t": n, "h": 1}, ("t",)) == want
    # what a side's own rows say of the row dim: the packed batch gives it, a box none
    assert sides[0].count_rows({"h": 1}, ("t",)) == {"h": 1}
    assert packed.count_rows({"h": 1}, ("t",)) == {"h": 1, "t": n}
    with pytest.raises(MimoFxError, match="holds 9 rows but the sizes of"):
        packed.count_rows({"t": n + 1, "h": 1}, ("t",))


def _one_rank(rank, world):
    """A packed bridge on a one-rank world, compiled with and without ``fullgraph``, the
    row width learned from the rank's own tensor: per mode, each step's output, input
    gradient and cotangent."""
    from mimo_fx.compiled import destroy, prepare

    src = Layout(Grid(dp=1), "(dp t) h", ragged="dp")
    out = {}
    for backend, fullgraph in (("aot_eager", True), ("aot_eager", False), ("inductor", False)):
        torch._dynamo.reset()

        @torch.compile(backend=backend, fullgraph=fullgraph)
        def step(x, images, weight):
            y = redistribute(x, src, images)
            return (y * weight).sum(), y

        got = []
        for k, (lengths, picked) in enumerate((([5, 6], [0, 2, 9]), ([3, 4, 2], [8, 1]))):
            images = PackedLayout(Grid(cp=1), "t h", [lengths]).select(picked)
            if k == 0:
                prepare(src, images, dtype=torch.float64)
            x = torch.randn(len(picked), H, generator=torch.Generator().manual_seed(k),
                            dtype=torch.float64, requires_grad=True)
            weight = torch.randn(shard(x.detach(), images)[0].shape, dtype=torch.float64)
            loss, y = step(x, images, weight)
            loss.backward()
            got.append((x.detach(), images, y.detach(), x.grad, weight))
        out[backend, fullgraph] = got
    destroy()
    return out


@pytest.mark.slow  # compiles with inductor
def test_a_one_rank_packed_bridge_compiles_with_or_without_fullgraph(worlds):
    """Before: with ``fullgraph=True`` "Pending unbacked symbols not in returned outputs"
    (the row width, learned from the rank's own shape, was an unbacked read no shape of
    the graph matched); without it, a graph break at the route op, then a data-dependent
    guard in the op's own Python."""
    (results,) = worlds.run(1, _one_rank, timeout=600)
    for mode, steps in results.items():
        for x, images, y, grad, weight in steps:
            xr = x.clone().requires_grad_()
            want = shard(xr, images)[0]
            assert torch.equal(y, want.detach()), mode
            (want_grad,) = torch.autograd.grad(want, xr, weight)
            assert torch.equal(grad, want_grad), mode


@pytest.mark.parametrize("pattern, split, sizes", [
    ("(cp t) (tp h)", "tensor_split", {"t": 6, "h": 3}),
    ("(cp t) (tp h)", "chunk", {"t": 6, "h": 3}),
    ("(cp t) (tp a) b", "tensor_split", {"t": 4, "a": 5, "b": 2}),
    ("(cp t) a (tp b)", "tensor_split", {"t": 4, "a": 2, "b": 7}),
    ("(cp t) (tp dp a)", "tensor_split", {"t": 4, "a": 9}),
])
def test_a_dst_that_cuts_features_is_its_whole_rows_sliced(pattern, split, sizes):
    """A row bridge into cut features moves whole rows (the layout without those cuts)
    and each rank keeps its slices: the oracle's pieces of both layouts agree."""
    from mimo_fx.rows import feature_slices, whole_features

    grid = Grid(cp=2, tp=2, dp=2)
    dst = Layout(grid, pattern, split=split)
    whole = whole_features(dst)
    assert [len(g) for g in whole.local_dims[1:]] == [1] * (len(dst.local_dims) - 1)
    assert not any(f.axes for g in whole.local_dims[1:] for f in g)
    X = torch.arange(math.prod(sizes.values()), dtype=torch.float64).reshape(
        *sizes.values())
    mine, rows = shard(X, dst), shard(X, whole)
    for r in grid.ranks:
        y = rows[r]
        slices = feature_slices(dst, sizes, r)
        assert slices, r
        for at, start, length in slices:
            y = y.narrow(at, start, length)
        assert torch.equal(y, mine[r]), (r, slices)
    assert whole_features(whole) is whole and feature_slices(whole, sizes, 0) == ()
