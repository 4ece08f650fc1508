"""No host read of tensor values in a bridge's steady state, eager and compiled.

On a GPU each ``.item()``, ``.tolist()``, ``int(t)`` of a device tensor waits for the
stream. :class:`mimo_fx.testing.syncs.HostReads` counts every read, whatever its
device (stricter than a GPU needs), over three steady-state calls (forward and backward)
after two warm-up calls, in one 2-rank gloo world:

- fixed sizes, sizes given again in each call, a packed batch given its token count:
  no read at all, eager and compiled;
- a call that learns its sizes: one read eagerly, the size gather's rows, which come
  back to the host in one copy; compiled, one more, the size record the graph made on the
  host (a CPU tensor: no device to wait for);
- a packed call that learns its count: one read eagerly; compiled, the route op also
  reads its batch (host tensors) -- still one read of data that crossed a collective;
- a pipelined bridge's imperative forward and backward (``Bridge`` fixed or told, the
  Megatron drop-in): none on the source; a told receiver reads the senders' rows once.

The same world drives both sides of the one capability a bridge asks of its backend
(:func:`mimo_fx.compiled.comm.coalesces`): an all-gather as the backend's own
collective and as grouped messages, each equal to the oracle.
"""

from __future__ import annotations

import pytest
import torch

from mimo_fx import Grid, Layout

pytestmark = pytest.mark.slow  # (four compiles per rank)

DP, TP = Grid(dp=2), Grid(tp=2)
H = 6


def _steady(fn, warm: int = 2, calls: int = 3) -> tuple[float, dict]:
    """Reads per call over ``calls`` calls after ``warm`` ones, and where they were."""
    from mimo_fx.testing.syncs import HostReads

    for _ in range(warm):
        fn()
    with HostReads() as reads:
        for _ in range(calls):
            fn()
    return reads.count() / calls, reads.by_line()


def _ragged(rank: int) -> torch.Tensor:
    return torch.ones((3, 5)[rank], H, requires_grad=True)


def _reads(rank: int) -> dict:
    import torch._dynamo

    from mimo_fx.compiled import Redistributor
    from mimo_fx.packed import PackedLayout

    out: dict = {}
    fixed = Redistributor(Layout(DP, "(dp b) h"), Layout(TP, "b (tp h)"), {"b": 4, "h": H})
    out["fixed", "eager"] = _steady(
        lambda: fixed(torch.ones(2, H, requires_grad=True)).sum().backward())
    step = torch.compile(lambda x: fixed(x).sum(), backend="aot_eager", fullgraph=True)
    out["fixed", "compiled"] = _steady(
        lambda: step(torch.ones(2, H, requires_grad=True)).backward())

    ragged = Redistributor(Layout(DP, "(dp t) h", ragged="dp"), Layout(TP, "t (tp h)"),
                           {"h": H})
    out["given", "eager"] = _steady(lambda: ragged(_ragged(rank), {"t": (3, 5)}).sum()
                                    .backward())
    out["learned", "eager"] = _steady(lambda: ragged(_ragged(rank)).sum().backward())
    learned = Redistributor(Layout(DP, "(dp t) h", ragged="dp"), Layout(TP, "t (tp h)"),
                            {"h": H})
    step2 = torch.compile(lambda x: learned(x).sum(), backend="aot_eager", fullgraph=True)

    def learned_compiled():
        x = _ragged(rank)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        step2(x).backward()
    out["learned", "compiled"] = _steady(learned_compiled)

    def packed_bridge():
        return Redistributor(Layout(DP, "(dp t) h"),
                             PackedLayout(Grid(cp=2), "t h", [[3, 5]]), {"h": H})
    packed = packed_bridge()
    out["packed given", "eager"] = _steady(
        lambda: packed(torch.ones(4, H, requires_grad=True), {"t": 8}).sum().backward())
    out["packed learned", "eager"] = _steady(
        lambda: packed(torch.ones(4, H, requires_grad=True)).sum().backward())
    packed2 = packed_bridge()
    step3 = torch.compile(lambda x: packed2(x).sum(), backend="aot_eager", fullgraph=True)
    out["packed learned", "compiled"] = _steady(
        lambda: step3(torch.ones(4, H, requires_grad=True)).backward())
    return out


