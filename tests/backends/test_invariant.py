"""The invariant: every rank of a bridge issues the same collectives, in the same order,
forward and backward, eager or compiled.

One 8-rank gloo world with Flight Recorder on runs every case of the shared table
(world <= 8) as one training step -- all bridges in one function, so one compiled graph
holds them all, as a real step holds several -- eagerly and under inductor, with
``loss.backward()`` and (eager) with ``torch.func.grad_and_value``, for 2 steps (a
desync may only show on the second). Inductor, the backend users train with, is the one
that may reorder: it compiles the AOT graphs aot_eager would run, through its own
passes (aot_eager runs on 4 ranks in test_compiled_features.py, and on the learned and
ragged sizes of test_variable_sizes.py).
Each rank records what its process groups actually ran; the test then checks, per step:

- every rank ran exactly the collectives the plans give it (forward and backward);
- on every group, all members ran the same kinds in the same order, with equal sizes
  where the collective needs them equal;
- every output and input gradient equals the oracle's (bitwise for pure data movement).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from cases import CASES, star
from harness import (
    expected_calls,
    expected_input_grad,
    expected_output,
    mismatch,
    oracle_data,
)

from mimo_fx import Collective
from mimo_fx.reference import shard

pytestmark = pytest.mark.slow  # spawned worlds, long: not in the fast subset (tests/README.md)

WORLD = 8
SAMPLE = [c for c in CASES if c.world <= WORLD]
BACKENDS = ("eager", "inductor")
MODES = ("backward", "func")
# each compile of this all-cases graph costs a minute (8 ranks on 2 cores): inductor runs
# the mode users train with; torch.func runs eager here (the order of its collectives)
# and compiled, values and gradients, in test_compiled_features.py (aot_eager on 4
# ranks, inductor on 2)
RUNS = [(b, m) for b in BACKENDS for m in MODES if b == "eager" or m == "backward"]
STEPS = 2  # a desync may only show on the second step


def _step_fn(bridges, mode: str):
    def loss_fn(xs, cots):
        ys = {}  # by case index; a bridge gives None off both its grids
        loss = torch.zeros((), dtype=torch.float64)
        for i, (bridge, x, cot) in enumerate(zip(bridges, xs, cots)):
            y = bridge(x)
            if y is not None:
                ys[i] = y
                loss = loss + (y * cot).sum()
        return loss, ys

    if mode == "func":
        grad = torch.func.grad_and_value(loss_fn, has_aux=True)

        def step(xs, cots):
            grads, (loss, ys) = grad(xs, cots)
            return loss, ys, grads
        return step
    return loss_fn


def _inputs(rank: int, cases, step: int, mode: str):
    xs, cots, want_y, want_g = [], [], [], []
    for index, case in enumerate(cases):
        x, g = oracle_data(case, 1000 * step + index)
        local = shard(x, case.src).get(rank)
        if local is None and mode == "func":
            local = torch.empty((0,) * len(case.src.local_dims), dtype=torch.float64)
        elif local is not None and mode == "backward":
            local = local.clone().requires_grad_()
        cot = shard(g, star(case.dst)).get(rank)
        if cot is None:
            cot = torch.zeros((0,) * len(case.dst.local_dims), dtype=torch.float64)
        xs.append(local)
        cots.append(cot)
        want_y.append(expected_output(case, x).get(rank))
        want_g.append(expected_input_grad(case, g).get(rank))
    return xs, cots, want_y, want_g


def _steps(rank: int, cases, bridges, step, backend: str, mode: str, out: dict) -> None:
    """``STEPS`` steps of ``step`` under ``backend``: the collectives each ran, and every
    output and input gradient against the oracle."""
    from mimo_fx.compiled import trace

    for s in range(STEPS):
        xs, cots, want_y, want_g = _inputs(rank, cases, s, mode)
        start = trace.mark()
        if mode == "func":
            _, ys, grads = step(xs, cots)
        else:
            loss, ys = step(xs, cots)
            loss.backward()
            grads = [None if x is None else x.grad for x in xs]
        calls = trace.since(start)
        problems = []
        for i, (case, x, g, wy, wg) in enumerate(zip(cases, xs, grads, want_y, want_g)):
            y = ys.get(i)
            problems.append(mismatch(case, None if y is None else y.detach(), wy,
                                     f"{case.name}: output"))
            if x is not None and x.numel():
                problems.append(mismatch(case, g, wg, f"{case.name}: input gradient"))
        out[backend, mode, s] = {
            "calls": [(c.kind, c.ranks, c.numel_in) for c in calls],
            "problems": [p for p in problems if p]}


def _world(rank: int, world: int, names: list[str], backends: tuple[str, ...]) -> dict:
    import torch._dynamo as dynamo
    import torch._inductor.config

    from mimo_fx.compiled import Redistributor

    torch._inductor.config.compile_threads = 1  # 8 ranks share 2 cores: no worker pools

    cases = [c for c in CASES if c.name in names]
    # (frozen=False: no call meets to decide whether a source is frozen; the collectives
    # counted are the plans')
    bridges = [Redistributor(c.src, c.dst, c.sizes, torch.float64, frozen=False)
               for c in cases]
    out: dict = {}
    compilers = tuple(b for b in backends if b != "eager")
    # kernels without SIMD: what this test checks (the collectives, their order, the
    # values) inductor fixes before C++ codegen, and g++ on ~190 vectorized kernels over
    # the ranks was a fifth of this world's time on a fresh machine (the other inductor
    # tests compile the default kernels)
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        for mode in MODES:
            if "eager" in backends:
                _steps(rank, cases, bridges, _step_fn(bridges, mode), "eager", mode, out)
            for backend in (b for b in compilers if (b, mode) in RUNS):
                dynamo.reset()
                step = torch.compile(_step_fn(bridges, mode), backend=backend,
                                     fullgraph=True)
                _steps(rank, cases, bridges, step, backend, mode, out)
    expected = sum(expected_calls(b.sizing.fwd, rank) + expected_calls(b.sizing.bwd, rank)
                   for b in bridges)
    for bridge in bridges:
        bridge.destroy()
    return {"runs": out, "expected": expected}


@pytest.fixture(scope="module")
def world_runs(worlds):
    return worlds.run(WORLD, _world, [c.name for c in SAMPLE], BACKENDS, record=True,
                     timeout=900)


def _runs(world_runs, backend, mode):
    return [(s, [r["runs"][backend, mode, s] for r in world_runs]) for s in range(STEPS)]


@pytest.mark.parametrize(("backend", "mode"), RUNS)
def test_values_and_gradients_equal_the_oracle(world_runs, backend, mode):
    for step, per_rank in _runs(world_runs, backend, mode):
        problems = {r: run["problems"] for r, run in enumerate(per_rank) if run["problems"]}
        assert not problems, f"step {step}: {problems}"


@pytest.mark.parametrize(("backend", "mode"), RUNS)
def test_every_rank_issues_the_plans_collectives(world_runs, backend, mode):
    for step, per_rank in _runs(world_runs, backend, mode):
        counts = [len(run["calls"]) for run in per_rank]
        expected = [r["expected"] for r in world_runs]
        assert counts == expected, f"step {step}: collectives per rank {counts}, plans " \
                                   f"say {expected}"


@pytest.mark.parametrize(("backend", "mode"), RUNS)
def test_group_members_issue_the_same_sequence(world_runs, backend, mode):
    for step, per_rank in _runs(world_runs, backend, mode):
        seen: dict[tuple[int, ...], dict[int, list]] = defaultdict(dict)
        for rank, run in enumerate(per_rank):
            for kind, ranks, numel in run["calls"]:
                # all-to-all sizes differ per member by design; the others must agree
                size = None if kind == Collective.ALL_TO_ALL else numel
                seen[tuple(ranks)].setdefault(rank, []).append((kind, size))
        for ranks, by_rank in seen.items():
            assert set(by_rank) == set(ranks), \
                f"step {step}: group {ranks}: only ranks {sorted(by_rank)} issued on it"
            sequences = {tuple(seq) for seq in by_rank.values()}
            assert len(sequences) == 1, f"step {step}: group {ranks} desyncs: {by_rank}"
