"""Shared test helpers: what the plan says each rank issues, and the oracle's outputs.

``expected_calls`` counts the collectives a rank takes part in for a plan; the gloo tests
compare it with what Flight Recorder saw the rank run. ``expected_output`` is what a
dst rank must hold after a redistribute: the oracle's ``shard`` of the global tensor, or,
when dst keeps partial sums (which the oracle leaves open), the reference backend's.
"""

from __future__ import annotations

from itertools import chain

import torch

from mimo_fx.plan import Exchange, Plan
from mimo_fx.reference import redistribute as reference_redistribute
from mimo_fx.reference import shard
from mimo_fx.regions import box_volume

__all__ = ["expected_calls", "expected_output"]


def expected_calls(plan: Plan, rank: int) -> int:
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


def expected_output(case, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every dst holder's piece of ``redistribute(shard(x, src), src, dst)``."""
    if case.dst.partial:
        return reference_redistribute(shard(x, case.src), case.src, case.dst, **case.sizes)
    x_dst = x.permute([case.src.dims.index(d) for d in case.dst.dims])
    return shard(x_dst, case.dst)
