"""Layout: how a logical tensor with named dims is spread over a grid.

The pattern is einops-style. It lists the local tensor's dims in order; a parenthesised
group is one local dim made of several factors, outermost first. Grid axes inside a
group shard the dim that follows them (``(dp b)``: b cut into DP contiguous blocks,
block i on dp index i; ``(dp cp b)``: b cut into DP*CP blocks, dp outermost). A group
may flatten several dims: ``(dp b s) h`` is a 2-D local tensor whose first dim is the
local batch times the sequence. Grid axes absent from the pattern replicate the tensor.

>>> from mimo_fx import Grid
>>> g = Grid(tp=2, cp=2, dp=2)
>>> layout = Layout(g, "(dp b) (cp s) h", zigzag=("cp",))
>>> str(layout)
'(dp b) (cp s) h'
>>> layout
Layout(Grid(tp=2, cp=2, dp=2), '(dp b) (cp s) h', zigzag=('cp',))
>>> layout.dims, layout.replicated
(('b', 's', 'h'), ('tp',))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from .constants import constant
from .errors import MimoFxError
from .grid import Grid, is_mesh

__all__ = ["Layout", "Factor"]

# Names that users use for grid axes; seeing one in a pattern whose grid lacks it is
# almost certainly a typo, not a tensor dim.
_AXIS_LIKE = ("tp", "cp", "pp", "dp", "ep", "sp", "etp", "edp")
_TOKEN = re.compile(r"\s*(\(|\)|[^\W\d]\w*|\S)")  # names: Unicode identifiers


@dataclass(frozen=True)
class Factor:
    """One dim inside a local dim: ``dim`` sharded by ``axes`` (outermost first)."""

    dim: str
    axes: tuple[str, ...]


@constant
@dataclass(frozen=True, init=False)
class Layout:
    """A named-dim pattern over a grid, with partial, pinned and zigzag axes.

    Args:
        grid: the ranks holding the tensor.
        pattern: e.g. ``"(dp b) s (tp h)"``.
        partial: axes over which local values are partial sums (not in the pattern).
        at: pin to one index of axes absent from the pattern, e.g. ``{"pp": -1}``;
            ranks at other indices hold nothing.
        zigzag: axes that shard their dim load-balanced for causal attention: the dim
            is cut into 2*N chunks and index i holds chunks i and 2*N-1-i.
        split: how a dim of uneven size is cut into shards. ``"tensor_split"`` (the
            default): the first ``n % k`` of ``k`` shards get one more element, flat over
            all the axes sharding the dim. ``"chunk"``: DTensor's ``torch.chunk`` rule,
            ``ceil(n / k)`` per shard with trailing shards smaller or empty, applied axis
            by axis (the outermost axis first, each cutting the previous axis's shard).
            Both agree when every cut divides evenly. Zigzag and ragged dims ignore it.
        ragged: axes whose dim is cut into shards of run-time lengths (e.g. a different
            token count per DP replica): the dim's size is a tuple of *counts*
            ``t=(c0, c1, ...)``, consecutive segments of the dim, and shard ``k`` of the
            dim's ``N`` shards (flat over its axes, outermost first) holds segments
            ``k*m/N ... (k+1)*m/N - 1`` of the ``m`` counts (``m`` a multiple of ``N``;
            one count per shard, or per sample). Every axis cutting the dim is named.
    """

    grid: Grid
    pattern: str
    partial: tuple[str, ...]
    at: tuple[tuple[str, int], ...]
    zigzag: tuple[str, ...]
    split: str
    ragged: tuple[str, ...]

    def __init__(
        self,
        grid: Grid,
        pattern: str,
        *,
        partial: tuple[str, ...] | list[str] | str = (),
        at: dict[str, int] | None = None,
        zigzag: tuple[str, ...] | list[str] | str = (),
        split: str = "tensor_split",
        ragged: tuple[str, ...] | list[str] | str = (),
    ) -> None:
        if is_mesh(grid):  # a DeviceMesh: its grid (see Grid.from_mesh)
            grid = Grid.from_mesh(grid)
        if not isinstance(grid, Grid):
            raise MimoFxError(f"Layout needs a Grid (or a DeviceMesh with named dims) as "
                              f"first argument, got {grid!r}")
        if not isinstance(pattern, str):
            raise MimoFxError(f"Layout pattern must be a string, got {pattern!r}")
        partial = axis_names(partial, "partial")
        zigzag = axis_names(zigzag, "zigzag")
        ragged = axis_names(ragged, "ragged")
        groups = _parse(pattern, grid)
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "pattern", " ".join(_format_group(g) for g in groups))
        object.__setattr__(self, "partial", _grid_order(partial, grid))
        object.__setattr__(self, "zigzag", _grid_order(zigzag, grid))
        object.__setattr__(self, "at", _normalise_at(at, grid, self.pattern))
        object.__setattr__(self, "split", _check_split(split, grid, self.pattern))
        object.__setattr__(self, "ragged", _grid_order(ragged, grid))
        object.__setattr__(self, "_local_dims", groups)
        self._check_axes_usage()
        self._check_ragged()
        # zigzag over one rank gives it both chunks in order: the identity, dropped so
        # that the layout equals (and plans as) the same layout without it
        object.__setattr__(self, "zigzag",
                           tuple(a for a in self.zigzag if grid.axis_size(a) > 1))
        # computed now, not on first use: a first use under torch.compile would trace
        # cached_property's lock (Python < 3.12), which Dynamo cannot
        self.dims, self.sharding, self.sharded_axes, self.replicated, self.holders  # noqa: B018
        self.ragged_dims  # noqa: B018

    # -- structure -----------------------------------------------------------------------
    @property
    def local_dims(self) -> tuple[tuple[Factor, ...], ...]:
        """The local dims, each a tuple of factors (outermost first)."""
        return self._local_dims  # type: ignore[attr-defined]

    @cached_property
    def dims(self) -> tuple[str, ...]:
        """The logical dims, in pattern order."""
        return tuple(f.dim for g in self.local_dims for f in g)

    @cached_property
    def sharding(self) -> dict[str, tuple[str, ...]]:
        """``{dim: axes that shard it}`` (empty tuple for unsharded dims)."""
        return {f.dim: f.axes for g in self.local_dims for f in g}

    @cached_property
    def ragged_dims(self) -> tuple[str, ...]:
        """The dims cut into shards of run-time lengths (see ``ragged=``)."""
        return tuple(d for d, axes in self.sharding.items() if axes and axes[0] in self.ragged)

    def shards(self, dim: str) -> int:
        """How many shards the axes cutting ``dim`` make (1 if none do)."""
        n = 1
        for axis in self.sharding[dim]:
            n *= self.grid.axis_size(axis)
        return n

    @cached_property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for g in self.local_dims for f in g for a in f.axes)

    @cached_property
    def replicated(self) -> tuple[str, ...]:
        """Axes over which every rank holds the same values."""
        used = set(self.sharded_axes) | set(self.partial) | {a for a, _ in self.at}
        return tuple(a for a in self.grid.names if a not in used)

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` holds a piece (it is in the grid and on the pinned index)."""
        if rank not in self.grid:
            return False
        if not self.at:  # (most layouts: no coordinate to compute, or to trace)
            return True
        coord = self.grid.coord(rank)
        return all(coord[a] == i for a, i in self.at)

    @cached_property
    def holders(self) -> tuple[int, ...]:
        """The ranks holding a piece, in rank order."""
        if not self.at:
            return tuple(self.grid.ranks)
        grid = self.grid
        pinned = {grid.axis_index(a): i for a, i in self.at}
        base = grid.offset + sum(i * grid.strides[k] for k, i in pinned.items())
        ranks = [base]
        for k, (size, stride) in enumerate(zip(grid.sizes, grid.strides)):
            if k not in pinned:  # enumerate the free axes, the fastest innermost
                ranks = [r + c * stride for c in range(size) for r in ranks]
        return tuple(sorted(ranks))

    # -- validation ----------------------------------------------------------------------
    def with_partial(self, axes: tuple[str, ...] | list[str] | str = ()) -> Layout:
        """This layout with its partial axes replaced by ``axes``, every other field kept;
        ``with_partial()`` is the replicated form its gradients take."""
        return Layout(self.grid, self.pattern, partial=axes, at=dict(self.at),
                      zigzag=self.zigzag, split=self.split, ragged=self.ragged)

    def _check_axes_usage(self) -> None:
        names = self.grid.names
        for kind, axes in (("partial", self.partial), ("zigzag", self.zigzag)):
            for axis in axes:
                if axis not in names:
                    raise self._error(
                        f"{kind}= names unknown axis {axis!r}; the grid has axes {names}"
                    )
            if len(set(axes)) != len(axes):
                raise self._error(f"{kind}={axes} names an axis twice")
        for axis in self.partial:
            if axis in self.sharded_axes:
                raise self._error(
                    f"axis {axis!r} both shards a dim and is partial; a partial axis holds "
                    f"partial sums of the same region, so remove it from the pattern or "
                    f"from partial="
                )
            if axis in dict(self.at):
                raise self._error(f"axis {axis!r} is both pinned (at=) and partial")
        for axis in self.zigzag:
            owner = [f for g in self.local_dims for f in g if axis in f.axes]
            if not owner:
                raise self._error(
                    f"zigzag axis {axis!r} does not shard any dim; write it in a group, "
                    f"e.g. '(cp s)'"
                )
            if owner[0].axes != (axis,):
                raise self._error(
                    f"zigzag axis {axis!r} must be the only axis sharding "
                    f"{owner[0].dim!r}, found {owner[0].axes}"
                )
        for axis, _ in self.at:
            if axis in self.sharded_axes:
                raise self._error(
                    f"axis {axis!r} is pinned with at= but also shards a dim; pin only "
                    f"axes absent from the pattern (e.g. pp)"
                )

    def _check_ragged(self) -> None:
        names = self.grid.names
        for axis in self.ragged:
            if axis not in names:
                raise self._error(f"ragged= names unknown axis {axis!r}; the grid has axes "
                                  f"{names}")
            owner = [f for g in self.local_dims for f in g if axis in f.axes]
            if not owner:
                raise self._error(f"ragged axis {axis!r} does not cut any dim; write it in a "
                                  f"group, e.g. '({axis} t)'")
            missing = [a for a in owner[0].axes if a not in self.ragged]
            if missing:
                raise self._error(
                    f"ragged axis {axis!r} cuts {owner[0].dim!r} together with {missing}; "
                    f"a ragged dim is cut by counts over all its axes: name them all, "
                    f"ragged={owner[0].axes}")
            if axis in self.zigzag:
                raise self._error(f"axis {axis!r} is both ragged and zigzag; a zigzag cut "
                                  f"needs equal chunks")
        if len(set(self.ragged)) != len(self.ragged):
            raise self._error(f"ragged={self.ragged} names an axis twice")

    def _error(self, message: str) -> MimoFxError:
        return MimoFxError(f"in layout {self.pattern!r} on {self.grid!r}: {message}")

    @property
    def structure(self) -> Layout:
        """What a bridge for this layout is built for: itself (a packed one's drops its batch)."""
        return self

    # -- printing ------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.pattern

    def describe(self) -> str:
        """The pattern plus its annotations, for plan printouts."""
        extra = []
        if self.partial:
            extra.append("partial " + ",".join(self.partial))
        if self.zigzag:
            extra.append("zigzag " + ",".join(self.zigzag))
        if self.at:
            extra.append("at " + ",".join(f"{a}={i}" for a, i in self.at))
        if self.split != "tensor_split":
            extra.append(f"split {self.split}")
        if self.ragged:
            extra.append("ragged " + ",".join(self.ragged))
        return self.pattern + (f" [{'; '.join(extra)}]" if extra else "")

    def __repr__(self) -> str:
        args = [repr(self.grid), repr(self.pattern)]
        if self.partial:
            args.append(f"partial={self.partial!r}")
        if self.at:
            args.append(f"at={dict(self.at)!r}")
        if self.zigzag:
            args.append(f"zigzag={self.zigzag!r}")
        if self.split != "tensor_split":
            args.append(f"split={self.split!r}")
        if self.ragged:
            args.append(f"ragged={self.ragged!r}")
        return f"Layout({', '.join(args)})"

    def __reduce__(self):
        return (_make_layout, (self.grid, self.pattern, self.partial, dict(self.at),
                               self.zigzag, self.split, self.ragged))

    # dataclass eq/hash use the declared fields only; _local_dims follows from them.


def _make_layout(grid, pattern, partial, at, zigzag, split="tensor_split", ragged=()) -> Layout:
    return Layout(grid, pattern, partial=partial, at=at, zigzag=zigzag, split=split,
                  ragged=ragged)


# -- parsing ---------------------------------------------------------------------------
def _parse(pattern: str, grid: Grid) -> tuple[tuple[Factor, ...], ...]:
    """Parse a pattern into groups of factors; every mistake names the token and a fix."""

    def fail(message: str) -> MimoFxError:
        return MimoFxError(f"in layout pattern {pattern!r} on {grid!r}: {message}")

    raw_groups: list[list[str]] = []
    current: list[str] | None = None
    for match in _TOKEN.finditer(pattern):
        token = match.group(1)
        if token == "(":
            if current is not None:
                raise fail("nested parentheses '(... (' are not allowed; a group lists the "
                           "factors of one dim, e.g. '(dp b s)'")
            current = []
        elif token == ")":
            if current is None:
                raise fail("unbalanced ')': no group is open")
            if not current:
                raise fail("empty group '()'; a group needs at least one dim")
            raw_groups.append(current)
            current = None
        elif token.isidentifier():
            if current is None:
                raw_groups.append([token])
            else:
                current.append(token)
        else:
            raise fail(f"unexpected character {token!r}; patterns hold names and parentheses")
    if current is not None:
        raise fail("unbalanced '(': a group is not closed; add ')'")
    if not raw_groups:
        raise fail("the pattern names no dims")
    seen_axes: set[str] = set()
    seen_dims: set[str] = set()
    groups = []
    for raw in raw_groups:
        groups.append(_parse_group(raw, grid, seen_axes, seen_dims, fail))
    return tuple(groups)


def _parse_group(raw, grid, seen_axes, seen_dims, fail) -> tuple[Factor, ...]:
    factors, pending = [], []
    for token in raw:
        if token in grid.names:
            if token in seen_axes:
                raise fail(f"axis {token!r} is used twice; an axis shards one dim only")
            seen_axes.add(token)
            if len(raw) == 1:
                raise fail(f"axis {token!r} stands alone and shards nothing; put it in a "
                           f"group before the dim it shards, e.g. '({token} h)'")
            pending.append(token)
            continue
        if token in _AXIS_LIKE:
            raise fail(f"{token!r} looks like a grid axis but the grid has axes {grid.names}; "
                       f"add it to the Grid or rename the dim")
        if token in seen_dims:
            raise fail(f"dim {token!r} is named twice; every dim appears once")
        seen_dims.add(token)
        factors.append(Factor(token, tuple(pending)))
        pending = []
    if pending and not factors:
        raise fail(f"group '({' '.join(raw)})' names axes but no dim; name the dim they "
                   f"shard after them, e.g. '({' '.join(raw)} b)'")
    if pending:
        moved = " ".join(pending + [t for t in raw if t not in pending])
        raise fail(f"axis {pending[-1]!r} ends group '({' '.join(raw)})' and shards nothing; "
                   f"put axes before the dim they shard, e.g. '({moved})'")
    return tuple(factors)


def _format_group(group: tuple[Factor, ...]) -> str:
    tokens = [t for f in group for t in (*f.axes, f.dim)]
    return tokens[0] if len(tokens) == 1 else f"({' '.join(tokens)})"


def axis_names(value, what: str) -> tuple[str, ...]:
    """Grid axis names given as one name, a tuple or list of names, or None (none); any
    other value is an error naming ``what``.

    >>> axis_names("cp", "zigzag"), axis_names(["tp", "cp"], "partial"), axis_names(None, "ragged")
    (('cp',), ('tp', 'cp'), ())
    """
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise MimoFxError(f"{what}={value!r} must name grid axes: one name or a tuple of names, "
                      f"e.g. {what}=('cp',)")


def _grid_order(axes: tuple[str, ...], grid: Grid) -> tuple[str, ...]:
    """Axes in grid order, so equal layouts compare (and cache) equal; unknown axes keep
    their place for the validation that names them."""
    known = [a for a in grid.names if a in axes]
    return tuple(known) + tuple(a for a in axes if a not in grid.names) \
        if len(set(axes)) == len(axes) else axes


SPLITS = ("tensor_split", "chunk")


def _check_split(split, grid: Grid, pattern: str) -> str:
    if split not in SPLITS:
        raise MimoFxError(f"in layout {pattern!r} on {grid!r}: split={split!r} is not a known "
                          f"rule; use one of {SPLITS} ('tensor_split': the first n%k shards "
                          f"get one more; 'chunk': DTensor's torch.chunk sizes, axis by axis)")
    return split


def _normalise_at(at, grid: Grid, pattern: str) -> tuple[tuple[str, int], ...]:
    if at is None:
        return ()
    if not isinstance(at, dict):
        raise MimoFxError(f"in layout {pattern!r}: at= must be a dict like {{'pp': -1}}, "
                          f"got {at!r}")
    out = []
    for axis, index in at.items():
        if axis not in grid.names:
            raise MimoFxError(f"in layout {pattern!r} on {grid!r}: at= names unknown axis "
                              f"{axis!r}; the grid has axes {grid.names}")
        size = grid.axis_size(axis)
        wrong = "is not an int" if isinstance(index, bool) or not isinstance(index, int) \
            else "is out of range" if not -size <= index < size else ""
        if wrong:
            raise MimoFxError(f"in layout {pattern!r} on {grid!r}: at={{{axis!r}: {index!r}}} "
                              f"{wrong}; valid indices are the ints {-size}..{size - 1}")
        out.append((axis, index % size))
    return tuple(sorted(out))
