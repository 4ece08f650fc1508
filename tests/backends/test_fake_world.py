"""Every rank's compiled step traced in one process on torch's fake backend
(mimo_fx.testing.fake_world), its record replayed with NCCL's rules.

The shared table's cases (world <= 8) as one training step, all bridges in one compiled
graph, forward and ``loss.backward()``, each of 8 ranks in turn: the members of every
group issue the same operations in the same order and sizes, no member skips a group's
first operation, nothing deadlocks -- under aot_eager for every case, and under inductor
(2 steps; on torch 2.14 its simple_overlap pass moves collectives and waits) for a
sample. Mistakes a fake world must catch -- ranks that build their bridges in other
orders, a rank that skips a call -- are named by the replay.
"""

from __future__ import annotations

import pytest
import torch
from cases import CASES, by_name

from mimo_fx import Grid, Layout
from mimo_fx.errors import MimoFxError
from mimo_fx.testing.fake_world import check, trace

# (torch's own: its compiler touches a deprecated jit entry point while tracing in this
# process; the spawned worlds' compiles show no warnings here)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

SAMPLE = [c for c in CASES if c.world <= 8]
INDUCTOR = ["fan_in", "fan_out_cp_zigzag", "partial_to_llm_cp", "disjoint_tp_sharded_dst"]


def _step(rank: int, world: int, names: list[str], backend: str, steps: int) -> int:
    """``steps`` training steps of every case's bridge in one compiled graph; how many
    cases gave this rank a piece."""
    import torch._inductor.config

    from mimo_fx.compiled import Redistributor
    from mimo_fx.reference import shard

    cases = [by_name(n) for n in names]
    bridges = [Redistributor(c.src, c.dst, c.sizes, torch.float64, frozen=False)
               for c in cases]

    def loss_fn(xs):
        loss, held = torch.zeros((), dtype=torch.float64), 0
        for bridge, x in zip(bridges, xs):
            y = bridge(x)
            if y is not None:  # (an empty piece too: its backward sends this rank's part)
                loss, held = loss + y.sum(), held + bool(y.numel())
        return loss, held

    fn = torch.compile(loss_fn, backend=backend, fullgraph=True)
    held = 0
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False, "compile_threads": 1}):
        for _ in range(steps):
            xs = []
            for case in cases:
                x = torch.zeros([case.totals[d] for d in case.src.dims], dtype=torch.float64)
                local = shard(x, case.src, **case.counts).get(rank)
                xs.append(None if local is None else local.clone().requires_grad_())
            loss, held = fn(xs)
            loss.backward()
    return held


@pytest.mark.slow
def test_the_table_compiled_with_aot_eager_keeps_nccls_rules_on_every_rank():
    results, records = trace(8, _step, [c.name for c in SAMPLE], "aot_eager", 1)
    from mimo_fx.testing.nccl_rules import replay

    report = replay(records)
    assert report.problems == [], report.problems[:3]
    # every rank took part: pieces on each, and grouped calls and collectives recorded
    assert all(results[r] > 0 for r in range(8)), results
    assert report.groups >= len(SAMPLE) and report.ops > 8 * len(SAMPLE), report


@pytest.mark.slow
def test_inductor_two_steps_keep_nccls_rules_on_every_rank():
    report = check(8, _step, INDUCTOR, "inductor", 2)
    assert report.problems == [] and report.ops > 8 * len(INDUCTOR), report


def _two_bridges(rank: int, world: int, swap: bool, skip: bool) -> None:
    """Two bridges over ranks 0-1 -> 2-3; rank 0 builds them in the other order
    (``swap``), or skips the second's call (``skip``)."""
    from mimo_fx.compiled import Redistributor

    src = Layout(Grid(dp=2), "(dp b) h")
    a = Redistributor(src, Layout(Grid(tp=2, offset=2), "b (tp h)"), {"b": 4, "h": 6},
                      frozen=False, name="a")
    b = Redistributor(src, Layout(Grid(dp=2, offset=2), "(dp b) h"), {"b": 4, "h": 2},
                      frozen=False, name="b")
    order = [b, a] if swap and rank == 0 else [a, b]
    x = {id(a): torch.ones(2, 6), id(b): torch.ones(2, 2)}
    for bridge in order[: 1 if skip and rank == 0 else 2]:
        bridge(x[id(bridge)] if rank < 2 else None)


def test_a_clean_pair_of_bridges_replays_clean():
    report = check(4, _two_bridges, False, False)
    assert report.problems == [] and report.ops > 0


def test_ranks_calling_bridges_in_other_orders_are_caught():
    problems = check(4, _two_bridges, True, False).problems
    assert problems and any(p.startswith(("deadlock", "mis-pair")) for p in problems), problems


def test_a_rank_that_skips_a_call_is_caught():
    problems = check(4, _two_bridges, False, True).problems
    assert any(p.startswith("deadlock") for p in problems), problems


def test_a_fake_world_needs_a_process_without_a_world(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(MimoFxError, match="without a process group; this one has a 2-rank"):
        trace(2, _two_bridges, False, False)
