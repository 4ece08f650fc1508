"""MIMO configuration: per-module parallelism -> grids, data-loader contract, stages.

A :class:`ModuleParallelism` gives one module's tp, cp, pp, dp, rank offset and axis
order (default ``tp, cp, pp, dp``, the first fastest). A :class:`MimoParallelism` names
the modules of a multimodal model and says whether they share ranks (``colocated``) or
tile the world. ``grids()`` builds one :class:`Grid` per module -- on every rank, since
every rank must take part in every collective that creates groups.

>>> cfg = MimoParallelism(world_size=8, colocated=True, modules={
...     "encoder": ModuleParallelism(tp=2, dp=4),
...     "llm": ModuleParallelism(tp=2, cp=2, dp=2)})
>>> cfg.grids()["llm"]
Grid(tp=2, cp=2, pp=1, dp=2)
>>> cfg.batch_slice("encoder", rank=3, global_batch=16)
(4, 8)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mimo_fx.errors import MimoFxError
from mimo_fx.grid import Grid
from mimo_fx.regions import split_bounds

__all__ = ["ModuleParallelism", "MimoParallelism", "is_first_stage", "is_last_stage",
           "embedding_group", "position_embedding_group"]

AXES = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class ModuleParallelism:
    """One module's parallel layout; ranks ``offset .. offset + tp*cp*pp*dp - 1``."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    offset: int = 0
    order: tuple[str, ...] = AXES

    def __post_init__(self) -> None:
        order = tuple(self.order)
        if sorted(order) != sorted(AXES):
            raise MimoFxError(
                f"axis order {order} must list each of {AXES} exactly once "
                f"(first fastest), e.g. order=('tp', 'cp', 'pp', 'dp')")
        object.__setattr__(self, "order", order)
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MimoFxError(f"{axis}={size!r} must be a positive integer")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise MimoFxError(f"offset={self.offset!r} must be a non-negative integer")

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def grid(self) -> Grid:
        return Grid(offset=self.offset, **{a: getattr(self, a) for a in self.order})


