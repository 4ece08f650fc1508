"""A new user's first day: each mistake is a clear error, each legitimate input works.

In-process checks run in the fast subset; the multi-process ones share one spawned
4-rank world (the ``worlds`` fixture) and compare with full-tensor math.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mimo_fx import Grid, Layout, MimoFxError, plan
from mimo_fx.reference import redistribute as reference_redistribute
from mimo_fx.reference import shard

ENC = Layout(Grid(dp=2), "(dp b) h")                    # ranks 0-1
LLM = Layout(Grid(tp=2, offset=2), "b (tp h)")          # ranks 2-3
SIZES = {"b": 4, "h": 4}


def _full(dtype=torch.float32) -> torch.Tensor:
    x = torch.arange(16.0).reshape(4, 4)
    return torch.complex(x, -x).to(dtype) if dtype.is_complex else x.to(dtype)


# -- 3. MIMO_FX_TIMEOUT ----------------------------------------------------------------------
@pytest.mark.parametrize("text,seconds", [("inf", 1e8), ("1e20", 1e8), ("0.5", 0.5)])
def test_timeout_inf_is_no_limit(monkeypatch, text, seconds):
    from mimo_fx.compiled import groups, timeouts

    monkeypatch.setenv("MIMO_FX_TIMEOUT", text)
    assert timeouts.timeout_seconds() == seconds
    assert groups._timeout("") == timedelta(seconds=seconds)  # no OverflowError
    assert ("no limit" in timeouts.wait_time()) == (seconds == 1e8)


@pytest.mark.parametrize("text", ["1e-9", "0.0001", "0", "-3", "nan", "soon"])
def test_timeout_too_short_or_not_a_number(monkeypatch, text):
    from mimo_fx.compiled import timeouts

    monkeypatch.setenv("MIMO_FX_TIMEOUT", text)
    with pytest.raises(MimoFxError) as err:
        timeouts.timeout_seconds()
    assert f"MIMO_FX_TIMEOUT={text!r}" in str(err.value) and "inf" in str(err.value)


# -- 3. a mesh dim named like Grid's keyword --------------------------------------------------
def test_mesh_dim_named_offset():
    from mimo_fx.interop.dtensor import grid_from_mesh, layout_from_dtensor

    for call in (lambda: grid_from_mesh([[0, 1], [2, 3]], ("offset", "tp")),
                 lambda: layout_from_dtensor([[0, 1], [2, 3]], ["Shard(0)", "Replicate()"],
                                             (4, 2), mesh_dim_names=("offset", "tp"))):
        with pytest.raises(MimoFxError, match=r"mesh dim name 'offset' is reserved.*Rename"):
            call()


# -- 3. redistribute_dtensor's own dim names never clash with the mesh's -----------------------
def test_dtensor_move_to_mesh_dim_d0():
    from mimo_fx.interop.dtensor import _layouts, chunk_counts

    src = SimpleNamespace(mesh=torch.arange(2), mesh_dim_names=("dp",))
    dst = SimpleNamespace(mesh=torch.arange(2, 4), mesh_dim_names=("d0",))
    a, b = _layouts(src, ["Shard(0)"], 2, dst, ["Shard(1)"])
    assert a.dims == b.dims == ("d_0", "d_1")
    assert b.grid == Grid(d0=2, offset=2)
    # the layouts move what DTensor's placements say (a dim one side cuts and the other
    # leaves whole is ragged over DTensor's chunk sizes)
    assert a.ragged_dims == ("d_0",) and b.ragged_dims == ("d_1",)
    full = _full()
    pieces = shard(full, a, d_0=chunk_counts(full.shape[0], 2))
    out = reference_redistribute(pieces, a, b, d_1=chunk_counts(full.shape[1], 2))
    assert torch.equal(out[2], full[:, :2]) and torch.equal(out[3], full[:, 2:])


# -- 3. the reference backend on meta tensors ---------------------------------------------------
@pytest.mark.parametrize("src,dst", [
    (Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(tp=2), "b (tp h)")),
    (Layout(Grid(dp=2), "b h", partial=("dp",)), Layout(Grid(tp=2), "(tp b) h")),
    (Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(tp=2), "b h")),
])
def test_reference_on_meta(src, dst):
    full = torch.empty(4, 6, device="meta", requires_grad=True)
    out = reference_redistribute(shard(full, src), src, dst)
    expected = shard(torch.zeros(4, 6), dst)
    assert {r: (t.device.type, t.shape) for r, t in out.items()} == {
        r: ("meta", t.shape) for r, t in expected.items()}
    sum(t.sum() for t in out.values()).backward()
    assert full.grad is not None and full.grad.shape == full.shape


def test_reference_pieces_on_two_devices():
    pieces = shard(_full(), ENC.__class__(Grid(dp=2), "(dp b) h"))
    pieces[1] = torch.empty(pieces[1].shape, device="meta")
    with pytest.raises(MimoFxError, match="several devices"):
        reference_redistribute(pieces, Layout(Grid(dp=2), "(dp b) h"),
                               Layout(Grid(tp=2), "b (tp h)"))


# -- 3. sizes: numpy and torch integers, any key order ----------------------------------------
def test_numpy_and_torch_integer_sizes():
    src, dst = Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(tp=2), "b (tp h)")
    p = plan(src, dst, {"b": np.int64(4), "h": torch.tensor(4)})
    assert p.sizes == (("b", 4), ("h", 4)) and all(type(n) is int for _, n in p.sizes)
    full = _full()
    out = reference_redistribute(shard(full, src), src, dst, b=np.int32(4), h=np.int64(4))
    assert all(torch.equal(out[r], t) for r, t in shard(full, dst).items())
    for bad in (np.float64(4.0), torch.tensor([4]), 4.0, True, np.int64(0)):
        with pytest.raises(MimoFxError, match="must be a positive integer"):
            plan(src, dst, {"b": bad, "h": 4})
    ragged = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    assert plan(ragged, Layout(Grid(dp=2), "t h"), {"t": [np.int64(3), 2], "h": 2}).sizes[0] \
        == ("t", (3, 2))


def test_sizes_key_order_is_one_call():
    from mimo_fx.plan import size_arguments

    src, dst = Layout(Grid(dp=2), "(dp b) s h"), Layout(Grid(tp=2), "b s (tp h)")
    a = size_arguments(src, dst, {"h": 4, "b": 2}, {"s": 3}, "call", ())
    b = size_arguments(src, dst, {"s": 3, "b": 2, "h": 4}, {}, "call", ())
    assert list(a.items()) == list(b.items()) == [("b", 2), ("s", 3), ("h", 4)]


# -- spawned: the same checks through the compiled backend -------------------------------------
def _compiled_scenarios(rank: int, size: int) -> dict:
    import mimo_fx
    from mimo_fx.compiled import Redistributor, destroy

    out: dict = {}
    # MIMO_FX_TIMEOUT=inf: groups are created (no OverflowError) and the move is exact
    os.environ["MIMO_FX_TIMEOUT"] = "inf"
    for dtype in (torch.float32, torch.complex64):
        full = _full(dtype)
        bridge = Redistributor(ENC, LLM, SIZES, dtype)
        x = shard(full, ENC).get(rank)
        if x is not None:
            x = x.clone().requires_grad_()
        y = bridge(x)
        ok = torch.equal(y, shard(full, LLM)[rank]) if rank >= 2 else y.numel() == 0
        (y.abs() if dtype.is_complex else y).sum().backward()
        if x is not None:  # d|z|/dz of every element, |z| summed: z/|z| (conjugated)
            ok = ok and x.grad is not None and torch.allclose(
                x.grad, shard(full / full.abs().clamp_min(1e-12), ENC)[rank]
                if dtype.is_complex else torch.ones_like(x))
        bridge.destroy()
        out[str(dtype)] = ok
    del os.environ["MIMO_FX_TIMEOUT"]
    # checked calls whose sizes differ in key order and type by rank are one call
    full = _full()
    x = shard(full, ENC).get(rank)
    sizes = {"h": np.int64(4), "b": 4} if rank % 2 else {"b": torch.tensor(4), "h": 4}
    y = mimo_fx.redistribute(x, ENC, LLM, sizes=sizes, checked=True)
    out["order"] = torch.equal(y, shard(full, LLM)[rank]) if rank >= 2 else y.numel() == 0
    destroy()
    return out


@pytest.mark.slow
def test_compiled_first_day(worlds):
    start = time.monotonic()
    results = worlds.run(4, _compiled_scenarios, timeout=600)
    assert results == [{"torch.float32": True, "torch.complex64": True, "order": True}] * 4
    assert time.monotonic() - start < 600


def _forgotten_backward(rank: int, size: int) -> dict:
    """Two steps per scenario on ENC -> LLM (ranks 0-1 hold no dst piece): the warnings
    each rank's bridge calls give. No rank runs a bridge backward except in "trained"
    (had the LLM ranks run theirs in "forgotten", they would wait for ranks 0-1 until
    the timeout; the warning comes before that)."""
    import warnings

    import mimo_fx
    from mimo_fx.compiled import Redistributor

    def step(bridge, scenario: str):
        x = shard(_full(), ENC).get(rank)
        y = bridge(None if x is None else x.clone().requires_grad_())
        if scenario == "trained":  # every rank's backward, as documented
            mimo_fx.backward(y.sum() if rank >= 2 else None)
        return y.sum() if rank >= 2 else None  # ranks 0-1 drop their result

    out = {}
    for scenario in ("forgotten", "held", "trained"):
        bridge = Redistributor(ENC, LLM, SIZES)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if scenario == "held":  # GPipe-like: the caller keeps both results
                x = shard(_full(), ENC).get(rank)
                ys = [bridge(None if x is None else x.clone().requires_grad_())
                      for _ in range(2)]
                del ys
            else:
                for _ in range(2):
                    step(bridge, scenario)
        out[scenario] = [str(w.message) for w in caught]
        bridge.destroy()
    return out


def _joined_in_torch_func(rank: int, size: int) -> dict:
    """ENC -> LLM differentiated with ``torch.func.grad``, eager, aot_eager and inductor,
    two steps each: ranks 0-1 hold no dst piece and return ``mimo_fx.joined(loss)``, the
    one way for source-only ranks; every rank's gradient against full-tensor math."""
    import mimo_fx
    from mimo_fx.compiled import Redistributor

    X = _full() / 8
    W = 1 + torch.arange(16.0).reshape(4, 4) / 16   # ranks 0-1: y = x * w is sent
    V = 2 - torch.arange(16.0).reshape(4, 4) / 32   # ranks 2-3: loss = sum(y * v)
    bridge = Redistributor(ENC, LLM, SIZES)
    src = rank in ENC.grid
    x = shard(X, ENC).get(rank)

    def loss_fn(w):
        if src:
            y = bridge(x * w)
            return mimo_fx.joined(w.sum() * 0)  # y: this rank's empty result, joined
        y = bridge(w.reshape(-1)[:0].reshape(0, 0))  # a differentiated empty input
        return mimo_fx.joined((y * w).sum())

    w = shard(W, ENC)[rank] if src else shard(V, LLM)[rank]
    want = shard(X * V, ENC)[rank] if src else shard(X * W, LLM)[rank]
    out = {}
    torch._inductor.config.compile_threads = 1  # 4 ranks share 2 cores: no worker pools
    compiled = {b: torch.compile(torch.func.grad(loss_fn), backend=b, fullgraph=True)
                for b in ("aot_eager", "inductor")}
    for name, fn in (("eager", torch.func.grad(loss_fn)), *compiled.items()):
        for step in range(2):
            got = fn(w.clone())
            out[name, step] = bool(torch.allclose(got, want, atol=1e-6)) and \
                not bridge.prepared.kept.in_transform and bridge.prepared.kept.last is None
    bridge.destroy()
    return out


