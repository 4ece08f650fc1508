"""Every rank's lowered program run at once in threads, collectives met in-process.

The compiled backend's programs, without processes: each rank runs its program in a
thread and the collectives meet in a rendezvous that computes them with the comm
table's plain tensor math (``mimo_fx.compiled.comm.OPS``). A mismatch of collectives
between ranks (kinds, split sizes, a rank that never comes) fails with the ranks named.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from mimo_fx.compiled import lowering, straight
from mimo_fx.compiled.comm import OPS, Comm
from mimo_fx.compiled.executor import CompiledExecutor

__all__ = ["ThreadComm", "StraightExecutor", "EXECUTORS", "run_programs", "run_plan"]


class _Rendezvous:
    """Collectives between threads: each group's n-th call meets the members' n-th calls."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.posts: dict[tuple[tuple[int, ...], int], dict[int, tuple]] = {}
        self.results: dict[tuple[tuple[int, ...], int], dict[int, torch.Tensor]] = {}
        self.calls: dict[tuple[int, tuple[int, ...]], int] = {}

    def collective(self, rank: int, members: tuple[int, ...], post: tuple) -> torch.Tensor:
        with self.cond:
            n = self.calls.get((rank, members), 0)
            self.calls[(rank, members)] = n + 1
            key = (members, n)
            self.posts.setdefault(key, {})[rank] = post
            if len(self.posts[key]) == len(members):
                self.results[key] = _compute(members, self.posts[key])
                self.cond.notify_all()
            if not self.cond.wait_for(lambda: key in self.results, timeout=20):
                raise AssertionError(f"rank {rank}: collective {post[0]} on {members} never "
                                     f"met its peers (mismatched programs)")
            return self.results[key][rank]


class ThreadComm(Comm):
    """The comm of one rank (a thread) of a :class:`_Rendezvous`."""

    def __init__(self, world: _Rendezvous, rank: int) -> None:
        self.world, self.rank = world, rank

    def _post(self, kind, ranks, flat, out_splits=(), in_splits=()):
        post = (kind, flat.clone(), tuple(out_splits), tuple(in_splits))
        return self.world.collective(self.rank, ranks, post)

    def collective(self, kind, flat, ranks, out_splits=(), in_splits=(), site=""):
        return self._post(kind, ranks, flat, out_splits, in_splits)


def _compute(members, posts) -> dict[int, torch.Tensor]:
    """Every member's output, as the comm table's plain tensor math computes it."""
    kinds = {posts[r][0] for r in members}
    assert len(kinds) == 1, f"members {members} issued different collectives {kinds}"
    outs = OPS[kinds.pop()].compute([posts[r][1] for r in members],
                                    [posts[r][2] for r in members],
                                    [posts[r][3] for r in members])
    return dict(zip(members, outs))


class StraightExecutor(CompiledExecutor):
    """Runs each program as its straight-line function (:mod:`mimo_fx.compiled.straight`,
    what a compiled call traces), here eagerly."""

    def run(self, program, tensors, env=None, inputs=(), *, direction="forward"):
        straight.attach(program)
        return (program.straight.run(tensors[0], env, inputs, self.comms[direction], "",
                                     direction, self.comm_dtype),)


EXECUTORS = {"interpreted": CompiledExecutor, "straight": StraightExecutor}


def run_programs(programs: dict, inputs: dict[int, torch.Tensor], ndim: int,
                 env: dict | None = None, dtype=torch.float64,
                 how: str = "interpreted", device="cpu", inside=None,
                 index: dict | None = None) -> dict[int, torch.Tensor]:
    """Run every rank's program (``{rank: program}``) at once; ``inputs`` are the src
    pieces (ranks without one pass an empty tensor of ``ndim`` dims). A template
    program's numbers are evaluated at ``env`` by the executor itself. ``how``:
    ``"interpreted"`` (the executor's eager run) or ``"straight"`` (the program's
    straight-line function, what a compiled call runs, called here eagerly). ``device``:
    where the empty pieces are made; ``inside(rank)``: a context each rank's thread
    runs its program in (a dispatch mode is per thread); ``index``: a row program's
    route index vectors by rank."""
    world = _Rendezvous()
    outs, errors = {}, []

    def one(rank):
        try:
            ex = EXECUTORS[how](ThreadComm(world, rank))
            x = inputs.get(rank)
            if x is None:
                x = torch.empty((0,) * ndim, dtype=dtype, device=device)
            with inside(rank) if inside is not None else contextlib.nullcontext():
                (outs[rank],) = ex.run(programs[rank], (x,), env,
                                       (index or {}).get(rank, ()))
        except BaseException as err:  # reported below
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "\n".join(errors)
    return outs


def run_plan(p, inputs: dict[int, torch.Tensor], ndim: int,
             how: str = "interpreted") -> dict[int, torch.Tensor]:
    """Run plan ``p``'s lowered program on every rank of both grids (``how``: see
    :func:`run_programs`)."""
    ranks = sorted(set(p.src.grid.ranks) | set(p.dst.grid.ranks))
    return run_programs({r: lowering.lower(p, r) for r in ranks}, inputs, ndim, how=how)



