"""The compiled backend on gloo: a sample of the shared table in one spawned world.

Every rank runs the case through a Redistributor and compares its output and input
gradient with the oracle (bitwise for pure data movement; a partial dst with the
reference backend's output), and counts the collectives its process groups ran
(Flight Recorder) against the plan.
"""

from __future__ import annotations

import pytest
import torch
from cases import CASES, Case, star
from harness import expected_calls, expected_input_grad, expected_output, mismatch, oracle_data

from mimo_fx.reference import shard
from mimo_fx.testing import run_world

pytestmark = pytest.mark.slow  # spawned worlds, long: not in the fast subset (tests/README.md)

WORLD = 8
SAMPLE = [c for c in CASES if c.world <= WORLD]


def _run_case(rank: int, case: Case, device: str = "cpu") -> str | None:
    from mimo_fx.compiled import Redistributor, trace

    x, g = oracle_data(case, 0)
    # (frozen=False: its backward always runs, so no call meets to decide it; the
    # collectives counted are the plan's)
    bridge = Redistributor(case.src, case.dst, case.sizes, torch.float64, device=device,
                           frozen=False)
    try:
        local = shard(x, case.src).get(rank)
        if local is not None:
            local = local.to(device).requires_grad_()
        with torch.no_grad():  # the no-autograd fast path gives the same result
            y_fast = bridge(local)
        start = trace.mark()
        y_dev = bridge(local)
        y = y_dev
        fwd_calls = len(trace.since(start))
        if y is not None and not torch.equal(y_fast, y.detach()):
            return f"rank {rank}: no-grad call differs from the autograd call"
        if rank not in bridge.union:
            return None if y is None else f"rank {rank} off both grids got {y!r}"
        problem = mismatch(case, y.cpu(), expected_output(case, x).get(rank),
                           f"rank {rank}: output")
        if problem:
            return problem
        if fwd_calls != expected_calls(bridge.sizing.fwd, rank):
            return f"rank {rank}: {fwd_calls} collectives, plan says " \
                   f"{expected_calls(bridge.sizing.fwd, rank)}"
        cot = shard(g, star(case.dst)).get(rank)
        start = trace.mark()
        y_dev.backward(cot.to(device) if cot is not None else torch.zeros_like(y_dev))
        bwd_calls = len(trace.since(start))
        if bwd_calls != expected_calls(bridge.sizing.bwd, rank):
            return f"rank {rank}: backward issued {bwd_calls} collectives, plan says " \
                   f"{expected_calls(bridge.sizing.bwd, rank)}"
        if local is not None:
            return mismatch(case, local.grad.cpu(), expected_input_grad(case, g)[rank],
                            f"rank {rank}: input gradient", exact=True)
        return None
    finally:
        bridge.destroy()


def _table_on_world(rank: int, world: int, names: list[str], device: str = "cpu") -> dict:
    from mimo_fx.compiled import live_groups

    out = {}
    for case in CASES:
        if case.name in names:
            try:
                out[case.name] = _run_case(rank, case,
                                           device if device == "cpu" else f"cuda:{rank}")
            except Exception as err:  # report per case; keep the world going
                out[case.name] = f"{type(err).__name__}: {err}"
    out["__live_groups__"] = live_groups()
    return out


@pytest.fixture(scope="module")
def table_results(worlds):
    return worlds.run(WORLD, _table_on_world, [c.name for c in SAMPLE], record=True)


@pytest.mark.parametrize("case", SAMPLE, ids=[c.name for c in SAMPLE])
def test_table_case_on_gloo(table_results, case: Case):
    problems = [r[case.name] for r in table_results if r[case.name] is not None]
    assert not problems, problems[:3]


def test_bridges_release_their_groups(table_results):
    assert [r["__live_groups__"] for r in table_results] == [0] * WORLD


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA devices (NCCL)")
def test_table_sample_on_nccl():
    """The same executor on NCCL: device placement follows the input tensor."""
    world = min(GPUS, WORLD)
    names = [c.name for c in SAMPLE if c.world <= world]
    results = run_world(world, _table_on_world, names, "cuda", backend="nccl", record=True)
    problems = {n: [r[n] for r in results if r[n] is not None] for n in names}
    assert not any(problems.values()), {n: p[:2] for n, p in problems.items() if p}
