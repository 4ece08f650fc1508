"""Balanced MIMO batches: the busiest rank's cost against the mean, naive and balanced,
the bytes balancing moves, and the step time it buys.

**The distribution** (:func:`loader_samples`; 8 data loaders, one per rank, 16 samples
each per step, 128 per step). Each step, each loader reads a shard of one source, drawn
with the source's weight (a shard holds one kind of data, so one loader's step is all
documents while another's is all captions -- the skew of Megatron-Bridge issue 4609):

| source | weight | images per sample | tiles per image | text tokens |
|---|---|---|---|---|
| caption | 0.4 | 1 | 1 (70%), 2 (20%), 4 (10%) | lognormal, median 40, sigma 0.6, cap 512 |
| document | 0.2 | 1-2 (geometric, p 0.6) | 4-6 | median 600, sigma 0.8, cap 8,192 |
| interleaved | 0.2 | 2-8 (geometric, p 0.35) | 1-4 | median 400, sigma 0.9, cap 8,192 |
| text | 0.2 | 0 | - | median 1,500, sigma 1.0, cap 16,384 |

A tile is 576 tokens (:data:`mimo_fx.balance.TOKENS_PER_TILE`); text runs are cut at
random around the images. The encoder runs on DP8 (an image costs its tokens), the LLM
on DP4 x CP2 (a sample costs ``sequence_costs`` of its length: ``L + L^2 / 49,152``,
one 4096-wide layer's linear and causal-attention work); *naive* leaves each loader's
images on its own rank and its samples in its own LLM dp group (loaders ``2d, 2d + 1``
to group ``d``), *balanced* is :func:`mimo_fx.placement.place`.

1. **Cost** (one process, ``--steps`` steps, default 100): per module, the busiest
   group's cost over the mean, naive and balanced, and the balanced busiest over the
   lower bound ``max(sum / bins, max)``; the placement's own time per step (both
   ``assign`` calls and the layouts), and ``assign`` alone at 20k items.
2. **Bytes** (the same steps): rows each bridge moves between ranks per step, naive and
   balanced, from the layouts' row maps (a row moves when its dst rank is not its src
   rank; checked against the row planner's bytes on two steps): patches (14 x 14 x 3
   bf16 pixels, forward), image embeddings (4096 bf16, forward and backward), text
   (token ids, int64, forward), and the sample gather itself (one all-gather).
3. **Step time** (8 gloo processes, 2 cores): each step, both placements in turn (the
   order alternating), every rank doing the real exchange, ``place`` (by the real
   costs), the patches and embeddings bridges (``redistribute``, eager, one row per 256
   tokens, 64 floats wide) and compute proportional to its cost (real matmuls sized by
   tokens): an encoder rank multiplies the rows it received by a 256 x 256 matrix 192
   times, an LLM rank a block of ``cost / 256 / cp`` rows likewise. Per placement: the
   wall time from barrier to barrier, and each rank's CPU time placing the step, in the
   bridges and computing. On 2 cores the 8 ranks share the CPU, so the wall time follows
   the total work, which balancing does not change; with a core per rank a step takes
   the busiest rank's placing + bridges + compute (waits aside), the last column.

    python bench/balance.py            # about 7 minutes on 2 cores
    python bench/balance.py --quick    # 10 steps
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mimo_fx import Grid  # noqa: E402
from mimo_fx.balance import TOKENS_PER_TILE, assign, lower_bound  # noqa: E402
from mimo_fx.placement import Placement, Sample, place  # noqa: E402
from mimo_fx.text import format_bytes  # noqa: E402

LOADERS, ENCODER, LLM = Grid(dp=8), Grid(dp=8), Grid(cp=2, dp=4)
SAMPLES = 16  # per loader and step
STEPS, QUICK_STEPS = 100, 10
# source: (weight, images per sample (least, most, geometric p), tiles per image (drawn
# uniformly from the tuple), text tokens (lognormal median, sigma, cap))
SOURCES = {
    "caption": (0.4, (1, 1, 1.0), (1, 1, 1, 1, 1, 1, 1, 2, 2, 4), (40, 0.6, 512)),
    "document": (0.2, (1, 2, 0.6), (4, 5, 6), (600, 0.8, 8192)),
    "interleaved": (0.2, (2, 8, 0.35), (1, 2, 3, 4), (400, 0.9, 8192)),
    "text": (0.2, (0, 0, 1.0), (1,), (1500, 1.0, 16384)),
}
ROW_BYTES = {"patches": 14 * 14 * 3 * 2, "embeddings": 4096 * 2, "text": 8}
BACKWARD = {"patches": False, "embeddings": True, "text": False}
SCALE, WIDTH, D, REPS = 256, 64, 256, 192  # the timed steps' rows, row width, compute
EXCHANGE = 512  # int64 values per rank in the sample gather


# -- the distribution --------------------------------------------------------------------
def loader_samples(step: int, loader: int) -> list[Sample]:
    """Loader ``loader``'s samples at ``step`` (see the module docstring)."""
    rng = random.Random(f"balance-{step}-{loader}")
    names = list(SOURCES)
    source = rng.choices(names, [SOURCES[k][0] for k in names])[0]
    _, (least, most, p), tiles, (median, sigma, cap) = SOURCES[source]
    out = []
    for _ in range(SAMPLES):
        k = least
        while k < most and rng.random() >= p:
            k += 1
        images = tuple(rng.choice(tiles) * TOKENS_PER_TILE for _ in range(k))
        text = max(1, min(cap, int(median * rng.lognormvariate(0, sigma))))
        cuts = sorted(rng.randint(0, text) for _ in range(k))
        out.append(Sample(tuple(b - a for a, b in zip([0, *cuts], [*cuts, text])), images))
    return out