@pytest.mark.slow
def test_source_only_ranks_join_their_results_inside_torch_func(worlds):
    """``mimo_fx.joined`` inside a ``torch.func`` transform: the source-only ranks'
    part of the bridge's backward runs (without it the LLM ranks would wait for theirs
    until the timeout, and ranks 0-1 get zero gradients), and every gradient is the
    oracle's; nothing is left on the bridge after the step."""
    results = worlds.run(4, _joined_in_torch_func, timeout=600)
    want = {(name, step): True for name in ("eager", "aot_eager", "inductor")
            for step in range(2)}
    assert results == [want] * 4, results


@pytest.mark.slow
def test_a_forgotten_backward_is_said_at_the_next_call(worlds):
    """A rank without a dst piece that calls a bridge again after dropping the previous
    call's result, whose backward never ran (no mimo_fx.backward()), warns at once,
    naming the call and the fix; the ranks holding dst pieces, a caller that holds its
    results (it may backpropagate them itself) and a step that runs mimo_fx.backward()
    say nothing."""
    results = worlds.run(4, _forgotten_backward, timeout=600)
    for rank in (0, 1):
        (said,) = results[rank]["forgotten"]
        assert f"rank {rank} holds no dst piece of this bridge and ran call 2 while the " \
            "backward of call 1 has not run on it" in said, said
        assert "mimo_fx.backward()" in said and "torch.no_grad()" in said, said
    for rank in range(4):
        assert results[rank]["trained"] == results[rank]["held"] == [], results[rank]
    for rank in (2, 3):
        assert results[rank]["forgotten"] == [], results[rank]


