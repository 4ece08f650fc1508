"""How fast the planner is: ``mimo_fx.plan.plan(src, dst, sizes, dtype)`` at 8 to 4096 ranks.

For each common bridge case (colocated fan-in with zigzag CP, fan-out, TP2xDP <-> TP4xDP,
a partial TP input made TP-sharded, pipelined disjoint grids) and each world size it
prints:

- plan ms: cold planning time (wall clock), best of 3. Before every timed call the plan
  cache is cleared (``_plan.cache_clear()`` of the module ``mimo_fx.plan``; the package
  attribute ``mimo_fx.plan`` is the function) and the grids and layouts are built afresh
  (untimed), so their cached properties are recomputed too.
- cpu ms: the same calls' process CPU time, best of 3; steadier than the wall clock
  when other processes share the machine.
- growth: time at N over time at N/8, wall / cpu. ~8x per 8x ranks is linear, ~64x
  quadratic; the verdict line turns it into an exponent (time ~ N^e, from cpu time).
- cost ms: the first evaluation of ``plan.max_recv`` and ``plan.max_lower_bound``
  (lazy, not part of ``plan()``, but paid by whoever prints or checks the cost).
- cached µs: a repeat call of ``plan()`` with equal arguments (a cache hit).
- steps: the collective kinds in issue order, with the number of groups of each.
- a2a pieces: transfers in all-to-all steps (gathers and reductions carry none).
- max recv / lower bound: ``plan.max_recv`` and ``plan.max_lower_bound``, bytes per rank.

The verdict (planning at 4096 ranks under 1 s) is judged on cpu time, the planner's own
cost; the wall time is printed next to it. The header prints a calibration loop's time so
absolute numbers can be scaled to another machine.

Sizes: s = h = 4096, bf16 (2 bytes), b = the least common multiple of the src and dst
dp sizes (one sample per rank of the wider data-parallel side). The pipelined case needs
N >= 16 (its dst grid has dp = N/16) and is shown as n/a at 8 ranks.

Run from the repository root::

    python bench/plan_speed.py           # 8, 64, 512 and 4096 ranks
    python bench/plan_speed.py --quick   # 8 and 64 ranks only
"""

from __future__ import annotations

import argparse
import math
import os
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass

from tabulate import tabulate

from mimo_fx import Grid, Layout
from mimo_fx.plan import Exchange, Plan, _plan, plan

WORLDS = (8, 64, 512, 4096)
QUICK_WORLDS = (8, 64)
S = H = 4096
ITEMSIZE = 2  # bf16; plan() takes anything with an itemsize, or the itemsize itself
COLD_REPEATS = 3
LIMIT_S = 1.0  # the verdict: planning at 4096 ranks must stay under this

Case = tuple[Layout, Layout, dict[str, int]]


def _sizes(*grids: Grid) -> dict[str, int]:
    dps = [dict(zip(g.names, g.sizes))["dp"] for g in grids]
    return {"b": math.lcm(*dps), "s": S, "h": H}