def step_samples(step: int) -> list[list[Sample]]:
    return [loader_samples(step, i) for i in range(LOADERS.size)]


def busiest_over_mean(loads: list[float]) -> float:
    return max(loads) / (sum(loads) / len(loads))


# -- 1 and 2: cost and bytes, one process -------------------------------------------------
def moved_rows(src, dst) -> int:
    """Rows that change rank between ``src`` and ``dst`` (each row held by one rank on
    each side, as every layout here is)."""
    where = {}
    for side, lay in (("src", src), ("dst", dst)):
        owner = torch.full((lay.n_rows,), -1, dtype=torch.int64)
        for r in lay.holders:
            owner[lay.rows(r)] = r
        where[side] = owner
    return int((where["src"] != where["dst"]).sum())


def bridge_rows(p: Placement) -> dict[str, int]:
    return {"patches": moved_rows(*p.patches()), "embeddings": moved_rows(*p.embeddings()),
            "text": moved_rows(*p.text())}


def check_rows_against_the_planner(p: Placement) -> None:
    """The rows counted here are the planner's (forward), on a step's placement."""
    from mimo_fx.plan import plan

    for name, (src, dst) in (("patches", p.patches()), ("embeddings", p.embeddings()),
                             ("text", p.text())):
        planned = plan(src, dst, {"f": 1, "h": 1}).total_bytes // 4
        assert planned == moved_rows(src, dst), (name, planned, moved_rows(src, dst))


def cost_and_bytes(steps: int) -> dict:
    """Per step: busiest/mean and busiest/bound per module and placement, placement
    time, rows moved per bridge."""
    out: dict = {k: [] for k in ("enc naive", "enc balanced", "llm naive", "llm balanced",
                                 "enc bound", "llm bound", "place ms")}
    out["rows naive"], out["rows balanced"] = [], []
    for step in range(steps):
        samples = step_samples(step)
        start = time.process_time()
        ours = place(samples, LOADERS, ENCODER, LLM)
        for lay in (*ours.patches(), *ours.embeddings(), *ours.text()):
            lay.rows(lay.holders[0])  # (the layouts' row maps, as a rank builds them)
        out["place ms"].append((time.process_time() - start) * 1e3)
        naive = place(samples, LOADERS, ENCODER, LLM, balanced=False)
        for name, p in (("naive", naive), ("balanced", ours)):
            out[f"enc {name}"].append(busiest_over_mean(p.encoder_loads()))
            out[f"llm {name}"].append(busiest_over_mean(p.llm_loads()))
            out[f"rows {name}"].append(bridge_rows(p))
        out["enc bound"].append(max(ours.encoder_loads()) / lower_bound(ours.image_cost, 8))
        out["llm bound"].append(max(ours.llm_loads()) / lower_bound(ours.sample_cost, 4))
        if step < 2:
            check_rows_against_the_planner(scaled(ours))
        if step % 10 == 9:
            print(f"[balance] {step + 1}/{steps} steps", file=sys.stderr, flush=True)
    return out


