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

from dataclasses import dataclass
from functools import cached_property
from math import prod

from .constants import constant
from .errors import MimoFxError

__all__ = ["Grid"]


@constant
@dataclass(frozen=True, init=False)
class Grid:
    """Named grid axes over a contiguous range of ranks starting at ``offset``."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    offset: int

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
        return isinstance(rank, int) and rank in self.ranks

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


def _make_grid(names, sizes, offset) -> Grid:
    return Grid(offset=offset, **dict(zip(names, sizes)))


def _mixed_radix_offsets(sizes: list[int], strides: list[int]) -> list[int]:
    """All sums ``sum(i_k * stride_k)``, the first size varying fastest."""
    out = [0]
    for size, stride in zip(sizes, strides):
        out = [o + i * stride for i in range(size) for o in out]
    return out