@dataclass(frozen=True)
class MimoParallelism:
    """Named modules over a world of ``world_size`` ranks; see the module docstring."""

    world_size: int
    modules: dict[str, ModuleParallelism] = field(hash=False)
    colocated: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                or self.world_size <= 0:
            raise MimoFxError(f"world_size={self.world_size!r} must be a positive integer")
        if not isinstance(self.modules, dict) or not all(
                isinstance(m, ModuleParallelism) for m in self.modules.values()):
            raise MimoFxError(
                f"modules must be a dict {{name: ModuleParallelism(...)}}, got "
                f"{type(self.modules).__name__}"
                + ("" if not isinstance(self.modules, dict) else " with values of types "
                   f"{sorted({type(m).__name__ for m in self.modules.values()})}"))
        if not isinstance(self.colocated, bool):
            raise MimoFxError(f"colocated={self.colocated!r} must be True or False")
        if not self.modules:
            raise MimoFxError("a MIMO config needs at least one module")
        self._check_fit()
        self._check_overlap()
        self._check_no_stub_ranks()
        self._check_dp_divides()

    def _check_fit(self) -> None:
        for name, m in self.modules.items():
            if m.offset + m.size > self.world_size:
                raise MimoFxError(
                    f"module {name!r} needs ranks {m.offset}..{m.offset + m.size - 1} "
                    f"(tp*cp*pp*dp = {m.size} from offset {m.offset}) but the world has "
                    f"{self.world_size} ranks; shrink it or grow the world")

    def _check_overlap(self) -> None:
        if self.colocated:
            return
        spans = sorted((m.offset, m.offset + m.size, n) for n, m in self.modules.items())
        for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
            if b0 < a1:
                raise MimoFxError(
                    f"modules {a!r} (ranks {a0}..{a1 - 1}) and {b!r} (ranks {b0}..{b1 - 1}) "
                    f"overlap but the config is not colocated; set colocated=True or move "
                    f"{b!r}'s offset to {a1}")

    def _check_no_stub_ranks(self) -> None:
        used: set[int] = set()
        for m in self.modules.values():
            used.update(range(m.offset, m.offset + m.size))
        stubs = sorted(set(range(self.world_size)) - used)
        if stubs:
            raise MimoFxError(
                f"ranks {stubs} join no module (stub ranks are not supported): every rank "
                f"of the {self.world_size}-rank world must run a module; resize the modules "
                f"or the world")

    def _check_dp_divides(self) -> None:
        dps = sorted((m.dp, n) for n, m in self.modules.items())
        for (small, a), (big, b) in zip(dps, dps[1:]):
            if big % small:
                raise MimoFxError(
                    f"DP sizes must divide one another so batches map between modules: "
                    f"{a!r} has dp={small}, {b!r} has dp={big}")

    def grids(self) -> dict[str, Grid]:
        """One Grid per module (build it on every rank)."""
        return {name: m.grid() for name, m in self.modules.items()}

    def modules_of(self, rank: int) -> tuple[str, ...]:
        """The modules ``rank`` runs."""
        return tuple(n for n, g in self.grids().items() if rank in g)

    # -- data-loader contract ----------------------------------------------------------
    def check_batches(self, global_batch: int, micro_batch: int, microbatches: int) -> None:
        """Micro-batch and global batch divisible by every module's DP, and
        microbatches x micro-batch = global batch."""
        for what, n in (("global batch", global_batch), ("micro-batch", micro_batch),
                        ("microbatches", microbatches)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise MimoFxError(f"{what} {n!r} must be a positive integer")
        if microbatches * micro_batch != global_batch:
            raise MimoFxError(
                f"microbatches x micro-batch = {microbatches} x {micro_batch} = "
                f"{microbatches * micro_batch}, but the global batch is {global_batch}")
        for name, m in self.modules.items():
            for what, n in (("micro-batch", micro_batch), ("global batch", global_batch)):
                if n % m.dp:
                    raise MimoFxError(f"{what} {n} is not divisible by module {name!r}'s "
                                      f"dp={m.dp}; use a multiple of {m.dp}")

    def batch_slice(self, module: str, rank: int, global_batch: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of a global batch that ``rank`` feeds ``module``."""
        if module not in self.modules:
            raise MimoFxError(f"unknown module {module!r}; modules are {list(self.modules)}")
        m = self.modules[module]
        if global_batch % m.dp:
            raise MimoFxError(f"batch {global_batch} is not divisible by module {module!r}'s "
                              f"dp={m.dp}")
        dp_index = m.grid().coord(rank)["dp"]
        return split_bounds(global_batch, m.dp)[dp_index]


# -- pipeline helpers ----------------------------------------------------------------------
def _stage(grid: Grid, rank: int) -> int:
    return grid.coord(rank)["pp"] if "pp" in grid.names else 0


def is_first_stage(grid: Grid, rank: int) -> bool:
    return _stage(grid, rank) == 0


def is_last_stage(grid: Grid, rank: int) -> bool:
    size = grid.axis_size("pp") if "pp" in grid.names else 1
    return _stage(grid, rank) == size - 1


def embedding_group(grid: Grid, rank: int) -> tuple[int, ...]:
    """First and last stage of ``rank``'s pipeline (tied word embeddings)."""
    pipe = grid.group_of(rank, ("pp",)) if "pp" in grid.names else (rank,)
    return tuple(sorted({pipe[0], pipe[-1]}))


def position_embedding_group(grid: Grid, rank: int) -> tuple[int, ...]:
    """The first stage of ``rank``'s pipeline (position embeddings)."""
    pipe = grid.group_of(rank, ("pp",)) if "pp" in grid.names else (rank,)
    return (pipe[0],)
