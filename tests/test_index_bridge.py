"""Index-mapped bridges (mimo_fx.index, reference.index, compiled.index) against full-tensor math.

The oracle is ``x_full[idx]`` and autograd of it: each dst rank's piece is the global
rows it asks for, and every src holder of a row gets that row's full gradient (DESIGN's
rule for replicated src). Checked: the plan sits at the lower bound (each rank receives
exactly its distinct needed rows it does not hold, each at most once), the reference
executor and the one-all_to_all-per-direction lowering (every rank in a thread of an
emulated world; 4 gloo processes, eager and under torch.compile) give exact values and
gradients, and on a packed CP=2 batch the bytes moved are at least CP times below the
replicate-and-all-reduce scheme. Hand-written cases first, then hypothesis over random
ownership and needs.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threads import ThreadComm, _Rendezvous

from mimo_fx import Collective, Grid, Layout, MimoFxError
from mimo_fx.compiled.index import index_bridge
from mimo_fx.index import layout_rows, plan_rows, seed_bytes
from mimo_fx.packed import Packing, image_rows, pack_shard
from mimo_fx.reference import shard
from mimo_fx.reference.index import index_bridge_all

FAST = settings(max_examples=60, deadline=None)
H = 3  # row width


# -- the oracle and helpers ---------------------------------------------------------------
def oracle(x, src_rows, dst_rows, weights):
    """Full-tensor math: dst pieces ``x[idx]``, and each src piece's gradient for the loss
    ``sum_r (y_r * w_r).sum()`` from autograd of that, read at the piece's rows."""
    x = x.detach().requires_grad_()
    ys = {r: x[torch.tensor(rows, dtype=torch.int64)] for r, rows in dst_rows.items()}
    loss = sum((ys[r] * weights[r]).sum() for r in ys)
    (g,) = torch.autograd.grad(loss, x) if ys else (torch.zeros_like(x),)
    grads = {r: g[torch.tensor(rows, dtype=torch.int64)] for r, rows in src_rows.items()}
    return {r: y.detach() for r, y in ys.items()}, grads


def pieces_of(x, src_rows, ranks):
    return {r: x[torch.tensor(src_rows.get(r, []), dtype=torch.int64)].clone()
            for r in ranks}


def weights_for(plan, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randn(len(rows), H, generator=gen, dtype=torch.float64)
            for r, rows in zip(plan.ranks, plan.dst_rows)}


def check_lower_bound(plan):
    for i, r in enumerate(plan.ranks):
        held, needed = set(plan.src_rows[i]), set(plan.dst_rows[i])
        got = [g for s in range(len(plan.ranks)) for g in plan.sends[s][i]]
        assert len(got) == len(set(got)), f"rank {r} receives a row twice: {got}"
        assert set(got) == needed - held, f"rank {r} receives {got}, needs {needed - held}"
        assert plan.received()[r] == plan.lower_bound()[r] == len(needed - held)
        for s in range(len(plan.ranks)):
            assert set(plan.sends[s][i]) <= set(plan.src_rows[s]), "a sender lacks a row"
    for g, s in enumerate(plan.sender):  # one sender per row, and only where needed
        senders = {plan.ranks[i] for i in range(len(plan.ranks)) for j in range(len(plan.ranks))
                   if g in plan.sends[i][j]}
        assert senders == ({s} if s >= 0 else set())


def run_reference(plan, x, src_rows, weights):
    pieces = pieces_of(x, src_rows, plan.ranks)
    for t in pieces.values():
        t.requires_grad_()
    ys = index_bridge_all(plan, pieces)
    loss = sum((ys[r] * weights[r]).sum() for r in plan.ranks)
    grads = torch.autograd.grad(loss, [pieces[r] for r in plan.ranks], allow_unused=True)
    return ({r: y.detach() for r, y in ys.items()},
            {r: g if g is not None else torch.zeros_like(pieces[r])
             for r, g in zip(plan.ranks, grads)})


