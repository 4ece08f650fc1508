"""mimo_fx vs DTensor vs a leader-based bridge vs bare collectives, measured on 8 gloo ranks.

Each case is a redistribution that PyTorch DTensor can also express, because both
layouts live on one parent mesh of 8 ranks: a 2x2x2 ``DeviceMesh`` whose mesh dims,
outermost first, are (m0, m1, m2) with rank = 4*m0 + 2*m1 + m2. mimo_fx's grids are
views of it: ``Grid(tp=2, dp=4)`` is tp = m2, dp = 2*m0 + m1, so ``(dp b)`` is
``[Shard(0), Shard(0), Replicate()]`` (DTensor shards one tensor dim over several mesh
dims outermost first); ``Grid(tp=4, dp=2)`` is tp = 2*m1 + m2, dp = m0; and
``Grid(tp=2, cp=2, dp=2)`` is tp = m2, cp = m1, dp = m0. Pipelined (disjoint) grids and
zigzag CP have no DTensor form and are left out here (see ``bench/plan_quality.py``).

Per case and rank, one world of 8 gloo processes (``mimo_fx.testing.run_world``, one
thread each) times four variants, float32, eager, under ``torch.no_grad()``:

- mimo_fx: ``Redistributor(src, dst, sizes, torch.float32)(x)``;
- DTensor: ``dt.redistribute(mesh, dst_placements).to_local()`` (waited) for
  ``dt = DTensor.from_local(x, mesh, src_placements)`` made once;
- leader: the seeds' pipelined-bridge scheme written with plain ``torch.distributed``
  calls: each src DP replica makes its data whole on its leader (its first rank:
  ``dist.reduce`` for a partial input, point-to-point receives for a TP-sharded one);
  each dst replica's leader receives its samples from the src leaders (``isend``/``irecv``;
  nothing when it is the same rank), ``dist.broadcast`` s them to its replica's ranks
  (process groups made once, before timing), and every rank keeps its dst piece;
- bare: the functional collectives mimo_fx's lowered program issues, with buffers of the
  same sizes made once, no packing and no assembly (how ``bench/compiled_speed.py``
  times them): the floor for mimo_fx's own overhead.

The variants are interleaved in one loop (one call of each per iteration, the order
rotating, ``dist.barrier()`` untimed before every call), so a change in the machine's
load hits all alike. Each rank takes the median of its timed calls; the table shows the
max over ranks, and the ratios of each variant to mimo_fx. Before timing, the output of
mimo_fx, DTensor and the leader bridge on every rank is compared with the oracle's
``shard(X, dst)[rank]`` (bitwise; the input values are small integers, so sums are
exact): a variant that disagrees is reported and the run fails. The bare collectives
move placeholder buffers of the right sizes and are not checked.

With 8 processes on a 2-core machine over loopback, the absolute times are mostly
scheduling and socket copies and swing from run to run: read the ratios, measured side by
side in the same run. The header notes cores, load average and torch version.

Run from the repository root::

    python bench/dtensor_compare.py           # 15 timed + 3 warm-up calls per variant
    python bench/dtensor_compare.py --quick   # 5 timed + 2 warm-up calls, small sizes
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from common import bare, collectives, replicas, timed
from tabulate import tabulate

from mimo_fx import Grid, Layout, plan
from mimo_fx.testing import run_world

WORLD = 8
ITERS, WARMUP = 15, 3
QUICK_ITERS, QUICK_WARMUP = 5, 2
SIZES = {"b": 8, "s": 256, "h": 512}        # 1 MiB float32 per src piece (b/4 x s x h)
QUICK_SIZES = {"b": 8, "s": 64, "h": 128}   # 64 KiB
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                      "dtensor_compare_gloo8.txt")
VARIANTS = ("mimo_fx", "DTensor", "leader", "bare")

ENC = Grid(tp=2, dp=4)


@dataclass(frozen=True)
class Case:
    name: str
    src: Layout
    dst: Layout
    src_placements: tuple[str, ...]  # per mesh dim (m0, m1, m2): "S<dim>", "R" or "P"
    dst_placements: tuple[str, ...]


CASES = (
    Case("fan-in TP2xDP4 -> TP4xDP2", Layout(ENC, "(dp b) s h"),
         Layout(Grid(tp=4, dp=2), "(dp b) s h"), ("S0", "S0", "R"), ("S0", "R", "R")),
    Case("fan-in TP2xDP4 -> TP2xCP2xDP2 (cp s)", Layout(ENC, "(dp b) s h"),
         Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h"), ("S0", "S0", "R"),
         ("S0", "S1", "R")),
    Case("partial tp -> replicated, TP2xDP4", Layout(ENC, "(dp b) s h", partial=("tp",)),
         Layout(ENC, "(dp b) s h"), ("S0", "S0", "P"), ("S0", "S0", "R")),
    Case("TP-sharded h -> (tp s), TP2xDP4", Layout(ENC, "(dp b) s (tp h)"),
         Layout(ENC, "(dp b) (tp s) h"), ("S0", "S0", "S2"), ("S0", "S0", "S1")),
)


# -- inputs and the expected output -------------------------------------------------------
def _global(sizes: dict[str, int]) -> torch.Tensor:
    """The logical tensor: small integers as floats, so every sum is exact."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(-8, 9, (sizes["b"], sizes["s"], sizes["h"]), generator=gen).float()


