"""Templates: one plan shape for every size of a regime.

A bridge whose sizes change every step cannot plan and lower per size (planning a
large world takes long, and a compiled graph would serve one size). A *template* is the
pair of plans (forward and adjoint) at template sizes, together with how each position
in them moves with the sizes:

- a *free even* dim ``d`` (a size that varies, cut evenly by every layout) is measured in
  granules: every boundary of both plans on ``d`` is a multiple of ``size / granules``,
  so a size ``n`` with ``n % granules == 0`` scales each boundary by
  ``n / template size`` -- the symbolic variable ``u[d] = n // granules`` (at least 1);
- a *free ragged* dim is cut only at its counts' prefix sums by every layout that cuts
  it, so each boundary is a sum of count variables ``c[d,i]`` (at least 0);
- a *fixed* dim (its size given when the bridge was built) is a constant.

Sizes *fit* the template when every free even size is a positive multiple of its
granules and every free ragged dim has the template's number of counts; the lowered
template then serves them with no planning at all (:mod:`mimo_fx.compiled.lowering`
writes each number of a program as a polynomial, :mod:`mimo_fx.symbolic`). Sizes that
do not fit (uneven cuts, a ragged dim that an even cut splits) are planned one by one.

>>> from mimo_fx import Grid, Layout
>>> src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
>>> dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag="cp")
>>> t = Template.build(src, dst, {"b": 8, "s": 64, "h": 16}, 4, (), free=("s",))
>>> t.granules, t.fits({"b": 8, "s": 4100, "h": 16}), t.fits({"b": 8, "s": 4098, "h": 16})
({'s': 4}, True, False)
>>> t.env({"b": 8, "s": 4100, "h": 16})
{('u', 's'): 1025}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from math import gcd, lcm
from typing import Any

from .layout import Layout
from .plan import (
    Plan,
    RankPlan,
    Step,
    backward_layouts,
    plan,
    plan_for_rank,
    plan_tilings,
)
from .regions import Box, Size, prefix_sums, total
from .symbolic import Expr, Num

__all__ = ["Template", "Symbolizer", "canonical_sizes", "layout_granules"]


def layout_granules(layout: Layout, dim: str) -> int:
    """The least size ``layout`` cuts ``dim`` evenly at (zigzag: twice its shards)."""
    axes = layout.sharding[dim]
    if not axes or dim in layout.ragged_dims:
        return 1
    return layout.shards(dim) * (2 if axes[0] in layout.zigzag else 1)


def canonical_sizes(src: Layout, dst: Layout, fixed: Mapping[str, Size],
                    counts: Mapping[str, int]) -> dict[str, Size]:
    """Template sizes known from the layouts alone: each free even dim a multiple of
    what both layouts cut it into, times every axis size (so the planner's own cuts of
    a dim among replicas divide it too); each free ragged dim ``counts[d]`` ones."""
    axes = lcm(*src.grid.sizes, *dst.grid.sizes)
    out: dict[str, Size] = {}
    for d in src.dims:
        if d in fixed:
            out[d] = fixed[d]
        elif d in counts:
            out[d] = (1,) * counts[d]
        else:
            out[d] = lcm(layout_granules(src, d), layout_granules(dst, d)) * axes
    return out


class _Unfit(Exception):
    """A boundary of the template plans that the sizes do not move as a template needs."""


@dataclass(frozen=True)
class Symbolizer:
    """Template positions -> polynomials, per dim (see the module docstring)."""

    dims: tuple[str, ...]
    maps: tuple[Callable[[int], Num] | None, ...]  # None: a fixed dim, positions as they are

    def interval(self, k: int, iv: tuple[int, int]) -> tuple[Num, Num]:
        f = self.maps[k]
        return iv if f is None else (f(iv[0]), f(iv[1]))

    def box(self, box: Box) -> tuple:
        return tuple(self.interval(k, iv) for k, iv in enumerate(box))

    def segments(self, segments) -> tuple:
        return tuple(tuple(self.interval(k, iv) for iv in seg)
                     for k, seg in enumerate(segments))

    def step(self, step: Step, rank: int) -> Step:
        """``step`` cut down to what ``rank`` takes part in, its boxes symbolic."""
        return step.restrict(rank, self.box)


def _even_map(granule: int, var: Expr, dim: str) -> Callable[[int], Num]:
    def f(e: int) -> Num:
        if e % granule:
            raise _Unfit(f"a boundary of {dim!r} at {e} is not a multiple of {granule}")
        return (e // granule) * var
    return f


def _ragged_map(positions: dict[int, Num], dim: str) -> Callable[[int], Num]:
    def f(e: int) -> Num:
        if e not in positions:
            raise _Unfit(f"a boundary of ragged {dim!r} falls inside a segment")
        return positions[e]
    return f


def _boundaries(tilings, k: int) -> set[int]:
    """Every boundary on dim ``k`` of ``tilings`` (a plan's, see ``plan_tilings``): every
    box a plan moves is cut from them, so these are all the positions it has."""
    out: set[int] = set()
    for tiling in tilings:
        t = tiling.tilings[k]
        for owner in range(t.owners):
            for lo, hi in t.owned(owner):
                out.update((lo, hi))
    return out


def _cut_evenly(layout: Layout, dim: str, size: int) -> bool:
    return size % layout_granules(layout, dim) == 0


@dataclass(frozen=True, eq=False)
class Template:
    """Forward and adjoint plans at template sizes and how their positions follow the
    sizes. Build with :meth:`build`; None there means the sizes give no template."""

    src: Layout
    dst: Layout
    sizes: dict[str, Size]           # the template sizes (free ragged dims: ones)
    free: tuple[str, ...]
    granules: dict[str, int]         # free even dims
    counts: dict[str, int]           # free ragged dims: how many counts
    fwd: Plan | RankPlan             # a rank's part when built for one rank
    bwd: Plan | RankPlan
    fwd_sym: Symbolizer              # positions of fwd (its dim order), as polynomials
    bwd_sym: Symbolizer
    variables: tuple[tuple, ...]     # the env's keys, in a fixed order

    @staticmethod
    def build(src: Layout, dst: Layout, sizes: Mapping[str, Size], itemsize: int,
              grad_partial: tuple[str, ...], free: tuple[str, ...],
              rank: int | None = None) -> Template | None:
        """The template at ``sizes``, or None when these sizes cannot be one: a free even
        dim that a layout cuts unevenly, or a free ragged dim that a layout cuts
        evenly (its plan then depends on the counts). With ``rank``, its plans are that
        rank's parts (what a bridge lowers); the granules are the same on every rank."""
        ragged = set(src.ragged_dims) | set(dst.ragged_dims)
        tsizes: dict[str, Size] = dict(sizes)
        for d in free:
            if d in ragged:
                if any(lay.sharding[d] and d not in lay.ragged_dims for lay in (src, dst)):
                    return None
                tsizes[d] = (1,) * len(sizes[d])  # type: ignore[arg-type]
            elif not all(_cut_evenly(lay, d, total(sizes[d])) for lay in (src, dst)):
                return None
        adjoint = backward_layouts(src, dst, grad_partial)
        fwd: Plan | RankPlan
        bwd: Plan | RankPlan
        if rank is None:
            fwd, bwd = plan(src, dst, tsizes, itemsize), plan(*adjoint, tsizes, itemsize)
        else:
            fwd = plan_for_rank(src, dst, tsizes, itemsize, rank=rank)
            bwd = plan_for_rank(*adjoint, tsizes, itemsize, rank=rank)
        tilings = (plan_tilings(src, dst, tsizes), plan_tilings(*adjoint, tsizes))
        try:
            return Template._symbolize(src, dst, tsizes, free, fwd, bwd, ragged, tilings)
        except _Unfit:
            return None

    @staticmethod
    def _symbolize(src, dst, tsizes, free, fwd, bwd, ragged, tilings) -> Template:
        maps: dict[str, Callable[[int], Num]] = {}
        granules: dict[str, int] = {}
        counts: dict[str, int] = {}
        variables: list[tuple] = []
        for d in fwd.dims:
            if d not in free:
                continue
            if d in ragged:
                n = len(tsizes[d])
                counts[d] = n
                variables += [("c", d, i) for i in range(n)]
                positions: dict[int, Num] = {0: 0}
                acc: Num = 0
                for i, e in enumerate(prefix_sums(tsizes[d])[1:]):
                    acc = acc + Expr.var(("c", d, i), 1)
                    positions[e] = acc
                maps[d] = _ragged_map(positions, d)
                continue
            g = tsizes[d]
            for plan_, cuts in zip((fwd, bwd), tilings):
                for e in _boundaries(cuts, plan_.dims.index(d)):
                    g = gcd(g, e)
            granules[d] = tsizes[d] // g
            variables.append(("u", d))
            maps[d] = _even_map(g, Expr.var(("u", d), g), d)
        syms = tuple(Symbolizer(p.dims, tuple(maps.get(d) for d in p.dims)) for p in (fwd, bwd))
        for plan_, sym, cuts in zip((fwd, bwd), syms, tilings):  # all map, else _Unfit
            for k in range(len(plan_.dims)):
                for e in _boundaries(cuts, k):
                    sym.interval(k, (e, e))
        return Template(src, dst, dict(tsizes), tuple(free), granules, counts, fwd, bwd,
                        syms[0], syms[1], tuple(variables))

    def fits(self, sizes: Mapping[str, Size]) -> bool:
        """Whether concrete ``sizes`` are served by this template."""
        for d, n in self.granules.items():
            if not isinstance(sizes[d], int) or sizes[d] % n:  # type: ignore[operator]
                return False
        return all(isinstance(sizes[d], tuple) and len(sizes[d]) == m  # type: ignore[arg-type]
                   for d, m in self.counts.items())

    def env(self, sizes: Mapping[str, Any]) -> dict[tuple, Any]:
        """The variables' values at ``sizes`` (ints, or SymInts under ``torch.compile``);
        the caller has checked that the sizes fit."""
        out: dict[tuple, Any] = {}
        for d, n in self.granules.items():
            out["u", d] = sizes[d] // n
        for d, m in self.counts.items():
            for i in range(m):
                out["c", d, i] = sizes[d][i]
        return out

    def describe(self) -> str:
        parts = [f"{d}: multiples of {n}" for d, n in self.granules.items()]
        parts += [f"{d}: {m} counts" for d, m in self.counts.items()]
        return ", ".join(parts) or "fixed sizes"
