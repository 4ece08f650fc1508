"""Gradient sums for plain ``nn.Module`` s: data-parallel replicas and tied embeddings.

:class:`ModuleGrads` works on mimo_fx layouts; a training loop built from ordinary
``torch.nn`` modules needs the same two reductions on ``.grad``:

- :class:`GradSync` -- every module's gradients summed over its own data axes (dp, and cp
  where its grid has one), whatever grid each module has and whether the modules share
  ranks (colocated) or not (pipelined);
- :class:`TiedGrads` -- the gradient of a weight tied between the first and the last
  stage of a pipeline (word embeddings and output projection) summed over both stages.

Both **sum**, never average: every micro-batch loss is normalised by the step's global
token count (a constant every rank knows), so the summed gradient is the step's gradient
for every module, whatever its DP size.

Construction is collective over the whole world: every rank builds the same objects, in
the same order, including ranks outside a module's grid. It first gathers a short
report (one ``all_gather_object``) so that any rank's mistake -- a missing module, a
typo in an axis name, replicas whose parameters differ -- raises the same
:class:`MimoFxError` on every rank instead of leaving peers waiting in a collective.
Then it creates every process group eagerly, in one order (a group created lazily inside
a training loop deadlocks). ``sync()`` issues one all-reduce per bucket: the gradients of
one module (or one tied set) and one dtype, flattened into a buffer.

A parameter whose ``.grad`` is ``None`` on a rank (unused in its forward) takes part as
zeros: ranks cannot know each other's ``None`` s without a collective, and a rank that
skipped it would desynchronise the buffers. After ``sync()`` every parameter of a
synchronised module has a ``.grad``.

>>> from mimo_fx import Grid
>>> data_axes(Grid(tp=2, cp=2, dp=4))
('dp', 'cp')
>>> embedding_groups(Grid(pp=2, dp=2))     # (first stage, last stage) of each pipeline
((0, 1), (2, 3))
>>> # on every rank, after torch.distributed.init_process_group:
>>> # grads = GradSync({"encoder": (enc, Grid(dp=4)), "llm": (llm, Grid(cp=2, dp=2, offset=4))})
>>> # loss.backward(); grads.sync(); optimizer.step()
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from mimo_fx.errors import MimoFxError
from mimo_fx.grid import Grid

from .config import MimoParallelism, embedding_group, is_first_stage, is_last_stage

__all__ = ["GradSync", "TiedGrads", "Bucket", "data_axes", "embedding_groups", "fsdp_sums"]

Ranks = tuple[int, ...]
DATA_AXES = ("dp", "cp")
_NOT_DATA = MappingProxyType({
    "tp": "tensor-parallel ranks hold different shards of a weight, so summing their "
          "gradients would add unrelated pieces (TP layers reduce what they need "
          "themselves)",
    "pp": "pipeline stages hold different parameters; a weight tied between the first "
          "and the last stage is summed by TiedGrads",
})


def data_axes(grid: Grid, axes: Sequence[str] = DATA_AXES) -> tuple[str, ...]:
    """The axes of ``axes`` that split ``grid``'s data: present, and of size > 1."""
    return tuple(a for a in axes if a in grid.names and grid.axis_size(a) > 1)


def fsdp_sums(module: nn.Module) -> nn.Module:
    """Make an FSDP2 module (``fully_shard``) *sum* its gradients over its mesh, as the
    loss convention here needs (every loss is divided by the step's global token count,
    so the step's gradient is the sum over data replicas; FSDP2 averages by default,
    which makes the module's gradient 1/DP too small). Sets a divide factor of 1 and a
    plain SUM reduction (with the divide factor alone, gloo raises "Cannot use
    ReduceOp.PREMUL_SUM with Gloo"). Returns the module.

    >>> fsdp_sums(torch.nn.Linear(2, 2))  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    mimo_fx.errors.MimoFxError: ... is not an FSDP2 module ...
    """
    if not hasattr(module, "set_gradient_divide_factor"):
        raise MimoFxError(f"fsdp_sums: {type(module).__name__} is not an FSDP2 module; "
                          f"wrap it with torch.distributed.fsdp.fully_shard first")
    fsdp: Any = module
    fsdp.set_gradient_divide_factor(1.0)
    fsdp.set_force_sum_reduction_for_comms(True)
    return module


def embedding_groups(grid: Grid) -> tuple[Ranks, ...]:
    """Every pipeline's (first stage, last stage) ranks, by first rank; one stage: one rank."""
    return tuple(sorted({embedding_group(grid, r) for r in grid.ranks}))


