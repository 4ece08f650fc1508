"""Pipeline schedules over Bridges between grids of different parallelism (gloo).

Every schedule runs a chain of stages -- ``y = tanh(x * w)``, ``w`` a weight over the
hidden dim that each rank holds the slice of its layout -- with 4+ micro-batches, and
every rank's weight gradient (summed over its micro-batches and rows) and every
activation it receives are compared with the undistributed chain run on full tensors in
the same process (the oracle). The schedules issue their calls in the orders Megatron's
1F1B (source ahead by its warm-up count, combined calls), interleaved 1F1B (two rank
sets, two model chunks each, three bridges) and GPipe produce; the issue's minimal 1F1B
case is the first regression test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mimo_fx import Grid, Layout

pytestmark = pytest.mark.slow  # spawned worlds, long: not in the fast subset (tests/README.md)

B, H, M = 4, 4, 4  # batch rows, hidden, micro-batches
EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "bridge_1f1b.py"


def _data(stages: int, micro: int):
    gen = torch.Generator().manual_seed(7)
    ws = [torch.randn(H, generator=gen, dtype=torch.float64) for _ in range(stages)]
    xs = [torch.randn(B, H, generator=gen, dtype=torch.float64) for _ in range(micro)]
    ts = [torch.randn(B, H, generator=gen, dtype=torch.float64) for _ in range(micro)]
    return ws, xs, ts


def _oracle(layouts, micro: int):
    """Per stage, the full weight-gradient field (rows x hidden) summed over micro-batches,
    and every stage's full input per micro-batch."""
    ws, xs, ts = _data(len(layouts), micro)
    fields = [torch.zeros(B, H, dtype=torch.float64) for _ in layouts]
    inputs = [[None] * micro for _ in layouts]
    for m in range(micro):
        wide = [w.expand(B, H).clone().requires_grad_() for w in ws]
        y = xs[m]
        for k, w in enumerate(wide):
            inputs[k][m] = y.detach().clone()
            y = torch.tanh(y * w)
        (y * ts[m]).sum().backward()
        for k, w in enumerate(wide):
            fields[k] += w.grad
    return fields, inputs


def _local_w(layout: Layout, w: torch.Tensor, rank: int) -> torch.Tensor:
    from mimo_fx.reference import shard

    piece = shard(w.expand(B, H), layout)[rank]
    return piece[0].clone()


class _Stage:
    """One (virtual) stage on this rank: its weight slice, its inputs and outputs by
    micro-batch, the bridges before and after it, and the checks against the oracle."""

    def __init__(self, k: int, layouts, bridges, rank: int, micro: int, sizes, problems):
        from mimo_fx.reference import shard

        self.shard = shard
        self.k, self.rank, self.sizes, self.problems = k, rank, sizes, problems
        told = bool(bridges) and getattr(bridges[0], "told", False)
        self.got_sizes = None if told else sizes  # (a told bridge's receivers give none)
        self.lay = layouts[k]
        self.fields, self.inputs = _oracle(layouts, micro)
        ws, self.xs, self.ts = _data(len(layouts), micro)
        self.w = _local_w(self.lay, ws[k], rank).requires_grad_()
        self.prev = bridges[k - 1] if k > 0 else None
        self.next = bridges[k] if k < len(layouts) - 1 else None
        self.ins: dict = {}
        self.outs: dict = {}

    def piece(self, full):
        return self.shard(full, self.lay)[self.rank]

    # the calls, no-ops (or data and loss) at the ends of the pipeline
    def recv_forward(self, m):
        if self.prev is None:
            return self.piece(self.xs[m]).clone()
        return self.prev.recv_forward(sizes=self.got_sizes)

    def send_forward(self, m):
        if self.next is not None:
            self.next.send_forward(self.outs[m].detach(), sizes=self.sizes)

    def recv_backward(self):
        return self.next.recv_backward() if self.next is not None else None

    def send_backward(self, g):
        if self.prev is not None:
            self.prev.send_backward(g)

    def send_forward_recv_backward(self, m):
        if self.next is None:
            return None
        return self.next.send_forward_recv_backward(self.outs[m].detach(), sizes=self.sizes)

    def send_backward_recv_forward(self, g, m_next):
        if self.prev is None:
            return self.piece(self.xs[m_next]).clone()
        return self.prev.send_backward_recv_forward(g, sizes=self.got_sizes)

    # compute
    def forward(self, m, x):
        if not torch.equal(x.detach(), self.piece(self.inputs[self.k][m])):
            self.problems.append(f"stage {self.k} micro-batch {m}: wrong activation on "
                                 f"rank {self.rank}")
        self.ins[m] = x
        self.outs[m] = torch.tanh(x * self.w)

    def backward(self, m, grad):
        if self.next is None:
            (self.outs[m] * self.piece(self.ts[m])).sum().backward()
        else:
            self.outs[m].backward(grad)
        return self.ins[m].grad if self.prev is not None else None

    def check(self) -> None:
        expect = self.piece(self.fields[self.k]).sum(0)
        got = self.w.grad
        if got is None or not torch.allclose(got, expect, rtol=0, atol=1e-12):
            self.problems.append(f"stage {self.k}: weight gradient differs on rank "
                                 f"{self.rank}: {got} vs {expect}")