def assign_speed() -> list[list]:
    """``assign`` at 20k items: median process CPU time of 5 calls."""
    rows = []
    for name, draw in (("lognormal sigma 2", lambda r: r.lognormvariate(0, 2)),
                       ("image tokens", lambda r: r.randint(1, 6) * 576.0),
                       ("sequence costs", lambda r: (lambda n: n + n * n / 49152)(
                           min(16384, int(r.lognormvariate(6.5, 1.2)))))):
        costs = [draw(random.Random(f"speed-{k}")) for k in range(20_000)]
        for bins in (8, 64, 512):
            times = []
            for _ in range(5):
                start = time.process_time()
                bin_of = assign(costs, bins)
                times.append(time.process_time() - start)
            loads = [0.0] * bins
            for c, b in zip(costs, bin_of):
                loads[b] += c
            rows.append([name, bins, f"{statistics.median(times) * 1e3:.0f}",
                         f"{max(loads) / lower_bound(costs, bins):.4f}"])
    return rows


def _stats(values: list[float], digits: int = 3) -> str:
    return (f"{statistics.mean(values):.{digits}f} (median {statistics.median(values):.{digits}f}"
            f", max {max(values):.{digits}f})")


def cost_table(out: dict) -> str:
    rows = []
    for module, name in (("enc", "encoder (DP8, image tokens)"),
                         ("llm", "LLM (DP4 x CP2, L + L^2/49152)")):
        naive, ours = out[f"{module} naive"], out[f"{module} balanced"]
        rows.append([name, _stats(naive), _stats(ours), _stats(out[f"{module} bound"], 4),
                     f"{statistics.mean(naive) / statistics.mean(ours):.2f}x"])
    return tabulate(rows, headers=["module", "busiest/mean naive", "busiest/mean balanced",
                                   "balanced busiest/bound", "naive/balanced"],
                    disable_numparse=True)


def bytes_table(out: dict) -> str:
    rows, totals = [], {"naive": 0.0, "balanced": 0.0}
    steps = len(out["rows naive"])
    for bridge, width in ROW_BYTES.items():
        ways = 2 if BACKWARD[bridge] else 1
        per = {}
        for which in ("naive", "balanced"):
            n = sum(r[bridge] for r in out[f"rows {which}"]) / steps
            per[which] = n * width * ways
            totals[which] += per[which]
        rows.append([bridge, f"{width} B x {ways}", format_bytes(per["naive"]),
                     format_bytes(per["balanced"]),
                     format_bytes(per["balanced"] - per["naive"])])
    exchange = (LOADERS.size - 1) * EXCHANGE * 8 * LOADERS.size  # a ring all-gather
    rows.append(["sample gather", f"{EXCHANGE} int64/rank", "-", format_bytes(exchange),
                 format_bytes(exchange)])
    totals["balanced"] += exchange
    rows.append(["all", "", format_bytes(totals["naive"]), format_bytes(totals["balanced"]),
                 f"{format_bytes(totals['balanced'] - totals['naive'])} "
                 f"({totals['balanced'] / totals['naive']:.2f}x)"])
    return tabulate(rows, headers=["bridge", "row x ways", "naive/step", "balanced/step",
                                   "extra"], disable_numparse=True)


# -- 3: step time, 8 gloo processes -------------------------------------------------------
def scaled_samples(samples) -> tuple[Sample, ...]:
    """``samples`` with every run of tokens at 1/:data:`SCALE` (rounded up)."""
    return tuple(Sample(tuple(math.ceil(n / SCALE) for n in s.text),
                        tuple(math.ceil(n / SCALE) for n in s.images)) for s in samples)


def scaled(p: Placement) -> Placement:
    """The same placement (placed by the real costs) with its samples'
    :func:`scaled_samples`: the rows the timed steps move."""
    return Placement(p.loaders, p.encoder, p.llm,
                     tuple(scaled_samples(mine) for mine in p.samples), p.image_group,
                     p.sample_group, p.image_cost, p.sample_cost, p.zigzag)


def _compute(rows: int, w: torch.Tensor) -> float:
    """``rows`` x D times D x D, :data:`REPS` times: process CPU seconds."""
    x = torch.ones(rows, D) / D
    start = time.process_time()
    for _ in range(REPS):
        x = x @ w
    return time.process_time() - start