# -- 1. a packed layout's cp=/dp= name axes of its grid ---------------------------------------
@pytest.mark.parametrize("kwargs,grid", [
    ({"cp": "sp"}, Grid(cp=2, dp=2)), ({"dp": "data"}, Grid(cp=2, dp=2)),
    ({"cp": "sp"}, Grid(tp=2)), ({"cp": "dp"}, Grid(cp=2, dp=2))])
def test_packed_axis_the_grid_lacks(kwargs, grid):
    from mimo_fx.packed import PackedLayout

    lengths = [[3]] * (grid.axis_size("dp") if "dp" in grid.names else 1)
    with pytest.raises(MimoFxError) as err:
        PackedLayout(grid, "t h", lengths, **kwargs)
    (what, name), = kwargs.items()
    assert f"{what}={name!r}" in str(err.value)
    if name not in grid.names:
        assert f"not an axis of {grid!r} (its axes: {', '.join(grid.names)})" in str(err.value)


def test_packed_axis_named_and_default():
    from mimo_fx.packed import PackedLayout

    # a cp axis named sp cuts each sequence as the default cp does
    named = PackedLayout(Grid(sp=2, dp=2), "t h", [[3], [2, 1]], zigzag=False, cp="sp")
    default = PackedLayout(Grid(cp=2, dp=2), "t h", [[3], [2, 1]], zigzag=False)
    assert [named.rows(r).tolist() for r in range(4)] == \
        [default.rows(r).tolist() for r in range(4)] == [[0, 1], [2, -1], [3, 5], [4, -1]]
    # a grid without cp or dp axes and no names given: one group, no cut (as before)
    whole = PackedLayout(Grid(tp=2), "t h", [[2, 1]], zigzag=False)
    assert [whole.rows(r).tolist() for r in range(2)] == [[0, 1, 2]] * 2