def megatron_1f1b(st: _Stage, stages: int, micro: int) -> None:
    """Megatron's non-interleaved 1F1B, with its combined calls: stage k runs
    ``stages - k - 1`` warm-up forwards ahead of the next stage."""
    warmup = min(stages - st.k - 1, micro)
    remaining = micro - warmup
    for m in range(warmup):
        st.forward(m, st.recv_forward(m))
        st.send_forward(m)
    x = st.recv_forward(warmup) if remaining else None
    for i in range(remaining):
        m = warmup + i
        st.forward(m, x)
        g = st.backward(i, st.send_forward_recv_backward(m))
        if i == remaining - 1:
            st.send_backward(g)
        else:
            x = st.send_backward_recv_forward(g, m + 1)
    for i in range(remaining, micro):
        st.send_backward(st.backward(i, st.recv_backward()))


def gpipe(st: _Stage, stages: int, micro: int) -> None:
    """Every forward, then every backward in micro-batch order."""
    for m in range(micro):
        st.forward(m, st.recv_forward(m))
        st.send_forward(m)
    for m in range(micro):
        st.send_backward(st.backward(m, st.recv_backward()))


def interleaved_order(p: int, sets: int, chunks: int, micro: int) -> list:
    """Megatron's interleaved 1F1B order for rank set ``p`` of ``sets``: forwards go
    through the chunks in groups of ``sets`` micro-batches, backwards likewise from the
    last chunk; ``(sets - p - 1) * 2 + (chunks - 1) * sets`` warm-up forwards."""
    def fwd(i):
        return ("F", (i // sets) % chunks, (i // (sets * chunks)) * sets + i % sets)

    def bwd(i):
        return ("B", chunks - 1 - (i // sets) % chunks, (i // (sets * chunks)) * sets + i % sets)

    total = micro * chunks
    warmup = min((sets - p - 1) * 2 + (chunks - 1) * sets, total)
    order = [fwd(i) for i in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    return order + [bwd(i) for i in range(total - warmup, total)]


def _one_schedule(rank: int, name: str, variant: str) -> list[str]:
    from mimo_fx.compiled import Bridge
    from mimo_fx.compiled.bridge import DEFERRED
    from mimo_fx.compiled.p2p import IN_FLIGHT

    problems: list[str] = []
    sizes = None
    fixed = {"b": B, "h": H}
    options: dict = {}
    micro = 40 if variant == "long" else M
    if variant in ("learned", "long", "told", "told checked"):  # no sizes fixed
        fixed = {}
        options["checked"] = variant in ("long", "told checked")
        if variant.startswith("told"):  # the senders give them, the receivers learn them
            options["told"], sizes = True, {"b": B, "h": H}
    elif variant == "checked":
        options["checked"] = True
    if name == "interleaved":
        sets, chunks = 2, 2
        grids = [Grid(tp=2), Grid(dp=2, offset=2)]
        patterns = ["b (tp h)", "(dp b) h"]
        layouts = [Layout(grids[v % sets], patterns[v % sets]) for v in range(sets * chunks)]
    elif name == "minimal":  # the case: one rank per stage
        layouts = [Layout(Grid(dp=1), "b h"), Layout(Grid(dp=1, offset=1), "b h")]
    else:
        layouts = [Layout(Grid(tp=2), "b (tp h)"), Layout(Grid(dp=2, offset=2), "(dp b) h"),
                   Layout(Grid(tp=2, offset=4), "b (tp h)")]
    bridges = [Bridge(layouts[k], layouts[k + 1], fixed or None, torch.float64, **options)
               for k in range(len(layouts) - 1)]
    stages = {k: _Stage(k, layouts, bridges, rank, micro, sizes, problems)
              for k, lay in enumerate(layouts) if lay.holds(rank)}
    if name == "interleaved":
        p = 0 if rank < 2 else 1
        if rank < 4:
            for kind, chunk, m in interleaved_order(p, 2, 2, M):
                st = stages[chunk * 2 + p]
                if kind == "F":
                    st.forward(m, st.recv_forward(m))
                    st.send_forward(m)
                else:
                    st.send_backward(st.backward(m, st.recv_backward()))
    else:
        run = megatron_1f1b if name in ("1f1b", "minimal") else gpipe
        for st in stages.values():
            run(st, len(layouts), micro)
    for st in stages.values():
        st.check()
    # what a rank keeps of its calls stays bounded (gloo says a message is through only
    # once waited for: unbounded, these lists grew by every call's messages): the bounds
    # hold before a call posts, so one call's messages (at most 2 per rank of the
    # bridge) may come on top
    for k, bridge in enumerate(bridges):
        call = 2 * len(bridge.union)
        for channel in bridge._channels:
            if (len(channel._sent) > IN_FLIGHT + call
                    or len(channel._posted) > (DEFERRED + 1) * call):
                problems.append(f"bridge {k} on rank {rank} keeps {len(channel._sent)} "
                                f"sends and {len(channel._posted)} receives in flight")
        if len(bridge._deferred) > DEFERRED + 1:
            problems.append(f"bridge {k} on rank {rank} defers {len(bridge._deferred)} "
                            f"checks")
    for bridge in bridges:
        bridge.destroy()
    return problems


CASES = [("minimal", "fixed"), ("1f1b", "fixed"), ("1f1b", "learned"), ("1f1b", "checked"),
         ("gpipe", "fixed"), ("gpipe", "learned"), ("gpipe", "long"), ("1f1b", "long"),
         ("1f1b", "told"), ("1f1b", "told checked"), ("gpipe", "told"), ("minimal", "told"),
         ("interleaved", "told"),
         ("interleaved", "fixed"),
         ("interleaved", "checked")]


def _mistakes(rank: int) -> dict:
    """Checked pipelined calls: a mistake on either side raises on every rank of both
    grids (the sender learns of a receiver's mistake at flush), and nothing hangs."""
    from mimo_fx import MimoFxError
    from mimo_fx.compiled import Bridge

    out: dict = {}
    src, dst = Layout(Grid(tp=2), "b (tp h)"), Layout(Grid(dp=2, offset=2), "(dp b) h")
    for who in ("sender", "receiver"):
        bridge = Bridge(src, dst, {"b": B, "h": H}, torch.float64, checked=True)
        good = torch.zeros(B, H // 2, dtype=torch.float64)
        try:
            if rank < 2:
                bridge.send_forward(good[:, :1] if who == "sender" and rank == 1 else good)
                bridge.flush()
            elif rank < 4:
                bridge.recv_forward(good if who == "receiver" and rank == 3 else None)
            out[who] = "no error"
        except MimoFxError as err:
            out[who] = str(err)
        bridge.destroy()  # on every rank: groups are created and released alike
    # a told bridge: a sender that misses a size, a receiver that gives them all (the
    # other side makes no call: it would wait for what the mistaken side never posts)
    for who in ("sender", "receiver"):
        bridge = Bridge(src, dst, None, torch.float64, told=True)
        try:
            if who == "sender" and rank < 2:
                bridge.send_forward(torch.zeros(B, H // 2, dtype=torch.float64), {"b": B})
            elif who == "receiver" and 2 <= rank < 4:
                bridge.recv_forward(sizes={"b": B, "h": H})
            out["told " + who] = "no error"
        except MimoFxError as err:
            out["told " + who] = str(err)
        bridge.destroy()
    # a source pinned to its last stage: rank 0 (the other stage) takes no part, and a
    # tensor passed there raises there; the others move the data without it
    pinned = Layout(Grid(pp=2), "b h", at={"pp": -1})
    bridge = Bridge(pinned, dst, {"b": B, "h": H}, torch.float64)
    full = torch.arange(B * H, dtype=torch.float64).view(B, H)
    try:
        if rank < 2:
            bridge.send_forward(full)
            bridge.flush()
            out["pinned"] = "no error"
        elif rank < 4:
            got = bridge.recv_forward()
            out["pinned"] = "equal" if torch.equal(got, full.chunk(2)[rank - 2]) else "differs"
    except MimoFxError as err:
        out["pinned"] = str(err)
    bridge.destroy()
    # one grid, both layouts pinned to its last stage, sizes learned: the size records are
    # a gather of the whole grid, so every rank of it calls (the other stage's with None)
    stages = Grid(pp=2, dp=2)
    bridge = Bridge(Layout(stages, "(dp b) h", at={"pp": -1}),
                    Layout(stages, "b h", at={"pp": -1}), None, torch.float64)
    last = rank in stages.ranks and stages.coord(rank)["pp"] == 1
    piece = full.chunk(2)[stages.coord(rank)["dp"]] if last else None
    try:
        for _ in range(2):  # (the second call's sizes as the first's)
            got = bridge.send_forward(piece)
        out["one grid pinned"] = (
            "not in the grid" if rank not in stages.ranks
            else ("equal" if torch.equal(got, full) else f"differs: {got}") if last
            else f"holds none: {None if got is None else tuple(got.shape)}")
    except MimoFxError as err:
        out["one grid pinned"] = str(err)
    bridge.destroy()
    # a backward before any forward, and the imperative calls under torch.compile
    bridge = Bridge(Layout(Grid(dp=1), "b h"), Layout(Grid(dp=1, offset=1), "b h"),
                    dtype=torch.float64)
    try:
        bridge.recv_backward() if rank == 0 else bridge.send_backward(None)
        out["no forward"] = "no error" if rank < 2 else "not involved"
    except MimoFxError as err:
        out["no forward"] = str(err)
    step = torch.compile(lambda x: bridge.send_forward(x, sizes={"b": B, "h": H}),
                         backend="eager", fullgraph=True)
    try:
        step(torch.zeros(B, H, dtype=torch.float64))
        out["compiled"] = "no error"
    except Exception as err:  # noqa: BLE001 (Dynamo wraps the error it traced)
        out["compiled"] = str(err)
    bridge.destroy()
    return out


def _readme_example(rank: int, world: int):
    """The README's hand-written 1F1B (docs/examples/bridge_1f1b.py) on this world."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bridge_1f1b", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.train(rank, world)


def _schedules(rank: int, world: int) -> dict:
    out: dict = {"mistakes": _mistakes(rank), "example": _readme_example(rank, world)}
    for name, variant in CASES:
        try:
            out[name, variant] = "; ".join(_one_schedule(rank, name, variant)) or None
        except Exception as err:  # noqa: BLE001 (reported per case)
            out[name, variant] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def world6(worlds):
    return worlds.run(6, _schedules, timeout=300)


@pytest.mark.parametrize("name,variant", CASES)
def test_schedule(world6, name, variant):
    problems = {r: res[name, variant] for r, res in enumerate(world6) if res[name, variant]}
    assert not problems, problems


@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_checked_mistake_raises_on_both_grids(world6, who):
    culprit = {"sender": "rank 1", "receiver": "rank 3"}[who]
    for rank in range(4):
        message = world6[rank]["mistakes"][who]
        assert culprit in message, (rank, message)


def test_readme_1f1b_example_matches_the_full_model(world6):
    """Gradients against ``x @ w`` differentiated whole, the loss summed over ranks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bridge_1f1b", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    w, xs = example.data()
    w.requires_grad_()
    loss = torch.tanh(xs @ w).square().sum() / xs.numel()
    loss.backward()
    for rank, want in enumerate(w.grad.chunk(2, dim=1)):
        assert torch.allclose(world6[rank]["example"], want, atol=1e-6), rank
    assert abs(world6[2]["example"] + world6[3]["example"] - loss.item()) < 1e-5
    assert world6[4]["example"] is None


def test_imperative_call_mistakes_raise(world6):
    for rank in range(6):
        got = world6[rank]["mistakes"]
        if rank < 2:
            assert f"rank {rank}: a backward with no forward waiting for it" in got["no forward"]
        assert "the imperative send/recv calls run eagerly" in got["compiled"], rank


def test_a_pinned_layouts_other_stage_takes_no_part(world6):
    """Rank 0 holds no piece of the pinned source: its call returns at once (the others
    never wait for it), and one that passes a tensor raises there, saying so."""
    got = [world6[rank]["mistakes"].get("pinned") for rank in range(6)]
    assert "rank 0 holds no piece of either side but passed a forward tensor of shape " \
           f"({B}, {H}); pass None there" in got[0], got[0]
    assert got[1:] == ["no error", "equal", "equal", None, None], got


def test_a_one_grid_bridge_with_pinned_layouts_runs_on_the_whole_grid(world6):
    """Both layouts on the last stage of one grid, sizes learned: the other stage's ranks
    call with None and get nothing; the last stage's each get the whole tensor."""
    got = [world6[rank]["mistakes"].get("one grid pinned") for rank in range(6)]
    stages = Grid(pp=2, dp=2)
    want = ["equal" if stages.coord(r)["pp"] == 1 else "holds none: (0, 0)" for r in range(4)]
    assert got == want + ["not in the grid"] * 2, got


def test_told_bridge_mistakes_raise(world6):
    for rank in range(4):
        got = world6[rank]["mistakes"]
        if rank < 2:
            assert f"rank {rank}: a told bridge's senders give every call's sizes; this " \
                   f"call misses h" in got["told sender"], got["told sender"]
        else:
            assert f"rank {rank}: a told bridge's receivers learn the sizes from the " \
                   f"senders; pass none" in got["told receiver"], got["told receiver"]
