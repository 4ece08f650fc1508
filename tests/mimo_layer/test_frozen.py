"""Frozen sources: a bridge whose source needs no gradient moves nothing backward.

One 4-rank gloo world (recording, so every rank's collectives can be counted) runs
docs/examples/frozen_encoder.py -- an encoder on DP2 under ``torch.no_grad()`` feeding
a TP2 layer, compiled with inductor, 3 steps, written the natural way -- against the
undistributed model, and counts what crossed the bridge: only the forwards. The same
world runs the other entry points with ``frozen=True`` (the functional
``redistribute`` after ``prepare``, ``Bridge``'s imperative calls, the MIMO layer's
``ProcessWorld`` in a ``torch.func`` step, ``BridgedPipeline`` with a frozen
boundary under ``Schedule1F1B``, DTensor interop) and the mistakes: a source tensor that
requires grad on a frozen bridge, a bad ``frozen=``, and ``frozen=False`` with a source
that needs no gradient (its backward runs all the same).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mimo_fx import Grid, Layout, MimoFxError
from mimo_fx.reference import shard

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "frozen_encoder.py"
ENC, LAYER = Grid(dp=2), Grid(tp=2, offset=2)
SRC, DST = Layout(ENC, "(dp b) h"), Layout(LAYER, "b (tp h)")
SIZES = {"b": 4, "h": 6}


def _example():
    spec = importlib.util.spec_from_file_location("frozen_encoder", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counted(fn):
    """``fn()``'s result and the kinds of collective this rank ran meanwhile."""
    from mimo_fx.compiled import trace

    start = trace.mark()
    out = fn()
    return out, [str(c.kind.value if hasattr(c.kind, "value") else c.kind)
                 for c in trace.since(start)]


def _full() -> torch.Tensor:
    return torch.arange(24.0).reshape(4, 6)


def _entry_points(rank: int) -> dict:
    """``frozen=True`` through every entry point: values, whether results require grad,
    and the collectives each ran."""
    import mimo_fx
    from mimo_fx.compiled import Bridge, prepare
    from mimo_fx.compiled.world import ProcessWorld

    out: dict = {}
    x = shard(_full(), SRC).get(rank)
    want = shard(_full(), DST).get(rank)

    # the functional op, prepared, compiled
    prepare(SRC, DST, SIZES, frozen=True)
    step = torch.compile(lambda t: mimo_fx.redistribute(t, SRC, DST, frozen=True, **SIZES),
                         backend="aot_eager", fullgraph=True)
    y, kinds = _counted(lambda: step(x))
    out["redistribute"] = (want is None or torch.equal(y, want), y.requires_grad, kinds)
    mimo_fx.compiled.destroy()

    # Bridge's imperative calls, 1F1B order on the layer's ranks
    bridge = Bridge(SRC, DST, SIZES, frozen=True)

    def one_f_one_b():
        got = []
        if rank in ENC:
            bridge.send_forward(x)
            bridge.send_forward(x)
            got.append(bridge.recv_backward())
            got.append(bridge.send_forward_recv_backward(x))
            got.append(bridge.recv_backward())
        else:
            y0 = bridge.recv_forward()
            got.append((torch.equal(y0, want), y0.requires_grad))
            got.append(bridge.send_backward_recv_forward(torch.ones_like(y0)).requires_grad)
            got.append(bridge.send_backward_recv_forward(torch.ones_like(y0)).requires_grad)
            got.append(bridge.send_backward(torch.ones_like(y0)))
        bridge.flush()
        return got

    got = one_f_one_b()
    out["bridge"] = (got, [c.messages for c in bridge._channels])  # forward, backward
    bridge.destroy()

    # the MIMO layer's process world, a torch.func step
    world = ProcessWorld()
    w = torch.full((4, 3), 2.0)

    def loss(w):
        world.begin(anchor=w)
        pieces = world.redistribute({rank: x} if x is not None else {}, SRC, DST,
                                    frozen=True, **SIZES)
        total = (pieces[rank] * w).sum() if rank in pieces else w.sum() * 0
        return world.end(total)

    (g, value), kinds = _counted(lambda: torch.func.grad_and_value(loss)(w))
    out["world"] = (float(value), g.tolist(), kinds)
    world.destroy()
    mimo_fx.compiled.destroy()
    return out


