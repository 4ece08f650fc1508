"""Tilings computed per owner against the bounds they are defined by.

A :class:`DimTiling` never lists its intervals; these tests list them with
``split_bounds``, ``chunk_bounds`` and ``zigzag_bounds`` (and a refinement by
``split_bounds`` of each interval) and check every lookup against the list: what each
owner holds, which interval holds each position, how a range is cut, and which owners
meet a range.
"""

from __future__ import annotations

from itertools import product

import pytest

from mimo_fx import Grid, Layout
from mimo_fx.regions import (
    Chunk,
    DimTiling,
    TensorSplit,
    Tiling,
    Zigzag,
    chunk_bounds,
    split_bounds,
    zigzag_bounds,
)


def _listed(size: int, parts: tuple[int, ...], rule: str, refine: int) -> dict[int, list]:
    """Owner -> its intervals, from the defining bounds."""
    n = 1
    for p in parts:
        n *= p
    if rule == "zigzag":
        base = {k: list(ivs) for k, ivs in enumerate(zigzag_bounds(size, n))}
    elif rule == "chunk":
        base = {k: [iv] for k, iv in enumerate(chunk_bounds(size, list(parts)))}
    else:
        base = {k: [iv] for k, iv in enumerate(split_bounds(size, n))}
    if not refine:
        return {k: [iv for iv in ivs if iv[1] > iv[0]] for k, ivs in base.items()}
    out = {}
    for k, ivs in base.items():
        for j in range(refine):
            out[k * refine + j] = [(lo + a, lo + b) for lo, hi in ivs
                                   for a, b in [split_bounds(hi - lo, refine)[j]] if b > a]
    return out


SHAPES = [(size, parts, rule, refine)
          for size, parts, rule, refine in product(
              range(1, 19), [(1,), (2,), (3,), (2, 3), (4,)], ["tensor_split", "chunk", "zigzag"],
              [0, 2, 3])
          if rule != "zigzag" or (len(parts) == 1 and size % (2 * parts[0]) == 0)]


@pytest.mark.parametrize("size, parts, rule, refine", SHAPES)
def test_dim_tiling_matches_its_listed_bounds(size, parts, rule, refine):
    cut = {"tensor_split": TensorSplit(), "chunk": Chunk(), "zigzag": Zigzag()}[rule]
    t = DimTiling(size, tuple(f"a{i}" for i in range(len(parts))), parts, cut)
    if refine:
        t = t.refine(("r",), [refine])
    listed = _listed(size, parts, rule, refine)
    assert {o: list(t.owned(o)) for o in range(t.owners)} == listed
    holder = {x: (iv, o) for o, ivs in listed.items() for iv in ivs for x in range(*iv)}
    assert sorted(holder) == list(range(size))  # the intervals tile the dim
    for x, (iv, o) in holder.items():
        assert t.locate(x) == (*iv, o)
    if rule != "zigzag":
        bounds = t.bounds(list(range(t.owners)))
        assert bounds is not None
        for o, lo, hi in zip(range(t.owners), *bounds):
            assert [(lo, hi)] == listed[o] or (lo == hi and not listed[o])
    for start in range(size):
        for stop in range(start + 1, size + 1):
            pieces = t.split(start, stop)
            assert [p for p, _, _ in pieces] == _cut(start, stop, holder)
            assert all(holder[p[0]] == (whole, o) for p, whole, o in pieces)
            owners = sorted({o for _, _, o in pieces})
            assert list(t.owners_meeting(start, stop)) == owners
            assert t.owner_span(start, stop) == (owners[0], owners[-1])


def _cut(start: int, stop: int, holder) -> list[tuple[int, int]]:
    out = []
    for x in range(start, stop):
        iv = holder[x][0]
        if out and out[-1][1] == x and holder[out[-1][0]][0] == iv:
            out[-1] = (out[-1][0], x + 1)
        else:
            out.append((x, x + 1))
    return out


def test_tiling_columns_equal_per_rank_lookups():
    """Owners, holding and coordinates a column at a time, as rank by rank."""
    grid = Grid(tp=2, pp=3, dp=4, offset=5)
    layout = Layout(grid, "(dp b) (tp s) h", at={"pp": 1})
    for tiling in (t := Tiling.of(layout, ("b", "s", "h"), {"b": 8, "s": 6, "h": 3}),
                   t.refine("b", ("pp",))):
        for ranks in (range(5, 29), range(0, 40), range(10, 20), range(30, 40), range(0, 3)):
            assert tiling.holds_column(ranks) == [tiling.holds(r) for r in ranks]
            inside = range(max(ranks.start, 5), min(ranks.stop, 29))
            if len(inside):
                assert list(zip(*tiling.owner_columns(inside))) == [tiling.owners(r)
                                                                     for r in inside]
            held = tiling.held_owner_columns(ranks)
            assert list(zip(*held)) == [tiling.owners(r) if tiling.holds(r) else (-1,) * 3
                                        for r in ranks]
        for rank in grid.ranks:  # owners' offsets and the other axes make up the rank
            others = sum(c * stride for c, stride, a in zip(
                grid.coord_tuple(rank), grid.strides, grid.names) if a not in tiling.owning_axes)
            owned = sum(tiling.offset(d, o) for d, o in enumerate(tiling.owners(rank)))
            assert grid.offset + owned + others == rank
