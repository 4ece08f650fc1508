"""Shared test helpers: what the plan says each rank issues, and the oracle's outputs.

``index_mask``/``box_mask`` are the oracle's element sets and ``received`` what a plan
delivers to each rank, for the plan-property tests. ``expected_calls`` counts the
collectives a rank takes part in for a plan; the gloo tests compare it with what Flight
Recorder saw the rank run. ``expected_output`` is what a dst rank must hold after a
redistribute: the oracle's ``shard`` of the global tensor, or, when dst keeps partial
sums (which the oracle leaves open), the reference backend's.
"""

from __future__ import annotations

from itertools import chain

import torch
from cases import Case, star

from mimo_fx import Collective
from mimo_fx.layout import Layout
from mimo_fx.plan import Exchange, Gather, Plan
from mimo_fx.reference import redistribute as reference_redistribute
from mimo_fx.reference import shard
from mimo_fx.reference.oracle import shard_index
from mimo_fx.regions import box_volume

__all__ = ["oracle_data", "expected_output", "expected_input_grad", "mismatch", "expected_calls",
           "index_mask", "box_mask", "received"]


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
                         for g, parts in zip(step.groups, step.shares))
    return calls


def oracle_data(case, seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """A global input ``x`` (src dim order) and a global cotangent ``g`` (dst dim order)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = case.totals
    x = torch.randn([sizes[d] for d in case.src.dims], generator=gen, dtype=dtype)
    g = torch.randn([sizes[d] for d in case.dst.dims], generator=gen, dtype=dtype)
    return x, g


def expected_input_grad(case, g: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every src holder's input gradient for dst cotangents ``shard(g, dst*)``: the
    oracle's ``shard(g, src*)`` in src dim order."""
    g_src = g.permute([case.dst.dims.index(d) for d in case.src.dims])
    return shard(g_src, star(case.src), **case.counts)


def mismatch(case, got: torch.Tensor | None, want: torch.Tensor | None, what: str,
             exact: bool | None = None) -> str | None:
    """None when ``got`` is ``want`` (bitwise for pure data movement, close when partial
    sums are added, unless ``exact`` says); a rank that should hold nothing must get
    nothing or an empty tensor."""
    if want is None:
        return None if got is None or got.numel() == 0 else f"{what}: got {tuple(got.shape)}"
    if got is None:
        return f"{what}: got nothing"
    if exact is None:
        exact = not case.src.partial and not case.dst.partial
    same = torch.equal(got, want) if exact else torch.allclose(got, want)
    return None if same else f"{what} differs from the oracle"


def expected_output(case, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every dst holder's piece of ``redistribute(shard(x, src), src, dst)``."""
    if case.dst.partial:
        return reference_redistribute(shard(x, case.src, **case.counts), case.src, case.dst,
                                      **case.sizes)
    x_dst = x.permute([case.src.dims.index(d) for d in case.dst.dims])
    return shard(x_dst, case.dst, **case.counts)


def index_mask(layout: Layout, rank: int, case: Case, dims) -> torch.Tensor:
    """Boolean mask (canonical = src dim order) of the global elements ``rank`` holds."""
    mask = torch.zeros([case.totals[d] for d in dims], dtype=torch.bool)
    if not layout.holds(rank):
        return mask
    index = dict(zip(layout.dims, shard_index(layout, rank, case.sizes)))
    mask[torch.meshgrid(*(index[d] for d in dims), indexing="ij")] = True
    return mask


def box_mask(box, case: Case, dims) -> torch.Tensor:
    mask = torch.zeros([case.totals[d] for d in dims], dtype=torch.bool)
    mask[tuple(slice(a, b) for a, b in box)] = True
    return mask


def received(p) -> dict[int, list]:
    """Per receiver, the boxes it gets in every step (reductions excluded)."""
    out: dict[int, list] = {}
    for step in p.steps:
        if isinstance(step, Exchange):
            for t in step.transfers:
                out.setdefault(t.dst, []).append(t.box)
        elif isinstance(step, Gather) or step.kind is Collective.ALL_REDUCE:
            for group, parts in zip(step.groups, step.shares):
                for rank in group:
                    out.setdefault(rank, []).extend(
                        b for r, part in zip(group, parts) if r != rank for b in part)
    return out
