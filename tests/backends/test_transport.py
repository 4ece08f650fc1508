"""How a bridge moves data, and what it does not do: messages between the ranks that
exchange data, no copy where nothing moves, given sizes agreed once, a posted call.

One 8-rank gloo world (Flight Recorder and the message journal on) runs every check;
values and gradients are compared with full-tensor math (the oracle, ``shard``).

- An exchange whose transfers pair disjoint ranks (a pipelined bridge: 0->4, 1->5, ...)
  goes as messages: each rank sends to and receives from its own peers only, and a rank
  with nothing to move posts nothing (the journal lists each op with its messages).
- A bridge whose plans move nothing returns a view of its input (no copy, the same
  storage) and passes the gradient through.
- A bridge with free dims whose calls give every size gathers size records on its first
  call and not again while the sizes stay the same; a new size gathers again.
- ``start()`` posts the transfer; ``wait()`` gives the same result and gradient as a
  plain call, with compute in between.
"""

from __future__ import annotations

import pytest
import torch

from mimo_fx import Collective, Grid, Layout, plan
from mimo_fx.reference import shard

pytestmark = pytest.mark.slow  # a spawned world (tests/README.md)

WORLD = 8
ENC = Grid(tp=2, dp=2)
LLM = Grid(tp=2, dp=2, offset=4)
PIPE = (Layout(ENC, "(dp b) s h"), Layout(LLM, "(dp b) s h"))
SIZES = {"b": 8, "s": 4, "h": 6}


def test_the_plan_names_the_groups_that_exchange_data():
    text = str(plan(*PIPE, SIZES))
    assert "all_to_all as messages in (0,4) (1,5) (2,6) (3,7) of 8 ranks" in text, text
    assert "all_gather" not in text, text  # a small exchange: one round


def test_in_two_rounds_the_shares_are_contiguous_runs(two_rounds):
    text = str(plan(*PIPE, SIZES))
    assert "all_to_all as messages in (0,4) (1,5) (2,6) (3,7) of 8 ranks" in text, text
    # the shares are cut along b, the dst piece's outermost dim: contiguous runs
    assert "shares b[0:2] | b[2:4]" in text, text


def _data(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-9, 10, (SIZES["b"], SIZES["s"], SIZES["h"]), generator=gen).double()
    g = torch.randint(-9, 10, x.shape, generator=gen).double()
    return x, g


def _messages(rank: int) -> dict:
    """The pipelined bridge's ops as this rank journaled them, forward and backward."""
    import mimo_fx
    from mimo_fx.compiled import Redistributor, trace

    x, g = _data(0)
    bridge = Redistributor(*PIPE, SIZES, torch.float64)
    try:
        local = shard(x, PIPE[0]).get(rank)
        leaf = None if local is None else local.clone().requires_grad_()
        start = trace.mark()
        y = bridge(leaf)
        if PIPE[1].holds(rank):
            y.backward(shard(g, PIPE[1])[rank])
        else:
            mimo_fx.backward()
        calls = trace.since(start)
        ok = (not PIPE[1].holds(rank) or torch.equal(y.detach(), shard(x, PIPE[1])[rank])) \
            and (leaf is None or torch.equal(leaf.grad, shard(g, PIPE[0])[rank]))
        return {"ok": ok, "calls": [(str(getattr(c.kind, "value", c.kind)), c.ranks, c.sent,
                                     c.received) for c in calls]}
    finally:
        bridge.destroy()


def _identity(rank: int) -> dict:
    from mimo_fx.compiled import Redistributor

    layout = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    bridge = Redistributor(layout, layout, SIZES, torch.float64)
    try:
        x, g = _data(1)
        local = shard(x, layout)[rank].requires_grad_()
        y = bridge(local)
        same_storage = y.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        y.backward(shard(g, layout)[rank])
        return {"same_storage": same_storage, "value": torch.equal(y.detach(), local.detach()),
                "grad": torch.equal(local.grad, shard(g, layout)[rank])}
    finally:
        bridge.destroy()