def _one_step(rank: int, step: int, balanced: bool, w: torch.Tensor) -> list[float]:
    """One step with one placement on this rank: its wall seconds, and the CPU seconds
    of placing the step (the exchange and ``place``), of the bridges (planning their
    routes, packing, the collectives) and of the compute."""
    import torch.distributed as dist

    from mimo_fx import redistribute
    from mimo_fx.mimo import share_samples

    samples = loader_samples(step, rank)
    pixels = torch.randn(sum(sum(s.images) for s in scaled_samples(samples)), WIDTH)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    shared = share_samples(samples, LOADERS, width=EXCHANGE)
    p = scaled(place(shared, LOADERS, ENCODER, LLM, balanced=balanced))
    placed = time.process_time()
    at_encoder = redistribute(pixels, *p.patches("t f"))
    bridges = time.process_time() - placed
    compute = _compute(at_encoder.shape[0], w)
    before = time.process_time()
    redistribute(at_encoder, *p.embeddings("t h"))  # (the LLM block below: its work)
    bridges += time.process_time() - before
    group = LLM.coord(rank)["dp"]
    mine = sum(c for c, g in zip(p.sample_cost, p.sample_group) if g == group)
    compute += _compute(math.ceil(mine / SCALE / LLM.axis_size("cp")), w)
    dist.barrier()
    return [time.perf_counter() - start, placed - cpu, bridges, compute]


def _timed(rank: int, world: int, steps: int) -> list[dict]:
    """Every step, both placements (order alternating): per placement every rank's
    wall, placing, bridge and compute times (gathered)."""
    import torch.distributed as dist

    from mimo_fx.compiled import destroy, prepare

    torch.set_num_threads(1)
    w = torch.eye(D)
    p = scaled(place(step_samples(0), LOADERS, ENCODER, LLM))
    prepare(*p.patches("t f"), {"f": WIDTH})  # the process groups, eagerly
    prepare(*p.embeddings("t h"), {"h": WIDTH})
    _one_step(rank, 0, True, w)  # warm-up
    _one_step(rank, 0, False, w)
    out = []
    for step in range(steps):
        row = {}
        for balanced in ((True, False) if step % 2 else (False, True)):
            mine = torch.tensor(_one_step(rank, step, balanced, w), dtype=torch.float64)
            every = [torch.zeros(4, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, mine)
            row["balanced" if balanced else "naive"] = [t.tolist() for t in every]
        out.append(row)
        if rank == 0 and step % 10 == 9:
            print(f"[balance] timed {step + 1}/{steps} steps", file=sys.stderr, flush=True)
    destroy()
    return out


def time_table(rows: list[dict]) -> str:
    """Per placement, means over the steps: the wall time (max over ranks), the busiest
    rank's placing, bridge and compute CPU, the mean rank's compute, and the busiest
    rank's placing + bridges + compute (what a step takes with a core per rank, waits
    aside)."""
    table, means = [], {}
    for which in ("naive", "balanced"):
        def col(k: int, reduce=max, which=which) -> float:
            return statistics.mean(reduce(rank[k] for rank in r[which]) for r in rows) * 1e3

        def busiest_step(r: dict, which=which) -> float:
            return max(rank[1] + rank[2] + rank[3] for rank in r[which])

        step = statistics.mean(busiest_step(r) for r in rows) * 1e3
        means[which] = (col(0), col(3), step)
        table.append([which, f"{col(0):.0f}", f"{col(1):.1f}", f"{col(2):.1f}",
                      f"{col(3):.1f}", f"{col(3, statistics.mean):.1f}", f"{step:.1f}"])
    table.append(["balanced / naive"] + [f"{means['balanced'][k] / means['naive'][k]:.2f}x"
                                         if k is not None else ""
                                         for k in (0, None, None, 1, None, 2)])
    return tabulate(table, headers=["placement", "wall ms/step", "placing ms (busiest)",
                                    "bridges ms (busiest)", "compute ms (busiest)",
                                    "compute ms (mean)", "busiest rank's step ms"],
                    disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps")
    parser.add_argument("--steps", type=int, default=None, help=f"default {STEPS}")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    from mimo_fx.testing import run_world

    out = cost_and_bytes(steps)
    print(f"{steps} steps of {LOADERS.size} loaders x {SAMPLES} samples (bench/balance.py's "
          f"distribution); busiest group's cost / mean, mean over the steps:")
    print(cost_table(out))
    print(f"\nplacing a step (two assign calls, the layouts): "
          f"{statistics.median(out['place ms']):.0f} ms CPU (median); assign at 20k items "
          f"(ms CPU, median of 5; busiest/bound):")
    print(tabulate(assign_speed(), headers=["costs", "bins", "ms", "busiest/bound"],
                   disable_numparse=True))
    print("\nbytes moved between ranks per step (mean over the steps, all ranks):")
    print(bytes_table(out), flush=True)
    rows = run_world(8, _timed, steps, timeout=args.timeout)[0]
    print(f"\nstep time on 8 gloo processes (2 cores), {steps} steps, placements "
          f"interleaved; compute proportional to cost (rows = tokens / {SCALE}); means over "
          f"the steps, ms:")
    print(time_table(rows))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average at the end: {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
