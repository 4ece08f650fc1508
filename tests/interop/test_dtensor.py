"""DTensor interop: mesh/placement <-> layout conversions and cross-mesh redistribute.

Single-process tests check the conversions (against DTensor's own shard-size function
and the shared layout table) and every error. One spawned 8-rank gloo world runs the
cross-mesh scenarios: each builds its source DTensor with DTensor's own sharding, moves it
with ``mimo_fx.redistribute_dtensor(dtensor, dst_mesh, dst_placements)`` and compares values and
gradients with full-tensor math and with DTensor's own sharding of the expected tensors;
the same world runs docs/examples/dtensor_mesh.py (docs/dtensor.md's example), a bridge
whose grid is a 2-D DeviceMesh (exact, and the groups it created or took from the mesh),
and one compiled ``redistribute_dtensor`` called with five shapes (at most 2 graphs).
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
from cases import CASES
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from mimo_fx import Grid, Layout, MimoFxError, redistribute
from mimo_fx.interop.dtensor import dtensor_layout, grid_from_mesh, layout_from_dtensor
from mimo_fx.packed import PackedLayout
from mimo_fx.reference import shard
from mimo_fx.reference.oracle import shard_index
from mimo_fx.regions import Tiling

WORLD = 8


# -- chunk split: the same shards as DTensor -----------------------------------------------
def _dtensor_cases():
    meshes = [(4,), (3,), (2, 2), (3, 2), (2, 3, 2)]
    for mesh_shape in meshes:
        options = [Shard(0), Shard(1), Replicate(), Partial()]
        for placements in itertools.product(options, repeat=len(mesh_shape)):
            if sum(p == Shard(0) for p in placements) or len(mesh_shape) == 1:
                yield mesh_shape, placements


DTENSOR_CASES = list(_dtensor_cases())


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 10, 13])
@pytest.mark.parametrize("mesh_shape,placements", DTENSOR_CASES,
                         ids=[f"{m}-{p}" for m, p in DTENSOR_CASES])
def test_shards_match_dtensor(mesh_shape, placements, n):
    """Every rank's index range under the layout (oracle and regions) is the one
    DTensor computes for the same mesh, placements and shape."""
    shape = (n, 3)
    ranks = torch.arange(torch.Size(mesh_shape).numel()).reshape(mesh_shape)
    layout, sizes = layout_from_dtensor(ranks, placements, shape)
    tiling = Tiling.of(layout, layout.dims, sizes)
    for coord in itertools.product(*map(range, mesh_shape)):
        rank = int(ranks[coord])
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord),
                                                               placements)
        oracle = shard_index(layout, rank, sizes)
        segments = tiling.segments(rank)
        for dim in range(2):
            expected = list(range(offset[dim], offset[dim] + local[dim])) if local[dim] else []
            assert oracle[dim].tolist() == expected, (coord, dim)
            assert [i for a, b in segments[dim] for i in range(a, b)] == expected


def test_chunk_split_empty_trailing_shards():
    layout = Layout(Grid(dp=4), "(dp b) h", split="chunk")
    pieces = shard(torch.arange(10.0).reshape(5, 2), layout)
    assert [tuple(pieces[r].shape) for r in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    nested = Layout(Grid(tp=2, dp=2), "(dp tp b)", split="chunk")
    assert {r: t.tolist() for r, t in shard(torch.arange(5), nested).items()} == {
        0: [0, 1], 1: [2], 2: [3], 3: [4]}


# -- the layout table round trip -------------------------------------------------------------
def _layouts_of_table():
    seen, out = set(), []
    for case in CASES:
        for side, layout in (("src", case.src), ("dst", case.dst)):
            key = (layout, tuple(sorted(case.sizes.items())))
            if key not in seen:
                seen.add(key)
                out.append(pytest.param(layout, case.sizes, id=f"{case.name}-{side}"))
    return out


def _why_not_expressible(layout: Layout, sizes: dict[str, int]) -> str | None:
    """The reason DTensor cannot express ``layout``, worked out from its parts."""
    if layout.zigzag:
        return "zigzag"
    if layout.at:
        return "pins it"
    if any(len(g) > 1 for g in layout.local_dims):
        return "flattens several dims"
    if layout.split == "tensor_split" and _splits_differ(layout, sizes):
        return "DTensor's chunk rule"
    return None


def _splits_differ(layout: Layout, sizes: dict[str, int]) -> bool:
    """Whether tensor_split and DTensor's nested chunk cut some dim of ``layout``
    differently."""
    for dim, axes in layout.sharding.items():
        parts = [layout.grid.axis_size(a) for a in axes]
        if parts:
            flat = [len(c) for c in torch.arange(sizes[dim]).tensor_split(int(torch.tensor(
                parts).prod()))]
            nested = [torch.arange(sizes[dim])]
            for k in parts:
                nested = [c for piece in nested for c in _padded_chunk(piece, k)]
            if flat != [len(c) for c in nested]:
                return True
    return False


def _padded_chunk(t: torch.Tensor, k: int) -> list[torch.Tensor]:
    chunks = list(t.chunk(k))
    return chunks + [t[:0]] * (k - len(chunks))


@pytest.mark.parametrize("layout,sizes", _layouts_of_table())
def test_table_round_trip(layout: Layout, sizes: dict[str, int]):
    why = _why_not_expressible(layout, sizes)
    if why is not None:
        with pytest.raises(MimoFxError, match=why):
            dtensor_layout(layout, sizes)
        return
    spec = dtensor_layout(layout, sizes)
    back, back_sizes = layout_from_dtensor(spec.ranks, spec.placements, spec.shape,
                                           dims=layout.dims,
                                           mesh_dim_names=spec.mesh_dim_names)
    # a chunk layout whose dims all cut alike under both rules comes back as the default
    split = "chunk" if _splits_differ(layout, sizes) else "tensor_split"
    assert back == Layout(layout.grid, layout.pattern, partial=layout.partial, split=split)
    assert back_sizes == {d: sizes[d] for d in layout.dims}


def test_table_has_both_kinds():
    params = _layouts_of_table()
    reasons = {_why_not_expressible(*p.values) for p in params}
    assert None in reasons and {"zigzag", "pins it", "flattens several dims",
                                "DTensor's chunk rule"} <= reasons


def test_layout_to_placements():
    layout = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp tp s) h", partial=())
    spec = dtensor_layout(layout, {"b": 4, "s": 8, "h": 3})
    assert spec.mesh_dim_names == ("dp", "cp", "tp") and spec.mesh_shape == (2, 2, 2)
    assert spec.placements == (Shard(0), Shard(1), Shard(1))
    assert spec.row_major and spec.shape == (4, 8, 3)
    assert torch.tensor(spec.ranks).flatten().tolist() == list(range(8))


def test_layout_to_placements_reorders_mesh_for_nested_shards():
    """``(tp dp b)``: tp outermost, so tp must come first among the mesh dims."""
    layout = Layout(Grid(tp=2, dp=4, offset=3), "(tp dp b) h", partial=())
    spec = dtensor_layout(layout, {"b": 16, "h": 2})
    assert spec.mesh_dim_names == ("tp", "dp") and not spec.row_major
    assert spec.placements == (Shard(0), Shard(0))
    assert spec.ranks == ((3, 5, 7, 9), (4, 6, 8, 10))
    assert layout_from_dtensor(spec.ranks, spec.placements, spec.shape, dims=("b", "h"),
                               mesh_dim_names=spec.mesh_dim_names)[0] == layout


def test_partial_maps_to_partial_sum():
    layout, sizes = layout_from_dtensor([[0, 1], [2, 3]], [Partial(), Shard(1)], (4, 6),
                                        mesh_dim_names=("dp", "tp"))
    assert layout == Layout(Grid(tp=2, dp=2), "d0 (tp d1)", partial="dp")
    assert dtensor_layout(layout, sizes).placements == (Partial(), Shard(1))


# -- meshes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks,names,grid", [
    (torch.arange(8).reshape(4, 2), ("dp", "tp"), Grid(tp=2, dp=4)),
    (torch.arange(8).reshape(2, 4).T, None, Grid(m0=4, m1=2)),
    (torch.arange(2, 8).reshape(3, 2), ("a", "b"), Grid(b=2, a=3, offset=2)),
    (torch.arange(4, 8), None, Grid(m0=4, offset=4)),
    (torch.arange(8).reshape(4, 1, 2), ("dp", "pp", "tp"), Grid(tp=2, pp=1, dp=4)),
    (torch.arange(8).reshape(2, 2, 2).permute(1, 2, 0), ("x", "y", "z"), Grid(y=2, x=2, z=2)),
    ([[5]], None, Grid(m1=1, m0=1, offset=5)),
])
def test_grid_from_mesh(ranks, names, grid):
    got = grid_from_mesh(ranks, names)
    assert got == grid
    expected = torch.as_tensor(ranks)
    for coord in itertools.product(*map(range, expected.shape)):
        axes = dict(zip(names or [f"m{i}" for i in range(expected.dim())], coord))
        assert got.rank(**axes) == int(expected[coord])


@pytest.mark.parametrize("ranks,match", [
    ([0, 2, 4, 6], r"ranks \[1, 3, 5\] are missing.*submesh"),
    ([[0, 1], [1, 2]], r"ranks \[1\] appear twice"),
    ([[2, 3], [0, 1]], r"steps ranks by -2.*flip"),
    ([[0, 1], [3, 2]], r"rank 2 at mesh coordinate \(1, 1\) breaks the fixed stride"),
    ([], "at least one"),
    (torch.tensor(3), "at least one"),
    ([[0.5, 1.0]], "integer"),
    ("dp", "DeviceMesh, a rank tensor"),
])
def test_grid_from_mesh_errors(ranks, match):
    with pytest.raises(MimoFxError, match=match):
        grid_from_mesh(ranks)


@pytest.mark.parametrize("names,match", [
    (("dp",), "has 2 dims but 1 names"),
    (("dp", "dp"), "repeat a name"),
    (("dp", "dp-shard"), "not an identifier"),
])
def test_mesh_name_errors(names, match):
    with pytest.raises(MimoFxError, match=match):
        grid_from_mesh([[0, 1], [2, 3]], names)


# -- placement errors -----------------------------------------------------------------------
@pytest.mark.parametrize("placements,shape,kwargs,match", [
    ([Partial("avg"), Replicate()], (4, 4), {}, r"Partial reduce op 'avg'.*partial SUMS"),
    ([Partial("max"), Replicate()], (4, 4), {}, r"reduce op 'max'"),
    (["Partial(max)", "Replicate()"], (4, 4), {}, r"reduce op 'max'"),
    ([Shard(2), Replicate()], (4, 4), {}, r"tensor dim 2 is out of range for a 2-dim"),
    ([Shard(-3), Replicate()], (4, 4), {}, r"tensor dim -3 is out of range"),
    (["Shard(x)", Replicate()], (4, 4), {}, "integer tensor dim"),
    (["Sharded(0)", Replicate()], (4, 4), {}, "not a placement"),
    ([Replicate()], (4, 4), {}, r"has 2 dims but 1 placements"),
    ([Replicate(), Replicate()], (), {}, "0-dim DTensor"),
    ([Replicate(), Replicate()], (4, 4), {"dims": ("b",)}, r"name 1 dims but the shape"),
    ([Replicate(), Replicate()], (4, 4), {"dims": ("m0", "h")}, r"\['m0'\] are also mesh"),
    ([Replicate(), Replicate()], (4.7, 4), {}, r"shape=\(4\.7, 4\) must be the DTensor's "
                                              r"global shape"),
    ([Replicate(), Replicate()], (-4, 4), {}, r"shape=\(-4, 4\) must be"),
    ([Replicate(), Replicate()], ("a", 4), {}, r"shape=\('a', 4\) must be"),
    ([Replicate(), Replicate()], (4, 4), {"dims": ("a b", "x")},
     r"tensor dim names must be identifiers.*\['a b'\] are not"),
])
def test_placement_errors(placements, shape, kwargs, match):
    with pytest.raises(MimoFxError, match=match):
        layout_from_dtensor([[0, 1], [2, 3]], placements, shape, **kwargs)


def test_strided_shard_is_refused():
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(MimoFxError, match="_StridedShard .*has no layout"):
        layout_from_dtensor([[0, 1], [2, 3]], [_StridedShard(0, split_factor=2), Shard(0)],
                            (8, 2))


def test_negative_shard_dim_and_text_placements():
    a = layout_from_dtensor([0, 1, 2], [Shard(-1)], (3, 7))
    b = layout_from_dtensor([0, 1, 2], ["Shard(1)"], (3, 7))
    assert a == b == (Layout(Grid(m0=3), "d0 (m0 d1)", split="chunk"), {"d0": 3, "d1": 7})
    even = layout_from_dtensor([0, 1], [Shard(1)], (3, 5))  # chunk and tensor_split agree
    assert even[0] == Layout(Grid(m0=2), "d0 (m0 d1)")


@pytest.mark.parametrize("layout,sizes,match", [
    (Layout(Grid(cp=2), "(cp s) h", zigzag="cp"), {"s": 8, "h": 2}, "zigzag"),
    (Layout(Grid(tp=2, pp=2), "b (tp h)", at={"pp": 1}), {"b": 2, "h": 4}, r"at=\{'pp': 1\}"),
    (Layout(Grid(dp=2), "(dp b s) h"), {"b": 2, "s": 2, "h": 2}, r"\(b s\) flattens"),
    (Layout(Grid(dp=4), "(dp b) h"), {"b": 10, "h": 2},
     r"'b' of size 10 over \('dp',\): tensor_split gives shards \[3, 3, 2, 2\], DTensor's "
     r"chunk rule \[3, 3, 3, 1\]; use Layout\(..., split='chunk'\)"),
    (Layout(Grid(dp=2), "(dp b) h"), {"b": 2}, r"missing \['h'\]"),
    (Layout(Grid(dp=2), "(dp t) h", ragged="dp"), {"t": (3, 2), "h": 2},
     r"cuts \['t'\] ragged"),
    (PackedLayout(Grid(dp=2), "t h", [[3], [2]]), {"h": 2},
     r"takes a box Layout; .* is a PackedLayout"),
])
def test_not_expressible(layout, sizes, match):
    with pytest.raises(MimoFxError, match=match):
        dtensor_layout(layout, sizes)


def test_chunk_layout_is_expressible_when_uneven():
    layout = Layout(Grid(dp=4), "(dp b) h", split="chunk")
    assert dtensor_layout(layout, {"b": 10, "h": 2}).placements == (Shard(0),)


# -- the facade keeps its other backends ----------------------------------------------------
def test_facade_dispatch_unchanged():
    src = Layout(Grid(dp=2), "(dp b) h")
    dst = Layout(Grid(tp=2), "b (tp h)")
    x = torch.arange(8.0).reshape(4, 2)
    y = redistribute(shard(x, src), src, dst)  # dict -> reference
    assert all(torch.equal(y[r], shard(x, dst)[r]) for r in y)
    with pytest.raises(MimoFxError, match="needs torch.distributed initialised"):
        redistribute(x, src, dst)  # tensor -> compiled (no process group here)
    with pytest.raises(MimoFxError, match="takes a tensor, None, or a dict"):
        redistribute([1, 2], src, dst)


# -- the 8-rank world ------------------------------------------------------------------------
# name: (src mesh, src placements, dst mesh, dst placements, shape); a mesh is
# ("init", shape, names) for init_device_mesh or (rank list, names) for DeviceMesh.
R, P, S0, S1 = "R", "P", "S0", "S1"
INIT42 = ("init", (4, 2), ("dp", "tp"))
INIT24 = ("init", (2, 4), ("dp", "tp"))
INIT8 = ("init", (8,), ("x",))
SCENARIOS = {
    "same_ranks_reshaped": (INIT42, (S0, R), INIT24, (S0, S1), (8, 6)),
    "same_ranks_uneven_nested": (INIT42, (S0, S0), INIT24, (R, S1), (7, 5)),
    "same_ranks_partial_src": (INIT42, (S1, P), INIT24, (S1, S0), (9, 6)),
    "same_mesh_partial_kept": (INIT42, (S0, P), INIT42, (S1, P), (4, 6)),
    "overlap_0_5_to_2_7": (([[0, 1], [2, 3], [4, 5]], ("a", "b")), (S0, S1),
                           ([[2, 3, 4], [5, 6, 7]], ("c", "d")), (R, S0), (5, 7)),
    "disjoint_0_3_to_4_7_partial": (([[0, 1], [2, 3]], ("a", "b")), (P, S1),
                                    ([4, 5, 6, 7], ("e",)), (S0,), (10, 3)),
    "disjoint_replicated_to_nested": (([6, 7], ("f",)), (R,),
                                      ([[0, 1, 2], [3, 4, 5]], ("g", "h")), (S0, S0), (7,)),
    "transposed_mesh_empty_shards": ((torch.arange(8).reshape(2, 4).T.tolist(), None),
                                     (S0, R), INIT8, (S1,), (6, 11)),
    "replicated_to_empty_shards": (INIT42, (R, R), INIT8, (S0,), (3, 4)),
}
# redistribute options per scenario (values and gradients are small integers, exact in bf16)
OPTIONS = {
    "overlap_comm_bf16": {"comm_dtype": torch.bfloat16},
    "disjoint_checked": {"checked": True},
}
SCENARIOS["overlap_comm_bf16"] = SCENARIOS["overlap_0_5_to_2_7"]
SCENARIOS["disjoint_checked"] = SCENARIOS["disjoint_replicated_to_nested"]
# under torch.compile (aot_eager, fullgraph, static shapes) on every rank, DTensor's
# placeholder as the input on ranks outside its mesh. Ranks 0-1 are src only, 2-3 src and
# dst, 4-5 dst only, 6-7 neither. One scenario: compiling costs seconds per rank.
COMPILED = ("compiled_overlap_partial",)
SCENARIOS[COMPILED[0]] = (([[0, 1], [2, 3]], ("a", "b")), (S0, P),
                          ([2, 3, 4, 5], ("e",)), (S1,), (6, 9))
ERRORS = ("error_partial_dst_other_mesh", "error_avg_partial", "error_unprepared_compile",
          "error_dtensor_to_layout_facade")


def _placement(p):
    return {"R": Replicate(), "P": Partial(), "S0": Shard(0), "S1": Shard(1)}[p]


def _mesh(spec, cache: dict):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    key = repr(spec)
    if key not in cache:
        if spec[0] == "init":
            cache[key] = init_device_mesh("cpu", spec[1], mesh_dim_names=spec[2])
        else:
            cache[key] = DeviceMesh("cpu", torch.tensor(spec[0]), mesh_dim_names=spec[1])
    return cache[key]


def _ints(shape, seed: int) -> torch.Tensor:
    """Integer-valued float64: sums of partial pieces and gradients are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).to(torch.float64)