# -- 4. mimo_fx.interop.dtensor after `import mimo_fx` alone -----------------------------------
def test_interop_dtensor_is_lazy():
    import subprocess
    import sys

    code = ("import sys, mimo_fx; "
            "before = [m for m in ('mimo_fx.interop.dtensor', 'torch.distributed.tensor') "
            "if m in sys.modules]; "
            "f = mimo_fx.interop.dtensor.prepare; "
            "g = mimo_fx.interop.dtensor.redistribute_dtensor; "
            "print(before, f.__module__, g is mimo_fx.redistribute_dtensor, "
            "'dtensor' in dir(mimo_fx.interop))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "mimo_fx.interop.dtensor", "True", "True"]
    import mimo_fx.interop

    with pytest.raises(AttributeError, match="no attribute 'dtensr'"):
        mimo_fx.interop.dtensr  # noqa: B018


# -- 7. the main job's undistributed step converts no grad-requiring tensor to a float -------
def test_main_job_reference_step_warns_nothing():
    import warnings

    from mimo_fx.jobs.e2e import _data, _undistributed_step
    from mimo_fx.jobs.toy import ToyConfig, ToyMimo
    from mimo_fx.mimo import ModuleParallelism as M

    cfg = ToyConfig()
    model = ToyMimo(cfg, M(dp=2).grid(), M(tp=2, offset=2).grid())
    full = model.init_params(dtype=torch.float32)
    x, t, text = _data(cfg, 1)
    zero = {n: torch.zeros_like(p) for n, p in
            ((n, shard(v, model.param_layouts[n]).get(2)) for n, v in full.items())
            if p is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Consider using tensor.detach() first" raises
        new, loss, diff = _undistributed_step(model, full, x, t, text, 0.1, zero, 2)
        float(loss)
    assert not loss.requires_grad and diff > 0
    assert set(new) == set(full) and not any(v.requires_grad for v in new.values())


# -- 2. a rank that left is named ---------------------------------------------------------------
def _rank_three_leaves(rank: int, size: int, out_dir: str, late: float) -> None:
    from mimo_fx.compiled import Redistributor

    bridge = Redistributor(ENC, LLM, SIZES)  # every group made, on every rank
    if rank == 3:
        os._exit(3)
    time.sleep(late)  # (late: gloo has seen rank 3's pairs close, and a send to it fails
    #                    while being posted, among the other messages of its grouped call)
    x = shard(_full(), ENC).get(rank)
    start = time.monotonic()
    try:
        for _ in range(3):  # (rank 2 may still return its first call: rank 3's sends are
            bridge(x)       # not its own)
        text = "returned"
    except MimoFxError as err:
        text = str(err)
    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
        f.write(f"{time.monotonic() - start:.3f}\n{text}")
    os._exit(0)  # (its peers may be gone too: no teardown that waits for them)


@pytest.mark.slow
@pytest.mark.parametrize("late", [0.0, 1.0], ids=["at-once", "late"])
def test_the_rank_that_left_is_named(tmp_path, late):
    from mimo_fx.testing import WorldError, run_world

    with pytest.raises(WorldError, match="rank 3"):
        run_world(4, _rank_three_leaves, str(tmp_path), late, timeout=300)
    said = {r: (tmp_path / f"{r}.txt").read_text().split("\n", 1) for r in range(3)}
    for r in (0, 1, 2):
        seconds, text = said[r]
        # the first call's ranks meet (is the source frozen?) in a small all-gather
        # through rank 0: rank 0 finds rank 3 gone, the others rank 0, which left once
        # it had raised
        left = (3,) if r == 0 else (0, 3)
        assert any(f"a rank of the group left: rank {g} (it raised, or its process ended"
                   in text for g in left), (r, text)
        assert float(seconds) < 60, (r, seconds)


@pytest.mark.parametrize("coalescing", [False, True], ids=["in-turn", "coalesced"])
def test_a_message_whose_posting_fails_names_its_peer(monkeypatch, coalescing):
    """A rank that has left makes gloo's send to it fail while being posted, before any
    work exists to map to its peer: the error still names that rank (global, not group).
    A backend that does not coalesce (gloo) posts a grouped call's messages in turn, so
    the failed one is known among several peers; a coalescing one (NCCL, which does not
    raise there) names it where the call has one peer."""
    import torch.distributed as dist

    from mimo_fx import Collective
    from mimo_fx.compiled import comm, timeouts

    posted = []

    def batch_isend_irecv(ops):
        posted.append(len(ops))
        if any(group_peer == 2 for _, _, group_peer in ops):
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:32990")
        return [object() for _ in ops]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(dist, "P2POp", lambda op, t, group, group_peer: (op, t, group_peer))
    monkeypatch.setattr(comm, "coalesces", lambda pg, device: coalescing)
    members = (4, 5, 6, 7)  # group rank 2 is global rank 6
    one = torch.ones(1)
    for sends, recvs, named in [([(2, one)], [(2, one)], True),
                                ([(1, one), (2, one), (3, one)], [(1, one), (3, one)],
                                 not coalescing)]:
        posted.clear()
        with pytest.raises(RuntimeError, match="closed by peer") as info:
            comm.post(None, members, sends, recvs)
        # (in turn: one call per message, up to the failed one)
        assert posted == ([len(sends) + len(recvs)] if coalescing else
                          [1] * (1 + [j for j, _ in sends].index(2)))
        bare = timeouts.failed("", Collective.ALL_TO_ALL, info.value)
        if not named:
            assert "rank 6" not in str(bare) and "closed by peer" in str(bare), bare
            continue
        assert "(rank 6 left) (RuntimeError: [pair.cc:553] Connection closed" in str(bare), bare
        site = timeouts.at("enc->llm", "forward", 0, "4,5,6,7")
        err = timeouts.failed(site, Collective.ALL_TO_ALL, info.value)
        assert "a rank of the group left: rank 6 (it raised" in str(err), err
        assert "over ranks (4,5,6,7)" in str(err), err


# -- 8. the examples check themselves; the DTensor doc and docstring agree ------------------
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "examples").glob("*.py")),
                         ids=lambda p: p.name)
