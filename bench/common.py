"""Pieces the benchmark scripts share (run as ``python bench/<script>.py``, which puts
this folder on ``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from mimo_fx import Grid
from mimo_fx.compiled.comm import OPS, Comm
from mimo_fx.plan import Plan


def collectives(p: Plan) -> str:
    """The plan's collectives, e.g. ``all_to_all + all_gather[4g]``; ``local`` if none."""
    if not p.steps:
        return "local"
    return " + ".join(f"{k.value}[{g}g]" if g > 1 else k.value for k, g in p.collectives)


def replicas(grid: Grid) -> list[tuple[int, ...]]:
    """Per dp index, the ranks of that replica (every other axis), leader first."""
    others = tuple(a for a in grid.names if a != "dp")
    if not others:
        return [(r,) for r in grid.ranks]
    return sorted(grid.groups(others), key=lambda g: grid.coord(g[0])["dp"])


def bare(program, comm) -> Callable[[], None]:
    """A call issuing the collectives of a lowered program through ``comm``, exactly as
    the executor does, on buffers of the packed sizes made once: no packing, no
    assembly."""
    from mimo_fx.compiled.executor import issue

    bufs = [torch.randn(op.numel) for op in program.ops]

    def call() -> None:
        for op, buf in zip(program.ops, bufs):
            issue(comm, op, buf)

    return call


class NullComm(Comm):
    """A comm that moves nothing: each collective returns a new buffer of its output's
    size, as a real one would (for timing everything but the communication)."""

    def collective(self, kind, flat, ranks, out_splits=(), in_splits=(), site=""):
        return OPS[kind].output(flat, ranks, out_splits, in_splits)


def timed(fns: dict[str, Callable[[], object]], iters: int,
          warmup: int) -> dict[str, tuple[float, float]]:
    """Per function, the median wall seconds and median process CPU seconds of ``fn()``,
    every rank calling it after a common barrier.

    The functions are interleaved (one call of each per iteration, the order rotating), so
    a change in the machine's load during the run affects all of them alike."""
    import torch.distributed as dist

    names = list(fns)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            fns[name]()
            if i >= warmup:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name]))
            for name in names}
