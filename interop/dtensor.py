"""DTensor interop: DeviceMesh + placements <-> Layout, and cross-mesh redistribute.

PyTorch's DTensor redistributes only within one DeviceMesh. A DTensor's
``(mesh, placements, global shape)`` is a mimo_fx :class:`~mimo_fx.layout.Layout` plus
sizes, so :func:`redistribute_dtensor` moves it to *another* mesh with mimo_fx's plans.

What maps to what:

- A mesh is a :class:`~mimo_fx.grid.Grid` when its rank tensor is an axis permutation of
  a contiguous range (``offset`` + mixed radix): ``init_device_mesh`` meshes are
  row-major, the LAST mesh dim fastest, so mesh ``("dp", "tp")`` of shape ``(4, 2)`` is
  ``Grid(tp=2, dp=4)``. Grid axes take the mesh dim names (``m0``, ``m1``, ... when the
  mesh has none) and are ordered by stride.
- Tensor dims are named ``d0``, ``d1``, ... (or ``dims=``), one pattern group each.
- ``Shard(i)`` on mesh dim ``m`` puts axis ``m`` in dim i's group; several mesh dims
  sharding one dim are nested in placement order (mesh dim 0 outermost), as DTensor
  does. ``Replicate()`` leaves the axis out; ``Partial("sum")`` makes it partial.
- DTensor cuts uneven dims with ``torch.chunk`` sizes per mesh dim; the layout gets
  ``split="chunk"`` where that differs from mimo_fx's default ``tensor_split``.

>>> import torch
>>> layout, sizes = layout_from_dtensor(torch.arange(8).reshape(4, 2), ["Shard(0)",
...                                     "Partial()"], (10, 3), mesh_dim_names=("dp", "tp"))
>>> layout, sizes
(Layout(Grid(tp=2, dp=4), '(dp d0) d1', partial=('tp',), split='chunk'), {'d0': 10, 'd1': 3})
>>> spec = dtensor_layout(layout, sizes)
>>> spec.mesh_dim_names, spec.mesh_shape, spec.placements
(('dp', 'tp'), (4, 2), (Shard(dim=0), Partial(sum)))
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.grid import _grid, _mesh_parts, grid_from_mesh
from mimo_fx.layout import Layout
from mimo_fx.op import is_dtensor
from mimo_fx.regions import chunk_bounds, split_bounds

__all__ = ["DTensorLayout", "grid_from_mesh", "layout_from_dtensor", "dtensor_layout",
           "redistribute_dtensor", "prepare", "is_dtensor"]


# -- placements ------------------------------------------------------------------------------
_PLACEMENT_TEXT = re.compile(r"^(Shard|Replicate|Partial)\((.*)\)$")


def _placement_kind(p, mesh_dim: int, ndim: int) -> tuple[str, int | None]:
    """``("shard", dim) | ("replicate", None) | ("partial", None)`` for a placement
    object, or its text (``"Shard(0)"``, ``"Replicate()"``, ``"Partial()"``)."""
    where = f"placement {p!r} on mesh dim {mesh_dim}"
    if isinstance(p, str):
        match = _PLACEMENT_TEXT.match(p.replace(" ", ""))
        if not match:
            raise MimoFxError(f"{where}: not a placement; use Shard(dim), Replicate() or "
                              f"Partial()")
        kind, arg = match.groups()
        if kind == "Shard":
            if not re.fullmatch(r"-?\d+", arg):
                raise MimoFxError(f"{where}: Shard needs an integer tensor dim")
            return "shard", _norm_dim(int(arg), ndim, where)
        if kind == "Partial" and arg not in ("", "sum", "'sum'", '"sum"'):
            raise _reduce_op_error(where, arg)
        return kind.lower(), None
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(p) is Shard:
        return "shard", _norm_dim(p.dim, ndim, where)
    if type(p) is Replicate:
        return "replicate", None
    if type(p) is Partial:
        if p.reduce_op != "sum":
            raise _reduce_op_error(where, p.reduce_op)
        return "partial", None
    raise MimoFxError(f"{where}: mimo_fx maps Shard(dim), Replicate() and Partial('sum') only; "
                      f"{type(p).__name__} (e.g. a strided or masked placement) has no "
                      f"layout. Redistribute to one of those with DTensor first")


def _reduce_op_error(where: str, op) -> MimoFxError:
    return MimoFxError(f"{where}: Partial reduce op {op!r} is not supported; mimo_fx layouts "
                       f"hold partial SUMS only. Reduce it with DTensor first "
                       f"(dtensor.redistribute(mesh, [Replicate()...])) or use Partial('sum')")


def _norm_dim(dim: int, ndim: int, where: str) -> int:
    if not -ndim <= dim < ndim:
        raise MimoFxError(f"{where}: tensor dim {dim} is out of range for a {ndim}-dim tensor")
    return dim % ndim


# -- meshes ----------------------------------------------------------------------------------
# -- DTensor -> Layout -----------------------------------------------------------------------
def _shape(shape) -> tuple[int, ...]:
    """A global shape as non-negative ints (torch.Size, SymInts, numpy integers), or an
    error naming it."""
    import operator

    try:  # (ints as before: int(n); other integer scalars through operator.index)
        out = tuple(int(n) if isinstance(n, int) and not isinstance(n, bool)
                    else operator.index(n) for n in shape)
    except TypeError:
        out = None
    if out is None or any(n < 0 for n in out):
        raise MimoFxError(f"shape={tuple(shape)!r} must be the DTensor's global shape: a "
                          f"sequence of non-negative integers")
    return out


def layout_from_dtensor(mesh, placements: Sequence, shape: Sequence[int], *,
                        dims: Sequence[str] | None = None,
                        mesh_dim_names: Sequence[str] | None = None
                        ) -> tuple[Layout, dict[str, int]]:
    """The layout and sizes of a DTensor on ``mesh`` with ``placements`` and global
    ``shape``.

    ``mesh`` is a DeviceMesh, a rank tensor or nested lists; ``placements`` holds one
    placement per mesh dim (objects or their text, ``"Shard(0)"``); tensor dims are named
    ``dims`` (default ``d0, d1, ...``). Where DTensor's ``torch.chunk`` split of an uneven
    dim differs from ``tensor_split``, the layout has ``split="chunk"``.
    """
    ranks, names = _mesh_parts(mesh, mesh_dim_names)
    shape = _shape(shape)
    if not shape:
        raise MimoFxError("a 0-dim DTensor has no layout: mimo_fx layouts name at least one "
                          "dim (reshape it to (1,))")
    dims = tuple(dims) if dims is not None else tuple(f"d{i}" for i in range(len(shape)))
    bad = [d for d in dims if not isinstance(d, str) or not d.isidentifier()]
    if bad:
        raise MimoFxError(f"dims={dims}: tensor dim names must be identifiers (they go into "
                          f"a layout pattern); {bad} are not")
    if len(dims) != len(shape):
        raise MimoFxError(f"dims {dims} name {len(dims)} dims but the shape {shape} has "
                          f"{len(shape)}")
    clash = sorted(set(dims) & set(names))
    if clash:
        raise MimoFxError(f"tensor dim names {clash} are also mesh dim names {names}; pass "
                          f"other dims= names")
    if len(placements) != ranks.dim():
        raise MimoFxError(f"mesh {names} has {ranks.dim()} dims but {len(placements)} "
                          f"placements {tuple(placements)} are given; give one per mesh dim")
    grid = _grid(ranks, names)
    shard: dict[int, list[str]] = {i: [] for i in range(len(shape))}
    partial = []
    for mesh_dim, (name, p) in enumerate(zip(names, placements)):
        kind, dim = _placement_kind(p, mesh_dim, len(shape))
        if kind == "shard" and dim is not None:
            shard[dim].append(name)
        elif kind == "partial":
            partial.append(name)
    pattern = " ".join(f"({' '.join([*shard[i], d])})" for i, d in enumerate(dims))
    sizes = dict(zip(dims, shape))
    split = "tensor_split"
    for i, n in enumerate(shape):
        axis_sizes = [grid.axis_size(a) for a in shard[i]]
        if axis_sizes and not _splits_agree(n, axis_sizes):
            split = "chunk"
    return Layout(grid, pattern, partial=tuple(partial), split=split), sizes


def _splits_agree(size: int, axis_sizes: list[int]) -> bool:
    return chunk_bounds(size, axis_sizes) == split_bounds(size, prod(axis_sizes))


# -- Layout -> DTensor -----------------------------------------------------------------------
@dataclass(frozen=True)
class DTensorLayout:
    """A layout as DTensor sees it: a mesh (dim names, shape, rank tensor as nested
    tuples), one placement per mesh dim and the global shape."""

    mesh_dim_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    ranks: tuple
    placements: tuple
    shape: tuple[int, ...]

    @property
    def row_major(self) -> bool:
        """Whether ``init_device_mesh(device, mesh_shape)`` builds this mesh (ranks from 0,
        the last mesh dim fastest) in a world of exactly these ranks."""
        flat = torch.tensor(self.ranks).flatten().tolist()
        return flat == list(range(len(flat)))

    def device_mesh(self, device_type: str = "cpu"):
        """The DeviceMesh (needs torch.distributed initialised, on every rank)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.row_major and dist.get_world_size() == prod(self.mesh_shape):
            return init_device_mesh(device_type, self.mesh_shape,
                                    mesh_dim_names=self.mesh_dim_names)
        return DeviceMesh(device_type, torch.tensor(self.ranks),
                          mesh_dim_names=self.mesh_dim_names)


