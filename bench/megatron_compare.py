"""mimo_fx against Megatron-Core's own bridge communicators, side by side on 8 ranks.

The incumbent is Megatron-Core's ``ColocatedBridgeCommunicator`` (encoder and LLM on the
same ranks, ``megatron/core/models/mimo/comm/colocated_communicator.py``) and
``BridgeCommunicator`` (on other ranks, ``megatron/core/pipeline_parallel/
bridge_communicator.py``), release 0.19.2, run unchanged. Megatron-Core is a bench-only
dependency: the two modules and ``hyper_comm_grid`` need only torch (and numpy), so they
are loaded from a wheel or a source tree without the package's ``__init__``
(``--megatron PATH``; ``--fetch`` downloads the wheel once with pip, see ``--help``).
On CPU their ``nccl`` groups are made on gloo and ``torch.cuda.current_device()`` answers
``"cpu"``; nothing else is touched. With 8 CUDA devices the same script runs on NCCL
(``--backend nccl``).

Every case moves one logical tensor ``X`` of ``b x s x h`` float32 (``b = 8``,
``h = 256``, ``s`` from the size) forward and its gradient ``G`` backward, with each
variant's own call pattern, on the same inputs:

- colocated (grids on ranks 0-7): Megatron ``y = comm.communicate(x); y.backward(g)``;
  mimo_fx ``y = bridge(x); y.backward(g)``, eager and compiled (the bridge's call inside
  ``torch.compile``; ``y.backward(g)`` runs the compiled backward).
- pipelined (src on ranks 0-3, dst on 4-7): Megatron ``send_forward(x)`` /
  ``recv_backward()`` on the src ranks, ``recv_forward()`` / ``send_backward(g)`` on the
  dst ranks; mimo_fx's ``Bridge`` the same four calls; its ``Redistributor`` the
  functional call (``y = bridge(x); mimo_fx.backward()`` on src ranks, ``y =
  bridge(None); y.backward(g)`` on dst ranks), eager and compiled.

The drop-in (``mimo_fx.interop.megatron``: Megatron's classes, grids and calls, one
import changed) runs Megatron's call pattern in both kinds of case, learning its shapes
per call as Megatron's communicators do.

Both sides' layouts are Megatron's: each rank of a DP replica holds that replica's
batch, replicated over TP (``Layout(grid, "(dp b) s h")``). Before timing, every
variant's result on every rank is compared with full-tensor math: the dst piece with
``shard(X, dst)[rank]`` and the src gradient with ``shard(G, src)[rank]`` (bitwise; the
values are small integers). A variant that disagrees is reported and the run fails.

Timing: one world of 8 processes, one intra-op thread each. Per case and size the
variants are interleaved (one call of each per iteration, the order rotating, a barrier
before each, untimed); each rank takes the median of its timed calls, and the table
shows the max over ranks, and each variant's time over Megatron's (below 1: faster than
Megatron). With 8 processes on a 2-core machine over loopback the absolute times are
mostly scheduling and socket copies: read the ratios, which are measured side by side.

    python bench/megatron_compare.py --megatron megatron_core-0.19.2-...whl
    python bench/megatron_compare.py --fetch           # pip-downloads the wheel once
    python bench/megatron_compare.py --quick           # 2 sizes, fewer calls, no file
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from common import collectives
from tabulate import tabulate

from mimo_fx import Grid, Layout, plan
from mimo_fx.testing import megatron_core, run_world

WORLD = 8
MEGATRON_VERSION = megatron_core.VERSION
B, H = 8, 256
SIZES = (64 << 10, 1 << 20, 16 << 20)          # bytes of X
QUICK_SIZES = (64 << 10, 1 << 20)
ITERS, WARMUP = 21, 3
SMALL, SMALL_ITERS = 1 << 20, 201  # up to 1 MiB a call is milliseconds of scheduling noise
# (61 calls moved the 64 KiB colocated cells by up to 0.3 between runs of one tree)
QUICK_ITERS, QUICK_WARMUP = 5, 2
CACHE = megatron_core.CACHE
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                      "megatron_compare.txt")


@dataclass(frozen=True)
class Case:
    name: str
    pipelined: bool
    src: dict       # grid axes, e.g. {"tp": 2, "dp": 4}
    dst: dict

    def grids(self) -> tuple[Grid, Grid]:
        return Grid(**self.src), Grid(**self.dst, offset=4 if self.pipelined else 0)

    def layouts(self) -> tuple[Layout, Layout]:
        src, dst = self.grids()
        return Layout(src, "(dp b) s h"), Layout(dst, "(dp b) s h")


def _fmt(axes: dict) -> str:
    return "x".join(f"{a.upper()}{n}" for a, n in axes.items() if n > 1 or a == "dp")


CASES = (
    Case("colocated fan-in", False, {"tp": 2, "dp": 4}, {"tp": 4, "dp": 2}),
    Case("colocated fan-out", False, {"tp": 4, "dp": 2}, {"tp": 2, "dp": 4}),
    Case("colocated DP8 -> TP8", False, {"tp": 1, "dp": 8}, {"tp": 8, "dp": 1}),
    Case("colocated equal (nothing moves)", False, {"tp": 2, "dp": 4}, {"tp": 2, "dp": 4}),
    Case("pipelined equal", True, {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2}),
    Case("pipelined fan-in", True, {"tp": 1, "dp": 4}, {"tp": 2, "dp": 2}),
    Case("pipelined fan-out", True, {"tp": 2, "dp": 2}, {"tp": 1, "dp": 4}),
    Case("pipelined DP4 -> TP4", True, {"tp": 1, "dp": 4}, {"tp": 4, "dp": 1}),
)
VARIANTS = {False: ("Megatron", "drop-in", "Redistributor", "compiled"),
            True: ("Megatron", "drop-in", "drop-in sizes=", "Bridge", "Redistributor",
                   "compiled")}


# -- Megatron-Core, loaded from a wheel or a tree (mimo_fx.testing.megatron_core) ---------
def _megatron_root(path: str | None, fetch: bool) -> str:
    try:
        return megatron_core.megatron_root(path, fetch_missing=fetch)
    except megatron_core.NotFound as err:
        sys.exit(f"{err} (--megatron PATH, or --fetch)")


def _megatron_grid(mods: dict, axes: dict, offset: int, pipelined: bool):
    grid_mod = mods["hyper_comm_grid"]
    if pipelined:  # the pipelined communicator reads a pp dim
        names = ["tp", "cp", "pp", "dp"]
        shape = [axes.get("tp", 1), 1, 1, axes["dp"]]
    else:
        names, shape = ["tp", "dp"], [axes.get("tp", 1), axes["dp"]]
    return grid_mod.HyperCommGrid(shape, names, rank_offset=offset)


# -- one case ---------------------------------------------------------------------------
def _tensors(s: int):
    gen = torch.Generator().manual_seed(s)
    x = torch.randint(-8, 9, (B, s, H), generator=gen).float()
    g = torch.randint(-8, 9, (B, s, H), generator=gen).float()
    return x, g


class _Passthrough(torch.autograd.Function):
    """The least a call that moves nothing can do: a view forward, the gradient back."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _variants(case: Case, mods: dict, rank: int, x: torch.Tensor, g: torch.Tensor,
              sizes: dict, compile_backend: str) -> tuple[dict, list]:
    """Per variant, a call running one forward and its backward on this rank and
    returning ``(dst piece or None, src gradient or None)``; and what to destroy."""
    import mimo_fx
    from mimo_fx.compiled import Bridge, Redistributor
    from mimo_fx.interop import megatron as megatron_interop

    src, dst = case.layouts()
    on_src, on_dst = src.holds(rank), dst.holds(rank)
    m_src = _megatron_grid(mods, case.src, 0, case.pipelined)
    m_dst = _megatron_grid(mods, case.dst, 4 if case.pipelined else 0, case.pipelined)
    leaf = x.clone().requires_grad_() if on_src else None
    fns: dict = {}
    cleanup: list = []

    def grad_of(t):
        out = None if t is None else t.grad
        if t is not None:
            t.grad = None
        return out

    if case.pipelined:
        comm = mods["bridge_communicator"].BridgeCommunicator(m_src, m_dst)

        def megatron():
            if on_src:
                comm.send_forward(x)
                return None, comm.recv_backward()
            y = comm.recv_forward()
            comm.send_backward(g)
            return y, None

        bridge = Bridge(src, dst, sizes, name=f"bench {case.name} Bridge")
        cleanup.append(bridge)

        def imperative():
            if on_src:
                bridge.send_forward(x)
                return None, bridge.recv_backward()
            y = bridge.recv_forward()
            bridge.send_backward(g)
            return y, None

        fns["Megatron"], fns["Bridge"] = megatron, imperative
        # mimo_fx's drop-in: Megatron's class, grids and calls, one import changed
        # (and with sizes=, the opt-in that skips the per-call shape exchange)
        for variant, given in (("drop-in", None), ("drop-in sizes=", sizes)):
            drop = megatron_interop.BridgeCommunicator(m_src, m_dst, sizes=given)
            cleanup.append(drop)

            def drop_in(drop=drop):
                if on_src:
                    drop.send_forward(x)
                    return None, drop.recv_backward()
                y = drop.recv_forward()
                drop.send_backward(g)
                return y, None

            fns[variant] = drop_in
    else:
        comm = mods["colocated_communicator"].ColocatedBridgeCommunicator(m_src, m_dst)

        def megatron():
            y = comm.communicate(leaf)
            y.backward(g)
            return y, grad_of(leaf)

        fns["Megatron"] = megatron
        cleanup.append(comm)
        drop = megatron_interop.ColocatedBridgeCommunicator(m_src, m_dst, dtype=x.dtype)
        cleanup.append(drop)

        def drop_in():
            y = drop.communicate(leaf)
            y.backward(g)
            return y, grad_of(leaf)

        fns["drop-in"] = drop_in
        if case.src == case.dst:  # nothing moves: the floor is a plain autograd.Function
            least = torch.compile(lambda t: _Passthrough.apply(t), backend=compile_backend,
                                  fullgraph=True)
            for name, fn in (("passthrough", _Passthrough.apply),
                             ("compiled passthrough", least)):
                def passthrough(fn=fn):
                    y = fn(leaf)
                    y.backward(g)
                    return y, grad_of(leaf)

                fns[name] = passthrough

    for variant in ("Redistributor", "compiled"):
        red = Redistributor(src, dst, sizes, name=f"bench {case.name} {variant}")
        cleanup.append(red)
        call = red if variant == "Redistributor" else torch.compile(
            lambda t, red=red: red(t), backend=compile_backend, fullgraph=True)

        def functional(call=call):
            y = call(leaf if on_src else None)
            if on_dst:
                y.backward(g)
            else:
                mimo_fx.backward()
            return (y if on_dst else None), grad_of(leaf)

        fns[variant] = functional
    return fns, cleanup