def _source(rank, mesh, placements, shape):
    """This rank's source DTensor built with DTensor's own sharding: Partial mesh dims
    split the values into pieces that sum to X. Returns (X, local leaf, DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    x, noise = _ints(shape, 0), _ints(shape, 1)
    plain = [Replicate() if p.is_partial() else p for p in placements]
    base = distribute_tensor(x, mesh, plain, src_data_rank=None).to_local()
    extra = distribute_tensor(noise, mesh, plain, src_data_rank=None).to_local()
    coord = mesh.get_coordinate()
    partial = [i for i, p in enumerate(placements) if p.is_partial()]
    if coord is not None and partial:
        count = 1
        flat = 0
        for i in partial:
            flat = flat * mesh.shape[i] + coord[i]
            count *= mesh.shape[i]
        base = base - (count - 1) * extra if flat == 0 else extra
    # off the mesh the local tensor is DTensor's empty placeholder, which takes no grad
    # (Dynamo cannot take a DTensor input whose empty local tensor requires grad)
    local = base.clone().requires_grad_(coord is not None)
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=x.shape,
                            stride=x.stride())
    return x, local, dt


def _check(rank, meshes, name, compiled: bool = False) -> list[str]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    import mimo_fx
    import mimo_fx.interop.dtensor as mdt

    src_spec, src_p, dst_spec, dst_p, shape = SCENARIOS[name]
    src_mesh, dst_mesh = _mesh(src_spec, meshes), _mesh(dst_spec, meshes)
    src_p, dst_p = [_placement(p) for p in src_p], [_placement(p) for p in dst_p]
    x, local, dt = _source(rank, src_mesh, src_p, shape)
    g = _ints(shape, 2)
    problems = []
    in_src = src_mesh.get_coordinate() is not None
    in_dst = dst_mesh.get_coordinate() is not None
    if in_src and not torch.equal(dt.full_tensor(), x):
        problems.append("test setup: source DTensor does not hold X")
    if compiled:
        mdt.prepare(dt, dst_mesh, dst_p)
        fn = torch.compile(lambda d: mimo_fx.redistribute_dtensor(d, dst_mesh, dst_p),
                           backend="aot_eager", fullgraph=True, dynamic=False)
        y = fn(dt)
    else:
        y = mimo_fx.redistribute_dtensor(dt, dst_mesh, dst_p, **OPTIONS.get(name, {}))
    if in_dst:
        if not isinstance(y, DTensor) or y.device_mesh is not dst_mesh \
                or tuple(y.placements) != tuple(dst_p):
            return problems + [f"dst rank got {type(y).__name__}, not a DTensor on dst"]
        full = y.full_tensor()
        if not torch.equal(full, x):
            problems.append("full_tensor() of the result differs from X")
        if not any(p.is_partial() for p in dst_p):
            own = distribute_tensor(x, dst_mesh, dst_p, src_data_rank=None).to_local()
            if not torch.equal(y.to_local(), own):
                problems.append(f"local piece {tuple(y.to_local().shape)} differs from "
                                f"DTensor's own shard {tuple(own.shape)}")
        loss = (full * g).sum()
    elif in_src:
        if not isinstance(y, torch.Tensor) or isinstance(y, DTensor) or y.numel():
            return problems + [f"src-only rank got {y!r}, not an empty tensor"]
        loss = y.sum()
    else:
        return problems + ([] if y is None else [f"rank off both meshes got {y!r}"])
    loss.backward()
    if in_src:
        plain = [Replicate() if p.is_partial() else p for p in src_p]
        expected = distribute_tensor(g, src_mesh, plain, src_data_rank=None).to_local()
        if local.grad is None or not torch.equal(local.grad, expected):
            problems.append("gradient of the source local tensor differs from G's shard")
    return problems


def _grad_partial(rank, meshes) -> list[str]:
    """grad_partial: dst replicas each contribute their own cotangent, which the adjoint
    sums (without it, replicas' cotangents are taken as equal and one is used)."""
    import mimo_fx

    src_mesh = _mesh(INIT42, meshes)
    dst_mesh = _mesh(([4, 5, 6, 7], ("e",)), meshes)
    shape = (8, 6)
    x, local, dt = _source(rank, src_mesh, [Shard(0), Replicate()], shape)
    y = mimo_fx.redistribute_dtensor(dt, dst_mesh, [Replicate()], grad_partial=("e",))
    problems = []
    if rank >= 4:
        if not torch.equal(y.to_local(), x):
            problems.append("replicated dst piece differs from X")
        loss = (y.to_local() * _ints(shape, 10 + rank)).sum()  # this replica's own part
    else:
        loss = y.sum()
    loss.backward()
    g_sum = sum(_ints(shape, 10 + r) for r in range(4, 8))
    expected = g_sum.tensor_split(4)[rank // 2]  # Shard(0) over dp, replicated over tp
    if not torch.equal(local.grad, expected):
        problems.append("source gradient is not the sum of the replicas' cotangents")
    return problems


def _error(rank, meshes, name) -> str | None:
    """The error message (or None) every rank gets."""
    import mimo_fx

    try:
        if name == "error_partial_dst_other_mesh":
            _, _, dt = _source(rank, _mesh(INIT42, meshes), [Shard(0), Partial()], (4, 4))
            mimo_fx.redistribute_dtensor(dt, _mesh(INIT24, meshes), [Shard(0), Partial()])
        elif name == "error_dtensor_to_layout_facade":
            _, _, dt = _source(rank, _mesh(INIT42, meshes), [Shard(0), Replicate()], (4, 4))
            mimo_fx.redistribute(dt, _mesh(INIT8, meshes), [Replicate()])
        elif name == "error_avg_partial":
            from torch.distributed.tensor import DTensor

            mesh = _mesh(INIT42, meshes)
            dt = DTensor.from_local(torch.zeros(1, 4), mesh, [Shard(0), Partial("avg")],
                                    run_check=False, shape=(4, 4), stride=(4, 1))
            mimo_fx.redistribute_dtensor(dt, _mesh(INIT8, meshes), [Replicate()])
        else:
            _, _, dt = _source(rank, _mesh(INIT42, meshes), [Shard(1), Replicate()], (3, 9))
            fn = torch.compile(lambda d: mimo_fx.redistribute_dtensor(d, _mesh(INIT8, meshes),
                                                              [Shard(1)]),
                               backend="aot_eager", fullgraph=True, dynamic=False)
            fn(dt)
    except Exception as err:  # report the message; Dynamo may wrap it
        return f"{type(err).__name__}: {err}"
    return None


def _mesh_grid(rank: int) -> dict:
    """A 2-D DeviceMesh (dp 4 x tp 2) as a bridge's grid: "(dp b) (tp h)" -> "(dp b) h"
    gathers h over each tp group, which is one of the mesh's own tp groups (a row of its
    rank tensor). Values and gradients against the oracle; the groups the bridge made."""
    from torch.distributed.device_mesh import init_device_mesh

    from mimo_fx.compiled import Redistributor

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    src, dst = Layout(mesh, "(dp b) (tp h)"), Layout(mesh, "(dp b) h")
    x, g = _ints((8, 6), 3), _ints((8, 6), 4)
    out: dict = {}
    for checked in (False, True):
        bridge = Redistributor(src, dst, {"b": 8, "h": 6}, torch.float64, checked=checked)
        piece = shard(x, src)[rank].clone().requires_grad_()
        y = bridge(piece)
        (y * shard(g, dst)[rank]).sum().backward()
        data = {ranks for tag, ranks in bridge.lease.tagged if tag != "check"}
        out[checked] = {"values": torch.equal(y, shard(x, dst)[rank]),
                        "grads": torch.equal(piece.grad, shard(g, src)[rank]),
                        "data_groups": sorted(data), "created": bridge.groups_created,
                        "reused": bridge.groups_reused}
        bridge.destroy()
    out["tp_groups"] = [tuple(row) for row in mesh.mesh.tolist()]
    return out


def _shapes_in_one_loop(rank: int, meshes: dict) -> dict:
    """redistribute_dtensor compiled once, then called with five shapes (every rank's
    piece at least 2 rows: Dynamo specialises sizes 0 and 1): values and gradients
    against DTensor's own sharding, and the graphs compiled."""
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor, distribute_tensor

    import mimo_fx
    import mimo_fx.interop.dtensor as mdt

    src_mesh, dst_mesh = _mesh(INIT42, meshes), _mesh(INIT24, meshes)
    src_p, dst_p = [Shard(0), Replicate()], [Replicate(), Shard(1)]
    torch._dynamo.reset()
    step = torch.compile(lambda d: mimo_fx.redistribute_dtensor(d, dst_mesh, dst_p),
                         backend="aot_eager", fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    problems = []
    for k, n in enumerate(SHAPES_IN_ONE_LOOP):
        x, g = _ints((n, 8), 20 + k), _ints((n, 8), 40 + k)
        local = distribute_tensor(x, src_mesh, src_p, src_data_rank=None).to_local()
        local = local.clone().requires_grad_()
        dt = DTensor.from_local(local, src_mesh, src_p, run_check=False, shape=x.shape,
                                stride=x.stride())
        if k == 0:
            mdt.prepare(dt, dst_mesh, dst_p)
        y = step(dt)
        if not torch.equal(y.full_tensor(), x):
            problems.append(f"{n} rows: values differ from X")
        own = distribute_tensor(g, dst_mesh, dst_p, src_data_rank=None).to_local()
        (y.to_local() * own).sum().backward()
        want = distribute_tensor(g, src_mesh, src_p, src_data_rank=None).to_local()
        if not torch.equal(local.grad, want):
            problems.append(f"{n} rows: gradient differs from G's shard")
    return {"problems": problems, "graphs": counters["stats"]["unique_graphs"] - before}


SHAPES_IN_ONE_LOOP = (8, 16, 24, 12, 40)


def _world(rank: int, world: int, names: list[str]) -> dict:
    import mimo_fx.compiled

    meshes: dict = {}
    out: dict = {}
    for name in names:
        try:
            out[name] = _check(rank, meshes, name, compiled=name in COMPILED)
        except Exception as err:  # keep the world going; report per scenario
            out[name] = [f"{type(err).__name__}: {err}"]
    try:
        out["grad_partial"] = _grad_partial(rank, meshes)
    except Exception as err:
        out["grad_partial"] = [f"{type(err).__name__}: {err}"]
    for name in ERRORS:
        out[name] = _error(rank, meshes, name)
    row_major = dtensor_layout(Layout(Grid(tp=2, dp=4), "(dp b) h"), {"b": 8, "h": 2})
    permuted = dtensor_layout(Layout(Grid(tp=2, dp=2, offset=4), "(tp dp b)"), {"b": 8})
    out["__device_mesh__"] = [(m.mesh.tolist(), m.mesh_dim_names) for m in
                              (row_major.device_mesh(), permuted.device_mesh())]
    out["__example__"] = _example().move(rank, world)
    mimo_fx.compiled.destroy()  # (the groups below are counted from none)
    out["__mesh_grid__"] = _mesh_grid(rank)
    out["__shapes__"] = _shapes_in_one_loop(rank, meshes)
    mimo_fx.compiled.destroy()
    out["__live_groups__"] = mimo_fx.compiled.live_groups()
    return out


EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "dtensor_mesh.py"


def _example():
    spec = importlib.util.spec_from_file_location("dtensor_mesh", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def world_results(worlds):
    # record: the suite's one 8-rank world (tests/README.md, "Spawned worlds")
    return worlds.run(WORLD, _world, list(SCENARIOS), record=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*SCENARIOS, "grad_partial"])
def test_cross_mesh_redistribute(world_results, name):
    problems = {rank: r[name] for rank, r in enumerate(world_results) if r[name]}
    assert not problems, problems


@pytest.mark.parametrize("name,match", [
    ("error_partial_dst_other_mesh", r"redistribute DTensor of shape \(4, 4\).*can only keep "
                                     r"partial axes"),
    ("error_avg_partial", r"MimoFxError: .*Partial reduce op 'avg'"),
    ("error_unprepared_compile", r"process groups must be prepared first"),
    ("error_dtensor_to_layout_facade", r"MimoFxError: redistribute takes layouts.*"
                                       r"mimo_fx.redistribute_dtensor\(x, dst_mesh"),
])
@pytest.mark.slow
def test_errors_on_every_rank(world_results, name, match):
    messages = [r[name] for r in world_results]
    assert all(m is not None for m in messages), messages
    import re

    assert all(re.search(match, m, re.S) for m in messages), messages[:2]


@pytest.mark.slow
def test_a_2d_device_mesh_as_grid_reuses_its_groups(world_results):
    """The mesh's tp groups carry the bridge's data: each rank takes its own one from the
    mesh (a rank holds the groups it is a member of) and creates only the world's check
    group (one per world, shared by every bridge), checked or not."""
    for rank, r in enumerate(world_results):
        got = r["__mesh_grid__"]
        for checked in (False, True):
            run = got[checked]
            assert run["values"] and run["grads"], (rank, checked, run)
            assert run["data_groups"] == got["tp_groups"], (rank, run)
            assert (run["reused"], run["created"]) == (1, 1), (rank, run)


@pytest.mark.slow
def test_dtensor_shapes_change_per_call_in_at_most_two_graphs(world_results):
    for rank, r in enumerate(world_results):
        got = r["__shapes__"]
        assert not got["problems"], (rank, got["problems"])
        assert got["graphs"] <= 2, (rank, got["graphs"])


@pytest.mark.slow
def test_groups_released(world_results):
    assert [r["__live_groups__"] for r in world_results] == [0] * WORLD


@pytest.mark.slow
def test_device_mesh_from_layout(world_results):
    """DTensorLayout.device_mesh builds the mesh whose ranks the grid names."""
    expected = [([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp")), ([[4, 6], [5, 7]], ("tp", "dp"))]
    assert all(r["__device_mesh__"] == expected for r in world_results)


def test_the_docs_example_moves_pieces_and_gradients(world_results):
    """docs/examples/dtensor_mesh.py (docs/dtensor.md's example): cp rank c holds columns
    2c, 2c+1 of X; each (dp, tp) rank gets back its dp rows of the gradient 2X."""
    x = torch.arange(32.0).reshape(4, 8)
    for rank, (piece, grad) in enumerate(r["__example__"] for r in world_results):
        if rank < 4:
            assert piece is None and torch.equal(grad, 2 * x.tensor_split(2)[rank // 2])
        else:
            assert grad is None and torch.equal(piece, x.tensor_split(4, dim=1)[rank - 4])


def test_the_moves_kept_are_bounded():
    """Numbering more moves than MOVES_KEPT reuses the oldest slots: the last ones are
    read back, a move seen again keeps its slot, and nothing grows past the bound."""
    from mimo_fx.interop.dtensor import MOVES_KEPT, _Moves

    moves = _Moves()
    slots = [moves.number(("move", i)) for i in range(MOVES_KEPT + 10)]
    assert slots[:3] == [0, 1, 2] and slots[MOVES_KEPT:MOVES_KEPT + 2] == [0, 1]
    assert len(moves.numbers) == len(moves.layouts) == MOVES_KEPT
    last = MOVES_KEPT + 9
    assert moves.layouts[moves.number(("move", last))] == ("move", last)
    assert moves.number(("move", last)) == slots[-1]
    assert ("move", 0) not in moves.numbers