def _pipeline(rank: int) -> dict:
    """A frozen encoder stage (DP2, ranks 0-1) before a trained TP2 stage (ranks 2-3)
    under Schedule1F1B: the layer's gradient, and what crossed backward."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B

    from mimo_fx.compiled.pipelining import Boundary, BridgedPipeline

    class Encoder(torch.nn.Module):  # frozen: no parameter requires grad
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(6), requires_grad=False)

        def forward(self, x):
            return torch.tanh(x @ self.w)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, y):
            return y * self.w

    pipe = BridgedPipeline([Boundary(Layout(Grid(dp=2), "(dp b) h"),
                                     Layout(Grid(tp=2, offset=2), "b (tp h)"), frozen=True)],
                           sizes={"b": 2, "h": 6},  # a micro-batch
                           output=Layout(Grid(tp=2, offset=2), "b (tp h)"))
    module = Encoder() if rank < 2 else Head()
    stage = pipe.stage(module)
    sched = Schedule1F1B(stage, 4, loss_fn=lambda y, t: (y * y).sum(), scale_grads=False)
    full = torch.arange(48.0).reshape(8, 6) / 48
    x = full.tensor_split(2)[rank] if rank < 2 else None
    if rank < 2:
        sched.step(x)
    else:
        sched.step(target=torch.zeros(8, 3))
    grad = None if rank < 2 else module.w.grad.tolist()
    (bridge,) = pipe.bridges
    messages = [c.messages for c in bridge._channels]  # forward, backward
    dist.barrier()
    pipe.destroy()
    return {"grad": grad, "messages": messages}


def _mistakes(rank: int) -> dict:
    """Mistakes: what each raised (or did)."""
    from mimo_fx.compiled import Redistributor

    out: dict = {}
    x = shard(_full(), SRC).get(rank)
    try:
        Redistributor(SRC, DST, SIZES, frozen="yes")
    except MimoFxError as err:
        out["bad_frozen"] = str(err)
    # frozen=True and a source tensor that requires grad: refused on its rank, before any
    # collective; the others call with no_grad so that nobody waits
    bridge = Redistributor(SRC, DST, SIZES, frozen=True)
    if rank == 0:
        try:
            bridge(x.clone().requires_grad_())
        except MimoFxError as err:
            out["requires_grad_on_frozen"] = str(err)
        with torch.no_grad():
            bridge(x)
    else:
        with torch.no_grad():
            bridge(x)
    bridge.destroy()
    # decided frozen by the first call, then a source that requires grad
    bridge = Redistributor(SRC, DST, SIZES)
    bridge(x)
    out["decided"] = bridge.frozen()
    if rank == 0:
        try:
            bridge(x.clone().requires_grad_())
        except MimoFxError as err:
            out["later_requires_grad"] = str(err)
        with torch.no_grad():
            bridge(x)
    else:
        with torch.no_grad():
            bridge(x)
    bridge.destroy()
    return out


def _frozen_false(rank: int) -> dict:
    """``frozen=False``: the source needs no gradient, yet the backward runs on every
    rank (its gradient is dropped), so the layer's ranks never wait."""
    import mimo_fx
    from mimo_fx.compiled import Redistributor

    bridge = Redistributor(SRC, DST, SIZES, frozen=False)
    x = shard(_full(), SRC).get(rank)
    w = torch.ones(4, 3, requires_grad=True)
    y = bridge(x)
    if rank in LAYER.ranks:
        (y * w).sum().backward()
        mimo_fx.backward()
    else:
        mimo_fx.backward()  # the encoder ranks' part of the bridge's backward
    from mimo_fx.compiled import timeouts

    out = {"backward_calls": timeouts.calls(bridge.name, "backward"),
           "grad": None if rank not in LAYER.ranks else w.grad.tolist()}
    bridge.destroy()
    return out


def _evaluation_first(rank: int) -> dict:
    """Calls under no_grad on every rank (an evaluation) decide nothing; the first call
    under autograd, with a source that requires grad, finds the bridge not frozen."""
    import mimo_fx
    from mimo_fx.compiled import Redistributor, timeouts

    bridge = Redistributor(SRC, DST, SIZES)
    x = shard(_full(), SRC).get(rank)
    with torch.no_grad():
        bridge(x)
        bridge(x)
    before = bridge.frozen()
    leaf = None if x is None else x.clone().requires_grad_()
    y = bridge(leaf)
    if rank in LAYER.ranks:
        y.sum().backward()
    mimo_fx.backward()
    out = {"before": before, "after": bridge.frozen(),
           "backward_calls": timeouts.calls(bridge.name, "backward"),
           "grad": None if leaf is None else leaf.grad.tolist()}
    bridge.destroy()
    return out


def _world(rank: int, world: int) -> dict:
    example = _example()
    out = {"example": example.train(rank, world, 3, "inductor")}
    out["example_frozen_true"] = example.train(rank, world, 2, "aot_eager", frozen=True)
    out["example_trace"] = _counted(lambda: example.train(rank, world, 2, "aot_eager"))[1]
    out["entry_points"] = _entry_points(rank)
    out["pipeline"] = _pipeline(rank)
    out["mistakes"] = _mistakes(rank)
    out["frozen_false"] = _frozen_false(rank)
    out["evaluation_first"] = _evaluation_first(rank)
    return out


@pytest.fixture(scope="module")
def results(worlds):
    return worlds.run(4, _world, timeout=900, record=True)


