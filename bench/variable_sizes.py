"""Sizes that change every step: what a new size costs, what learning it costs, and a
compiled training loop whose sequence length changes every step against the same loop
at a fixed length.

1. **A new size, per rank** (one process, no communication): for the bridges of
   ``plan_quality.py``'s table at 8 to 4,096 ranks, with ``b`` and ``s`` free (``h``
   fixed), the cost of serving a size the bridge has not seen -- evaluating the rank's
   template programs at it (``lowering.at``, forward and adjoint) -- against planning
   and lowering that rank's part again (``plan_for_rank`` + ``lower``) and planning the
   whole world. Target: at most 1 ms per rank at 4,096 ranks. CPU time, cold (the first
   evaluation at that size), best of 3; what the bridge prepares once (its programs and
   their evaluators, ``lowering.evaluator``) is not counted.
2. **The size gather** (8 gloo processes, 2 cores): a colocated fan-in to zigzag CP
   (TP2xDP4 -> TP2xCP2xDP2) called eagerly by a bridge built with every size (fixed),
   with ``b``, ``s`` free and given in every call (the same sizes: gathered at the
   first call only, then the data alone; target: at most 1.2x the fixed bridge) and
   with them learned (one all-gather of int64 size records first), at 16 KiB and 1 MiB of
   src per rank; beside them the size gather alone and the bare data transfer. Median wall
   time per call, interleaved.
3. **A compiled training loop** (8 gloo processes): ``tanh(x @ w1)`` on the encoder
   layout, the bridge, ``(y @ w2)^2`` summed, ``loss.backward()``, compiled with
   ``fullgraph=True``; the sequence length cycles through 7 lengths around ``S`` (mean
   ``S``) every step, sizes learned, against the same loop at ``S`` every step. After
   warm-up, the median step time (slowest rank) of each and their ratio (target <= 1.10),
   and the number of Dynamo graphs each compiled.

    python bench/variable_sizes.py            # all three (about 4 minutes on 2 cores)
    python bench/variable_sizes.py --quick    # smaller worlds and fewer steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import timed  # noqa: E402
from plan_quality import CASES as QUALITY_CASES  # noqa: E402

from mimo_fx import Grid, Layout  # noqa: E402
from mimo_fx.compiled import lowering  # noqa: E402
from mimo_fx.plan import backward_plan, clear_caches, plan, plan_for_rank  # noqa: E402
from mimo_fx.templates import Template  # noqa: E402

WORLDS, QUICK_WORLDS = (8, 64, 512, 4096), (8, 64)
TARGET_MS = 1.0
ENC = Grid(tp=2, dp=4)
LLM = Grid(tp=2, cp=2, dp=2)


# -- 1. a new size, per rank ------------------------------------------------------------
def _cpu(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def _new_size_record(name: str, build, n: int) -> list:
    case = build(n)
    src, dst, sizes = case.src, case.dst, dict(case.sizes)
    sizes["s"] = 64  # a small template size: its plans are the same shape at any s
    t = Template.build(src, dst, sizes, 2, (), ("b", "s"))
    if t is None:
        return [name, n, "no template", "", "", "", ""]
    rank = src.holders[len(src.holders) // 2]
    # what a bridge prepares once: the programs and their evaluators
    fwd = lowering.evaluator(lowering.lower(t.fwd, rank, t.fwd_sym))
    bwd = lowering.evaluator(lowering.lower(t.bwd, rank, t.bwd_sym))
    k = iter(range(1, 1000))
    new = dict(case.sizes)  # s = 4096: a size the template has not run

    def evaluate():  # a new size each repeat: nothing cached
        env = t.env({**new, "s": new["s"] + t.granules["s"] * next(k)})
        fwd(env)
        bwd(env)

    def replan():
        clear_caches()
        for p in (plan_for_rank(src, dst, new, 2, rank=rank),
                  backward_plan(src, dst, new, 2).for_rank(rank)):
            lowering.lower(p, rank)

    def whole():
        clear_caches()
        plan(src, dst, new, 2)
        backward_plan(src, dst, new, 2)

    at_ms, replan_ms = _cpu(evaluate) * 1e3, _cpu(replan) * 1e3
    whole_ms = _cpu(whole, 1) * 1e3 if n <= 4096 else float("nan")
    ok = "OK" if at_ms <= TARGET_MS else "MISSED"
    return [name, n, t.describe(), f"{at_ms:.3f}", f"{replan_ms:.1f}", f"{whole_ms:.1f}",
            f"{replan_ms / at_ms:.0f}x", ok]


def new_size_table(worlds) -> str:
    rows = []
    for name, build in QUALITY_CASES:
        for n in worlds:
            if "pipelined" in name and n < 16:
                continue
            rows.append(_new_size_record(name.split(" TP")[0], build, n))
            print(f"  new size: {rows[-1][0]} at {n} ranks", file=sys.stderr, flush=True)
    return tabulate(rows, headers=["bridge", "ranks", "template (b, s free)",
                                   "new size ms (at)", "re-plan rank ms",
                                   "whole-world plan ms", "re-plan / at",
                                   f"<= {TARGET_MS:g} ms"], disable_numparse=True)


# -- 2. the size gather, 3. the compiled loop (8 gloo processes) ----------------------
def _gather_size_records(rank: int, iters: int) -> list:
    from common import bare

    from mimo_fx.compiled import Redistributor

    src, dst = Layout(ENC, "(dp b) s h"), Layout(LLM, "(dp b) (cp s) h", zigzag="cp")
    rows = []
    for label, s, h in (("16 KiB", 64, 32), ("1 MiB", 1024, 128)):
        bridge = Redistributor(src, dst, {"h": h})   # sizes given every call
        learning = Redistributor(src, dst, {"h": h})  # sizes learned every call
        fixed = Redistributor(src, dst, {"b": 8, "s": s, "h": h})
        x = torch.randn(2, s, h)  # b=8 over dp 4: 2 samples per rank
        fwd = bridge.sizing.programs_at((("b", 8), ("h", h), ("s", s)))[0]
        times = timed({
            "fixed": lambda x=x, b=fixed: b(x),
            "given": lambda x=x, s=s, b=bridge: b(x, b=8, s=s),
            "learned": lambda x=x, b=learning: b(x),
            "gather": lambda x=x, b=learning, h=h: b.prepared.gather._learn(x, {"h": h}, {}),
            "bare": bare(fwd, bridge.executor.comm),
        }, iters, 5)
        rows.append((label, {k: v[0] for k, v in times.items()}))
        for b in (bridge, learning, fixed):
            b.destroy()
    return rows


def _loop_times(rank: int, backend: str, steps: int, warm: int, S: int) -> dict:
    import torch._dynamo as dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from mimo_fx.compiled import Redistributor

    h = 128
    src, dst = Layout(ENC, "(dp b) s h"), Layout(LLM, "(dp b) (cp s) h", zigzag="cp")
    gen = torch.Generator().manual_seed(rank)
    w1, w2 = (torch.randn(h, h, generator=gen) / h ** 0.5 for _ in range(2))
    w1.requires_grad_()
    w2.requires_grad_()
    out = {}
    for mode in ("fixed", "variable"):
        bridge = Redistributor(src, dst, {"h": h})
        dynamo.reset()
        counters.clear()

        def step(x, bridge=bridge):
            y = bridge(torch.tanh(x @ w1))
            return ((y @ w2) ** 2).mean()

        fn = torch.compile(step, backend=backend, fullgraph=True)
        lengths = [S] if mode == "fixed" else [S + 16 * (k - 3) for k in range(7)]
        times = []
        for i in range(warm + steps):
            x = torch.randn(2, lengths[i % len(lengths)], h, generator=gen)
            dist.barrier()
            start = time.perf_counter()
            fn(x).backward()
            if i >= warm:
                times.append(time.perf_counter() - start)
        out[mode] = (statistics.median(times), int(counters["stats"]["unique_graphs"]))
        bridge.destroy()
    return out


def _world(rank: int, world: int, quick: bool) -> dict:
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    out = {"gather": _gather_size_records(rank, 20 if quick else 60)}
    steps, warm = (10, 14) if quick else (40, 21)
    for backend in ("aot_eager",) if quick else ("aot_eager", "inductor"):
        out[backend] = _loop_times(rank, backend, steps, warm, 512)
    return out


def gloo_tables(quick: bool) -> str:
    from mimo_fx.testing import run_world

    results = run_world(8, _world, quick, timeout=1800)
    rows = []
    for i, (label, _) in enumerate(results[0]["gather"]):
        t = {k: max(r["gather"][i][1][k] for r in results) * 1e6
             for k in ("fixed", "given", "learned", "gather", "bare")}
        rows.append([label, f"{t['bare']:.0f}", f"{t['fixed']:.0f}", f"{t['given']:.0f}",
                     f"{t['learned']:.0f}", f"{t['gather']:.0f}",
                     f"{t['given'] / t['fixed']:.2f}", f"{t['learned'] / t['given']:.2f}",
                     "OK" if t["given"] / t["fixed"] <= 1.2 else "MISSED"])
    out = ["size gather, 8 gloo processes, eager, median µs per call (slowest rank); "
           "sizes given: the same sizes every call (gathered at the first only)",
           tabulate(rows, headers=["src per rank", "bare data transfer", "fixed sizes",
                                   "sizes given", "sizes learned", "gather alone",
                                   "given / fixed", "learned / given", "<= 1.2"],
                    disable_numparse=True), ""]
    loops = []
    for backend in ("aot_eager", "inductor"):
        if backend not in results[0]:
            continue
        fixed = max(r[backend]["fixed"][0] for r in results)
        variable = max(r[backend]["variable"][0] for r in results)
        graphs = [max(r[backend][m][1] for r in results) for m in ("fixed", "variable")]
        loops.append([backend, f"{fixed * 1e3:.2f}", f"{variable * 1e3:.2f}",
                      f"{variable / fixed:.3f}", graphs[0], graphs[1],
                      "OK" if variable / fixed <= 1.10 else "MISSED"])
    out += ["compiled training loop, 8 gloo processes: s = 512 every step vs s cycling "
            "464..560 (mean 512), sizes learned; median step ms after warm-up",
            tabulate(loops, headers=["backend", "fixed s ms", "changing s ms", "ratio",
                                     "graphs (fixed)", "graphs (changing)", "<= 1.10"],
                     disable_numparse=True)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer worlds and steps")
    args = parser.parse_args(argv)
    worlds = QUICK_WORLDS if args.quick else WORLDS
    print("new size, per rank: CPU ms, cold, best of 3 (b and s free, h fixed; s=4096, "
          "h=4096, bf16)")
    print(new_size_table(worlds), flush=True)
    print()
    print(gloo_tables(args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
