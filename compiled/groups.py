"""Process groups for plans, created eagerly in one order on every rank.

``torch.distributed.new_group`` is a collective over the whole world: every rank must
call it for every group, in the same order. Creating groups lazily (inside a pipeline
schedule, or on first use under ``torch.compile``) deadlocks, so :func:`acquire` creates
all groups a plan needs up front, in plan order, and counts references; :func:`release`
destroys a group when its last user is gone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from mimo_fx.errors import MimoFxError
from mimo_fx.plan import Exchange, Plan

__all__ = ["plan_groups", "acquire", "release", "group_name", "live_groups"]

_GROUPS: dict[tuple[int, ...], list] = {}  # ranks -> [ProcessGroup, references]


def plan_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The groups (rank tuples, size > 1) a plan's steps run on, in issue order."""
    out: list[tuple[int, ...]] = []
    for step in plan.steps:
        groups = (step.ranks,) if isinstance(step, Exchange) else step.groups
        for g in groups:
            if len(g) > 1 and g not in out:
                out.append(g)
    return out


def acquire(groups: Iterable[tuple[int, ...]]) -> None:
    """Create (or reference) every group; call on every rank with the same list."""
    if not dist.is_initialized():
        raise MimoFxError("the compiled backend needs torch.distributed initialised "
                          "(torch.distributed.init_process_group) before groups are prepared")
    world = dist.get_world_size()
    for ranks in groups:
        if ranks[-1] >= world:
            raise MimoFxError(f"group {ranks} needs rank {ranks[-1]} but the world has "
                              f"{world} ranks; check the grids' sizes and offsets")
        entry = _GROUPS.get(ranks)
        if entry is None:
            pg = dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks))
            _GROUPS[ranks] = [pg, 1]
        else:
            entry[1] += 1


def release(groups: Iterable[tuple[int, ...]]) -> None:
    """Drop one reference to each group; destroy groups nobody uses any more."""
    for ranks in groups:
        entry = _GROUPS.get(ranks)
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] == 0:
            pg = _GROUPS.pop(ranks)[0]
            if pg is not dist.group.WORLD and dist.is_initialized():
                dist.destroy_process_group(pg)


def group_name(ranks: tuple[int, ...]) -> str:
    """The registered name of a prepared group (a constant under ``torch.compile``)."""
    entry = _GROUPS.get(ranks)
    if entry is None:
        raise MimoFxError(
            f"process group {ranks} is not prepared. Groups must be created eagerly on every "
            f"rank, in the same order, before the first call and before torch.compile: call "
            f"mimo_fx.compiled.prepare(src, dst, sizes, dtype) (or build a Redistributor) on "
            f"every rank first"
        )
    return entry[0].group_name


def live_groups() -> int:
    """How many groups the registry holds (for leak checks)."""
    return len(_GROUPS)