@dataclass(frozen=True)
class Bucket:
    """One all-reduce of ``sync()``: ``numel`` elements of one dtype -- the gradients of
    ``params`` of ``module`` -- summed over ``ranks``."""

    module: str
    ranks: Ranks
    dtype: torch.dtype
    numel: int
    params: tuple[str, ...]

    def __str__(self) -> str:
        return (f"{self.module}: all_reduce(sum) of {self.numel} x {self.dtype} over ranks "
                f"{self.ranks} ({len(self.params)} parameters)")


# -- the collective core, shared by GradSync and TiedGrads -------------------------------
def _rank(what: str) -> int:
    from mimo_fx.compiled.lease import require_world

    return require_world(what)


def _check_fits(name: str, grid: Grid) -> None:
    import torch.distributed as dist

    world = dist.get_world_size()
    if grid.ranks.stop > world:
        raise MimoFxError(f"{name}'s grid {grid!r} needs ranks {grid.ranks.start}.."
                          f"{grid.ranks.stop - 1} but the world has {world}; shrink the grid "
                          f"or change its offset")


def _signature(named: Sequence[tuple[str, nn.Parameter]]) -> tuple[str, str]:
    """A digest of names, shapes and dtypes, and a readable summary for errors."""
    text = repr([(n, tuple(p.shape), str(p.dtype)) for n, p in named])
    per_dtype: dict[str, int] = {}
    for _, p in named:
        per_dtype[str(p.dtype)] = per_dtype.get(str(p.dtype), 0) + p.numel()
    summary = f"{len(named)} parameter{'s' * (len(named) != 1)}, " + ", ".join(
        f"{n} elements of {d}" for d, n in per_dtype.items()) if named else "no parameters"
    return hashlib.sha1(text.encode()).hexdigest(), summary


def _describe(err: Exception) -> str:
    return str(err) if isinstance(err, MimoFxError) else f"{type(err).__name__}: {err}"