def _imperative(rank: int) -> dict:
    """A pipelined bridge's imperative calls (rank 0 the source, rank 1 the destination),
    one forward and its backward per step: a plain ``Bridge`` at fixed sizes and told
    its sizes, and the Megatron drop-in (told by default) on the same two ranks."""
    from types import SimpleNamespace

    from mimo_fx.compiled import Bridge
    from mimo_fx.interop.megatron import BridgeCommunicator

    src, dst = Layout(Grid(dp=1), "b h"), Layout(Grid(dp=1, offset=1), "b h")
    x, g = torch.ones(4, H), torch.ones(4, H)

    def step(bridge, sizes=None):
        def run():
            if rank == 0:
                bridge.send_forward(x, sizes)
                bridge.recv_backward()
            else:
                bridge.recv_forward()
                bridge.send_backward(g)
        return run
    out = {}
    fixed = Bridge(src, dst, {"b": 4, "h": H})
    out["bridge fixed"] = _steady(step(fixed))
    told = Bridge(src, dst, told=True)
    out["bridge told"] = _steady(step(told, {"b": 4, "h": H} if rank == 0 else None))

    def grid(offset):
        return SimpleNamespace(shape=[1, 1, 1, 1], dim_names=["tp", "cp", "pp", "dp"],
                               rank_offset=offset)
    comm = BridgeCommunicator(grid(0), grid(1), comm_dtype=torch.float32)

    def megatron():
        if rank == 0:
            comm.send_forward(torch.ones(2, 3, H))
            comm.recv_backward()
        else:
            comm.recv_forward()
            comm.send_backward(torch.ones(2, 3, H))
    out["drop-in told"] = _steady(megatron)
    for bridge in (fixed, told, comm):
        bridge.destroy()
    return out


def _gathers(rank: int) -> dict:
    """An all-gather bridge, its backend asked to coalesce (its own all-gather) and not
    (grouped messages): its result, and how many grouped calls it posted."""
    from unittest import mock

    from mimo_fx.compiled import Redistributor, comm

    x = torch.arange(12.0).reshape(2, H) + 100 * rank
    out = {}
    for coalescing in (True, False):
        posted = []
        real = comm.post

        def counting(*args, _real=real, _posted=posted):
            _posted.append(1)
            return _real(*args)
        with mock.patch.object(comm, "coalesces", lambda pg, device, _c=coalescing: _c), \
                mock.patch.object(comm, "post", counting):
            comm._COALESCES.clear()
            bridge = Redistributor(Layout(DP, "(dp b) h"), Layout(DP, "b h"), {"b": 4, "h": H},
                                   frozen=True)
            y = bridge(x)
            bridge.destroy()
        out[coalescing] = (y, len(posted))
    return out


def _world(rank: int, world: int) -> dict:
    import mimo_fx.compiled

    try:
        return {"reads": _reads(rank), "gathers": _gathers(rank),
                "imperative": _imperative(rank)}
    finally:
        mimo_fx.compiled.destroy()


@pytest.fixture(scope="module")
def results(worlds):
    return worlds.run(2, _world, timeout=600)


@pytest.mark.parametrize("kind, how", [("fixed", "eager"), ("fixed", "compiled"),
                                       ("given", "eager"), ("packed given", "eager")])
def test_a_steady_call_reads_no_tensor_on_the_host(results, kind, how):
    for rank, r in enumerate(results):
        per_call, lines = r["reads"][kind, how]
        assert per_call == 0, f"rank {rank}: {kind} {how}: {lines}"


@pytest.mark.parametrize("kind, how, most", [
    ("learned", "eager", 1), ("packed learned", "eager", 1),
    ("learned", "compiled", 2),        # + the size record the graph made on the host
    ("packed learned", "compiled", 5),  # + that row, and the route op's batch (host)
])
def test_a_call_that_learns_reads_its_gathered_rows_once(results, kind, how, most):
    for rank, r in enumerate(results):
        per_call, lines = r["reads"][kind, how]
        assert 1 <= per_call <= most, f"rank {rank}: {kind} {how}: {lines}"
        # the one read of data that crossed a collective: the size gather's rows
        gathered = sum(n for line, n in lines.items() if line.startswith("compiled/learn.py"))
        assert gathered == 3, f"rank {rank}: {kind} {how}: {lines}"


@pytest.mark.parametrize("kind, reads", [("bridge fixed", (0, 0)), ("bridge told", (0, 1)),
                                         ("drop-in told", (0, 1))])
def test_a_pipelined_step_reads_only_the_told_sizes_on_the_receiver(results, kind, reads):
    """A told source reads nothing (it gives the sizes and posts its row without waiting);
    its receiver reads the senders' rows once per forward; fixed sizes: nothing."""
    for rank, r in enumerate(results):
        per_call, lines = r["imperative"][kind]
        assert per_call == reads[rank], f"rank {rank}: {kind}: {lines}"
        if reads[rank]:
            assert all(line.startswith("compiled/bridge.py") for line in lines), lines


def test_an_all_gather_is_exact_whether_or_not_the_backend_coalesces(results):
    full = torch.cat([torch.arange(12.0).reshape(2, H) + 100 * r for r in range(2)])
    for rank, r in enumerate(results):
        for coalescing, (y, _posted) in r["gathers"].items():
            assert torch.equal(y, full), f"rank {rank}, coalescing={coalescing}"
        # as messages: grouped calls posted; as the backend's own all-gather: none
        assert r["gathers"][False][1] > 0 and r["gathers"][True][1] == 0, r["gathers"]
