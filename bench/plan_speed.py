"""How fast the planner is: whole-world ``plan()`` to 4,096 ranks and one rank's part
(``plan_for_rank``) to 65,536 ranks.

The cases are the bridges of ``bench/plan_quality.py``'s table (colocated fan-in,
fan-out, equal DP to zigzag CP, fan-in to zigzag CP, a partial TP input, two pipelined
bridges onto the other half of the ranks) and a dense all-to-all, ``(dp b) s h`` ->
``b (dp s) h`` on one DP(N) grid, where every rank sends to every rank. Sizes: s = h =
4096, bf16 (2 bytes), b = the least common multiple of the src and dst dp sizes; the
dense case has b = N and s = lcm(4096, N), so each rank sends and receives N - 1 pieces.

**Whole world** (``plan(src, dst, sizes, dtype)``, every rank's steps) at 8, 64, 512 and
4,096 ranks (the dense case to 2,048: 4,192,256 transfers):

- plan ms / cpu ms: cold planning time (wall clock, and process CPU time, steadier on a
  shared machine), best of 3. Before every timed call the plan caches are cleared
  (``mimo_fx.plan.clear_caches()``) and the grids and layouts are built afresh (untimed).
- growth: the CPU time's exponent against the previous world size (time ~ N^e; 1.0 is
  linear in the ranks; the dense case's transfers grow as N^2, so 2.0 is linear in them).
- cost ms: the first evaluation of ``plan.max_recv`` and ``plan.max_lower_bound``.
- cached µs: a repeat call with equal arguments (a cache hit).
- steps, a2a transfers, max recv / lower bound (bytes per rank).

**Per rank** (``plan_for_rank(..., rank=r)``: the steps with only what rank r takes part
in) at 8, 512, 4,096 and 65,536 ranks, for rank 0 and a middle rank (N/2 + 1), cold
(caches cleared, fresh layouts), best of 3: wall and CPU ms, the exponent of the CPU
time against the previous world size, and the rank's own transfers and groups. The
verdict asks for at most 1 s of CPU per rank at 65,536 ranks.

The header prints a calibration loop's time so absolute numbers can be scaled to another
machine.

Run from the repository root::

    python bench/plan_speed.py           # both modes, all sizes (about 3 minutes)
    python bench/plan_speed.py --quick   # whole world at 8 and 64, per rank at 8 and 512
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass

from common import collectives
from plan_quality import CASES as QUALITY_CASES
from plan_quality import Case
from tabulate import tabulate

from mimo_fx import Grid, Layout
from mimo_fx.plan import Exchange, Plan, RankPlan, clear_caches, plan, plan_for_rank

WORLDS = (8, 64, 512, 4096)
DENSE_WORLDS = (8, 64, 512, 2048)
RANK_WORLDS = (8, 512, 4096, 65536)
QUICK = {"worlds": (8, 64), "dense": (8, 64), "ranks": (8, 512)}
S = H = 4096
ITEMSIZE = 2  # bf16; plan() takes anything with an itemsize, or the itemsize itself
REPEATS = 3
LIMIT_S = 1.0  # the per-rank verdict: one rank's part at 65,536 ranks within this


def dense(n: int) -> Case:
    """Every rank sends to every rank: a batch shard becomes a sequence shard."""
    grid = Grid(dp=n)
    return Case(Layout(grid, "(dp b) s h"), Layout(grid, "b (dp s) h"),
                {"b": n, "s": math.lcm(S, n), "h": H})


CASES: tuple[tuple[str, Callable[[int], Case]], ...] = (
    *QUALITY_CASES, ("dense all-to-all DP(N): (dp b) s h -> b (dp s) h", dense))


@dataclass
class Timing:
    world: int
    wall: float
    cpu: float
    result: Plan | RankPlan
    rank: int | None = None
    cost_s: float | None = None
    cached_s: float | None = None


def _cold(call: Callable[[Case], Plan | RankPlan], build: Callable[[int], Case], n: int,
          repeats: int) -> tuple[float, float, Plan | RankPlan]:
    """Best of ``repeats`` cold calls (fresh layouts, caches cleared): wall and cpu s."""
    wall = cpu = math.inf
    result = None
    for _ in range(repeats):
        case = build(n)
        result = None  # free the previous plan before the next is made
        clear_caches()
        start, start_cpu = time.perf_counter(), time.process_time()
        result = call(case)
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    assert result is not None
    return wall, cpu, result


def whole(build: Callable[[int], Case], n: int, repeats: int) -> Timing:
    wall, cpu, result = _cold(lambda c: plan(c.src, c.dst, c.sizes, ITEMSIZE), build, n,
                              repeats)
    assert isinstance(result, Plan)
    start = time.perf_counter()
    _ = result.max_recv, result.max_lower_bound
    cost = time.perf_counter() - start
    case = build(n)
    plan(case.src, case.dst, case.sizes, ITEMSIZE)
    timer = timeit.Timer(lambda: plan(case.src, case.dst, case.sizes, ITEMSIZE))
    cached = min(timer.repeat(repeat=5, number=1000)) / 1000
    return Timing(n, wall, cpu, result, None, cost, cached)


def one_rank(build: Callable[[int], Case], n: int, rank: int, repeats: int) -> Timing:
    def call(c: Case) -> RankPlan:
        return plan_for_rank(c.src, c.dst, c.sizes, ITEMSIZE, rank=rank)

    wall, cpu, result = _cold(call, build, n, repeats)
    return Timing(n, wall, cpu, result, rank)


# -- printing ------------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _transfers(p: Plan | RankPlan) -> int:
    return sum(len(s.transfers) for s in p.steps if isinstance(s, Exchange))


def _exponent(prev: Timing | None, t: Timing) -> str:
    if prev is None or prev.cpu <= 0 or t.cpu <= 0:
        return "-"
    return f"N^{math.log(t.cpu / prev.cpu, t.world / prev.world):.2f}"


def whole_table(rows: list[Timing]) -> str:
    out = []
    for prev, t in zip([None, *rows], rows):
        p = t.result
        assert isinstance(p, Plan) and t.cost_s is not None and t.cached_s is not None
        ratio = f"{p.max_recv / p.max_lower_bound:.2f}x" if p.max_lower_bound else "-"
        out.append([t.world, f"{t.wall * 1e3:.2f}", f"{t.cpu * 1e3:.2f}", _exponent(prev, t),
                    f"{t.cost_s * 1e3:.2f}", f"{t.cached_s * 1e6:.2f}", collectives(p),
                    _transfers(p), _fmt_bytes(p.max_recv),
                    f"{_fmt_bytes(p.max_lower_bound)} ({ratio})"])
    return tabulate(out, disable_numparse=True, colalign=("right",) * 6 + ("left",)
                    + ("right",) * 3,
                    headers=["world", "plan ms (cold)", "cpu ms", "growth", "cost ms",
                             "cached µs", "steps", "a2a transfers", "max recv",
                             "lower bound (recv/LB)"])


def rank_table(rows: list[Timing]) -> str:
    out = []
    by = {(t.world, t.rank): t for t in rows}
    worlds = sorted({t.world for t in rows})
    for t in rows:
        p = t.result
        assert isinstance(p, RankPlan)
        before = [w for w in worlds if w < t.world]
        prev = by.get((before[-1], 0 if t.rank == 0 else before[-1] // 2 + 1)) if before else None
        groups = sum(len(s.rank_groups) for s in p.steps if not isinstance(s, Exchange))
        out.append([t.world, t.rank, f"{t.wall * 1e3:.2f}", f"{t.cpu * 1e3:.2f}",
                    _exponent(prev, t), _transfers(p), groups,
                    " + ".join(s.kind.value for s in p.steps) or "local"])
    return tabulate(out, disable_numparse=True, colalign=("right",) * 7 + ("left",),
                    headers=["world", "rank", "plan ms (cold)", "cpu ms", "growth",
                             "its transfers", "its groups", "steps"])


def verdict(name: str, rows: list[Timing]) -> str:
    largest = max(t.world for t in rows)
    last = [t for t in rows if t.world == largest]
    worst = max(last, key=lambda t: t.cpu)
    if largest != RANK_WORLDS[-1]:
        return f"{name}: {largest} ranks at most (--quick); worst {worst.cpu * 1e3:.0f} ms cpu"
    ok = worst.cpu <= LIMIT_S
    return (f"{name}: one rank's part at {largest} ranks takes {worst.cpu * 1e3:.0f} ms cpu "
            f"at most (rank {worst.rank}; {worst.wall * 1e3:.0f} ms wall) "
            f"{'<=' if ok else '>'} 1 s -> {'OK' if ok else 'TOO SLOW'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small sizes only")
    parser.add_argument("--repeat", type=int, default=REPEATS, metavar="K",
                        help=f"cold timings: best of K (default {REPEATS})")
    args = parser.parse_args(argv)
    worlds = QUICK["worlds"] if args.quick else WORLDS
    dense_worlds = QUICK["dense"] if args.quick else DENSE_WORLDS
    rank_worlds = QUICK["ranks"] if args.quick else RANK_WORLDS
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    calib = min(timeit.repeat("sum(range(10000))", number=100, repeat=5)) / 100
    print(f"planning speed; s=h={S}, itemsize={ITEMSIZE}, b=lcm(dp sizes); cold = best of "
          f"{args.repeat} with the plan caches cleared and fresh layouts")
    print(f"machine: {os.cpu_count()} CPUs, load average {load}; calibration "
          f"sum(range(10000)) = {calib * 1e6:.0f} µs (about 100 µs on a recent desktop)\n")
    for _, build in CASES:  # warm-up: import-time and first-call costs, untimed
        whole(build, 64, 1)
    verdicts = []
    print("== whole world: plan(), every rank's steps ==\n")
    for name, build in CASES:
        sizes = dense_worlds if build is dense else worlds
        print(name)
        print(whole_table([whole(build, n, args.repeat) for n in sizes]), end="\n\n")
        print(f"  ({name}: whole world done)", file=sys.stderr, flush=True)
    print("== per rank: plan_for_rank(), the steps with only what the rank takes part in ==\n")
    for name, build in CASES:
        rows = [one_rank(build, n, rank, args.repeat)
                for n in rank_worlds for rank in (0, n // 2 + 1)]
        print(name)
        print(rank_table(rows), end="\n\n")
        verdicts.append(verdict(name, rows))
        print(f"  ({name}: per rank done)", file=sys.stderr, flush=True)
    print("Verdicts (one rank's part, cpu time)")
    for line in verdicts:
        print(" -", line)
    return 0 if args.quick or all(line.endswith("OK") for line in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
