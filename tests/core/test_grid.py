"""Grid semantics against independent rank arithmetic (first axis fastest)."""

from __future__ import annotations

import pickle
import re
from itertools import product

import pytest

from mimo_fx import Grid, MimoFxError

# (axes in order, offset)
GRIDS = [
    ({"tp": 2, "dp": 4}, 0),
    ({"tp": 2, "dp": 4}, 8),
    ({"tp": 2, "cp": 1, "pp": 3, "dp": 2}, 5),
    ({"tp": 1, "cp": 2, "pp": 1, "dp": 1}, 0),
    ({"x": 3}, 2),
    ({"a": 2, "b": 3, "c": 2}, 100),
]
IDS = [f"{'-'.join(f'{k}{v}' for k, v in ax.items())}-off{off}" for ax, off in GRIDS]


def expected_rank(offset: int, sizes: tuple[int, ...], coord: tuple[int, ...]) -> int:
    """offset + c0 + n0*(c1 + n1*(c2 + ...)), evaluated innermost-last (Horner)."""
    acc = 0
    for c, n in reversed(list(zip(coord, sizes))):
        acc = acc * n + c
    return offset + acc


def all_coords(sizes: tuple[int, ...]):
    """Every coordinate tuple (order irrelevant; ranks are computed independently)."""
    return product(*(range(n) for n in sizes))


def rank_table(axes: dict[str, int], offset: int) -> dict[int, dict[str, int]]:
    names, sizes = tuple(axes), tuple(axes.values())
    return {expected_rank(offset, sizes, c): dict(zip(names, c)) for c in all_coords(sizes)}


def expected_groups(axes: dict[str, int], offset: int, varying: tuple[str, ...]):
    names, sizes = list(axes), list(axes.values())
    var = [i for i, n in enumerate(names) if n in varying]
    fix = [i for i, n in enumerate(names) if n not in varying]
    groups = []
    for fixed in product(*(range(sizes[i]) for i in fix)):
        members = []
        # product varies its LAST factor fastest; reverse so the first grid axis is fastest
        for rev in product(*(range(sizes[i]) for i in reversed(var))):
            coord = [0] * len(names)
            for i, c in zip(fix, fixed):
                coord[i] = c
            for i, c in zip(reversed(var), rev):
                coord[i] = c
            members.append(expected_rank(offset, tuple(sizes), tuple(coord)))
        groups.append(tuple(members))
    return sorted(groups)


def subsets(names):
    return [tuple(n for n, keep in zip(names, mask) if keep)
            for mask in product((False, True), repeat=len(names))]


# -- shape and rank arithmetic --------------------------------------------------------------
def test_docstring_example_hand_computed():
    g = Grid(tp=2, dp=4, offset=8)
    assert g.size == 8
    assert g.ranks == range(8, 16)
    assert g.coord(11) == {"tp": 1, "dp": 1}  # 11 = 8 + 1 + 2*1
    assert g.rank(tp=1, dp=3) == 15  # 8 + 1 + 2*3
    assert g.names == ("tp", "dp") and g.sizes == (2, 4) and g.offset == 8


@pytest.mark.parametrize("axes,offset", GRIDS, ids=IDS)
def test_size_and_ranks(axes, offset):
    g = Grid(offset=offset, **axes)
    n = 1
    for s in axes.values():
        n *= s
    assert g.size == n
    assert list(g.ranks) == list(range(offset, offset + n))
    assert sorted(rank_table(axes, offset)) == list(range(offset, offset + n))
    assert offset + n not in g and offset - 1 not in g
    assert offset in g and offset + n - 1 in g


@pytest.mark.parametrize("axes,offset", GRIDS, ids=IDS)
def test_rank_of_coordinate(axes, offset):
    g = Grid(offset=offset, **axes)
    names, sizes = tuple(axes), tuple(axes.values())
    for coord in all_coords(sizes):
        want = expected_rank(offset, sizes, coord)
        assert g.rank(**dict(zip(names, coord))) == want
        assert g.rank_of(coord) == want


@pytest.mark.parametrize("axes,offset", GRIDS, ids=IDS)
def test_coord_round_trip_every_rank(axes, offset):
    g = Grid(offset=offset, **axes)
    table = rank_table(axes, offset)
    for rank in g.ranks:
        assert g.coord(rank) == table[rank]
        assert list(g.coord(rank)) == list(axes)  # keys in axis order
        assert g.coord_tuple(rank) == tuple(table[rank].values())
        assert g.rank(**g.coord(rank)) == rank
        assert g.rank_of(g.coord_tuple(rank)) == rank


