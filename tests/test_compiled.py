"""The compiled backend on gloo: a sample of the shared table in one spawned world.

Every rank runs the case through a Redistributor and compares its output and input
gradient with the oracle (bitwise for pure data movement), and counts the functional
collectives it issued against the plan.
"""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from cases import CASES, Case, star

from mimo_fx.launch import run_world
from mimo_fx.plan import Exchange
from mimo_fx.reference import shard
from mimo_fx.regions import box_volume

WORLD = 8
SAMPLE = [c for c in CASES if c.world <= WORLD]


def _expected_calls(plan, rank: int) -> int:
    """One collective per step the rank takes part in: every rank of an all-to-all, and
    the members of a gather or reduce group of two or more ranks with data to move (a
    group whose shares are all empty, as uneven chunk splits leave, has nothing to do)."""
    calls = 0
    for step in plan.steps:
        if isinstance(step, Exchange):
            calls += rank in step.ranks
        else:
            calls += any(rank in g and len(g) > 1 and any(map(box_volume, chain(*parts)))
                         for g, parts in zip(step.groups, step.parts))
    return calls


def _run_case(rank: int, case: Case, counter: dict, device: str = "cpu") -> str | None:
    from mimo_fx.compiled import Redistributor

    gen = torch.Generator().manual_seed(0)
    x = torch.randn([case.sizes[d] for d in case.src.dims], generator=gen, dtype=torch.float64)
    g = torch.randn([case.sizes[d] for d in case.dst.dims], generator=gen, dtype=torch.float64)
    bridge = Redistributor(case.src, case.dst, case.sizes, torch.float64, device=device)
    try:
        local = shard(x, case.src).get(rank)
        if local is not None:
            local = local.to(device).requires_grad_()
        with torch.no_grad():  # the no-autograd fast path gives the same result
            y_fast = bridge(local)
        counter.clear()
        y_dev = bridge(local)
        y = y_dev
        fwd_calls = sum(counter.values())
        if y is not None and not torch.equal(y_fast, y.detach()):
            return f"rank {rank}: no-grad call differs from the autograd call"
        if rank not in bridge.union:
            return None if y is None else f"rank {rank} off both grids got {y!r}"
        x_dst = x.permute([case.src.dims.index(d) for d in case.dst.dims])
        expected = shard(x_dst, case.dst).get(rank) if not case.dst.partial else None
        y = y.cpu()
        if expected is not None:
            same = (torch.allclose(y, expected) if case.src.partial
                    else torch.equal(y, expected))
            if not same:
                return f"forward differs on rank {rank}"
        elif case.dst.holds(rank) is False and y.numel() != 0:
            return f"rank {rank} holds nothing under dst but got {tuple(y.shape)}"
        if fwd_calls != _expected_calls(bridge.fwd, rank):
            return f"rank {rank}: {fwd_calls} collectives, plan says " \
                   f"{_expected_calls(bridge.fwd, rank)}"
        cot = shard(g, star(case.dst)).get(rank)
        counter.clear()
        y_dev.backward(cot.to(device) if cot is not None else torch.zeros_like(y_dev))
        if sum(counter.values()) != _expected_calls(bridge.bwd, rank):
            return f"rank {rank}: backward issued {sum(counter.values())} collectives"
        if local is not None:
            g_src = g.permute([case.dst.dims.index(d) for d in case.src.dims])
            if not torch.equal(local.grad.cpu(), shard(g_src, star(case.src))[rank]):
                return f"input gradient differs on rank {rank}"
        return None
    finally:
        bridge.destroy()


def _table_on_world(rank: int, world: int, names: list[str], device: str = "cpu") -> dict:
    import torch.distributed._functional_collectives as fc

    import mimo_fx.compiled.executor as executor
    from mimo_fx.compiled import live_groups

    counter: dict[str, int] = {}

    class Counting:  # wraps the functional collectives the executor calls
        def __getattr__(self, name):
            fn = getattr(fc, name)
            if name == "wait_tensor":
                return fn

            def counted(*args, **kwargs):
                counter[name] = counter.get(name, 0) + 1
                return fn(*args, **kwargs)
            return counted

    executor.fc = Counting()
    out = {}
    for case in CASES:
        if case.name in names:
            try:
                out[case.name] = _run_case(rank, case, counter,
                                           device if device == "cpu" else f"cuda:{rank}")
            except Exception as err:  # report per case; keep the world going
                out[case.name] = f"{type(err).__name__}: {err}"
    out["__live_groups__"] = live_groups()
    return out


@pytest.fixture(scope="module")
def table_results():
    return run_world(WORLD, _table_on_world, [c.name for c in SAMPLE])


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
    results = run_world(world, _table_on_world, names, "cuda", backend="nccl")
    problems = {n: [r[n] for r in results if r[n] is not None] for n in names}
    assert not any(problems.values()), {n: p[:2] for n, p in problems.items() if p}