class CountingComm(ThreadComm):
    """A thread's comm that records the collectives it issues."""

    def __init__(self, world, rank):
        super().__init__(world, rank)
        self.issued = []

    def _post(self, kind, ranks, flat, out_splits=(), in_splits=()):
        self.issued.append((kind, ranks))
        return super()._post(kind, ranks, flat, out_splits, in_splits)


def run_threads(plan, x, src_rows, weights):
    """Every rank's index_bridge in its own thread, the all_to_alls met in-process; each
    rank issues exactly one all_to_all over the plan's ranks per direction."""
    world, out, errors = _Rendezvous(), {}, []

    def one(rank):
        try:
            piece = pieces_of(x, src_rows, [rank])[rank].requires_grad_()
            comm = CountingComm(world, rank)
            y = index_bridge(piece, plan.route(rank), comm=comm, rank=rank)
            (g,) = torch.autograd.grad((y * weights[rank]).sum(), piece, allow_unused=True)
            out[rank] = (y.detach(), torch.zeros_like(piece) if g is None else g)
            assert comm.issued == [(Collective.ALL_TO_ALL, plan.ranks)] * 2, comm.issued
        except BaseException as err:  # reported below
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in plan.ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "\n".join(errors)
    return {r: out[r][0] for r in plan.ranks}, {r: out[r][1] for r in plan.ranks}


def assert_matches(plan, got, want, src_rows, dst_rows):
    ys, grads = got
    want_y, want_g = want
    for r in plan.ranks:
        assert torch.equal(ys[r], want_y.get(r, torch.zeros(0, H, dtype=torch.float64)))
        expect = want_g.get(r, torch.zeros(0, H, dtype=torch.float64))
        torch.testing.assert_close(grads[r], expect, atol=1e-6, rtol=1e-6)


def check_all(src_rows, dst_rows, n_rows, threads=True, seed=0):
    plan = plan_rows(src_rows, dst_rows, n_rows)
    check_lower_bound(plan)
    x = torch.randn(n_rows, H, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    weights = weights_for(plan, seed)
    want = oracle(x, src_rows, {r: list(d) for r, d in zip(plan.ranks, plan.dst_rows)},
                  weights)
    assert_matches(plan, run_reference(plan, x, src_rows, weights), want, src_rows, dst_rows)
    if threads:
        assert_matches(plan, run_threads(plan, x, src_rows, weights), want, src_rows,
                       dst_rows)
    return plan


# -- hand-written cases -------------------------------------------------------------------
def test_two_ranks_swap_and_reuse():
    plan = check_all({0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1, 1, 2]}, 4)
    assert plan.sends == (((), (1,)), ((3,), ()))
    assert plan.received() == {0: 1, 1: 1} and plan.sent("backward") == {0: 1, 1: 1}


def test_a_row_held_twice_is_sent_once_and_both_holders_get_its_full_gradient():
    # rows 0..3 replicated on ranks 0 and 1 (TP replicas); ranks 2 and 3 need them
    src, dst = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, {2: [0, 1, 3], 3: [2, 3, 3]}
    plan = check_all(src, dst, 4)
    # row 3 goes to both ranks: 5 rows to send, shared 3 and 2 between the replicas
    assert plan.sent() == {0: 3, 1: 2, 2: 0, 3: 0}
    assert plan.received() == {0: 0, 1: 0, 2: 3, 3: 2}


def test_empty_ranks_and_rows_nobody_needs():
    check_all({0: [4, 0], 2: [1, 2, 3]}, {1: [], 2: [0, 0], 3: [4, 2]}, 6)


def test_nothing_to_move():
    plan = check_all({0: [0, 1], 1: [2]}, {0: [1, 0], 1: [2, 2]}, 3)
    assert "(nothing moves)" in str(plan) and plan.received() == {0: 0, 1: 0}