def _gather_reports(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's report, by rank (one all_gather_object over the world)."""
    import torch.distributed as dist

    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def _agree(what: str, reports: list[dict[str, Any]]) -> None:
    """Raise on every rank if any rank rejected its arguments or built something else."""
    for rank, r in enumerate(reports):
        if r["error"] is not None:
            raise MimoFxError(f"{what} on rank {rank}: {r['error']}")
    for rank, r in enumerate(reports):
        if r["config"] != reports[0]["config"]:
            raise MimoFxError(
                f"{what}: rank {rank} was built with {r['config']} but rank 0 with "
                f"{reports[0]['config']}; every rank must build the same {what} (same "
                f"names, grids and axes), in the same order")


def _check_members(what: str, reports: list[dict[str, Any]], key: str, group: Ranks,
                   rule: str) -> None:
    """Raise if the members of ``group`` hold different parameters under ``key``."""
    kinds: dict[tuple[str, str], list[int]] = {}
    for r in group:
        kinds.setdefault(tuple(reports[r]["sigs"][key]), []).append(r)
    if len(kinds) > 1:
        held = "; ".join(f"ranks {ranks}: {summary}" for (_, summary), ranks in kinds.items())
        raise MimoFxError(f"{what}: {rule}, but ranks {group} differ ({held}). They must "
                          f"hold the same parameters (names, shapes, dtypes) in the same "
                          f"order")


def _buckets(module: str, ranks: Ranks, named: Sequence[tuple[str, nn.Parameter]],
             bucket_numel: int | None) -> list[tuple[Bucket, list[nn.Parameter]]]:
    """Parameters grouped by (dtype, device) in order of first appearance, each group cut
    into buffers of at most ``bucket_numel`` elements (a larger parameter goes alone)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[tuple[str, nn.Parameter]]]] = {}
    for name, p in named:
        chunks = by_kind.setdefault((p.dtype, p.device), [[]])
        size = sum(q.numel() for _, q in chunks[-1])
        if bucket_numel and chunks[-1] and size + p.numel() > bucket_numel:
            chunks.append([])
        chunks[-1].append((name, p))
    return [(Bucket(module, ranks, dtype, sum(p.numel() for _, p in chunk),
                    tuple(n for n, _ in chunk)), [p for _, p in chunk])
            for (dtype, _), chunks in by_kind.items() for chunk in chunks]


def _flat_grads(params: Sequence[nn.Parameter]) -> torch.Tensor:
    parts = []
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise MimoFxError("a parameter has a sparse gradient; only dense gradients "
                              "are summed (use sparse=False in nn.Embedding)")
        parts.append(torch.zeros_like(p).reshape(-1) if p.grad is None
                     else p.grad.detach().reshape(-1))
    return torch.cat(parts)


def _pieces(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    return [piece.view(p.shape) for piece, p in
            zip(flat.split([p.numel() for p in params]), params)]


def _unflatten_into_grads(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
    for p, piece in zip(params, _pieces(flat, params)):
        if p.grad is None:
            p.grad = piece
        else:
            p.grad.copy_(piece)


class _Sums:
    """Groups created eagerly at construction (a lease); one all-reduce per bucket on
    ``run()``."""

    def __init__(self, what: str, groups: Sequence[Ranks], rank: int,
                 buckets: list[tuple[Bucket, list[nn.Parameter]]]) -> None:
        from mimo_fx.compiled.lease import Lease

        self.what, self.groups = what, tuple(dict.fromkeys(groups))
        self.lease = Lease(f"this {what}", self.groups)
        self.comm = self.lease.comm()
        self.buckets = buckets

    def run(self) -> None:
        self.lease.check()
        with torch.no_grad():
            for bucket, params in self.buckets:
                summed = self.comm.all_reduce(_flat_grads(params), bucket.ranks)
                _unflatten_into_grads(summed, params)

    def destroy(self) -> None:
        self.lease.release()


def _check_bucket_numel(bucket_numel: int | None) -> None:
    if bucket_numel is not None and (isinstance(bucket_numel, bool)
                                     or not isinstance(bucket_numel, int) or bucket_numel < 1):
        raise MimoFxError(f"bucket_numel={bucket_numel!r} must be a positive integer (elements "
                          f"per all-reduce) or None for one buffer per module and dtype")


def _trainable(module: nn.Module, what: str) -> list[tuple[str, nn.Parameter]]:
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    dtensor = sys.modules.get("torch.distributed.tensor")  # never imported: no DTensor
    for name, p in named:
        if dtensor is not None and isinstance(p, dtensor.DTensor):
            raise MimoFxError(f"{what}.{name} is a DTensor (FSDP2 or tensor parallel): its "
                              f"gradient is reduced by its own mesh; leave this module out")
    return named


# -- data-parallel replicas -------------------------------------------------------------
ModuleEntry = tuple[nn.Module | None, Grid]


class GradSync:
    """Sums every module's ``.grad`` over the module's own data axes (see the module
    docstring). Build it on every rank, with the same names, grids and axes.

    Args:
        modules: name -> ``(module, grid)``. ``module`` is this rank's replica (its
            stage, on a grid with pp), or ``None`` on ranks outside ``grid``; a module
            given on a rank outside its grid is ignored.
        axes: the data axes to sum over; an axis a grid lacks, or of size 1, is skipped
            for that module. ``"tp"`` and ``"pp"`` are refused (they do not replicate
            weights).
        bucket_numel: at most this many elements per all-reduce (a larger parameter goes
            alone); ``None``: one buffer per module and dtype.

    Call :meth:`sync` once per step, after the last micro-batch's backward and before
    the optimizer step; :meth:`destroy` releases the process groups.
    """

    def __init__(self, modules: Mapping[str, ModuleEntry], axes: Sequence[str] = DATA_AXES,
                 *, bucket_numel: int | None = None) -> None:
        self.rank = _rank("GradSync")
        error, named, grids, config = None, {}, {}, None
        try:
            grids = _check_entries(modules)
            self.axes = _check_axes(axes, grids)
            _check_bucket_numel(bucket_numel)
            named = _local_modules(modules, self.rank)
            config = (tuple(grids.items()), self.axes, bucket_numel)
        except Exception as err:  # reported to every rank, so none waits for this one
            error = _describe(err)
        reports = _gather_reports({"error": error, "config": config,
                             "sigs": {n: _signature(ps) for n, ps in named.items()}})
        _agree("GradSync", reports)
        groups = []
        for name, grid in grids.items():
            on = data_axes(grid, self.axes)
            for group in grid.groups(on) if on else ():
                _check_members("GradSync", reports, name, group,
                               f"the replicas of module {name!r} over {on} are summed")
                groups.append(group)
        buckets = []
        for name, ps in named.items():
            on = data_axes(grids[name], self.axes)
            if on:
                buckets += _buckets(name, grids[name].group_of(self.rank, on), ps, bucket_numel)
        self.grids = grids
        self._local = {n: [p for _, p in ps] for n, ps in named.items()}
        self._sums = _Sums("GradSync", groups, self.rank, buckets)

    @classmethod
    def from_config(cls, config: MimoParallelism, modules: Mapping[str, nn.Module | None],
                    axes: Sequence[str] = DATA_AXES, *,
                    bucket_numel: int | None = None) -> GradSync:
        """The grids from a MIMO config; ``modules`` maps its module names to this rank's
        modules (``None`` or absent where the rank does not run one)."""
        unknown = sorted(set(modules) - set(config.modules))
        if unknown:  # raised on every rank: the others are in GradSync's report gather
            _rank("GradSync")
            _agree("GradSync", _gather_reports({
                "error": f"modules {unknown} are not in the config, whose modules are "
                         f"{list(config.modules)}", "config": None, "sigs": {}}))
        return cls({n: (modules.get(n), g) for n, g in config.grids().items()}, axes,
                   bucket_numel=bucket_numel)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """This rank's all-reduces, in the order :meth:`sync` issues them."""
        return tuple(b for b, _ in self._sums.buckets)

    def sync(self) -> None:
        """Sum the gradients of every module this rank runs over the module's data axes;
        a ``None`` gradient counts as zeros and is set. Once per step: a second call
        would sum the sums."""
        self._sums.run()
        with torch.no_grad():  # modules without a data axis: None grads set to zeros too
            for name, params in self._local.items():
                if not data_axes(self.grids[name], self.axes):
                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)

    def destroy(self) -> None:
        """Release the process groups (idempotent)."""
        self._sums.destroy()

    def __str__(self) -> str:
        lines = [f"GradSync on rank {self.rank}, axes {self.axes}:"]
        lines += [f"  {b}" for b in self.buckets] or ["  (nothing to sum on this rank)"]
        return "\n".join(lines)