def test_axis_size_and_index():
    g = Grid(tp=2, cp=1, pp=3, dp=2)
    assert [g.axis_size(a) for a in ("tp", "cp", "pp", "dp")] == [2, 1, 3, 2]
    assert [g.axis_index(a) for a in ("tp", "cp", "pp", "dp")] == [0, 1, 2, 3]


# -- groups --------------------------------------------------------------------------------
GROUP_CASES = [(axes, off, sub) for axes, off in GRIDS for sub in subsets(list(axes))]


@pytest.mark.parametrize("axes,offset,varying", GROUP_CASES)
def test_groups_match_independent_enumeration(axes, offset, varying):
    g = Grid(offset=offset, **axes)
    got = g.groups(varying)
    assert [tuple(grp) for grp in got] == expected_groups(axes, offset, varying)
    # partition: every rank in exactly one group
    flat = [r for grp in got for r in grp]
    assert sorted(flat) == list(g.ranks)
    table = rank_table(axes, offset)
    n_members = 1
    for a in varying:
        n_members *= axes[a]
    for grp in got:
        assert len(grp) == n_members
        fixed = [a for a in axes if a not in varying]
        first = table[grp[0]]
        for r in grp:
            assert all(table[r][a] == first[a] for a in fixed)
        # distinct members, covering every combination of the varying axes
        assert len({tuple(table[r][a] for a in varying) for r in grp}) == n_members
        for r in grp:
            assert g.group_of(r, varying) == tuple(grp)


def test_groups_hand_written():
    g = Grid(tp=2, dp=4, offset=8)
    assert g.groups(("tp",)) == ((8, 9), (10, 11), (12, 13), (14, 15))
    assert g.groups("dp") == ((8, 10, 12, 14), (9, 11, 13, 15))
    assert g.groups(()) == tuple((r,) for r in range(8, 16))
    # members are ordered fastest grid axis first, whatever order axes are given in
    assert g.groups(("dp", "tp")) == ((8, 9, 10, 11, 12, 13, 14, 15),)
    g3 = Grid(a=2, b=2, c=2)
    assert g3.groups(("c", "a")) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert g3.group_of(6, ["c", "a"]) == (2, 3, 6, 7)
    assert g3.group_of(5, "b") == (5, 7)


# -- value semantics -----------------------------------------------------------------------
def test_equality_and_hash():
    a, b = Grid(tp=2, dp=4), Grid(tp=2, dp=4)
    assert a == b and hash(a) == hash(b)
    assert a != Grid(dp=4, tp=2)  # axis order matters: different rank order
    assert a != Grid(tp=2, dp=4, offset=8)
    assert a != Grid(tp=2, dp=2)
    d = {a: "x"}
    assert d[b] == "x"
    assert len({a, b, Grid(tp=2, dp=4, offset=1)}) == 2


def test_frozen():
    g = Grid(tp=2)
    with pytest.raises(AttributeError):
        g.offset = 3  # type: ignore[misc]


@pytest.mark.parametrize("axes,offset", GRIDS, ids=IDS)
def test_pickle_round_trip(axes, offset):
    g = Grid(offset=offset, **axes)
    _ = g.size, g.strides  # populate cached properties before pickling
    h = pickle.loads(pickle.dumps(g))
    assert h == g and hash(h) == hash(g)
    assert h.names == tuple(axes) and h.sizes == tuple(axes.values()) and h.offset == offset
    assert [h.coord(r) for r in h.ranks] == [g.coord(r) for r in g.ranks]