def fan_in(n: int) -> Case:
    src = Grid(tp=2, dp=n // 2)
    dst = Grid(tp=2, cp=2, dp=n // 4)
    return (Layout(src, "(dp b) s h"), Layout(dst, "(dp b) (cp s) h", zigzag=("cp",)),
            _sizes(src, dst))


def fan_out(n: int) -> Case:
    src, dst = Grid(tp=4, dp=n // 4), Grid(tp=2, dp=n // 2)
    return Layout(src, "(dp b) s h"), Layout(dst, "(dp b) s h"), _sizes(src, dst)


def tp2_to_tp4(n: int) -> Case:
    src, dst = Grid(tp=2, dp=n // 2), Grid(tp=4, dp=n // 4)
    return Layout(src, "(dp b) s h"), Layout(dst, "(dp b) s h"), _sizes(src, dst)


def partial_tp(n: int) -> Case:
    grid = Grid(tp=2, dp=n // 2)
    return (Layout(grid, "(dp b) s h", partial=("tp",)), Layout(grid, "(dp b) s (tp h)"),
            _sizes(grid))


def pipelined(n: int) -> Case | None:
    if n < 16:
        return None
    src = Grid(tp=2, pp=2, dp=n // 8)
    dst = Grid(tp=4, pp=2, dp=n // 16, offset=n // 2)
    return (Layout(src, "(dp b) s h", at={"pp": -1}), Layout(dst, "(dp b) s h", at={"pp": 0}),
            _sizes(src, dst))


CASES: tuple[tuple[str, Callable[[int], Case | None]], ...] = (
    ("colocated fan-in: TP2xDP(N/2) -> TP2xCP2xDP(N/4) zigzag cp", fan_in),
    ("colocated fan-out: TP4xDP(N/4) -> TP2xDP(N/2)", fan_out),
    ("colocated equal (as briefed): TP2xDP(N/2) -> TP4xDP(N/4)", tp2_to_tp4),
    ("TP-partial -> TP-sharded h: TP2xDP(N/2)", partial_tp),
    ("pipelined: TP2xPP2xDP(N/8) pp=-1 -> TP4xPP2xDP(N/16)+N/2 pp=0", pipelined),
)


@dataclass
class Row:
    world: int
    plan_s: float | None = None
    cpu_s: float | None = None
    cost_s: float | None = None
    cached_s: float | None = None
    result: Plan | None = None


def _cold(
    build: Callable[[int], Case | None], n: int, repeats: int
) -> tuple[float, float, float, Plan]:
    """Best of ``repeats`` cold plans (fresh layouts, empty cache): wall and cpu seconds;
    then the wall time of the first cost evaluation."""
    wall = cpu = math.inf
    result = None
    for _ in range(repeats):
        src, dst, sizes = build(n)
        _plan.cache_clear()
        start, start_cpu = time.perf_counter(), time.process_time()
        result = plan(src, dst, sizes, ITEMSIZE)
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    start = time.perf_counter()
    _ = result.max_recv, result.max_lower_bound
    return wall, cpu, time.perf_counter() - start, result


def _cached(src: Layout, dst: Layout, sizes: dict[str, int]) -> float:
    """Seconds per cache-hit call of ``plan()`` with the same argument objects."""
    plan(src, dst, sizes, ITEMSIZE)
    timer = timeit.Timer(lambda: plan(src, dst, sizes, ITEMSIZE))
    number = 2000
    return min(timer.repeat(repeat=5, number=number)) / number


def measure(build: Callable[[int], Case | None], n: int, repeats: int) -> Row:
    case = build(n)
    if case is None:
        return Row(n)
    plan_s, cpu_s, cost_s, result = _cold(build, n, repeats)
    return Row(n, plan_s, cpu_s, cost_s, _cached(*case), result)


# -- printing ------------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _steps(p: Plan) -> str:
    if not p.steps:
        return "local"
    return " + ".join(f"{kind.value}[{groups}g]" if groups > 1 else kind.value
                      for kind, groups in p.collectives)


def _pieces(p: Plan) -> int:
    return sum(len(s.transfers) for s in p.steps if isinstance(s, Exchange))


def table_rows(rows: list[Row]) -> list[list[object]]:
    out = []
    by_world = {r.world: r for r in rows}
    for r in rows:
        if r.result is None:
            out.append([r.world, "n/a", "", "", "", "", "n/a (grid needs N >= 16)", "", "",
                        ""])
            continue
        prev = by_world.get(r.world // 8)
        growth = "-"
        if prev is not None and prev.plan_s and prev.cpu_s:
            growth = f"{r.plan_s / prev.plan_s:.1f}x / {r.cpu_s / prev.cpu_s:.1f}x"
        p = r.result
        ratio = f"{p.max_recv / p.max_lower_bound:.2f}x" if p.max_lower_bound else "-"
        out.append([
            r.world, f"{r.plan_s * 1e3:.2f}", f"{r.cpu_s * 1e3:.2f}", growth,
            f"{r.cost_s * 1e3:.2f}", f"{r.cached_s * 1e6:.2f}", _steps(p), _pieces(p),
            _fmt_bytes(p.max_recv),
            f"{_fmt_bytes(p.max_lower_bound)} ({ratio})",
        ])
    return out


HEADERS = ["world", "plan ms (cold)", "cpu ms", "growth vs N/8", "cost ms", "cached µs",
           "steps", "a2a pieces", "max recv", "lower bound (recv/LB)"]


def verdict(name: str, rows: list[Row]) -> str:
    timed = [r for r in rows if r.plan_s is not None]
    pairs = [(a, b) for a in timed for b in timed if b.world == 8 * a.world]
    exps = [math.log(b.cpu_s / a.cpu_s, 8) for a, b in pairs if a.cpu_s and b.cpu_s]
    growth = (f"growth ~N^{exps[-1]:.2f} over the last 8x ({timed[-2].world}->"
              f"{timed[-1].world})" if exps else "growth: too few sizes")
    last = timed[-1] if timed else None
    if last is None or last.world != 4096:
        return f"{name}: 4096 ranks not run (--quick); {growth}"
    ok = last.cpu_s < LIMIT_S
    return (f"{name}: planning at 4096 ranks {last.cpu_s * 1e3:.0f} ms cpu "
            f"({last.plan_s * 1e3:.0f} ms wall) {'<' if ok else '>='} 1 s -> "
            f"{'OK' if ok else 'TOO SLOW'}; {growth}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only 8 and 64 ranks")
    parser.add_argument("--repeat", type=int, default=COLD_REPEATS, metavar="K",
                        help=f"cold timings: best of K (default {COLD_REPEATS})")
    args = parser.parse_args(argv)
    worlds = QUICK_WORLDS if args.quick else WORLDS
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    calib = min(timeit.repeat("sum(range(10000))", number=100, repeat=5)) / 100
    print(f"plan() speed; s=h={S}, itemsize={ITEMSIZE}, b=lcm(dp sizes); cold = best of "
          f"{args.repeat} with the plan cache cleared and fresh layouts")
    print(f"machine: {os.cpu_count()} CPUs, load average {load}; calibration "
          f"sum(range(10000)) = {calib * 1e6:.0f} µs (about 100 µs on a recent desktop)\n")
    for _, build in CASES:  # warm-up: import-time and first-call costs, untimed
        measure(build, 64, 1)
    verdicts = []
    for name, build in CASES:
        rows = [measure(build, n, args.repeat) for n in worlds]
        print(name)
        print(tabulate(table_rows(rows), headers=HEADERS, disable_numparse=True,
                       colalign=("right",) * 6 + ("left", "right", "right", "right")))
        print()
        verdicts.append(verdict(name, rows))
    print("Verdicts")
    for line in verdicts:
        print(" -", line)


if __name__ == "__main__":
    main()
