"""How fast the compiled backend moves data: ``Redistributor`` calls vs bare collectives.

One world of 8 gloo processes on 127.0.0.1 (spawned by ``mimo_fx.testing.run_world``)
runs every case of a small table, float32, twice: at a size where each rank's piece is
>= 1 MiB, and at ~16 KiB per rank. For each row every rank measures, and rank 0 reports
the max over ranks of the per-rank medians (an ``all_reduce(MAX)`` of floats):

- redistribute ms: ``bridge(x_local)`` for ``bridge = Redistributor(src, dst, sizes,
  torch.float32)``, eager, under ``torch.no_grad()``; median of ``--iters`` timed calls
  after a few warm-up calls, with ``torch.distributed.barrier()`` (untimed) before each
  call so the ranks start together. The bridge, bare and compiled calls are interleaved
  in one loop (one call of each per iteration, in rotating order), so a change in the
  machine's load during the run hits all three alike and their ratios stay fair.
- bare ms: the same functional collectives the bridge's forward program issues, without
  the bridge: for each op of ``bridge.sizing.fwd_program.ops`` a contiguous buffer of the packed
  size (the sum of its pieces' sizes and pads) is allocated once, and each timed
  iteration issues the same collective through the bridge's own comm (the ordered
  ``mimo_fx::*`` ops over ``torch.distributed``'s functional collectives, waited on),
  with the same group and splits. Timed like the bridge.
- ratio: redistribute / bare. Target for the >= 1 MiB rows: <= 1.10x.
- overhead µs: the eager call overhead, i.e. everything ``bridge(x)`` does besides the
  collectives (``Redistributor.__call__``, the autograd.Function, the executor's loop,
  packing, unpacking and assembling the dst piece). Measured directly rather than as a
  difference of two noisy gloo timings: that bridge's executor gets a comm that moves
  nothing (``common.NullComm``: each collective returns a new buffer of its output's
  size), and ``bridge(x)`` is timed alone: one rank at a time, while the
  other seven wait in a barrier, so the 2 cores are not shared (median of
  ``--overhead-iters`` calls). On the ~16 KiB rows it is the fixed per-call cost (target
  <= 50 µs); on the >= 1 MiB rows it also includes the cost of the packing and assembly
  copies, so it says how much of redistribute - bare is the bridge's own CPU work.
- notes: redistribute - bare in wall time (on the ~16 KiB rows an indirect estimate of
  the overhead, for a cross-check), and both calls' process CPU time per rank (median,
  max over ranks, gloo's threads included): with 8 ranks on 2 cores the wall time is
  roughly the CPU time of all ranks over the free cores, so extra CPU per rank in the
  bridge shows up about 4x in the wall time.
- compile s: wall time of the first call of ``torch.compile(lambda t: bridge(t),
  backend="aot_eager", fullgraph=True)`` after ``torch._dynamo.reset()`` (Dynamo tracing +
  AOT autograd; all eight ranks compile at once on two cores, so this is pessimistic).
- compiled ms: the compiled call's steady state, timed with (interleaved with) the
  eager call; the notes give compiled / eager, and check that the compiled result equals
  the eager one.

Gloo over loopback with 8 processes on a 2-core machine is noisy: the absolute times
are dominated by scheduling and socket copies and swing from run to run, so read the
ratios (bridge vs the same collectives on the same machine in the same run) rather
than the absolute numbers; the header and the last line print the load average, since
other processes on the machine make it worse. Each worker runs with ``OMP_NUM_THREADS=1``.

Run from the repository root::

    python bench/compiled_speed.py             # 10 timed + 3 warm-up calls per row
    python bench/compiled_speed.py --quick     # 5 timed + 2 warm-up calls
    python bench/compiled_speed.py --iters 30  # more timed calls
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from common import NullComm, bare, collectives, timed
from tabulate import tabulate

from mimo_fx import Grid, Layout
from mimo_fx.plan import plan
from mimo_fx.testing import run_world

WORLD = 8
ITERS, WARMUP, OVERHEAD_ITERS = 10, 3, 200
QUICK_ITERS, QUICK_WARMUP, QUICK_OVERHEAD_ITERS = 5, 2, 50
RATIO_TARGET = 1.10
OVERHEAD_TARGET_US = 50.0
BIG_BYTES = 1 << 20  # rows whose pieces are at least this big get the ratio target
MIB = float(1 << 20)


# -- the table -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    src: Layout
    dst: Layout
    big: dict[str, int]    # each rank's piece >= 1 MiB (float32)
    small: dict[str, int]  # ~16 KiB per rank


ENC = Grid(tp=2, dp=4)
LLM = Grid(tp=2, cp=2, dp=2)

CASES = (
    Case("fan-in TP2xDP4 -> TP2xCP2xDP2 zigzag", Layout(ENC, "(dp b) s h"),
         Layout(LLM, "(dp b) (cp s) h", zigzag=("cp",)),
         {"b": 8, "s": 256, "h": 512}, {"b": 8, "s": 16, "h": 128}),
    Case("equal TP2xDP4 -> TP4xDP2", Layout(ENC, "(dp b) s h"),
         Layout(Grid(tp=4, dp=2), "(dp b) s h"),
         {"b": 8, "s": 256, "h": 512}, {"b": 8, "s": 16, "h": 128}),
    Case("TP-sharded h -> replicated", Layout(ENC, "(dp b) s (tp h)"),
         Layout(ENC, "(dp b) s h"),
         {"b": 8, "s": 256, "h": 1024}, {"b": 8, "s": 16, "h": 256}),
    Case("partial tp -> replicated", Layout(ENC, "(dp b) s h", partial=("tp",)),
         Layout(ENC, "(dp b) s h"),
         {"b": 8, "s": 256, "h": 512}, {"b": 8, "s": 16, "h": 128}),
    Case("pipelined disjoint 0-3 -> 4-7 (tp s)", Layout(Grid(tp=2, dp=2), "(dp b) s h"),
         Layout(Grid(tp=2, dp=2, offset=4), "(dp b) (tp s) h"),
         {"b": 8, "s": 256, "h": 512}, {"b": 4, "s": 16, "h": 128}),
)


# -- measuring (on every rank) ---------------------------------------------------------------
def _alone(rank: int, world: int, fn: Callable[[], object], iters: int) -> float:
    """Median seconds of ``fn()`` on each rank in turn, the others waiting in a barrier
    (used only where ``fn`` issues no collective)."""
    result = 0.0
    for turn in range(world):
        if turn == rank:
            for _ in range(max(3, iters // 10)):
                fn()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            result = statistics.median(times)
        dist.barrier()
    return result


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _measure(rank: int, world: int, case: Case, sizes: dict[str, int], iters: int,
             warmup: int, overhead_iters: int) -> dict:
    import torch._dynamo as dynamo

    from mimo_fx.compiled import Redistributor

    bridge = Redistributor(case.src, case.dst, sizes, torch.float32)
    try:
        program = bridge.sizing.fwd_program
        gen = torch.Generator().manual_seed(rank)
        x = (torch.randn(bridge.sizing.fwd_program.src_shape, generator=gen)
             if bridge.sizing.fwd_program.src_shape is not None else None)
        src_bytes = 4 * math.prod(bridge.sizing.fwd_program.src_shape) if x is not None else 0
        with torch.no_grad():
            eager_y = bridge(x)
            dst_bytes = 4 * eager_y.numel() if eager_y is not None else 0
            dynamo.reset()
            compiled = torch.compile(lambda t: bridge(t), backend="aot_eager", fullgraph=True)
            dist.barrier()
            start = time.perf_counter()
            compiled_y = compiled(x)
            compile_s = time.perf_counter() - start
            same = torch.equal(compiled_y, eager_y)
            medians = timed({"eager": lambda: bridge(x),
                             "bare": bare(program, bridge.executor.comm),
                             "compiled": lambda: compiled(x)}, iters, warmup)
            (eager_s, eager_cpu), (bare_s, bare_cpu) = medians["eager"], medians["bare"]
            compiled_s = medians["compiled"][0]
            dynamo.reset()

            null = NullComm()  # both directions' comms: the forward issues through comms
            bridge.executor.comm = null
            bridge.executor.comms = {"forward": null, "backward": null}
            overhead_s = _alone(rank, world, lambda: bridge(x), overhead_iters)
        values = [eager_s, bare_s, compile_s, compiled_s, overhead_s, eager_cpu, bare_cpu,
                  src_bytes, dst_bytes, len(program.ops), 0.0 if same else 1.0]
        keys = ["eager_s", "bare_s", "compile_s", "compiled_s", "overhead_s", "eager_cpu",
                "bare_cpu", "src_bytes", "dst_bytes", "ops", "compiled_differs"]
        return dict(zip(keys, _max_over_ranks(values)))
    finally:
        bridge.destroy()


def _bench(rank: int, world: int, iters: int, warmup: int, overhead_iters: int) -> list | None:
    rows = []
    for case in CASES:
        for sizes in (case.big, case.small):
            start = time.perf_counter()
            row = _measure(rank, world, case, sizes, iters, warmup, overhead_iters)
            row.update(case=case.name, collectives=collectives(plan(case.src, case.dst, sizes, 4)))
            rows.append(row)
            if rank == 0:  # progress, on stderr so the report stays clean
                print(f"  [{len(rows)}/{2 * len(CASES)}] {case.name} "
                      f"{_mib(row['src_bytes'])} MiB: {time.perf_counter() - start:.1f} s",
                      file=sys.stderr, flush=True)
    return rows if rank == 0 else None


# -- printing --------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / MIB:.3f}" if n < BIG_BYTES / 8 else f"{n / MIB:.1f}"


def _verdict(row: dict) -> tuple[str, bool]:
    ratio = row["eager_s"] / row["bare_s"]
    if min(row["src_bytes"] or row["dst_bytes"], row["dst_bytes"] or row["src_bytes"]) \
            >= BIG_BYTES:
        ok = ratio <= RATIO_TARGET
        return f"ratio <= {RATIO_TARGET:.2f}x: {'met' if ok else 'MISSED'}", ok
    ok = row["overhead_s"] * 1e6 <= OVERHEAD_TARGET_US
    return f"overhead <= {OVERHEAD_TARGET_US:.0f} µs: {'met' if ok else 'MISSED'}", ok


def table(rows: list[dict]) -> list[list[object]]:
    out = []
    for r in rows:
        out.append([
            r["case"], f"{_mib(r['src_bytes'])} / {_mib(r['dst_bytes'])}", r["collectives"],
            f"{r['eager_s'] * 1e3:.3f}", f"{r['bare_s'] * 1e3:.3f}",
            f"{r['eager_s'] / r['bare_s']:.2f}x", _verdict(r)[0],
            f"{r['overhead_s'] * 1e6:.0f}", f"{r['compile_s']:.1f}",
            f"{r['compiled_s'] * 1e3:.3f}",
        ])
    return out


HEADERS = ["case", "MiB per rank (src / dst)", "collectives", "redistribute ms", "bare ms",
           "ratio", "target (<=1.10x for >=1 MiB)", "overhead µs", "compile s",
           "compiled ms"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_ITERS} timed + {QUICK_WARMUP} warm-up calls per row")
    parser.add_argument("--iters", type=int, default=None, metavar="N",
                        help=f"timed calls per row (default {ITERS}, --quick {QUICK_ITERS})")
    parser.add_argument("--overhead-iters", type=int, default=None, metavar="K",
                        help=f"stubbed calls per rank for the overhead (default "
                             f"{OVERHEAD_ITERS}, --quick {QUICK_OVERHEAD_ITERS})")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="kill the world after this many seconds (default 600)")
    args = parser.parse_args(argv)
    iters = args.iters or (QUICK_ITERS if args.quick else ITERS)
    warmup = QUICK_WARMUP if args.quick else WARMUP
    overhead_iters = args.overhead_iters or (QUICK_OVERHEAD_ITERS if args.quick
                                             else OVERHEAD_ITERS)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"compiled backend speed: {WORLD} gloo ranks on 127.0.0.1, float32, torch "
          f"{torch.__version__}; median of {iters} timed calls ({warmup} warm-up), barrier "
          f"before each; max over ranks of per-rank medians")
    print(f"machine: {os.cpu_count()} CPUs, load average {load}; overhead: median of "
          f"{overhead_iters} calls with collectives stubbed, one rank at a time\n")
    start = time.perf_counter()
    rows = run_world(WORLD, _bench, iters, warmup, overhead_iters, timeout=args.timeout)[0]
    elapsed = time.perf_counter() - start
    print(tabulate(table(rows), headers=HEADERS, disable_numparse=True,
                   colalign=("left", "right", "left") + ("right",) * 3 + ("left",)
                   + ("right",) * 3))
    print()
    print("Notes")
    for r in rows:
        delta = (r["eager_s"] - r["bare_s"]) * 1e6
        differs = " COMPILED RESULT DIFFERS FROM EAGER" if r["compiled_differs"] else ""
        print(f" - {r['case']} ({_mib(r['src_bytes'])} MiB): redistribute - bare = "
              f"{delta:.0f} µs wall; CPU per call and rank {r['eager_cpu'] * 1e3:.2f} vs "
              f"{r['bare_cpu'] * 1e3:.2f} ms; compiled / eager = "
              f"{r['compiled_s'] / r['eager_s']:.2f}x; {int(r['ops'])} collective call(s) "
              f"per rank{differs}")
    met = [f"{r['case']} ({_mib(r['src_bytes'])} MiB)" for r in rows if _verdict(r)[1]]
    missed = [f"{r['case']} ({_mib(r['src_bytes'])} MiB): {_verdict(r)[0].split(':')[0]}"
              for r in rows if not _verdict(r)[1]]
    print(f"\nSummary: {len(met)}/{len(rows)} rows meet their target (ratio <= "
          f"{RATIO_TARGET:.2f}x for >= 1 MiB rows, overhead <= {OVERHEAD_TARGET_US:.0f} µs "
          f"for ~16 KiB rows); missed: {'; '.join(missed) if missed else 'none'}.")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"World run took {elapsed:.0f} s; load average after it {load}.")


if __name__ == "__main__":
    main()