def _check_entries(modules: Mapping[str, Any]) -> dict[str, Grid]:
    """The grids by module name; each entry must be a pair (module or None, Grid)."""
    if not isinstance(modules, Mapping) or not modules:
        raise MimoFxError(f"modules must be a non-empty dict name -> (module, grid); got "
                          f"{modules!r}")
    for name, entry in modules.items():
        if not (isinstance(name, str) and isinstance(entry, tuple) and len(entry) == 2
                and isinstance(entry[1], Grid)):
            raise MimoFxError(f"modules[{name!r}] must be a pair (nn.Module or None, Grid) "
                              f"under a string name; got {entry!r}")
        _check_fits(f"module {name!r}", entry[1])
    return {name: entry[1] for name, entry in modules.items()}


def _check_axes(axes: Sequence[str], grids: Mapping[str, Grid]) -> tuple[str, ...]:
    if isinstance(axes, str) or not isinstance(axes, Iterable):
        raise MimoFxError(f"axes={axes!r} must be a sequence of axis names, e.g. ('dp', 'cp')")
    axes = tuple(axes)
    known = sorted({n for grid in grids.values() for n in grid.names})
    for axis in axes:
        if axis in _NOT_DATA:
            raise MimoFxError(f"axis {axis!r} cannot be summed over: {_NOT_DATA[axis]}. "
                              f"Data axes are {DATA_AXES}")
        if axis not in known and axis not in DATA_AXES:
            raise MimoFxError(f"unknown axis {axis!r}: the grids have axes {known}; the "
                              f"data axes are usually {DATA_AXES}")
    if len(set(axes)) != len(axes):
        raise MimoFxError(f"axes {axes} name an axis twice")
    return axes


def _local_modules(modules: Mapping[str, ModuleEntry],
                   rank: int) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """This rank's modules' trainable parameters, by module name."""
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    owner: dict[int, str] = {}
    for name, (module, grid) in modules.items():
        if rank not in grid:
            continue
        if not isinstance(module, nn.Module):
            raise MimoFxError(
                f"modules[{name!r}]: rank {rank} is in its grid {grid!r} but the module is "
                f"{module!r}; pass this rank's nn.Module (or fix the grid's sizes/offset)")
        out[name] = _trainable(module, name)
        for pname, p in out[name]:
            if id(p) in owner:
                raise MimoFxError(f"parameter {name}.{pname} is also {owner[id(p)]}: one "
                                  f"parameter in two modules would be summed twice; keep "
                                  f"it in one module")
            owner[id(p)] = f"{name}.{pname}"
    return out