def _given_sizes(rank: int) -> dict:
    """Calls of a bridge with b free, every call giving b: size gathers counted."""
    from mimo_fx.compiled import Redistributor, trace

    src, dst = Layout(Grid(tp=2, dp=4), "(dp b) s h"), Layout(Grid(tp=4, dp=2), "(dp b) s h")
    bridge = Redistributor(src, dst, {"s": SIZES["s"], "h": SIZES["h"]}, torch.float64)
    union = tuple(range(WORLD))
    exchanges, ok = [], True
    try:
        for b in (8, 8, 8, 16, 16):
            x, _ = _data(b)
            x = torch.cat([x, x])[:b]
            start = trace.mark()
            with torch.no_grad():
                y = bridge(shard(x, src)[rank], b=b)
            calls = trace.since(start)
            # the size records: an all-gather over the union (the data's are in pairs)
            exchanges.append(sum(c.kind == Collective.ALL_GATHER and c.ranks == union
                                 for c in calls))
            ok = ok and torch.equal(y, shard(x, dst)[rank])
        return {"exchanges": exchanges, "ok": ok}
    finally:
        bridge.destroy()


def _posted(rank: int) -> dict:
    """start() ... compute ... wait() against the plain call, values and gradients."""
    import mimo_fx
    from mimo_fx.compiled import Redistributor

    x, g = _data(2)
    bridge = Redistributor(*PIPE, SIZES, torch.float64)
    try:
        out = {}
        for how in ("call", "posted"):
            local = shard(x, PIPE[0]).get(rank)
            leaf = None if local is None else local.clone().requires_grad_()
            if how == "call":
                y = bridge(leaf)
            else:
                pending = bridge.start(leaf)
                busy = torch.randn(64, 64) @ torch.randn(64, 64)  # independent compute
                y = pending.wait()
                assert pending.wait() is y and busy.shape == (64, 64)
            if PIPE[1].holds(rank):
                y.backward(shard(g, PIPE[1])[rank])
                out[how, "y"] = torch.equal(y.detach(), shard(x, PIPE[1])[rank])
            else:
                mimo_fx.backward()
            if leaf is not None:
                out[how, "grad"] = torch.equal(leaf.grad, shard(g, PIPE[0])[rank])
        with torch.no_grad():  # no autograd: the posted run alone
            local = shard(x, PIPE[0]).get(rank)
            y = bridge.start(local).wait()
            if PIPE[1].holds(rank):
                out["no_grad", "y"] = torch.equal(y, shard(x, PIPE[1])[rank])
        return out
    finally:
        bridge.destroy()