def dtensor_layout(layout: Layout, sizes: dict[str, int]) -> DTensorLayout:
    """The DTensor mesh, placements and shape of ``layout`` with global ``sizes``.

    Tensor dims follow the pattern's order. Mesh dims are the grid axes slowest first
    (so an offset-0 grid is an ``init_device_mesh`` mesh), reordered only where several
    axes shard one dim outermost-first against that order. Not expressible (raises
    :class:`MimoFxError`): zigzag, ``at=`` pinning, groups flattening several dims, and
    uneven ``tensor_split`` dims that DTensor's chunk rule would cut differently.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    _check_expressible(layout, sizes)
    order = _mesh_order(layout)
    grid = layout.grid
    k = len(grid.names)
    base = torch.arange(grid.size).reshape(tuple(reversed(grid.sizes)))
    ranks = base.permute([k - 1 - grid.axis_index(a) for a in order]) + grid.offset
    placements: list = []
    for axis in order:
        sharded = [d for d, axes in layout.sharding.items() if axis in axes]
        if sharded:
            placements.append(Shard(layout.dims.index(sharded[0])))
        elif axis in layout.partial:
            placements.append(Partial())
        else:
            placements.append(Replicate())
    return DTensorLayout(tuple(order), tuple(grid.axis_size(a) for a in order),
                         _nested(ranks.tolist()), tuple(placements),
                         tuple(sizes[d] for d in layout.dims))


def _nested(value):
    return tuple(_nested(v) for v in value) if isinstance(value, list) else value


def _check_expressible(layout: Layout, sizes: dict[str, int]) -> None:
    if not isinstance(layout, Layout):
        what = layout.describe() if hasattr(layout, "describe") else layout
        raise MimoFxError(f"dtensor_layout takes a box Layout; {what!r} is a "
                          f"{type(layout).__name__}, which has no DTensor placements (keep "
                          f"this bridge in mimo_fx)")

    def fail(why: str) -> MimoFxError:
        return MimoFxError(f"layout {layout.describe()!r} on {layout.grid!r} has no DTensor "
                           f"placements: {why}")

    if layout.ragged_dims:
        raise fail(f"it cuts {list(layout.ragged_dims)} ragged (per-shard counts); DTensor "
                   f"shards follow torch.chunk (keep this bridge in mimo_fx)")
    if layout.zigzag:
        raise fail(f"zigzag over {layout.zigzag} gives a rank two chunks of a dim; DTensor "
                   f"shards are contiguous (keep this bridge in mimo_fx)")
    if layout.at:
        raise fail(f"at={dict(layout.at)} pins it to one pipeline stage; a DTensor lives on "
                   f"its whole mesh (use a mesh of that stage's ranks)")
    flat = [g for g in layout.local_dims if len(g) > 1]
    if flat:
        names = " ".join(f.dim for f in flat[0])
        raise fail(f"local dim ({names}) flattens several dims; a DTensor local tensor has one "
                   f"dim per tensor dim (unflatten it first)")
    missing = [d for d in layout.dims if d not in sizes]
    if missing:
        raise MimoFxError(f"dtensor_layout needs the size of every dim of {layout.pattern!r}; "
                          f"missing {missing}")
    if layout.split == "chunk":
        return
    for d, axes in layout.sharding.items():
        axis_sizes = [layout.grid.axis_size(a) for a in axes]
        if axes and not _splits_agree(sizes[d], axis_sizes):
            ts = [b - a for a, b in split_bounds(sizes[d], prod(axis_sizes))]
            ch = [b - a for a, b in chunk_bounds(sizes[d], axis_sizes)]
            raise fail(f"dim {d!r} of size {sizes[d]} over {axes}: tensor_split gives shards "
                       f"{ts}, DTensor's chunk rule {ch}; use Layout(..., split='chunk') or a "
                       f"size divisible by {prod(axis_sizes)}")


def _mesh_order(layout: Layout) -> list[str]:
    """Grid axes slowest first, except that the axes sharding one dim keep their
    outermost-first order (DTensor nests shards in mesh-dim order)."""
    before = {}
    for axes in layout.sharding.values():
        for outer, inner in zip(axes, axes[1:]):
            before[inner] = outer
    left = list(reversed(layout.grid.names))
    order: list[str] = []
    while left:
        axis = next(a for a in left if before.get(a) is None or before[a] in order)
        order.append(axis)
        left.remove(axis)
    return order


# -- redistribute ----------------------------------------------------------------------------
def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _layouts(src_mesh, src_placements, ndim: int, dst_mesh, dst_placements):
    """The layouts of a move of an ``ndim``-dim DTensor: DTensor's chunk rule on every
    sharded dim, so they hold for every shape (one bridge serves them all)."""
    shape = (1,) * ndim  # (the layouts do not depend on it: split is always chunk)
    dims = _free_dims(ndim, _mesh_parts(src_mesh, None)[1] + _mesh_parts(dst_mesh, None)[1])
    src, _ = layout_from_dtensor(src_mesh, src_placements, shape, dims=dims)
    dst, _ = layout_from_dtensor(dst_mesh, dst_placements, shape, dims=dims)
    return _ragged(_chunked(src), _chunked(dst))


def _ragged(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    """``src`` and ``dst`` with each cut dim made ragged where the other side leaves it
    whole or cuts it alike (over axes of the same sizes, in the same order: then the
    shards are the same): its shards are DTensor's chunk sizes -- nested, first mesh dim
    outermost, where several mesh dims cut it -- given per call as counts
    (:func:`chunk_counts`). A ragged dim cut only at its counts shares one plan, and one
    compiled graph, for every size, uneven ones included; an even ``chunk`` cut has one
    only for sizes its granule divides (docs/sizes.md). Not where either side is
    partial: a reduction is planned over cuts of known size."""
    if src.partial or dst.partial:
        return src, dst
    axes: tuple[list[str], list[str]] = ([], [])
    for d in src.dims:
        a, b = src.sharding.get(d, ()), dst.sharding.get(d, ())
        if set(a) & set(src.zigzag) or set(b) & set(dst.zigzag):
            continue
        if a and b and _parts(src, d) != _parts(dst, d):
            continue
        axes[0].extend(a)
        axes[1].extend(b)
    new = [Layout(lay.grid, lay.pattern, partial=lay.partial, split=lay.split, ragged=tuple(ax))
           if ax else lay for lay, ax in ((src, axes[0]), (dst, axes[1]))]
    return new[0], new[1]


def _parts(layout: Layout, d: str) -> tuple[int, ...]:
    """The sizes of the axes that cut dim ``d``, outermost first."""
    return tuple(layout.grid.axis_size(a) for a in layout.sharding.get(d, ()))


def chunk_counts(size, parts: int | tuple[int, ...]) -> tuple:
    """DTensor's ``torch.chunk`` shard sizes of a dim of ``size`` over ``parts`` ranks,
    or nested over several mesh dims of ``parts`` sizes (the first outermost; one count
    per flat shard index). ``size`` may be a symbol under ``torch.compile``: the counts
    are its expressions.

    >>> chunk_counts(5, 2), chunk_counts(7, 4), chunk_counts(1, 3)
    ((3, 2), (2, 2, 2, 1), (1, 0, 0))
    >>> chunk_counts(5, (2, 2)), chunk_counts(5, 4)   # nested is not flat
    ((2, 1, 1, 1), (2, 2, 1, 0))
    """
    parts = (parts,) if isinstance(parts, int) else tuple(parts)
    return tuple(b - a for a, b in chunk_bounds(size, parts))


def _free_dims(ndim: int, taken: Sequence) -> tuple[str, ...]:
    """Tensor dim names ``d0, d1, ...``, or ``d_0, ...`` (and so on) clear of the mesh's.

    >>> _free_dims(2, ("dp", "d0"))
    ('d_0', 'd_1')
    """
    prefix = "d"
    while any(f"{prefix}{i}" in taken for i in range(ndim)):
        prefix += "_"
    return tuple(f"{prefix}{i}" for i in range(ndim))


def _chunked(layout: Layout) -> Layout:
    if layout.split == "chunk" or not layout.sharded_axes:
        return layout
    return Layout(layout.grid, layout.pattern, partial=layout.partial, split="chunk")


MOVES_KEPT = 256  # the moves whose layouts are kept (the oldest slot is reused)


class _Moves:
    """The layouts of the moves seen lately, each in a numbered slot: a graph keeps a
    move's number (a constant) and reads its layouts back while it is traced, just
    after numbering it. Past ``MOVES_KEPT`` moves the oldest slot takes the next."""

    def __init__(self) -> None:
        self.layouts: list[tuple | None] = [None] * MOVES_KEPT
        self.numbers: dict[tuple, int] = {}
        self.seen = 0

    def number(self, move: tuple) -> int:
        slot = self.numbers.get(move)
        if slot is None:
            slot, self.seen = self.seen % MOVES_KEPT, self.seen + 1
            old = self.layouts[slot]
            if old is not None:
                del self.numbers[old]
            self.layouts[slot], self.numbers[move] = move, slot
        return slot


_MOVES = _Moves()


@torch.compiler.assume_constant_result
def _move_index(src_mesh, src_placements, ndim: int, dst_mesh, dst_placements) -> int:
    """The number in ``_MOVES`` of ``(src, dst)`` of a move, computed while tracing (plain
    Python on the meshes' rank tensors, which Dynamo cannot trace)."""
    try:
        src, dst = _layouts(src_mesh, src_placements, ndim, dst_mesh, dst_placements)
    except MimoFxError as err:
        raise MimoFxError(f"redistribute a {ndim}-dim DTensor from {src_placements} on "
                          f"{src_mesh} to {dst_placements} on {dst_mesh}: {err}") from None
    return _MOVES.number((src, dst))


def _bridge_of(x, dst_mesh, dst_placements, grad_partial, comm_dtype, checked,
               frozen=None):
    """The bridge moving ``x`` (from the one bridge cache, see mimo_fx.compiled)."""
    from mimo_fx.compiled import bridge_for
    from mimo_fx.compiled.options import Options

    move = _MOVES.layouts[_move_index(x.device_mesh, tuple(x.placements), x.dim(), dst_mesh,
                                      tuple(dst_placements))]
    assert move is not None  # (numbered just now)
    src, dst = move
    opts = Options(x.dtype, grad_partial, comm_dtype, checked, frozen=frozen)
    try:  # sizes free: each call gives its shape (one bridge, one graph for even sizes)
        return bridge_for(src, dst, opts, None, "redistribute_dtensor")
    except MimoFxError as err:
        raise MimoFxError(f"redistribute DTensor of shape {tuple(x.shape)} from "
                          f"{tuple(x.placements)} to {tuple(dst_placements)}: {err}") from None


def _global_shape(x) -> tuple:
    """``x``'s global shape; under ``torch.compile`` its spec's, which Dynamo guards on every
    rank (it does not guard the shape of a DTensor holding the empty off-mesh placeholder, so
    a graph traced there would keep its traced shape)."""
    if torch.compiler.is_compiling():
        return tuple(x._spec.tensor_meta.shape)
    return tuple(x.shape)


def prepare(x, dst_mesh, dst_placements: Sequence, *, grad_partial=(), comm_dtype=None,
            checked: bool = False, frozen: bool | None = None) -> None:
    """Create, on every rank of both meshes, the groups :func:`redistribute_dtensor` traces with."""
    _bridge_of(x, dst_mesh, dst_placements, grad_partial, comm_dtype, checked, frozen)


def redistribute_dtensor(x, dst_mesh, dst_placements: Sequence, *, grad_partial=(),
                         comm_dtype=None, checked: bool = False, frozen: bool | None = None):
    """Move DTensor ``x`` to ``dst_mesh`` with ``dst_placements``; differentiable
    (``frozen=True``: ``x`` needs no gradient, and the backward moves nothing).

    Every rank of both meshes calls it (it builds a bridge over their ranks; a rank of
    neither may call it too, and gets None) with the DTensor it holds: on ranks outside
    ``x``'s mesh that is DTensor's empty placeholder. Returns:

    - on ranks of ``dst_mesh``: a DTensor on ``dst_mesh`` with ``dst_placements`` (its
      local tensor may be empty where DTensor's chunk rule leaves a shard empty);
    - on ranks of ``x``'s mesh only: an empty plain tensor (one dim per tensor dim),
      linked to ``x`` by autograd. The rank must backpropagate through it, as the
      others through their results: ``y.sum().backward()`` (docs/dtensor.md's
      example), or ``mimo_fx.backward()`` (``mimo_fx.backward(loss)`` with a loss of
      its own), which runs the backward of every bridge call whose result the rank
      does not hold. It is not a DTensor because DTensor cannot backpropagate through
      the placeholder it keeps on ranks outside its mesh;
    - on ranks outside both meshes: ``None``.

    The shape may change from call to call: one bridge serves them all, and under
    ``torch.compile`` one graph serves every size of a dim that one side cuts and the
    other leaves whole or cuts alike, over mesh dims of the same sizes (uneven sizes
    included: that dim is ragged over DTensor's chunk sizes, nested where several mesh
    dims cut it), and every size of other dims cut evenly. Gradients reach
    ``x``'s local tensor through mimo_fx's custom vjp, with DTensor's
    conventions: a Partial source gets a replicated gradient, a Replicate destination's
    cotangents are taken as equal on every replica (as after ``full_tensor()``), unless
    ``grad_partial`` names dst mesh dims whose cotangents are per-replica contributions.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        raise MimoFxError(f"redistribute_dtensor takes a DTensor, got {type(x).__name__}")
    bridge = _bridge_of(x, dst_mesh, dst_placements, grad_partial, comm_dtype, checked,
                        frozen)
    rank = dist.get_rank()
    full = dict(zip(bridge.src.dims, _global_shape(x)))  # every rank knows it
    sizes: dict = dict(full)
    for layout in (bridge.src, bridge.dst):  # (a dim both cut: the same counts)
        for d in layout.ragged_dims:
            sizes[d] = chunk_counts(full[d], _parts(layout, d))
    y = bridge(x.to_local() if bridge.src.holds(rank) else None, sizes)
    if y is None or not bridge.dst.holds(rank):
        return y
    shape = tuple(x.shape)
    return DTensor.from_local(y, dst_mesh, tuple(dst_placements), run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))
