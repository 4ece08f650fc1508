"""Every rank's lowered program run at once in threads, collectives met in-process.

The compiled backend's programs, without processes: each rank runs its program in a
thread and the collectives meet in a rendezvous that computes them with plain tensor
math. A mismatch of collectives between ranks (kinds, split sizes, a rank that never
comes) fails with the ranks named.
"""

from __future__ import annotations

import threading

import torch

from mimo_fx.compiled import lowering
from mimo_fx.compiled.executor import CompiledExecutor

__all__ = ["ThreadComm", "run_programs", "run_plan"]


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


class ThreadComm:
    """The comm of one rank (a thread) of a :class:`_Rendezvous`."""

    def __init__(self, world: _Rendezvous, rank: int) -> None:
        self.world, self.rank = world, rank

    def _post(self, kind, ranks, flat, out_splits=(), in_splits=()):
        post = (kind, flat.clone(), tuple(out_splits), tuple(in_splits))
        return self.world.collective(self.rank, ranks, post)

    def all_gather(self, flat, ranks):
        return self._post("all_gather", ranks, flat)

    def reduce_scatter(self, flat, ranks):
        return self._post("reduce_scatter", ranks, flat)

    def all_reduce(self, flat, ranks):
        return self._post("all_reduce", ranks, flat)

    def all_to_all(self, flat, out_splits, in_splits, ranks):
        return self._post("all_to_all", ranks, flat, out_splits, in_splits)


def _compute(members, posts) -> dict[int, torch.Tensor]:
    kinds = {posts[r][0] for r in members}
    flats = [posts[r][1] for r in members]
    assert len(kinds) == 1, f"members {members} issued different collectives {kinds}"
    kind = kinds.pop()
    n = len(members)
    if kind == "all_gather":
        assert len({f.numel() for f in flats}) == 1, "all_gather inputs differ in size"
        return {r: torch.cat(flats) for r in members}
    if kind == "all_reduce":
        total = torch.stack(flats).sum(0)
        return {r: total.clone() for r in members}
    if kind == "reduce_scatter":
        total = torch.stack(flats).sum(0)
        return {r: c.clone() for r, c in zip(members, total.chunk(n))}
    assert kind == "all_to_all"
    out = {}
    for j, r in enumerate(members):
        pieces = []
        for i, s in enumerate(members):
            splits = posts[s][3]
            assert posts[r][2][i] == splits[j], "all_to_all split sizes disagree"
            start = sum(splits[:j])
            pieces.append(flats[i][start:start + splits[j]])
        out[r] = torch.cat(pieces)
    return out


def run_programs(programs: dict, inputs: dict[int, torch.Tensor], ndim: int,
                 env: dict | None = None, dtype=torch.float64) -> dict[int, torch.Tensor]:
    """Run every rank's program (``{rank: program}``) at once; ``inputs`` are the src
    pieces (ranks without one pass an empty tensor of ``ndim`` dims). A template
    program's numbers are evaluated at ``env`` by the executor itself."""
    world = _Rendezvous()
    outs, errors = {}, []

    def one(rank):
        try:
            ex = CompiledExecutor(ThreadComm(world, rank))
            x = inputs.get(rank)
            if x is None:
                x = torch.empty((0,) * ndim, dtype=dtype)
            (outs[rank],) = ex.run(programs[rank], (x,), env)
        except BaseException as err:  # reported below
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in programs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, "\n".join(errors)
    return outs


def run_plan(p, inputs: dict[int, torch.Tensor], ndim: int) -> dict[int, torch.Tensor]:
    """Run plan ``p``'s lowered program on every rank of both grids."""
    ranks = sorted(set(p.src.grid.ranks) | set(p.dst.grid.ranks))
    return run_programs({r: lowering.lower(p, r) for r in ranks}, inputs, ndim)