def packed_case(cp_ranks):
    """Image embeddings of a packed, per-sequence zigzag CP=2 batch: encoder DP2 holds
    contiguous blocks of image rows on ranks 0 and 1; cp rank i of the LLM is
    ``cp_ranks[i]`` and receives ``image_rows(...)[i].rows``."""
    packing = Packing([7, 12, 5, 16], cp=2)
    # image spans in sequences 0, 1 and 3; each cp rank holds 10 of the 20 tokens
    positions = [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 18, 28, 29, 30, 31, 32, 33, 36, 37]
    n = len(positions)
    src = {0: list(range(n // 2)), 1: list(range(n // 2, n))}
    rows = image_rows(packing, positions)
    dst = {cp_ranks[i]: rows[i].rows.tolist() for i in range(2)}
    return packing, positions, rows, src, dst


@pytest.mark.parametrize("cp_ranks", [(0, 1), (2, 3)], ids=["colocated", "pipelined"])
def test_packed_images_land_on_their_tokens(cp_ranks):
    packing, positions, rows, src, dst = packed_case(cp_ranks)
    n = len(positions)
    plan = check_all(src, dst, n)
    images = torch.randn(n, H, dtype=torch.float64)
    text = torch.randn(packing.total, H, dtype=torch.float64)
    ys = index_bridge_all(plan, pieces_of(images, src, plan.ranks))
    # independent: replace the tokens in the packed sequence, then cut it over cp
    full = text.clone()
    full[torch.tensor(positions)] = images
    want = pack_shard(full, packing)
    for i in range(2):
        local = pack_shard(text, packing)[i].clone()
        local[rows[i].local_rows] = ys[cp_ranks[i]]
        assert torch.equal(local, want[i])


def test_packed_bytes_are_cp_times_below_replicate_and_all_reduce():
    _, positions, _, src, dst = packed_case((2, 3))
    n, row_bytes = len(positions), H * 8
    plan = plan_rows(src, dst, n)
    moved = {d: sum(b[f"{d}_received"] for b in plan.bytes(row_bytes).values())
             for d in ("forward", "backward")}
    seed = seed_bytes(n, (2, 3), row_bytes)
    assert moved == {"forward": n * row_bytes, "backward": n * row_bytes}
    assert seed["forward"] >= 2 * moved["forward"]
    assert seed["forward"] + seed["backward"] >= 2 * (moved["forward"] + moved["backward"])
    # per cp rank too: each receives its own images only, not all of them
    assert plan.received() == {0: 0, 1: 0, 2: n // 2, 3: n // 2}


def test_torch_func_grad_runs_the_adjoint():
    src, dst = {0: [0, 1], 1: [2, 3]}, {0: [3, 0, 3], 1: [1, 2]}
    plan = plan_rows(src, dst, 4)
    x = torch.randn(4, H, dtype=torch.float64)
    weights = weights_for(plan)
    _, want = oracle(x, src, dst, weights)

    def loss(a, b):
        ys = index_bridge_all(plan, {0: a, 1: b})
        return sum((ys[r] * weights[r]).sum() for r in plan.ranks)

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
    plan = plan_rows({0: [0, 1]}, {0: [1]}, 2)
    with pytest.raises(MimoFxError, match=r"\(2, \*row_shape\)"):
        index_bridge_all(plan, {0: torch.zeros(3, H)})
    with pytest.raises(MimoFxError, match=r"ranks \[5\]"):
        index_bridge_all(plan, {0: torch.zeros(2, H), 5: torch.zeros(0, H)})


# -- random ownership and needs -----------------------------------------------------------
@st.composite
def layouts(draw):
    n_ranks = draw(st.integers(1, 4))
    n_rows = draw(st.integers(0, 10))
    holders = [draw(st.sets(st.integers(0, n_ranks - 1), max_size=n_ranks))
               for _ in range(n_rows)]
    src = {}
    for r in range(n_ranks):
        mine = [g for g in range(n_rows) if r in holders[g]]
        src[r] = draw(st.permutations(mine)) if mine else []
    held = [g for g in range(n_rows) if holders[g]]
    dst = {r: draw(st.lists(st.sampled_from(held), max_size=8)) if held else []
           for r in range(n_ranks)}
    return src, dst, n_rows


@FAST
@given(layouts(), st.integers(0, 3))
def test_random_plans_are_minimal_and_exact(case, seed):
    src, dst, n = case
    check_all(src, dst, n, threads=False, seed=seed)


@settings(max_examples=15, deadline=None)
@given(layouts())
def test_random_plans_over_an_emulated_world(case):
    src, dst, n = case
    check_all(src, dst, n, threads=True)


# -- four gloo processes ------------------------------------------------------------------
STEPS = 3


def gloo_case(step):
    """Step ``step``'s random packed batch on 4 ranks: sequences of random lengths (some
    empty, some without images) packed over CP=2 on ranks 2 and 3, image rows held by
    encoder ranks 0, 1, 2 in uneven contiguous blocks (rank 2 is encoder and LLM)."""
    gen = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 14, (4,), generator=gen).tolist()
    packing = Packing(lengths, cp=2)
    is_image = torch.rand(packing.total, generator=gen) < 0.4
    positions = torch.nonzero(is_image).flatten().tolist()
    n = len(positions)
    cuts = sorted(torch.randint(0, n + 1, (2,), generator=gen).tolist())
    src = {0: list(range(cuts[0])), 1: list(range(cuts[0], cuts[1])),
           2: list(range(cuts[1], n))}
    rows = image_rows(packing, positions)
    dst = {2 + i: rows[i].rows.tolist() for i in range(2)}
    dst[1] = [0, 0] if n else []  # a non-CP rank that needs a row twice
    x = torch.randn(n, H, dtype=torch.float64, generator=gen)
    return src, dst, n, x


def _gloo_rank(rank, world):
    """Per mode (eager, aot_eager, inductor): this rank's dst piece and src gradient at
    every step, via ``loss.backward()``, and the graphs compiled for all the steps."""
    from torch._dynamo.utils import counters

    from mimo_fx.compiled.index import IndexBridge

    bridge = IndexBridge(range(world))
    out = {}
    for mode in ("eager", "aot_eager", "inductor"):
        def step(piece, route, weight):
            y = bridge(piece, route)
            return (y * weight).sum(), y

        fn = step if mode == "eager" else torch.compile(step, fullgraph=True, backend=mode)
        torch._dynamo.reset()
        counters.clear()
        got = []
        for k in range(STEPS):
            src, dst, n, x = gloo_case(k)
            plan = bridge.plan(src, dst, n)
            piece = pieces_of(x, src, [rank])[rank].requires_grad_()
            weight = weights_for(plan, k)[rank]
            for t in (piece, weight):  # 0 or 1 rows too: no recompile
                torch._dynamo.decorators.mark_unbacked(t, 0)
            loss, y = fn(piece, bridge.route(plan), weight)
            loss.backward()
            got.append((y.detach(), piece.grad))
        out[mode] = (got, counters["stats"]["unique_graphs"])
    # mistakes raise on the rank that makes them, before any collective
    src, dst, n, x = gloo_case(0)
    plan = bridge.plan(src, dst, n)
    wrong = torch.zeros(len(src.get(rank, ())) + 1, H)
    with pytest.raises(MimoFxError, match=f"rank {rank} holds .* src rows"):
        bridge(wrong, bridge.route(plan))
    with pytest.raises(MimoFxError, match="not among this IndexBridge's ranks"):
        bridge.plan({7: [0]}, {}, 1)
    with pytest.raises(MimoFxError, match="plan's ranks"):
        bridge(wrong, plan_rows({0: [0]}, {1: [0]}, 1))
    bridge.destroy()
    with pytest.raises(MimoFxError, match="destroyed"):
        bridge(wrong, plan)
    out["example"] = _example().step(rank, world)
    return out


def _example():
    """docs/examples/packed_images.py, the README's example."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "examples" / "packed_images.py"
    spec = importlib.util.spec_from_file_location("packed_images", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gloo_world():
    """Every rank's results of ``_gloo_rank`` (one spawned world for the tests below)."""
    from mimo_fx.testing import run_world

    return run_world(4, _gloo_rank, timeout=600)


def test_four_gloo_processes_one_graph_for_every_plan(gloo_world):
    """A new plan every step, one compiled graph for all of them (the route's indices
    are graph inputs), eager, aot_eager and inductor, exact against the oracle."""
    got = gloo_world
    for k in range(STEPS):
        src, dst, n, x = gloo_case(k)
        plan = plan_rows({r: src.get(r, ()) for r in range(4)},
                         {r: dst.get(r, ()) for r in range(4)}, n)
        check_lower_bound(plan)
        want = oracle(x, src, dst, weights_for(plan, k))
        for mode in ("eager", "aot_eager", "inductor"):
            assert_matches(plan, ({r: out[mode][0][k][0] for r, out in enumerate(got)},
                                  {r: out[mode][0][k][1] for r, out in enumerate(got)}),
                           want, src, dst)
    for mode in ("aot_eager", "inductor"):
        assert [out[mode][1] for out in got] == [1] * 4, f"{mode}: one graph per rank"


def test_the_readme_example_puts_image_rows_at_their_tokens(gloo_world):
    """The README's packed-images example (run in the world above, under inductor): each
    LLM rank's input is the packed text with every image row at its token, cut over cp
    (``pack_shard`` of the full-tensor result), and the encoder gradient summed over the
    ranks is the full one, ``2 F^T F``, at every step."""
    got, example = gloo_world, _example()
    for k in range(3):
        lengths, is_image, features, text = example.batch(k)
        full = text.clone()
        full[is_image] = features
        want = pack_shard(full, Packing(lengths, cp=2))
        for c, rank in enumerate((2, 3)):
            torch.testing.assert_close(got[rank]["example"][k][0], want[c])
        grad = sum(out["example"][k][1] for out in got)
        torch.testing.assert_close(grad, 2 * features.T @ features)


# -- src rows from a layout (dense or ragged encoders) -------------------------------------
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


def test_a_dense_encoder_output_to_a_packed_cp_layout():
    """Encoder output ``(dp b) s h`` (every sample s tokens) to a packed LLM on CP2 with
    per-sequence zigzag: each cp rank gets ``pack_shard`` of the flattened batch (padding
    rows filled locally), and the gradient is autograd's of the full-tensor version."""
    enc = Layout(Grid(dp=2, offset=2), "(dp b) s h")  # ranks 2, 3; the LLM on ranks 0, 1
    b, s = 4, 3
    packing = Packing([s] * b, cp=2)
    x = torch.randn(b, s, H, dtype=torch.float64)
    src = layout_rows(enc, {"b": b, "s": s, "h": H}, ("b", "s"))
    where = image_rows(packing, torch.arange(packing.total))  # every token is a "row"
    plan = plan_rows(src, {c: where[c].rows for c in range(2)}, b * s)
    check_lower_bound(plan)
    pieces = {r: p.requires_grad_() for r, p in shard(x, enc).items()}
    ys = index_bridge_all(plan, {r: p.reshape(-1, H) for r, p in pieces.items()})
    full = x.reshape(-1, H).clone().requires_grad_()
    want = pack_shard(full, packing)
    weights = {c: torch.randn(packing.local_total, H, dtype=torch.float64) for c in range(2)}
    loss = 0
    for c in range(2):
        local = torch.zeros(packing.local_total, H, dtype=torch.float64)
        local = local.index_copy(0, where[c].local_rows, ys[c])
        assert torch.equal(local, want[c])
        loss = loss + (local * weights[c]).sum()
    loss.backward()
    sum((want[c] * weights[c]).sum() for c in range(2)).backward()
    for r, p in pieces.items():
        torch.testing.assert_close(p.grad.reshape(-1, H), full.grad[src[r]])


def test_layout_rows_mistakes():
    lay = Layout(Grid(tp=2, dp=2), "(dp b) (tp h)")
    with pytest.raises(MimoFxError, match="cuts a row's features"):
        layout_rows(lay, {"b": 2, "h": 4}, ("b",))
    with pytest.raises(MimoFxError, match="leading dims"):
        layout_rows(lay, {"b": 2, "h": 4}, ("h",))
    with pytest.raises(MimoFxError, match="missing"):
        layout_rows(lay, {"b": 2}, ("b",))
