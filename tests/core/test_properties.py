"""Property tests over random grid pairs and patterns (world <= 16).

For any src/dst pair: the forward equals ``shard(X, dst)``, the vjp fed ``shard(G, dst)``
returns ``shard(G, src*)``, and the plan sends every rank exactly the bytes it needs and
does not hold (the lower bound), or for partial inputs at most that plus the
bandwidth-optimal reduction volume. Layouts draw either split rule (``tensor_split`` or
DTensor's nested ``chunk``, whose uneven sizes leave trailing shards empty).
"""

from __future__ import annotations

import torch
from cases import Case, star
from harness import box_mask, index_mask, received
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mimo_fx import Grid, Layout, plan
from mimo_fx.reference import redistribute, shard

DIMS = ("b", "s", "h")


@st.composite
def grids(draw, max_size: int, offset: int = 0) -> Grid:
    names = draw(st.permutations(["tp", "cp", "pp", "dp"]))
    count = draw(st.integers(1, 4))
    axes, total = {}, 1
    for name in names[:count]:
        size = draw(st.integers(1, max(1, min(4, max_size // total))))
        axes[name] = size
        total *= size
    return Grid(offset=offset, **axes)


@st.composite
def layouts(draw, grid: Grid, allow_partial: bool) -> tuple[Layout, dict[str, int]]:
    """A random layout on ``grid`` and the size constraints it needs (zigzag)."""
    shard_axes: dict[str, list[str]] = {d: [] for d in DIMS}
    partial, at = [], {}
    for axis in grid.names:
        role = draw(st.sampled_from(["shard", "shard", "replicate", "partial", "pin"]))
        if role == "partial" and allow_partial and axis != "pp":
            partial.append(axis)
        elif role == "pin":
            at[axis] = draw(st.integers(-grid.axis_size(axis), grid.axis_size(axis) - 1))
        elif role == "shard":
            shard_axes[draw(st.sampled_from(DIMS))].append(axis)
    zigzag, multiple = [], {}
    for dim, axes in shard_axes.items():
        if len(axes) == 1 and draw(st.booleans()):
            zigzag.append(axes[0])
            multiple[dim] = 2 * grid.axis_size(axes[0])
    factors = {d: " ".join([*shard_axes[d], d]) for d in DIMS}
    order = draw(st.permutations(DIMS))
    if draw(st.booleans()):  # flatten the first two dims into one local dim
        pattern = f"({factors[order[0]]} {factors[order[1]]}) ({factors[order[2]]})"
    else:
        pattern = " ".join(f"({factors[d]})" for d in order)
    split = draw(st.sampled_from(["tensor_split", "chunk"]))
    layout = Layout(grid, pattern, partial=tuple(partial), at=at, zigzag=tuple(zigzag),
                    split=split)
    return layout, multiple


@st.composite
def pairs(draw):
    src_grid = draw(grids(16))
    placement = draw(st.sampled_from(["colocated", "disjoint", "overlap"]))
    if placement == "colocated":
        offset = 0
    elif placement == "disjoint":
        offset = src_grid.size
    else:
        offset = draw(st.integers(0, src_grid.size))
    dst_grid = draw(grids(max(1, 16 - offset), offset))
    src, m1 = draw(layouts(src_grid, allow_partial=True))
    dst, m2 = draw(layouts(dst_grid, allow_partial=False))
    sizes = {}
    for dim in DIMS:
        multiple = max(m1.get(dim, 1), m2.get(dim, 1))
        if m1.get(dim, 1) * m2.get(dim, 1) > multiple:  # both zigzag: common multiple
            multiple = m1[dim] * m2[dim]
        sizes[dim] = multiple * draw(st.integers(1, 3 if multiple > 1 else 9))
    return src, dst, sizes



SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _global(sizes, dims, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn([sizes[d] for d in dims], generator=g, dtype=torch.float64)


@SETTINGS
@given(pairs())
def test_forward_and_vjp_match_full_tensor_math(pair):
    src, dst, sizes = pair
    x = _global(sizes, src.dims, 0)
    pieces = {r: t.requires_grad_() for r, t in shard(x, src).items()}
    y = redistribute(pieces, src, dst, **sizes)
    x_dst = x.permute([src.dims.index(d) for d in dst.dims])
    expected = shard(x_dst, dst)
    assert sorted(y) == sorted(expected)
    for rank, piece in expected.items():
        if src.partial:
            torch.testing.assert_close(y[rank], piece)
        else:
            assert torch.equal(y[rank], piece)
    g = _global(sizes, dst.dims, 1)
    cot = shard(g, dst)
    if y:
        torch.autograd.backward([y[r] for r in sorted(y)], [cot[r] for r in sorted(y)])
    g_src = shard(g.permute([dst.dims.index(d) for d in src.dims]), star(src))
    for rank, piece in pieces.items():
        grad = piece.grad if piece.grad is not None else torch.zeros_like(piece)
        assert torch.equal(grad, g_src[rank])


@SETTINGS
@given(pairs())
def test_plan_sends_exactly_the_lower_bound(pair):
    src, dst, sizes = pair
    p = plan(src, dst, sizes)

    case = Case("random", src, dst, sizes)
    got = received(p)
    for rank in dst.holders:
        need = index_mask(dst, rank, case, src.dims)
        held = (torch.zeros_like(need) if src.partial
                else index_mask(src, rank, case, src.dims))
        lower = int((need & ~held).sum()) * 4
        assert p.lower_bound[rank] == lower
        if src.partial:
            continue
        count = torch.zeros(need.shape, dtype=torch.int64)
        for box in got.get(rank, []):
            count += box_mask(box, case, src.dims)
        assert int(count.max()) <= 1 and torch.equal(count.bool(), need & ~held)
        assert p.bytes_recv.get(rank, 0) == lower
    if not src.partial:
        assert p.max_recv == p.max_lower_bound
    elif _reduction_divides(p):  # reductions cut along a dim: slab granularity
        # the peak receiver gets no more than the largest lower bound plus a
        # bandwidth-optimal reduction (per rank the planner may trade one for the other)
        assert p.max_recv <= max(p.lower_bound.get(r, 0) + p.reduction_bound.get(r, 0)
                                 for r in set(p.lower_bound) | set(p.reduction_bound))


def _reduction_divides(p) -> bool:
    """Whether every reduced region has a dim its group size divides (a perfect split)."""
    for step in p.steps:
        if hasattr(step, "regions"):
            for group, region in zip(step.groups, step.regions):
                extents = [b - a for a, b in region[0]] if region else []
                if len(region) > 1 or not any(e % len(group) == 0 for e in extents):
                    return False
    return True