def _case(rank: int, case: Case, nbytes: int, iters: int, warmup: int, mods: dict,
          compile_backend: str) -> dict:
    from common import timed

    from mimo_fx.reference import shard

    s = nbytes // (B * H * 4)
    sizes = {"b": B, "s": s, "h": H}
    x_full, g_full = _tensors(s)
    src, dst = case.layouts()
    x = shard(x_full, src)[rank] if src.holds(rank) else None
    g = shard(g_full, dst)[rank] if dst.holds(rank) else None
    want_y = g_want = None
    if dst.holds(rank):
        want_y = shard(x_full, dst)[rank]
    if src.holds(rank):
        g_want = shard(g_full, src)[rank]
    fns, cleanup = _variants(case, mods, rank, x, g, sizes, compile_backend)
    names = list(fns)
    try:
        wrong = []
        for name in names:  # also the compile, before timing
            y, gx = fns[name]()
            ok = (want_y is None or (y is not None and torch.equal(y.detach(), want_y))) and \
                 (g_want is None or (gx is not None and torch.equal(gx, g_want)))
            wrong.append(0.0 if ok else 1.0)
        times = timed(fns, iters, warmup)
        k = len(names)
        values = torch.tensor([times[n][0] for n in names] + [times[n][1] for n in names]
                              + wrong, dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        out = dict(zip(names, values[:k].tolist()))
        out["cpu"] = dict(zip(names, values[k:2 * k].tolist()))
        out["wrong"] = [n for n, w in zip(names, values[2 * k:].tolist()) if w]
        return out
    finally:
        for obj in cleanup:
            obj.destroy()
        torch._dynamo.reset()


def _bench(rank: int, world: int, root: str, sizes: tuple[int, ...], iters: tuple[int, int],
           warmup: int, compile_backend: str, backend: str):
    """Every case at every size; ``iters``: timed calls above ``SMALL`` bytes, and up to it."""
    with megatron_core.on_cpu() if backend == "gloo" else contextlib.nullcontext():
        return _cases(rank, root, sizes, iters, warmup, compile_backend)


def _cases(rank: int, root: str, sizes: tuple[int, ...], iters: tuple[int, int],
           warmup: int, compile_backend: str):
    mods = megatron_core.load(root)
    rows = []
    total = len(CASES) * len(sizes)
    for case in CASES:
        for nbytes in sizes:
            start = time.perf_counter()
            calls = iters[1] if nbytes <= SMALL else iters[0]
            rows.append(_case(rank, case, nbytes, calls, warmup, mods, compile_backend))
            if rank == 0:
                print(f"  [{len(rows)}/{total}] {case.name}, {_size(nbytes)}: "
                      f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    for cls in (mods["bridge_communicator"].BridgeCommunicator,):
        cls.destroy_broadcast_pgs()
        cls.destroy_bridge_pgs()
    return rows if rank == 0 else None


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def report(rows: list[dict], sizes: tuple[int, ...]) -> str:
    table, floor, compiled, cpu = [], [], [], []
    shown = ("drop-in", "drop-in sizes=", "Bridge", "Redistributor", "compiled")
    it = iter(rows)
    for case in CASES:
        src, dst = case.grids()
        for nbytes in sizes:
            r = next(it)
            names = VARIANTS[case.pipelined]
            s = nbytes // (B * H * 4)
            p = plan(*case.layouts(), {"b": B, "s": s, "h": H}, 4)
            ms = {n: r[n] * 1e3 for n in names}
            ratios = [f"{ms[n] / ms['Megatron']:.2f}" if n in ms else "" for n in shown]
            c = {n: r["cpu"][n] * 1e3 for n in names}
            cpu.append([case.name, _size(nbytes), f"{c['Megatron']:.2f}"]
                       + [f"{c[n] / c['Megatron']:.2f}" if n in c else "" for n in shown])
            check = "exact" if not r["wrong"] else "WRONG: " + ", ".join(r["wrong"])
            table.append([case.name, f"{_fmt(case.src)} -> {_fmt(case.dst)}", _size(nbytes),
                          collectives(p), f"{ms['Megatron']:.2f}", *ratios, check])
            if "passthrough" in r:
                floor.append(f"{_size(nbytes)} {r['Redistributor'] / r['passthrough']:.2f}")
                compiled.append(f"{_size(nbytes)} {r['compiled'] / r['compiled passthrough']:.2f}"
                                f" ({r['compiled passthrough'] * 1e3:.2f} ms)")
    note = ("" if not floor else
            "\nWhere nothing moves, the eager Redistributor's forward + backward over a plain "
            "autograd.Function passthrough's (a view forward, the gradient back; same "
            "interleaved loop; target <= 1.5): " + ", ".join(floor) + ". The compiled "
            "call's over the same passthrough compiled alike (torch.compile's own cost per "
            "call): " + ", ".join(compiled) + ".")
    return tabulate(table, disable_numparse=True,
                    colalign=("left", "left", "right", "left", "right", "right", "right",
                              "right", "right", "right", "left"),
                    headers=["case", "grids", "X", "mimo_fx plan", "Megatron ms",
                             "drop-in / Megatron", "drop-in sizes= / Megatron",
                             "Bridge / Megatron", "Redistributor / Megatron",
                             "compiled / Megatron", "values"]) + note + (
        "\n\nHost CPU per call (process CPU time of forward + backward, gloo's threads "
        "included; median over the same timed calls, max over ranks), over Megatron's:\n\n")\
        + tabulate(cpu, disable_numparse=True,
                   colalign=("left", "right", "right", "right", "right", "right", "right",
                             "right"),
                   headers=["case", "X", "Megatron CPU ms", *(f"{n} / Megatron"
                                                              for n in shown)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", metavar="PATH",
                        help="a megatron_core wheel, or a directory holding megatron/core")
    parser.add_argument("--fetch", action="store_true",
                        help=f"without --megatron: pip-download megatron-core=="
                             f"{MEGATRON_VERSION} (no dependencies) into {CACHE}")
    parser.add_argument("--quick", action="store_true",
                        help="2 sizes, fewer calls; writes no result file")
    parser.add_argument("--iters", type=int, default=None, metavar="N")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="KIB",
                        help="sizes of X in KiB (default 64 1024 16384)")
    parser.add_argument("--compile-backend", default="aot_eager",
                        help="torch.compile backend of the compiled variant")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    root = _megatron_root(args.megatron, args.fetch)
    iters = args.iters or (QUICK_ITERS if args.quick else ITERS)
    small_iters = args.iters or (QUICK_ITERS if args.quick else SMALL_ITERS)
    warmup = QUICK_WARMUP if args.quick else WARMUP
    sizes = tuple(k << 10 for k in args.sizes) if args.sizes else (
        QUICK_SIZES if args.quick else SIZES)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        f"mimo_fx vs Megatron-Core {megatron_core.version(root)}'s bridge communicators: {WORLD} "
        f"{args.backend} ranks, float32, forward + backward per call; X = {B} x s x {H}; "
        f"median of {iters} timed calls ({small_iters} up to {_size(SMALL)}; {warmup} "
        f"warm-up), variants interleaved, barrier "
        f"before each; max over ranks; compiled: torch.compile(backend="
        f"{args.compile_backend!r}, fullgraph=True)",
        f"machine: {os.cpu_count()} CPUs, load average before {load}; torch "
        f"{torch.__version__}; 1 thread per rank",
    ]
    print("\n".join(lines) + "\n", flush=True)
    start = time.perf_counter()
    rows = run_world(WORLD, _bench, root, sizes, (iters, small_iters), warmup,
                     args.compile_backend,
                     args.backend, timeout=args.timeout, backend=args.backend)[0]
    text = report(rows, sizes)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    tail = (f"\nWorld run took {time.perf_counter() - start:.0f} s; load average after it "
            f"{load}.")
    print(text + "\n" + tail)
    if not args.quick and not args.sizes:
        os.makedirs(os.path.dirname(RESULT), exist_ok=True)
        with open(RESULT, "w") as f:
            f.write(f"# python bench/megatron_compare.py, {datetime.date.today().isoformat()}"
                    f"\n" + "\n".join(lines) + "\n\n" + text + "\n" + tail + "\n")
        print(f"wrote {os.path.relpath(RESULT)}")
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
