"""Every rank of a world traced in one process, on torch's ``fake`` process group.

torch's fake backend gives one process the rank and world size of any member of a world
and completes every collective at once without moving data (its all-gathers copy the
caller's input; what point-to-point receives fill in is unset). :func:`trace` runs a
function as each rank of an ``n``-rank world in turn -- build bridges, compile, run a
step, backward -- with the NCCL-rules record on (:mod:`.nccl_rules`), and returns every
rank's record; :func:`check` replays them together with NCCL's semantics. So the members
of each group are checked to issue the same collectives and point-to-point calls in the
same order, with the same sizes, forward and backward, through what the compiled graphs
(inductor's scheduling included) actually ran, with no process spawned and no port opened.

What a fake world cannot give is a peer's data: values are garbage, and so is anything a
call learns from its peers. Its bridges therefore have their sizes fixed (or given) and
``frozen=`` given (a bridge that decides it meets its peers' states), run unchecked,
and the agreement on a bridge's definition -- a store protocol among the ranks, no
communicator's traffic -- is skipped (each rank builds alone). Every bridge still live
when the function returns is destroyed, then the world, so the next rank starts afresh.

>>> import torch
>>> from mimo_fx import Grid, Layout
>>> from mimo_fx.compiled import Redistributor
>>> def step(rank, world):
...     bridge = Redistributor(Layout(Grid(dp=2), "(dp b) h"),
...                            Layout(Grid(tp=2, offset=2), "b (tp h)"),
...                            {"b": 4, "h": 6}, frozen=False)
...     y = bridge(torch.ones(2, 6) if rank < 2 else None)
...     return tuple(y.shape)
>>> results, records = trace(4, step)
>>> results
{0: (0, 0), 1: (0, 0), 2: (4, 3), 3: (4, 3)}
>>> report = check(4, step)
>>> (report.problems, report.groups)
([], 3)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from mimo_fx.errors import MimoFxError

from .nccl_rules import Report, replay

__all__ = ["trace", "check"]


def trace(world: int, fn: Callable[..., Any], *args: Any
          ) -> tuple[dict[int, Any], dict[int, list[tuple]]]:
    """Run ``fn(rank, world, *args)`` as each rank of a ``world``-rank fake world in
    turn; every rank's result and NCCL-rules record, by rank."""
    import torch._dynamo as dynamo
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")

    from mimo_fx.compiled import comm, live
    from mimo_fx.compiled import prepared as bridges

    if dist.is_initialized():
        raise MimoFxError("a fake world runs in a process without a process group; this "
                          f"one has a {dist.get_world_size()}-rank world: destroy it first")
    results: dict[int, Any] = {}
    records: dict[int, list[tuple]] = {}
    agree, kept = bridges.agree, os.environ.get(comm.RULES_ENV)
    os.environ[comm.RULES_ENV] = "1"
    bridges.agree = _alone  # type: ignore[assignment]
    try:
        for rank in range(world):
            comm.MESSAGES.rules.clear()
            dynamo.reset()
            dist.init_process_group("fake", rank=rank, world_size=world,
                                    store=dist.HashStore())
            try:
                results[rank] = fn(rank, world, *args)
            finally:
                for prepared in live.bridges():
                    bridge = prepared.owner()  # (its handle: a Bridge releases more)
                    with contextlib.suppress(MimoFxError):
                        (prepared if bridge is None else bridge).destroy()
                dist.destroy_process_group()
            records[rank] = list(comm.MESSAGES.rules)
    finally:
        bridges.agree = agree  # type: ignore[assignment]
        comm.MESSAGES.rules.clear()
        dynamo.reset()
        if kept is None:
            os.environ.pop(comm.RULES_ENV, None)
        else:
            os.environ[comm.RULES_ENV] = kept
    return results, records


def check(world: int, fn: Callable[..., Any], *args: Any) -> Report:
    """:func:`trace`, then every rank's record replayed with NCCL's semantics."""
    return replay(trace(world, fn, *args)[1])


def _alone(*args: Any, **kwargs: Any) -> None:
    """The agreement of a fake world's rank: none (its peers never post; see the module
    docstring)."""