def _gathers(rank: int) -> dict:
    """All-gathers as messages over 4 and 8 ranks, eagerly, rows small (through the
    group's first member) and large (direct): each rank's output, and what it journaled."""
    import torch.distributed as dist

    from mimo_fx.compiled import trace
    from mimo_fx.compiled.comm import ROOTED_BYTES, FunctionalComm

    out = {}
    for members in ((0, 2, 4, 6), tuple(range(WORLD))):
        group = dist.new_group(list(members))  # (every rank makes it)
        if rank not in members:
            continue
        comm = FunctionalComm({members: group.group_name})
        for numel in (3, ROOTED_BYTES // 8 + 1):
            start = trace.mark()
            row = torch.arange(numel, dtype=torch.float64) * 10 + rank
            got = comm.all_gather(row, members)
            out[members, numel] = (got, [(c.sent, c.received) for c in trace.since(start)])
    return out


def _world(rank: int, world: int) -> dict:
    return {"messages": _messages(rank), "identity": _identity(rank),
            "given": _given_sizes(rank), "posted": _posted(rank), "gathers": _gathers(rank)}


@pytest.fixture(scope="module")
def results(worlds):
    return worlds.run(WORLD, _world, record=True, timeout=600)


def test_exchange_messages_go_only_between_peers(results):
    for rank, r in enumerate(results):
        m = r["messages"]
        assert m["ok"], f"rank {rank}: values or gradient differ from the oracle"
        exchanges = [c for c in m["calls"] if c[0] == "all_to_all"]
        assert len(exchanges) == 2, (rank, m["calls"])  # forward and backward, every rank
        peer = rank + 4 if rank < 4 else rank - 4
        for _, ranks, sent, received in exchanges:
            assert ranks == tuple(range(WORLD))
            assert {p for p, _ in sent + received} == {peer}, (rank, sent, received)


def test_small_rows_gather_through_the_first_member(results):
    from mimo_fx.compiled.comm import ROOTED_BYTES

    for rank, r in enumerate(results):
        for (members, numel), (got, journal) in r["gathers"].items():
            want = torch.cat([torch.arange(numel, dtype=torch.float64) * 10 + m
                              for m in members])
            assert torch.equal(got, want), (rank, members, numel)
            assert len(journal) == 1, (rank, members, numel, journal)
            sent, received = journal[0]
            others = [m for m in members if m != rank]
            if numel * 8 > ROOTED_BYTES:  # direct: a row to and from every other member
                assert sent == tuple((m, numel) for m in others), (rank, sent)
                assert received == tuple((m, numel) for m in others), (rank, received)
            elif rank == members[0]:  # the root: every row in, the whole out
                assert received == tuple((m, numel) for m in others), (rank, received)
                assert sent == tuple((m, numel * len(members)) for m in others), rank
            else:
                assert sent == ((members[0], numel),), (rank, sent)
                assert received == ((members[0], numel * len(members)),), (rank, received)
        assert len(r["gathers"]) == 4 if rank in (0, 2, 4, 6) else 2, (rank, r["gathers"])


def test_a_bridge_that_moves_nothing_returns_a_view(results):
    for rank, r in enumerate(results):
        assert r["identity"] == {"same_storage": True, "value": True, "grad": True}, rank


def test_given_sizes_are_exchanged_only_when_they_change(results):
    for rank, r in enumerate(results):
        assert r["given"]["ok"], rank
        # (the first call's two: its ranks' meeting, which asks whether the source is
        # frozen, and the size gather)
        assert r["given"]["exchanges"] == [2, 0, 0, 1, 0], (rank, r["given"])


def test_a_posted_call_equals_the_call(results):
    for rank, r in enumerate(results):
        assert r["posted"] and all(r["posted"].values()), (rank, r["posted"])


def _compiled_overlap(rank: int, world: int) -> dict:
    """A step compiled by inductor: the bridge call, compute that does not need its
    result, then the use. The generated code must wait for the transfer after the
    compute; two steps of loss.backward() exact against full-tensor math."""
    from torch._inductor.utils import run_and_get_code

    from mimo_fx.compiled import Redistributor

    src, dst = Layout(Grid(dp=1), "b h"), Layout(Grid(dp=1, offset=1), "b h")
    bridge = Redistributor(src, dst, {"b": 16, "h": 16}, torch.float64)
    try:
        a = torch.eye(16, dtype=torch.float64) * 2

        def step(x, a):
            y = bridge(x)
            c = torch.tanh(a @ a) @ a                  # independent of the transfer
            return (y * y).sum() + c.sum()

        f = torch.compile(step, backend="inductor", fullgraph=True)
        out = {"order": None, "ok": []}
        for k in range(2):
            x_full = torch.arange(256.0, dtype=torch.float64).reshape(16, 16) + k
            x = x_full.clone().requires_grad_() if rank == 0 else None
            if k == 0:
                loss, code = run_and_get_code(f, x, a)
                lines = code[0].splitlines()
                wait = next(i for i, ln in enumerate(lines) if "wait_tensor.default(" in ln)
                mm = [i for i, ln in enumerate(lines) if "extern_kernels.mm(" in ln]
                out["order"] = bool(mm) and all(i < wait for i in mm)
            else:
                loss = f(x, a)
            c = (torch.tanh(a @ a) @ a).sum()
            if rank == 1:
                out["ok"].append(torch.allclose(loss, (x_full * x_full).sum() + c))
                loss.backward()
            else:
                mimo_fx_backward(loss)
                out["ok"].append(torch.equal(x.grad, 2 * x_full))
        # every posted transfer was waited for (none left registered: no leak per step)
        out["ok"].append(torch._C._distributed_c10d._get_work_registry_size() == 0)
        return out
    finally:
        bridge.destroy()


def mimo_fx_backward(loss) -> None:
    import mimo_fx

    mimo_fx.backward(loss)


def test_compiled_wait_sits_at_the_first_use(worlds):
    results = worlds.run(2, _compiled_overlap, timeout=600)
    for rank, r in enumerate(results):
        assert all(r["ok"]) and len(r["ok"]) == 3, (rank, r)
        assert r["order"], f"rank {rank}: the wait comes before the independent matmuls"
