"""A bridge's transfer overlapping independent compute, against the same step in series.

Four gloo processes: an encoder on ranks 0-1 (``Grid(dp=2)``) sends its activations to an
LLM on ranks 2-3 (``Grid(dp=2, offset=2)``), ``(dp b) s h`` on both sides. Each step, the
LLM ranks also run compute that does not depend on the transfer (a chain of float32
matmuls: the text embeddings of the same micro-batch), then use the bridge's result:

- **serial**: ``y = bridge(x)``; ``c = compute()``; ``use(y, c)``;
- **overlapped**: ``p = bridge.start(x)``; ``c = compute()``; ``y = p.wait()``; ``use(y, c)``.

The compute is sized so that it takes about as long as the transfer alone (both are
measured first, in the same world); the best an overlap can do is then about half the
serial step. Per step: a barrier (untimed), then the step; the variants interleave
(the order rotating); each rank takes the median of its steps, and the table shows the
max over ranks. The results are checked against full-tensor math before timing.

Each rank runs one intra-op thread, and gloo moves the data on threads of its own: on
this 2-core machine 4 processes share the cores, so the transfer's own CPU work (copies
into and out of the sockets) competes with the compute. Read the ratio, measured side
by side.

    python bench/overlap.py              # 30 timed steps per variant
    python bench/overlap.py --ranks 2    # one sender, one receiver: a core each
    python bench/overlap.py --quick      # 8 steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

from mimo_fx import Grid, Layout
from mimo_fx.testing import run_world

WORLD = 4
SRC = Layout(Grid(dp=2), "(dp b) s h")
DST = Layout(Grid(dp=2, offset=2), "(dp b) s h")
# --ranks 2: one encoder rank sends to one LLM rank (a core each on a 2-core machine)
PAIR = (Layout(Grid(dp=1), "(dp b) s h"), Layout(Grid(dp=1, offset=1), "(dp b) s h"))
SIZES = {"b": 8, "s": 512, "h": 1024}   # 8 MiB float32 in all, 4 MiB per src rank
QUICK_SIZES = {"b": 8, "s": 128, "h": 1024}


def _median_over(fn, n: int) -> float:
    times = []
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _world(rank: int, world: int, sizes: dict, steps: int) -> dict:
    from mimo_fx.compiled import Redistributor
    from mimo_fx.reference import shard

    global SRC, DST
    if world == 2:
        SRC, DST = PAIR

    torch.manual_seed(0)
    full = torch.randn(sizes["b"], sizes["s"], sizes["h"])
    x = shard(full, SRC).get(rank)
    want = shard(full, DST).get(rank)
    bridge = Redistributor(SRC, DST, sizes)
    try:
        def transfer():
            return bridge(x)

        # compute of about the transfer's length: k chained (n x n) matmuls
        n = 256
        a = torch.randn(n, n) / n ** 0.5
        k = [1]

        def compute():
            c = a
            for _ in range(k[0] if DST.holds(rank) else 0):  # the LLM ranks compute
                c = c @ a
            return c

        t_transfer = _median_over(transfer, 10)
        k[0] = 8
        t_eight = _median_over(compute, 10)
        k[0] = max(1, round(8 * t_transfer / t_eight)) if DST.holds(rank) else 1
        k_all = torch.tensor([k[0]], dtype=torch.int64)
        dist.all_reduce(k_all, op=dist.ReduceOp.MAX)  # every rank computes alike
        k[0] = int(k_all)

        def use(y, c):
            return None if y is None or not y.numel() else y.sum() + c.sum()

        def serial():
            y = bridge(x)
            c = compute()
            return y, use(y, c)

        def overlapped():
            pending = bridge.start(x)
            c = compute()
            y = pending.wait()
            return y, use(y, c)

        wrong = []
        for name, fn in (("serial", serial), ("overlapped", overlapped)):
            y, _ = fn()
            if want is not None and not torch.equal(y, want):
                wrong.append(name)
        fns = {"transfer": transfer, "compute": compute, "serial": serial,
               "overlapped": overlapped}
        names = list(fns)
        times: dict[str, list[float]] = {m: [] for m in names}
        cpu: dict[str, list[float]] = {m: [] for m in names}
        for i in range(steps + 2):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                fns[name]()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
        med = torch.tensor([statistics.median(times[m]) for m in names] + [float(bool(wrong))],
                           dtype=torch.float64)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        # the process's CPU time (gloo's threads included), summed over the ranks
        used = torch.tensor([statistics.median(cpu[m]) for m in names], dtype=torch.float64)
        dist.all_reduce(used, op=dist.ReduceOp.SUM)
        out = dict(zip(names, med[:-1].tolist()))
        out.update({f"{m} cpu": v for m, v in zip(names, used.tolist())})
        out["wrong"] = bool(med[-1])
        out["matmuls"] = k[0]
        return out
    finally:
        bridge.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--ranks", type=int, default=WORLD, choices=(2, 4),
                        help="4 (two encoder ranks, two LLM ranks) or 2 (one each)")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    steps = args.steps or (8 if args.quick else 30)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    src, dst = (SRC, DST) if args.ranks == 4 else PAIR
    print(f"a bridge's transfer overlapping compute: {args.ranks} gloo ranks, "
          f"{src.describe()} on {src.grid!r} -> {dst.describe()} on {dst.grid!r}, sizes "
          f"{sizes} (float32); median "
          f"of {steps} steps, interleaved, barrier before each; max over ranks\n"
          f"machine: {os.cpu_count()} CPUs, load average before {load}; torch "
          f"{torch.__version__}; 1 thread per rank\n", flush=True)
    r = run_world(args.ranks, _world, sizes, steps, timeout=900)[0]
    ms = {k: r[k] * 1e3 for k in ("transfer", "compute", "serial", "overlapped")}
    cpu = {k: r[f"{k} cpu"] * 1e3 for k in ("transfer", "compute", "overlapped")}
    best = max(ms["transfer"], ms["compute"]) / (ms["transfer"] + ms["compute"])
    cores = os.cpu_count() or 1
    # the overlapped step cannot end before its CPU work, spread over every core, is done
    floor = max(ms["transfer"], ms["compute"], (cpu["transfer"] + cpu["compute"]) / cores)
    print(tabulate([[f"{ms['transfer']:.2f} ({cpu['transfer']:.2f})",
                     f"{ms['compute']:.2f} ({cpu['compute']:.2f}; {r['matmuls']} matmuls)",
                     f"{ms['serial']:.2f}", f"{ms['overlapped']:.2f} ({cpu['overlapped']:.2f})",
                     f"{ms['overlapped'] / ms['serial']:.2f}", f"{best:.2f}",
                     f"{floor / ms['serial']:.2f}", "WRONG" if r["wrong"] else "exact"]],
                   headers=["transfer ms (CPU ms)", "compute ms (CPU ms)", "serial ms",
                            "overlapped ms (CPU ms)", "overlapped / serial", "ideal",
                            f"CPU floor on {cores} cores", "values"],
                   disable_numparse=True))
    print(f"\nCPU ms: the processes' CPU time per step (gloo's threads included), medians "
          f"summed over the {args.ranks} ranks. The CPU floor is the overlapped step's least "
          f"time given that work: max(transfer, compute, (transfer CPU + compute CPU) / "
          f"{cores} cores), over the serial step.")
    return 1 if r["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