# -- tied embeddings ----------------------------------------------------------------------
class TiedGrads:
    """Sums the gradient of weights tied between the first and the last stage of every
    pipeline of ``grid`` (word embeddings and output projection). Build it on every rank.

    Args:
        grid: the pipelined module's grid (axis ``pp``; without it, or with pp=1, the
            first stage is the last and there is nothing to sum).
        params: this rank's tied parameters (``nn.Parameter`` s, such as
            ``embedding.weight``) -- on a first or last stage the same number,
            shapes and dtypes in the same order on both; ``None`` on middle stages and
            off the grid.

    The tied weights must start equal on both stages: build the last stage's copy from
    the first's, or call :meth:`broadcast_from_first_stage` once after construction.
    :meth:`sync` sums the two stages' gradients; summing over dp is :class:`GradSync`'s
    job (the two sums commute, so their order does not matter).
    """

    def __init__(self, grid: Grid,
                 params: torch.Tensor | Sequence[torch.Tensor] | None) -> None:
        self.rank = _rank("TiedGrads")
        error, mine, config = None, None, None
        try:
            if not isinstance(grid, Grid):
                raise MimoFxError(f"grid must be a mimo_fx Grid; got {grid!r}")
            _check_fits("the tied module", grid)
            mine = _tied_params(grid, params, self.rank)
            config = grid
        except Exception as err:  # reported to every rank, so none waits for this one
            error = _describe(err)
        named = [(str(i), p) for i, p in enumerate(mine or [])]
        reports = _gather_reports({"error": error, "config": config,
                             "sigs": {"tied": _signature(named)} if mine is not None else {}})
        _agree("TiedGrads", reports)
        self.grid, self.params = grid, tuple(mine or ())
        groups = [g for g in embedding_groups(grid) if len(g) > 1]
        for group in groups:
            _check_members("TiedGrads", reports, "tied", group,
                           "the first and last stage's tied weights are summed")
        mygroup = next((g for g in groups if self.rank in g), None)
        buckets = _buckets("tied", mygroup, named, None) if mygroup else []
        self._sums = _Sums("TiedGrads", groups, self.rank, buckets)

    @property
    def groups(self) -> tuple[Ranks, ...]:
        """The (first, last) stage groups whose gradients are summed, all pipelines."""
        return self._sums.groups

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """This rank's all-reduces, in the order :meth:`sync` issues them."""
        return tuple(b for b, _ in self._sums.buckets)

    def sync(self) -> None:
        """Sum the first and last stages' tied gradients (``None`` as zeros) into both."""
        self._sums.run()

    def broadcast_from_first_stage(self) -> None:
        """Copy the first stage's tied weights to the last stage (collective: call it on
        every rank, e.g. once after initialisation)."""
        self._sums.lease.check()
        first = self.rank in self.grid and is_first_stage(self.grid, self.rank)
        with torch.no_grad():
            for bucket, params in self._sums.buckets:
                flat = torch.cat([(p.detach() if first else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
                flat = self._sums.comm.all_reduce(flat, bucket.ranks)  # x + 0 = x
                if not first:
                    for p, piece in zip(params, _pieces(flat, params)):
                        p.copy_(piece)

    def destroy(self) -> None:
        """Release the process groups (idempotent)."""
        self._sums.destroy()


def _tied_params(grid: Grid, params: Any, rank: int) -> list[nn.Parameter] | None:
    """This rank's tied parameters, or None where it holds none; checks the role."""
    stages = grid.axis_size("pp") if "pp" in grid.names else 1
    listed = [params] if isinstance(params, torch.Tensor) else params
    if rank not in grid:
        if params is not None:
            raise MimoFxError(f"rank {rank} is not in {grid!r} but was given tied "
                              f"parameters; pass None off the grid")
        return None
    if stages == 1 and params is None:  # first stage = last stage: nothing to sum
        return None
    if not (is_first_stage(grid, rank) or is_last_stage(grid, rank)):
        if params is not None and len(listed):
            raise MimoFxError(f"rank {rank} is stage {grid.coord(rank)['pp']} of {stages}, "
                              f"neither first nor last: it holds no tied weight; pass None")
        return None
    if params is None or isinstance(params, str) or not isinstance(listed, Sequence) \
            or not listed or not all(isinstance(p, nn.Parameter) for p in listed):
        raise MimoFxError(f"rank {rank} is the first or last stage of {grid!r}, so it must "
                          f"pass its tied weights (an nn.Parameter or a list of them); got "
                          f"{params!r}")
    return list(listed)