def test_every_example_checks_itself(path):
    """Run as a script, every example compares what it computed with full-tensor math
    (or the model on one process) and says it did: a failed check raises."""
    import ast

    tree = ast.parse(path.read_text())
    main = [node for node in tree.body if isinstance(node, ast.If)
            and "__main__" in ast.unparse(node.test)]
    assert main, f"{path.name} has no __main__ block"
    # what the script runs: the __main__ block and the module's main(), if it calls it
    run = [ast.unparse(node) for node in main]
    if any("main()" in text for text in run):
        run += [ast.unparse(n) for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.name == "main"]
    text = "\n".join(run)
    assert "checked against" in text, text  # it says so
    assert "assert" in text or "check(" in text or "check_" in text, text  # and checks


def test_dtensor_backward_doc_agrees_with_docstring():
    from mimo_fx.interop.dtensor import redistribute_dtensor

    page = (ROOT / "docs" / "dtensor.md").read_text()
    doc = " ".join((redistribute_dtensor.__doc__ or "").split())
    for words in ("y.sum().backward()", "mimo_fx.backward()"):
        assert words in page and words in doc, words


# -- 6. MIMO_FX_DEBUG=1 logs every call's sizes and bytes, every bridge kind ------------------
def _debug_calls(rank: int, size: int) -> dict:
    import logging

    from mimo_fx.compiled import Redistributor

    os.environ["MIMO_FX_DEBUG"] = "1"
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("mimo_fx").addHandler(Keep())
    ragged = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    bridges = {"fixed": (Redistributor(ENC, LLM, SIZES), [{}]),
               "free": (Redistributor(ENC, LLM, {"h": 4}), [{"b": 4}, {"b": 2}]),
               "ragged": (Redistributor(ragged, Layout(Grid(tp=2, offset=2), "t h"),
                                        {"h": 4}), [{"t": (3, 1)}, {"t": (0, 2)}])}
    out = {}
    for kind, (bridge, calls) in bridges.items():
        lines.clear()
        for sizes in calls:
            src = bridge.src
            n = sizes.get("t", (sizes.get("b", 4),) * 2)
            x = torch.ones(n[rank] if "t" in sizes else n[0] // 2, 4) if rank < 2 else None
            with torch.no_grad():
                bridge(x, sizes if "t" in sizes or "b" in sizes else None)
            del src
        out[kind] = [line for line in lines if " call " in line]
        bridge.destroy()
    del os.environ["MIMO_FX_DEBUG"]
    return out


@pytest.mark.slow
def test_debug_logs_every_call(worlds):
    results = worlds.run(4, _debug_calls, timeout=600)
    for rank, out in enumerate(results):
        assert [len(out[k]) for k in ("fixed", "free", "ragged")] == [1, 2, 2], (rank, out)
        assert "sizes b=4, h=4" in out["free"][0] and "sizes b=2, h=4" in out["free"][1]
        assert "sizes t=[3, 1], h=4" in out["ragged"][0], out["ragged"]
        assert "sizes t=[0, 2], h=4" in out["ragged"][1], out["ragged"]
    import re

    def moved(line: str) -> tuple[int, int]:
        sent, got = re.search(r"forward sends (\d+) B, receives (\d+) B", line).groups()
        return int(sent), int(got)

    for kind, calls in (("fixed", 1), ("free", 2), ("ragged", 2)):
        for k in range(calls):  # every byte sent is received
            per_rank = [moved(out[kind][k]) for out in results]
            assert sum(s for s, _ in per_rank) == sum(g for _, g in per_rank), per_rank
    # a small exchange goes in one round: the encoder ranks send each of their rows of 4
    # float32 to both LM ranks, which replicate t (3 and 1 rows, then 0 and 2)
    assert [moved(results[r]["ragged"][k])[0] for k in (0, 1) for r in (0, 1)] == \
        [2 * 4 * 4 * n for n in (3, 1, 0, 2)]
    # the fixed bridge: rank 0 holds 2 rows x 4, sends 2 columns of them to each LLM rank
    assert moved(results[0]["fixed"][0]) == (32, 0)
    assert moved(results[2]["free"][1]) == (0, 16)  # b=2: 2 rows x 2 columns


# -- 6. run_world says how far it is when it takes a while ----------------------------------
def _rank_one_is_slow(rank: int, size: int) -> int:
    if rank == 1:
        time.sleep(SLOW_RANK)
    return rank


SLOW_RANK = 4.0  # seconds rank 1 sleeps, with progress lines from 1 s on (3 s to spare)


@pytest.mark.slow
def test_run_world_prints_progress(capfd, monkeypatch):
    from mimo_fx.testing import launch, run_world

    monkeypatch.setattr(launch, "PROGRESS", 1.0)  # the default's 5 s, sooner
    start = time.monotonic()
    assert run_world(2, _rank_one_is_slow, timeout=300) == [0, 1]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[mimo_fx] 2-process")]
    # from PROGRESS seconds on, a line each time the state changes (a loaded machine may
    # still be starting ranks at the first one, or see rank 1 finish before its result
    # is read); one of them shows rank 0 done and rank 1 still running
    assert 1 <= len(lines) <= 5 and len(set(lines)) == len(lines), err
    assert any("2/2 ranks started, 1/2 done; running: ranks 1" in line for line in lines), lines
    assert time.monotonic() - start < 300
