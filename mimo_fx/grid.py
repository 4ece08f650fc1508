"""Grid: named axes of ranks, first axis fastest.

A grid is a value (frozen, hashable, no process groups). The rank of a coordinate is
``offset + c0 + n0 * (c1 + n1 * (c2 + ...))`` for axes given in the order
``(a0, a1, a2, ...)`` with sizes ``(n0, n1, n2, ...)`` -- the innermost axis first, like
Megatron's HyperCommGrid.

>>> g = Grid(tp=2, dp=4, offset=8)
>>> g.size, g.ranks
(8, range(8, 16))
>>> g.coord(11)
{'tp': 1, 'dp': 1}
>>> g.rank(tp=1, dp=3)
15
>>> g.groups(("tp",))[:2]
((8, 9), (10, 11))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from math import prod

import torch

from .constants import constant
from .errors import MimoFxError

__all__ = ["Grid", "grid_from_mesh", "mesh_groups", "is_mesh"]


@constant
@dataclass(frozen=True, init=False)
class Grid:
    """Named grid axes over a contiguous range of ranks starting at ``offset``."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    offset: int
    mesh = None  # (not a field: the DeviceMesh it was made from, see Grid.from_mesh)

    @staticmethod
    def from_mesh(mesh) -> Grid:
        """The grid of a ``DeviceMesh`` with named dims: the same ranks, its axes the mesh's
        dims ordered fastest first (a mesh's LAST dim is fastest: mesh ``("dp", "tp")`` of
        shape ``(4, 2)`` is ``Grid(tp=2, dp=4)``). Layouts on it name the mesh's dims, and
        bridges reuse the mesh's process groups where they match one of its dims'."""
        return _from_mesh(mesh)

    def __init__(self, offset: int = 0, **axes: int) -> None:
        object.__setattr__(self, "names", tuple(axes))
        object.__setattr__(self, "sizes", tuple(axes.values()))
        object.__setattr__(self, "offset", offset)
        self._check()
        # computed now, not on first use: a first use under torch.compile would trace
        # cached_property's lock (Python < 3.12), which Dynamo cannot
        self.size, self.ranks, self.strides  # noqa: B018

    def _check(self) -> None:
        if not self.names:
            raise MimoFxError("Grid needs at least one axis, e.g. Grid(tp=2, dp=4)")
        for name, size in zip(self.names, self.sizes):
            if not name.isidentifier():
                raise MimoFxError(f"Grid axis name {name!r} is not an identifier")
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise MimoFxError(
                    f"Grid axis {name!r} has size {size!r}; axis sizes must be positive "
                    f"integers (use {name}=1 for an axis that does not split anything)"
                )
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise MimoFxError(
                f"Grid offset {self.offset!r} must be a non-negative integer: the first rank "
                f"of the grid in the world"
            )

    # -- shape ---------------------------------------------------------------------------
    @cached_property
    def size(self) -> int:
        return prod(self.sizes)

    @cached_property
    def ranks(self) -> range:
        return range(self.offset, self.offset + self.size)

    @cached_property
    def strides(self) -> tuple[int, ...]:
        strides, acc = [], 1
        for size in self.sizes:
            strides.append(acc)
            acc *= size
        return tuple(strides)

    def axis_size(self, axis: str) -> int:
        return self.sizes[self.axis_index(axis)]

    def axis_index(self, axis: str) -> int:
        try:
            return self.names.index(axis)
        except ValueError:
            raise MimoFxError(
                f"unknown axis {axis!r}: {self!r} has axes {self.names}"
            ) from None

    def __contains__(self, rank: object) -> bool:
        # (compared, not looked up in the range: under torch.compile(dynamic=True) a rank
        # from a closure or an attribute is a symbol, which a range lookup cannot take)
        return (isinstance(rank, int) and not isinstance(rank, bool)
                and self.offset <= rank < self.offset + self.size)

    # -- rank <-> coordinate -------------------------------------------------------------
    def coord(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` as ``{axis: index}``."""
        return dict(zip(self.names, self.coord_tuple(rank)))

    def coord_tuple(self, rank: int) -> tuple[int, ...]:
        """The coordinate of ``rank`` as a tuple in axis order.

        Computed, not looked up: a table of every rank's coordinate would cost each grid
        of a 65,536-rank world a tenth of a second and megabytes it rarely reads.
        """
        local = rank - self.offset if isinstance(rank, int) else -1
        if not 0 <= local < self.size:
            raise MimoFxError(
                f"rank {rank!r} is not in {self!r}, which holds ranks "
                f"{self.ranks.start}..{self.ranks.stop - 1}"
            )
        return tuple((local // stride) % size for stride, size in zip(self.strides, self.sizes))

    def rank(self, **coord: int) -> int:
        """The rank at ``coord``; every axis must be given."""
        missing = [name for name in self.names if name not in coord]
        unknown = [name for name in coord if name not in self.names]
        if unknown or missing:
            raise MimoFxError(
                f"Grid.rank needs exactly the axes {self.names}; got {tuple(coord)}"
                + (f" (unknown: {unknown})" if unknown else "")
                + (f" (missing: {missing})" if missing else "")
            )
        return self.rank_of(tuple(coord[name] for name in self.names))

    def rank_of(self, coord: tuple[int, ...]) -> int:
        """The rank of a coordinate tuple in axis order."""
        if len(coord) != len(self.names):
            raise MimoFxError(
                f"coordinate {tuple(coord)} has {len(coord)} entries but {self!r} has "
                f"{len(self.names)} axes {self.names}; give one index per axis"
            )
        total = self.offset
        for name, index, size, stride in zip(self.names, coord, self.sizes, self.strides):
            if not 0 <= index < size:
                raise MimoFxError(
                    f"coordinate {name}={index} is out of range for {self!r}: "
                    f"valid indices are 0..{size - 1}"
                )
            total += index * stride
        return total

    # -- groups --------------------------------------------------------------------------
    def groups(self, axes: tuple[str, ...] | list[str] | str) -> tuple[tuple[int, ...], ...]:
        """All groups of ranks that vary ``axes`` and fix the others.

        Members are ordered fastest axis first (the grid's order, not the order of
        ``axes``); groups are ordered by their first member.
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        self._check_axes(axes)
        varying = [i for i, name in enumerate(self.names) if name in axes]
        offsets = _mixed_radix_offsets([self.sizes[i] for i in varying],
                                       [self.strides[i] for i in varying])
        fixed = [i for i, name in enumerate(self.names) if name not in axes]
        bases = _mixed_radix_offsets([self.sizes[i] for i in fixed],
                                     [self.strides[i] for i in fixed])
        groups = [tuple(self.offset + base + off for off in offsets) for base in bases]
        return tuple(sorted(groups))

    def group_of(self, rank: int, axes: tuple[str, ...] | list[str] | str) -> tuple[int, ...]:
        """The group through ``rank`` that varies ``axes``."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        self._check_axes(axes)
        coord = self.coord_tuple(rank)
        base = self.offset + sum(
            c * s for name, c, s in zip(self.names, coord, self.strides) if name not in axes
        )
        varying = [i for i, name in enumerate(self.names) if name in axes]
        offsets = _mixed_radix_offsets([self.sizes[i] for i in varying],
                                       [self.strides[i] for i in varying])
        return tuple(base + off for off in offsets)

    def _check_axes(self, axes: tuple[str, ...]) -> None:
        for axis in axes:
            if axis not in self.names:
                raise MimoFxError(f"unknown axis {axis!r}: {self!r} has axes {self.names}")
        if len(set(axes)) != len(axes):
            raise MimoFxError(f"axes {axes} name an axis twice")

    def __repr__(self) -> str:
        args = [f"{n}={s}" for n, s in zip(self.names, self.sizes)]
        if self.offset:
            args.append(f"offset={self.offset}")
        return f"Grid({', '.join(args)})"

    def __reduce__(self):
        return (_make_grid, (self.names, self.sizes, self.offset))

    def __deepcopy__(self, memo) -> Grid:
        copied = _make_grid(self.names, self.sizes, self.offset)
        if self.mesh is not None:  # (the same mesh: a copy's groups are still its dims')
            object.__setattr__(copied, "mesh", self.mesh)
        return copied


def _make_grid(names, sizes, offset) -> Grid:
    _check_names(names, "axis")
    return Grid(offset=offset, **dict(zip(names, sizes)))


RESERVED = ("offset",)  # Grid's own keyword arguments: no axis takes their names


def _check_names(names: Sequence[str], what: str) -> None:
    """A clear error for an axis (or mesh dim) named after one of Grid's keywords."""
    for name in names:
        if name in RESERVED:
            raise MimoFxError(
                f"{what} name {name!r} is reserved: Grid({name}=...) is Grid's keyword for "
                f"the grid's first rank, not an axis. Rename the {what} (e.g. "
                f"{name + '_'!r} or 'dp_shard') and name it so in the layouts' patterns")


def _mixed_radix_offsets(sizes: list[int], strides: list[int]) -> list[int]:
    """All sums ``sum(i_k * stride_k)``, the first size varying fastest."""
    out = [0]
    for size, stride in zip(sizes, strides):
        out = [o + i * stride for i in range(size) for o in out]
    return out


# -- DeviceMesh -> Grid -------------------------------------------------------------------------
def _mesh_parts(mesh, mesh_dim_names) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The rank tensor and the dim names of a DeviceMesh, a rank tensor or nested lists."""
    names = mesh_dim_names
    if hasattr(mesh, "mesh") and hasattr(mesh, "mesh_dim_names"):  # a DeviceMesh
        ranks = mesh.mesh
        names = names if names is not None else mesh.mesh_dim_names
    else:
        try:
            ranks = torch.as_tensor(mesh)
        except (TypeError, ValueError, RuntimeError) as err:
            raise MimoFxError(f"mesh {mesh!r}: give a DeviceMesh, a rank tensor or nested "
                              f"lists of ranks ({err})") from None
    if ranks.dim() == 0 or ranks.numel() == 0 or ranks.is_floating_point():
        raise MimoFxError(f"mesh ranks {ranks.tolist()!r}: need an integer tensor with at "
                          f"least one dim and one rank")
    ranks = ranks.to(torch.int64).cpu()
    if names is None:
        names = tuple(f"m{i}" for i in range(ranks.dim()))
    names = tuple(names)
    if len(names) != ranks.dim():
        raise MimoFxError(f"mesh of shape {tuple(ranks.shape)} has {ranks.dim()} dims but "
                          f"{len(names)} names {names}")
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise MimoFxError(f"mesh dim name {name!r} is not an identifier; mimo_fx names "
                              f"grid axes after mesh dims (rename it, e.g. 'dp_shard')")
    if len(set(names)) != len(names):
        raise MimoFxError(f"mesh dim names {names} repeat a name")
    _check_names(names, "mesh dim")
    return ranks, names


def grid_from_mesh(mesh, mesh_dim_names: Sequence[str] | None = None) -> Grid:
    """The :class:`Grid` of a DeviceMesh (or of a rank tensor / nested lists of ranks).

    The mesh's ranks must be an axis permutation of a contiguous range: every mesh dim
    steps ranks by a fixed positive stride and the strides, sorted, form a mixed radix.
    Grid axes are the mesh dims ordered by stride (fastest first), named after them.

    >>> grid_from_mesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp"))
    Grid(tp=2, dp=4)
    >>> grid_from_mesh([[4, 6], [5, 7]])
    Grid(m0=2, m1=2, offset=4)
    """
    ranks, names = _mesh_parts(mesh, mesh_dim_names)
    return _grid(ranks, names)


def _grid(ranks: torch.Tensor, names: tuple[str, ...]) -> Grid:
    flat = ranks.flatten().tolist()
    shape = tuple(ranks.shape)
    offset, size = min(flat), len(flat)
    where = f"mesh {names} of shape {shape} with ranks {ranks.tolist()}"
    if sorted(flat) != list(range(offset, offset + size)):
        seen = set(flat)
        missing = [r for r in range(offset, max(flat) + 1) if r not in seen]
        twice = sorted({r for r in flat if flat.count(r) > 1})
        raise MimoFxError(
            f"{where}: a mimo_fx grid covers a contiguous range of ranks once each, but "
            + (f"ranks {missing[:8]} are missing from the range {offset}..{max(flat)}"
               if missing else f"ranks {twice[:8]} appear twice")
            + ". A submesh (e.g. mesh['dp'] of a 2-D mesh) is not a grid: use the whole mesh "
              "with Replicate() on the other mesh dims")
    strides: list[int | float | None] = []
    for i, n in enumerate(shape):
        if n == 1:
            strides.append(None)
            continue
        step = ranks.select(i, 1).flatten()[0].item() - ranks.select(i, 0).flatten()[0].item()
        if step <= 0:
            raise MimoFxError(f"{where}: mesh dim {names[i]!r} steps ranks by {step}; a grid "
                              f"axis counts ranks upwards (flip that mesh dim)")
        strides.append(step)
    index = torch.zeros(shape, dtype=torch.int64) + offset
    for i, (n, s) in enumerate(zip(shape, strides)):
        if s is not None:
            index = index + (torch.arange(n) * s).reshape([n if k == i else 1
                                                            for k in range(len(shape))])
    if not torch.equal(index, ranks):
        bad = (index != ranks).nonzero()[0].tolist()
        raise MimoFxError(f"{where}: rank {ranks[tuple(bad)].item()} at mesh coordinate "
                          f"{tuple(bad)} breaks the fixed stride per mesh dim "
                          f"({dict(zip(names, strides))}); mimo_fx grids are axis "
                          f"permutations of a mixed-radix range")
    order = sorted(range(len(shape)), key=lambda i: (_virtual_stride(i, shape, strides), -i))
    acc = 1
    for i in order:  # a bijective affine map onto a range is mixed radix
        assert strides[i] is None or strides[i] == acc, (where, strides)
        acc *= shape[i]
    _check_names(names, "mesh dim")
    return Grid(offset=offset, **{names[i]: shape[i] for i in order})


def _virtual_stride(i: int, shape, strides) -> int:
    """A size-1 mesh dim sits just outside the next larger mesh dim after it (where
    row-major order puts it)."""
    if strides[i] is not None:
        return strides[i]
    later = [j for j in range(i + 1, len(shape)) if strides[j] is not None]
    return strides[later[0]] * shape[later[0]] if later else 1


def is_mesh(obj: object) -> bool:
    """Whether ``obj`` is a torch ``DeviceMesh`` (checked without importing DTensor)."""
    return hasattr(obj, "mesh") and hasattr(obj, "mesh_dim_names") and hasattr(obj, "get_group")


def _from_mesh(mesh) -> Grid:
    if mesh.mesh_dim_names is None:
        raise MimoFxError(f"DeviceMesh {mesh} has no dim names; name its dims "
                          f"(init_device_mesh(..., mesh_dim_names=(\"dp\", \"tp\"))): a "
                          f"layout's pattern names them")
    grid = grid_from_mesh(mesh)
    # the mesh travels with the grid made from it (not part of its value: equal grids
    # are equal whatever mesh they came from), so a bridge over it can reuse the mesh's
    # process groups (see mesh_groups)
    object.__setattr__(grid, "mesh", mesh)
    return grid


def mesh_groups(ranks: tuple[int, ...], meshes) -> tuple | None:
    """A mesh dim's process group whose members are ``ranks`` in this order, from
    ``meshes`` (those a bridge's grids were made from): ``(mesh, dim name)``, or None.
    Every rank answers alike (it reads the meshes' rank tensors, which every rank holds)."""
    for mesh in meshes:
        table = mesh.mesh
        for d, name in enumerate(mesh.mesh_dim_names):
            moved = table.movedim(d, -1).reshape(-1, table.shape[d])
            if any(tuple(row.tolist()) == ranks for row in moved):
                return mesh, name
    return None