@pytest.mark.slow
def test_the_natural_frozen_encoder_is_exact_and_moves_nothing_backward(results):
    """The frozen-encoder program, inductor, 3 steps: every loss and the trained weight
    as the undistributed model's; 3 forward transfers and no backward one on every
    rank; the bridge decided it was frozen."""
    want, w = _example().reference(3)
    for rank, r in enumerate(results):
        losses, weight, counts, frozen, _ = r["example"]
        assert counts == (3, 0) and frozen is True, (rank, counts, frozen)
        if rank in (2, 3):
            for k in range(3):
                assert torch.allclose(losses[k], want[k][rank - 2], rtol=1e-5), (rank, k)
    assert torch.allclose(torch.cat([results[2]["example"][1], results[3]["example"][1]]),
                          w, rtol=1e-5)


@pytest.mark.slow
def test_frozen_true_creates_no_backward_groups_and_every_collective_is_forward(results):
    for rank, r in enumerate(results):
        *_, counts, frozen, groups = r["example_frozen_true"]
        natural_groups = r["example"][4]
        assert counts == (2, 0) and frozen is True, (rank, r["example_frozen_true"])
        assert groups == natural_groups - 1, (rank, groups, natural_groups)  # (no < group)
        # the natural program's collectives, counted by the records: each group's first
        # operation when it is built, the first call's meeting (it decides the bridge is
        # frozen), then 2 steps of forwards and no backward
        assert r["example_trace"] == ["all_reduce"] * 3 + ["all_gather"] + ["all_to_all"] * 2, \
            (rank, r["example_trace"])


@pytest.mark.slow
def test_every_entry_point_takes_frozen(results):
    for rank, r in enumerate(results):
        e = r["entry_points"]
        ok, grad, kinds = e["redistribute"]
        assert ok and not grad and kinds == ["all_to_all"], (rank, e["redistribute"])
        got, (forward, backward) = e["bridge"]
        assert forward > 0 and backward == 0, (rank, e["bridge"])
        if rank < 2:
            assert got == [None, None, None], (rank, got)  # nothing comes back
        else:
            assert got == [(True, False), False, False, None], (rank, got)
        value, g, kinds = e["world"]
        assert kinds.count("all_to_all") == 1, (rank, kinds)  # the forward only
        if rank >= 2:
            want = shard(_full(), DST)[rank]
            assert value == float((want * 2).sum()) and g == want.tolist(), (rank, e["world"])


@pytest.mark.slow
def test_a_frozen_pipeline_boundary_moves_nothing_backward(results):
    for rank, r in enumerate(results):
        p = r["pipeline"]
        if rank >= 2:  # the layer: d/dw sum((y w)^2) = 2 w sum(y^2) over its columns
            full = torch.tanh(torch.arange(48.0).reshape(8, 6) / 48)
            want = (2 * full[:, (rank - 2) * 3:(rank - 1) * 3].square().sum(0)).tolist()
            assert p["grad"] == pytest.approx(want, rel=1e-6), (rank, p)
        forward, backward = p["messages"]
        assert forward > 0 and backward == 0, (rank, p)


@pytest.mark.slow
def test_frozen_mistakes_are_errors_that_say_what_to_do(results):
    m0 = results[0]["mistakes"]
    assert "frozen='yes' must be True" in m0["bad_frozen"], m0
    assert "rank 0's input requires grad, but this bridge's source is frozen (it was " \
           "built with frozen=True)" in m0["requires_grad_on_frozen"], m0
    assert "no source rank's input required grad at its first call" in \
           m0["later_requires_grad"], m0
    assert "frozen=False" in m0["later_requires_grad"] and "x.detach()" in \
           m0["later_requires_grad"], m0
    assert all(r["mistakes"]["decided"] is True for r in results)


@pytest.mark.slow
def test_frozen_false_runs_the_backward_on_every_rank(results):
    for rank, r in enumerate(results):
        f = r["frozen_false"]
        assert f["backward_calls"] == 1, (rank, f)
        if rank >= 2:
            assert f["grad"] == shard(_full(), DST)[rank].tolist(), (rank, f)


@pytest.mark.slow
def test_calls_under_no_grad_everywhere_decide_nothing(results):
    """Before, a first call under no_grad (an evaluation) froze the bridge, and the first
    training call then raised."""
    for rank, r in enumerate(results):
        e = r["evaluation_first"]
        assert e["before"] is None and e["after"] is False, (rank, e)
        assert e["backward_calls"] == 1, (rank, e)
        if rank < 2:  # d sum(y) / dx: ones
            assert e["grad"] == [[1.0] * 6] * 2, (rank, e)


def test_reference_backend_frozen():
    """The reference backend: results that require no grad; a piece that requires grad
    is refused."""
    import mimo_fx

    pieces = {r: p.requires_grad_() for r, p in shard(_full(), SRC).items()}
    y = mimo_fx.redistribute({r: p.detach() for r, p in pieces.items()}, SRC, DST,
                             frozen=True)
    assert all(not t.requires_grad and torch.equal(t, shard(_full(), DST)[r])
               for r, t in y.items())
    with pytest.raises(MimoFxError, match=r"frozen=True: the pieces of ranks \[0, 1\] "
                                          r"require grad"):
        mimo_fx.redistribute(pieces, SRC, DST, frozen=True)