def _src_piece(case: Case, x: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's src piece; a partial src splits the values into per-rank terms."""
    from mimo_fx.reference import shard

    if not case.src.partial:
        return shard(x, case.src)[rank]
    piece = shard(x, Layout(case.src.grid, case.src.pattern))[rank]
    k = math.prod(case.src.grid.axis_size(a) for a in case.src.partial)
    index = sum(case.src.grid.coord(rank)[a] for a in case.src.partial)
    gen = torch.Generator().manual_seed(1 + rank // k)
    terms = torch.randint(-4, 5, (k - 1, *piece.shape), generator=gen).float()
    return piece - terms.sum(0) if index == k - 1 else terms[index]


# -- DTensor ------------------------------------------------------------------------------
def _placements(spec: tuple[str, ...]):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [Shard(int(p[1:])) if p.startswith("S") else Partial() if p == "P" else Replicate()
            for p in spec]


def _dtensor(case: Case, x_local: torch.Tensor, shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("m0", "m1", "m2"))
    stride = torch.empty(shape).stride()
    dt = DTensor.from_local(x_local, mesh, _placements(case.src_placements), run_check=False,
                            shape=torch.Size(shape), stride=stride)
    dst = _placements(case.dst_placements)

    def call() -> torch.Tensor:
        y = dt.redistribute(mesh, dst).to_local()
        return y.wait() if hasattr(y, "wait") else y

    return call


# -- the leader-based bridge ------------------------------------------------------------------
def _leader(case: Case, rank: int, x: torch.Tensor, sizes: dict[str, int]):
    """Build (once, on every rank, in one order) the groups of the leader scheme and
    return the call."""
    from mimo_fx.reference.oracle import shard_index

    src_reps, dst_reps = replicas(case.src.grid), replicas(case.dst.grid)
    groups = {rep: dist.new_group(list(rep)) for rep in (*src_reps, *dst_reps)
              if len(rep) > 1}
    b, per_src, per_dst = sizes["b"], sizes["b"] // len(src_reps), sizes["b"] // len(dst_reps)
    full = (sizes["s"], sizes["h"])
    my_src = next(rep for rep in src_reps if rank in rep)
    my_dst = next(rep for rep in dst_reps if rank in rep)
    j = dst_reps.index(my_dst)
    sharded = [d for d, axes in case.src.sharding.items() if d != "b" and axes]
    index = [i - (j * per_dst if d == "b" else 0)
             for d, i in zip(case.dst.dims, shard_index(case.dst, rank, sizes))]
    assert case.src.dims == case.dst.dims == ("b", "s", "h") and b % len(dst_reps) == 0

    def make_src_whole() -> torch.Tensor | None:
        """The src replica's samples on its leader (None elsewhere)."""
        lead = my_src[0]
        if case.src.partial:
            out = x.clone()
            dist.reduce(out, lead, group=groups[my_src])
            return out if rank == lead else None
        if not sharded:
            return x if rank == lead else None
        dim = ("b", "s", "h").index(sharded[0])
        if rank != lead:
            dist.send(x.contiguous(), lead)
            return None
        parts = [x] + [torch.empty_like(x) for _ in my_src[1:]]
        for peer, buf in zip(my_src[1:], parts[1:]):
            dist.recv(buf, peer)
        return torch.cat(parts, dim)

    def call() -> torch.Tensor:
        whole = make_src_whole()
        ops, chunks = [], {}
        for jj, rep in enumerate(dst_reps):
            lo, hi = jj * per_dst, (jj + 1) * per_dst
            for i, src_rep in enumerate(src_reps):
                slo, shi = i * per_src, (i + 1) * per_src
                a, z = max(lo, slo), min(hi, shi)
                if a >= z:
                    continue
                if rank == src_rep[0] and rank == rep[0]:
                    chunks[a] = whole[a - slo:z - slo]
                elif rank == src_rep[0]:
                    ops.append(dist.P2POp(dist.isend, whole[a - slo:z - slo].contiguous(),
                                          rep[0]))
                elif rank == rep[0]:
                    chunks[a] = torch.empty(z - a, *full)
                    ops.append(dist.P2POp(dist.irecv, chunks[a], src_rep[0]))
        for req in dist.batch_isend_irecv(ops) if ops else ():
            req.wait()
        if rank == my_dst[0]:
            replica = torch.cat([chunks[a] for a in sorted(chunks)])
        else:
            replica = torch.empty(per_dst, *full)
        if len(my_dst) > 1:
            dist.broadcast(replica, my_dst[0], group=groups[my_dst])
        return replica[index[0]][:, index[1]][:, :, index[2]]

    return call


# -- measuring -----------------------------------------------------------------------------------
def _measure(rank: int, case: Case, sizes: dict[str, int], iters: int, warmup: int) -> dict:
    from mimo_fx.compiled import Redistributor
    from mimo_fx.reference import shard

    x_global = _global(sizes)
    x = _src_piece(case, x_global, rank)
    expected = shard(x_global, case.dst)[rank]
    bridge = Redistributor(case.src, case.dst, sizes, torch.float32)
    try:
        fns = {"mimo_fx": lambda: bridge(x),
               "DTensor": _dtensor(case, x, tuple(x_global.shape)),
               "leader": _leader(case, rank, x, sizes),
               "bare": bare(bridge.sizing.fwd_program, bridge.executor.comm)}
        with torch.no_grad():
            wrong = [name for name in VARIANTS[:3]
                     if not torch.equal(fns[name](), expected)]
            seconds = {n: wall for n, (wall, _) in timed(fns, iters, warmup).items()}
        values = torch.tensor([seconds[n] for n in VARIANTS]
                              + [float(n in wrong) for n in VARIANTS[:3]], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        out = dict(zip(VARIANTS, values[:4].tolist()))
        out["wrong"] = [n for n, w in zip(VARIANTS[:3], values[4:].tolist()) if w]
        out["ops"] = len(bridge.sizing.fwd_program.ops)
        out["src_bytes"] = x.numel() * 4
        out["dst_bytes"] = expected.numel() * 4
        return out
    finally:
        bridge.destroy()


def _bench(rank: int, world: int, sizes: dict[str, int], iters: int, warmup: int):
    rows = []
    for case in CASES:
        start = time.perf_counter()
        row = _measure(rank, case, sizes, iters, warmup)
        rows.append(row)
        if rank == 0:
            print(f"  [{len(rows)}/{len(CASES)}] {case.name}: "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return rows if rank == 0 else None


def report(rows: list[dict], sizes: dict[str, int]) -> str:
    table = []
    for case, r in zip(CASES, rows):
        ms = [f"{r[n] * 1e3:.3f}" for n in VARIANTS]
        ratios = [f"{r[n] / r['mimo_fx']:.2f}x" for n in VARIANTS[1:]]
        check = "all equal the oracle" if not r["wrong"] else "WRONG: " + ", ".join(r["wrong"])
        table.append([case.name, f"{r['src_bytes'] / 2**20:.3g} / {r['dst_bytes'] / 2**20:.3g}",
                      collectives(plan(case.src, case.dst, sizes, 4)), *ms, *ratios, check])
    return tabulate(table, disable_numparse=True,
                    colalign=("left", "right", "left") + ("right",) * 7 + ("left",),
                    headers=["case", "MiB per rank (src / dst)", "mimo_fx collectives",
                             "mimo_fx ms", "DTensor ms", "leader ms", "bare ms",
                             "DTensor/mimo_fx", "leader/mimo_fx", "bare/mimo_fx", "outputs"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_ITERS} timed + {QUICK_WARMUP} warm-up calls, 64 KiB "
                             f"pieces; writes no result file")
    parser.add_argument("--iters", type=int, default=None, metavar="N")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    iters = args.iters or (QUICK_ITERS if args.quick else ITERS)
    warmup = QUICK_WARMUP if args.quick else WARMUP
    sizes = QUICK_SIZES if args.quick else SIZES
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        f"mimo_fx vs DTensor vs leader-based vs bare collectives: {WORLD} gloo ranks on "
        f"127.0.0.1, float32, eager, no_grad; sizes {sizes}; median of {iters} timed calls "
        f"({warmup} warm-up), interleaved, barrier before each; max over ranks",
        f"machine: {os.cpu_count()} CPUs, load average before {load}; torch "
        f"{torch.__version__}; 1 thread per rank",
    ]
    print("\n".join(lines) + "\n", flush=True)
    start = time.perf_counter()
    rows = run_world(WORLD, _bench, sizes, iters, warmup, timeout=args.timeout)[0]
    text = report(rows, sizes)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    tail = (f"\nWorld run took {time.perf_counter() - start:.0f} s; load average after it "
            f"{load}.")
    print(text + "\n" + tail)
    if not args.quick:
        os.makedirs(os.path.dirname(RESULT), exist_ok=True)
        with open(RESULT, "w") as f:
            f.write(f"# python bench/dtensor_compare.py, {datetime.date.today().isoformat()}\n"
                    + "\n".join(lines) + "\n\n" + text + "\n" + tail + "\n")
        print(f"wrote {RESULT}")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
