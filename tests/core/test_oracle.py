"""The oracle (shard / unshard) against hand-written torch indexing."""

from __future__ import annotations

from itertools import product

import pytest
import torch

from mimo_fx import Grid, Layout, MimoFxError
from mimo_fx.reference import shard, unshard


def coords(axes: dict[str, int], offset: int = 0):
    """(rank, {axis: index}) for every rank; rank = offset + c0 + n0*(c1 + n1*(...))."""
    names, sizes = list(axes), list(axes.values())
    for c in product(*(range(n) for n in sizes)):
        acc = 0
        for ci, n in reversed(list(zip(c, sizes))):
            acc = acc * n + ci
        yield offset + acc, dict(zip(names, c))


def arange(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def zigzag_rows(x: torch.Tensor, cp: int, i: int) -> torch.Tensor:
    c = x.shape[0] // (2 * cp)
    j = 2 * cp - 1 - i
    return torch.cat([x[i * c:(i + 1) * c], x[j * c:(j + 1) * c]])


# Each case: grid axes, offset, pattern, layout kwargs, global shape, expected piece(x, coord)
# (None = the rank holds nothing), extra sizes for unshard.
CASES = {
    "dp_b-even": (
        {"tp": 2, "dp": 2}, 0, "(dp b) s h", {}, (4, 3, 2),
        lambda x, c: torch.tensor_split(x, 2, dim=0)[c["dp"]], {}),
    "dp_b-5-over-2": (
        {"tp": 2, "dp": 2}, 0, "(dp b) s h", {}, (5, 3, 2),
        lambda x, c: x[[0, 1, 2]] if c["dp"] == 0 else x[[3, 4]], {}),
    "dp_b-3-over-4-empty": (
        {"dp": 4}, 3, "(dp b) s h", {}, (3, 2, 2),
        lambda x, c: x[c["dp"]:c["dp"] + 1] if c["dp"] < 3 else x[3:], {}),
    "b_tp_h": (
        {"tp": 2, "dp": 2}, 0, "b (tp h)", {}, (3, 6),
        lambda x, c: x[:, 3 * c["tp"]:3 * c["tp"] + 3], {}),
    "b_tp_h-uneven": (
        {"tp": 2, "dp": 2}, 0, "b (tp h)", {}, (3, 5),
        lambda x, c: x[:, :3] if c["tp"] == 0 else x[:, 3:], {}),
    "dp_cp_b": (
        {"cp": 2, "dp": 2}, 0, "(dp cp b) s", {}, (8, 2),
        lambda x, c: torch.tensor_split(x, 4, dim=0)[2 * c["dp"] + c["cp"]], {}),
    "dp_cp_b-uneven": (
        {"tp": 2, "cp": 2, "dp": 2}, 0, "(dp cp b) s", {}, (7, 2),
        lambda x, c: x[[[0, 1], [2, 3], [4, 5], [6]][2 * c["dp"] + c["cp"]]], {}),
    "dp_cp_b-6-over-4": (  # tensor_split sizes 2,2,1,1 (torch.chunk would give 2,2,2)
        {"cp": 2, "dp": 2}, 0, "(dp cp b) s", {}, (6, 2),
        lambda x, c: x[[[0, 1], [2, 3], [4], [5]][2 * c["dp"] + c["cp"]]], {}),
    "chunk-6-over-4": (  # torch.chunk per axis: dp halves 3,3, then cp cuts each 2,1
        {"cp": 2, "dp": 2}, 0, "(dp cp b) s", {"split": "chunk"}, (6, 2),
        lambda x, c: x[[[0, 1], [2], [3, 4], [5]][2 * c["dp"] + c["cp"]]], {}),
    "chunk-5-over-4-empty": (  # flat chunk of 5 by 4: 2,2,1 and an empty fourth shard
        {"dp": 4}, 0, "(dp b) h", {"split": "chunk"}, (5, 2),
        lambda x, c: x[[[0, 1], [2, 3], [4], []][c["dp"]]], {"b": 5}),
    "chunk-7-over-3-nested-empty": (  # dp: 4,3; tp cuts 4 into 2,2,0 and 3 into 1,1,1
        {"tp": 3, "dp": 2}, 0, "h (dp tp b)", {"split": "chunk"}, (2, 7),
        lambda x, c: x[:, [[0, 1], [2, 3], [], [4], [5], [6]][3 * c["dp"] + c["tp"]]],
        {"b": 7}),
    "zigzag-cp2": (
        {"cp": 2, "dp": 2}, 0, "(cp s) h", {"zigzag": "cp"}, (8, 3),
        lambda x, c: zigzag_rows(x, 2, c["cp"]), {}),
    "zigzag-cp3": (
        {"tp": 2, "cp": 3}, 4, "(cp s) h", {"zigzag": "cp"}, (12, 2),
        lambda x, c: zigzag_rows(x, 3, c["cp"]), {}),
    "zigzag-b-s": (
        {"cp": 2, "dp": 2}, 0, "(dp b) (cp s)", {"zigzag": "cp"}, (3, 8),
        lambda x, c: zigzag_rows(torch.tensor_split(x, 2, 0)[c["dp"]].T, 2, c["cp"]).T, {}),
    "flat_dp_b_s": (
        {"tp": 2, "dp": 2}, 0, "(dp b s) h", {}, (5, 3, 4),
        lambda x, c: torch.tensor_split(x, 2, dim=0)[c["dp"]].reshape(-1, 4), {"s": 3}),
    "flat_s_dp_b": (
        {"dp": 2}, 0, "(s dp b) h", {}, (3, 5, 4),  # dims in pattern order: s b h
        lambda x, c: torch.tensor_split(x, 2, dim=1)[c["dp"]].reshape(-1, 4), {"s": 3}),
    "pinned-pp1": (
        {"tp": 2, "pp": 3}, 0, "b h", {"at": {"pp": 1}}, (2, 3),
        lambda x, c: x if c["pp"] == 1 else None, {}),
    "pinned-pp-1-sharded": (
        {"tp": 2, "pp": 2}, 6, "b (tp h)", {"at": {"pp": -1}}, (2, 4),
        lambda x, c: x[:, 2 * c["tp"]:2 * c["tp"] + 2] if c["pp"] == 1 else None, {}),
    "replicated-all": (
        {"tp": 2, "cp": 2}, 0, "b s", {}, (2, 3),
        lambda x, c: x, {}),
}


def layout_of(case):
    axes, offset, pattern, kwargs, *_ = case
    return Layout(Grid(offset=offset, **axes), pattern, **kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_shard_matches_hand_indexing(name):
    case = CASES[name]
    axes, offset, _, _, shape, piece, _ = case
    layout = layout_of(case)
    x = arange(*shape)
    got = shard(x, layout)
    want = {r: piece(x, c) for r, c in coords(axes, offset)}
    want = {r: p for r, p in want.items() if p is not None}
    assert sorted(got) == sorted(want)
    for r, w in want.items():
        assert got[r].shape == w.shape, (r, got[r].shape, w.shape)
        assert torch.equal(got[r], w), r


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip(name):
    case = CASES[name]
    layout = layout_of(case)
    x = torch.randn(case[4])
    back = unshard(shard(x, layout), layout, **case[6])
    assert back.shape == x.shape
    assert torch.equal(back, x)


def test_uneven_piece_shapes_and_empty_piece():
    layout = Layout(Grid(dp=4), "(dp b) s h")
    got = shard(arange(3, 2, 2), layout)
    assert [tuple(got[r].shape) for r in range(4)] == [(1, 2, 2)] * 3 + [(0, 2, 2)]
    layout = Layout(Grid(dp=2), "(dp b) s h")
    got = shard(arange(5, 2, 2), layout)
    assert [got[r].shape[0] for r in range(2)] == [3, 2]
    got = shard(arange(10, 1, 1), Layout(Grid(dp=4), "(dp b) s h"))
    assert [got[r].flatten().tolist() for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_zigzag_docstring_values():
    layout = Layout(Grid(cp=2), "(cp s)", zigzag="cp")
    got = shard(torch.arange(8), layout)
    assert got[0].tolist() == [0, 1, 6, 7]
    assert got[1].tolist() == [2, 3, 4, 5]


def test_replicas_identical():
    layout = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) s")
    got = shard(torch.randn(4, 3), layout)
    for dp in range(2):
        members = [r for r, c in coords({"tp": 2, "cp": 2, "dp": 2}) if c["dp"] == dp]
        assert len(members) == 4
        for r in members[1:]:
            assert torch.equal(got[r], got[members[0]])


# -- partial -------------------------------------------------------------------------------
PARTIAL = [
    ({"tp": 2, "dp": 2}, "(dp b) h", ("tp",), (5, 3),
     lambda x, c: torch.tensor_split(x, 2)[c["dp"]]),
    ({"tp": 2, "cp": 2, "dp": 2}, "(dp b) h", ("tp", "cp"), (4, 3),
     lambda x, c: torch.tensor_split(x, 2)[c["dp"]]),
    ({"tp": 3, "cp": 2}, "(cp s) h", ("tp",), (8, 2), lambda x, c: zigzag_rows(x, 2, c["cp"])),
    ({"tp": 2, "dp": 2}, "b h", ("dp",), (2, 3), lambda x, c: x),
]


@pytest.mark.parametrize("axes,pattern,partial,shape,piece", PARTIAL)
def test_partial_pieces_sum_to_x(axes, pattern, partial, shape, piece):
    zig = ("cp",) if "(cp s)" in pattern else ()
    layout = Layout(Grid(**axes), pattern, partial=partial, zigzag=zig)
    x = torch.randn(shape)
    got = shard(x, layout)
    assert sorted(got) == sorted(r for r, _ in coords(axes))
    table = dict(coords(axes))
    # group ranks that differ only in the partial axes; their pieces must sum to x's piece
    groups: dict[tuple, list[int]] = {}
    for r, c in table.items():
        groups.setdefault(tuple(v for a, v in c.items() if a not in partial), []).append(r)
    for members in groups.values():
        n = 1
        for a in partial:
            n *= axes[a]
        assert len(members) == n
        total = sum(got[r] for r in members)
        assert torch.allclose(total, piece(x, table[members[0]]))
    assert torch.equal(unshard(got, layout), x)


@pytest.mark.parametrize("axes,pattern,partial,shape,piece", PARTIAL)
def test_unshard_sums_arbitrary_partial_pieces(axes, pattern, partial, shape, piece):
    """Split every piece into random summands (not shard's zero convention); unshard sums."""
    zig = ("cp",) if "(cp s)" in pattern else ()
    layout = Layout(Grid(**axes), pattern, partial=partial, zigzag=zig)
    x = torch.randint(-50, 50, shape).double()
    table = dict(coords(axes))
    pieces, gen = {}, torch.Generator().manual_seed(0)
    groups: dict[tuple, list[int]] = {}
    for r, c in table.items():
        groups.setdefault(tuple(v for a, v in c.items() if a not in partial), []).append(r)
    for members in groups.values():
        target = piece(x, table[members[0]])
        rest = target.clone()
        for r in members[1:]:
            pieces[r] = torch.randint(-9, 9, target.shape, generator=gen).double()
            rest = rest - pieces[r]
        pieces[members[0]] = rest
    assert torch.equal(unshard(pieces, layout), x)


# -- unshard errors ------------------------------------------------------------------------
@pytest.mark.parametrize("victim", [0, 1, 7])
def test_unshard_replicas_disagree(victim):
    layout = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) s")
    pieces = shard(torch.randn(4, 3), layout)
    pieces[victim] = pieces[victim].clone()
    pieces[victim][0, 0] += 1.0
    with pytest.raises(MimoFxError, match=r"replicas disagree at rank \d+ under '\(dp b\) s'"):
        unshard(pieces, layout)


def test_unshard_replicas_within_atol():
    layout = Layout(Grid(tp=2), "b s")
    pieces = shard(torch.zeros(2, 3), layout)
    pieces[1] = pieces[1] + 1e-6
    back = unshard(pieces, layout, atol=1e-5)
    assert back.shape == (2, 3) and float(back.abs().max()) <= 1e-6 + 1e-12
    with pytest.raises(MimoFxError, match="replicas disagree"):
        unshard(pieces, layout)


@pytest.mark.parametrize("layout,drop,match", [
    (Layout(Grid(tp=2, dp=2), "(dp b) s"), 3, r"holders \[0, 1, 2, 3\]; missing \[3\]"),
    (Layout(Grid(tp=2, pp=2, offset=4), "b s", at={"pp": 1}), 6, r"missing \[6\], extra \[\]"),
    (Layout(Grid(tp=2, dp=2), "(dp b) s", partial="tp"), 0, r"missing \[0\]"),
])
def test_unshard_missing_holder(layout, drop, match):
    pieces = shard(torch.randn(4, 3), layout)
    del pieces[drop]
    with pytest.raises(MimoFxError, match=match):
        unshard(pieces, layout)


def test_unshard_extra_rank():
    layout = Layout(Grid(tp=2, pp=2), "b s", at={"pp": 0})
    pieces = shard(torch.randn(4, 3), layout)
    pieces[2] = pieces[0]
    with pytest.raises(MimoFxError, match=r"missing \[\], extra \[2\]"):
        unshard(pieces, layout)
