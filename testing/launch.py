"""Spawn one local world of processes and run a function on every rank.

Used by the tests, the benchmarks and the end-to-end example: gloo on 127.0.0.1 (or
NCCL with one GPU per rank). Spawning costs seconds, so callers spawn one world and run
many checks in it (or keep a :class:`~mimo_fx.testing.SpawnedWorld` to run many functions);
each rank returns a picklable result. A world that does not finish in time is killed
and reported, never left hanging; a rank that raises has its traceback re-raised in the
parent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .worlds import SpawnedWorld, WorldError

__all__ = ["WorldError", "run_world"]


# seconds after which a run says on stderr how many ranks started and finished (and
# again as that changes): a long run is not silent until every rank returns
PROGRESS = 5.0


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
              backend: str = "gloo", threads: int = 1, record: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; results by rank.

    ``fn`` must be importable by the children (a module-level function). Each process
    runs with ``threads`` intra-op threads (1 by default: many ranks share few cores).
    With ``record`` every process keeps a Flight Recorder of its collectives
    (:mod:`mimo_fx.compiled.trace`). The world is spawned for this one call and gone when
    it returns; ``timeout`` covers the spawn. A run longer than :data:`PROGRESS`
    seconds prints to stderr how many ranks have started and finished, as that changes.
    """
    with SpawnedWorld(world, backend=backend, threads=threads, record=record, reuse=False,
               progress=PROGRESS) as w:
        return w.run(fn, *args, timeout=timeout)