def test_repr():
    assert repr(Grid(tp=2, dp=4)) == "Grid(tp=2, dp=4)"
    assert repr(Grid(tp=2, dp=4, offset=8)) == "Grid(tp=2, dp=4, offset=8)"
    g = Grid(tp=1, cp=2, pp=1, dp=3, offset=4)
    assert eval(repr(g), {"Grid": Grid}) == g


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 0}, r"axis 'tp' has size 0.*positive integers.*tp=1"),
    ({"tp": 2, "dp": -1}, r"axis 'dp' has size -1.*positive"),
    ({"tp": 2.0}, r"axis 'tp' has size 2\.0.*positive integers"),
    ({"tp": "2"}, r"axis 'tp' has size '2'"),
    ({"tp": True}, r"axis 'tp' has size True"),
    ({"tp": 2, "offset": -1}, r"offset -1 must be a non-negative integer"),
    ({"tp": 2, "offset": 1.5}, r"offset 1\.5 must be a non-negative integer"),
    ({}, r"at least one axis, e\.g\. Grid\(tp=2, dp=4\)"),
    ({"offset": 3}, r"at least one axis"),
    ({"a-b": 2}, r"axis name 'a-b' is not an identifier"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(MimoFxError, match=match):
        Grid(**kwargs)


G = Grid(tp=2, dp=4, offset=8)


@pytest.mark.parametrize("call,match", [
    (lambda: G.groups(("ep",)), r"unknown axis 'ep'.*has axes \('tp', 'dp'\)"),
    (lambda: G.groups("cp"), r"unknown axis 'cp'"),
    (lambda: G.groups(("tp", "tp")), r"name an axis twice"),
    (lambda: G.group_of(8, ("pp",)), r"unknown axis 'pp'"),
    (lambda: G.axis_size("pp"), r"unknown axis 'pp'.*\('tp', 'dp'\)"),
    (lambda: G.axis_index("x"), r"unknown axis 'x'"),
    (lambda: G.rank_of((2, 0)), r"coordinate tp=2 is out of range.*valid indices are 0\.\.1"),
    (lambda: G.rank_of((0, 4)), r"coordinate dp=4 is out of range.*0\.\.3"),
    (lambda: G.rank_of((-1, 0)), r"coordinate tp=-1 is out of range"),
    (lambda: G.rank(tp=0, dp=7), r"coordinate dp=7 is out of range"),
    (lambda: G.coord(7), r"rank 7 is not in Grid\(tp=2, dp=4, offset=8\).*8\.\.15"),
    (lambda: G.coord(16), r"rank 16 is not in .*8\.\.15"),
    (lambda: G.coord_tuple(-1), r"rank -1 is not in"),
    (lambda: G.group_of(20, "tp"), r"rank 20 is not in"),
    (lambda: G.rank(tp=1), r"needs exactly the axes \('tp', 'dp'\).*missing: \['dp'\]"),
    (lambda: G.rank(tp=1, dp=0, pp=0), r"unknown: \['pp'\]"),
    (lambda: G.rank(), r"missing: \['tp', 'dp'\]"),
])
def test_lookup_errors(call, match):
    with pytest.raises(MimoFxError, match=match):
        call()


@pytest.mark.parametrize("coord", [(1,), (1, 0, 0)])
def test_rank_of_wrong_length_tuple(coord):
    """A coordinate tuple must name every axis; zip must not silently truncate/ignore."""
    with pytest.raises(MimoFxError, match=re.escape(str(coord))):
        G.rank_of(coord)


@pytest.mark.parametrize("at", [None, {"dp": 1}])
def test_membership_of_a_rank_dynamo_made_symbolic(at):
    """Under ``torch.compile(dynamic=True)`` an int from a closure is a symbol: asking
    whether a layout holds it (a grid's membership, and with ``at=`` its coordinate)
    traces instead of failing in Dynamo, and answers as the plain range test does."""
    import torch

    from mimo_fx import Layout

    grid = Grid(tp=2, dp=2, offset=2)
    layout = Layout(grid, "b h", at=at) if at else Layout(grid, "b h")

    def step_for(rank):
        def step(x):
            return x * 2 if layout.holds(rank) else x - 1
        return step

    for rank in (0, 2, 3, 4, 5, 6):
        torch._dynamo.reset()
        got = torch.compile(step_for(rank), backend="eager", fullgraph=True,
                            dynamic=True)(torch.ones(3))
        holds = 2 <= rank < 6 and (at is None or (rank - 2) // 2 == 1)
        assert torch.equal(got, torch.full((3,), 2.0 if holds else 0.0)), (rank, got)


class _Mesh:
    """What Grid.from_mesh reads of a DeviceMesh: its rank table and dim names."""

    def __init__(self, table, names) -> None:
        import torch

        self.mesh, self.mesh_dim_names = torch.tensor(table), names

    def get_group(self, name):  # (never called here)
        raise AssertionError(name)


def test_a_grid_made_from_a_mesh_carries_it_outside_its_value():
    """The mesh travels with the grid (and its deep copies, as a bridge's layouts are),
    not with its value: equal to the plain grid, pickled without it; and its dims'
    groups are found in it alone (no registry of every mesh seen)."""
    import copy

    from mimo_fx.grid import mesh_groups

    mesh = _Mesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
    grid = Grid.from_mesh(mesh)
    assert grid.mesh is mesh and Grid(tp=2, dp=4).mesh is None
    assert grid == Grid(tp=2, dp=4) and hash(grid) == hash(Grid(tp=2, dp=4))
    assert copy.deepcopy(grid).mesh is mesh
    assert pickle.loads(pickle.dumps(grid)).mesh is None
    assert mesh_groups((0, 1), [mesh]) == (mesh, "tp")
    assert mesh_groups((1, 3, 5, 7), [mesh]) == (mesh, "dp")
    assert mesh_groups((0, 2), [mesh]) is None and mesh_groups((0, 1), []) is None
