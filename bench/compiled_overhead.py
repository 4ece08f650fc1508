"""What a compiled bridge call costs over the eager one, and how much of that is
``torch.compile``'s own cost per call.

Two gloo processes (one per core: no process waits for a core), a pair all-gather
``(dp b) s h`` on ``Grid(dp=2)`` -> ``b s h`` on ``Grid(tp=2)`` at 64 KiB of output,
forward + backward per call. Six variants, interleaved, a barrier before each call:
the eager ``Redistributor``, the same bridge under ``torch.compile`` (``fullgraph``), a
plain ``autograd.Function`` passthrough (a view forward, the gradient back) and that
passthrough compiled alike, and torch's own traceable all-gather
(``all_gather_tensor_autograd``, whose backward is a reduce-scatter: one more
collective than the bridge's) eager and compiled. Medians of wall and process CPU
time (gloo's threads included), max over the ranks; then the compiled call's graphs
(Dynamo's, and AOT autograd's forward and backward), which show what the compiled
call runs.

The passthrough pair gives ``torch.compile``'s floor per call (its frame, guards and
AOT autograd's runtime wrappers); the rest of the compiled call's excess is the
ordered custom op that keeps every rank's collectives in one order (its effect token)
and the op's dispatch. On CPU each is paid synchronously; on a GPU the host runs ahead
of the device, so a host cost per call is hidden while the device is busy.

    python bench/compiled_overhead.py     # -> results/compiled_overhead.txt
    python bench/compiled_overhead.py --quick   # 50 calls, writes nothing
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = {"b": 8, "s": 8, "h": 256}  # float32: 64 KiB gathered
RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                      "compiled_overhead.txt")


class _Passthrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view(t.shape)

    @staticmethod
    def backward(ctx, g):
        return g


def _graphs(fn, x: torch.Tensor) -> list[str]:
    """The code of the graphs ``fn`` compiles to (one forward + backward at ``x``):
    Dynamo's, AOT autograd's forward and backward."""
    from torch._functorch.aot_autograd import aot_module_simplified

    out: list[str] = []

    def keep(name: str):
        def compiler(gm, example_inputs):
            out.append(f"{name}:{gm.code.rstrip()}")
            return gm
        return compiler

    def backend(gm, example_inputs):
        out.append(f"dynamo:{gm.code.rstrip()}")
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep("aot forward"),
                                     bw_compiler=keep("aot backward"))

    torch.compile(fn, backend=backend, fullgraph=True)(x).sum().backward()
    x.grad = None
    return out


def _world(rank: int, world: int, iters: int) -> dict:
    from common import timed

    from mimo_fx import Grid, Layout
    from mimo_fx.compiled import Redistributor

    src, dst = Layout(Grid(dp=world), "(dp b) s h"), Layout(Grid(tp=world), "b s h")
    bridge = Redistributor(src, dst, SIZES, name="compiled overhead")
    x = torch.randn(SIZES["b"] // world, SIZES["s"], SIZES["h"], requires_grad=True)
    g = torch.randn(SIZES["b"], SIZES["s"], SIZES["h"])
    g_own = torch.randn(x.shape)

    def call(fn, grad):
        def run():
            fn(x).backward(grad)
            x.grad = None
        return run

    def compiled(fn):
        return torch.compile(fn, backend="aot_eager", fullgraph=True)

    def bare(t):  # torch's own traceable all-gather (its backward: a reduce-scatter)
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        return all_gather_tensor_autograd(t, 0, dist.group.WORLD).view(g.shape)

    fns = {"eager bridge": call(bridge, g),
           "compiled bridge": call(compiled(lambda t: bridge(t)), g),
           "eager passthrough": call(_Passthrough.apply, g_own),
           "compiled passthrough": call(compiled(lambda t: _Passthrough.apply(t)), g_own),
           "eager functional all-gather": call(bare, g),
           "compiled functional all-gather": call(compiled(bare), g)}

    try:
        times = timed(fns, iters, 20)
        graphs = _graphs(lambda t: bridge(t), x)
    finally:
        bridge.destroy()
    values = torch.tensor([v for n in fns for v in times[n]], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {"times": dict(zip(fns, values.view(-1, 2).tolist())), "graphs": graphs}


def report(res: dict) -> str:
    from tabulate import tabulate

    t = res["times"]
    rows = [[name, f"{wall * 1e3:.3f}", f"{cpu * 1e3:.3f}"] for name, (wall, cpu) in t.items()]
    excess = {i: t["compiled bridge"][i] - t["eager bridge"][i] for i in (0, 1)}
    floor = {i: t["compiled passthrough"][i] - t["eager passthrough"][i] for i in (0, 1)}
    bare = {i: t["compiled functional all-gather"][i] - t["eager functional all-gather"][i]
            for i in (0, 1)}
    lines = [tabulate(rows, headers=["variant", "wall ms", "CPU ms"]), "",
             f"compiled bridge over eager bridge: wall +{excess[0] * 1e3:.3f} ms, CPU "
             f"+{excess[1] * 1e3:.3f} ms; torch.compile's own (compiled passthrough over "
             f"eager passthrough): wall +{floor[0] * 1e3:.3f} ms, CPU +{floor[1] * 1e3:.3f} ms",
             f"torch's functional all-gather, compiled over eager: wall "
             f"+{bare[0] * 1e3:.3f} ms, CPU +{bare[1] * 1e3:.3f} ms",
             "", "the compiled call's graphs (rank 0):", *res["graphs"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300, help="timed calls per variant")
    parser.add_argument("--quick", action="store_true", help="50 calls; writes no file")
    args = parser.parse_args(argv)
    iters = 50 if args.quick else args.iters
    if iters < 1:
        parser.error(f"--iters {iters}: give at least 1")
    from datetime import date

    from mimo_fx.testing import run_world

    res = run_world(2, _world, iters, timeout=600)[0]
    text = (f"# python bench/compiled_overhead.py, {date.today()}\n"
            f"a pair all-gather of {SIZES} float32, 2 gloo ranks, forward + backward; median "
            f"of {iters} interleaved calls, max over ranks; torch {torch.__version__}\n"
            + report(res) + "\n")
    print(text, end="")
    if not args.quick:
        with open(RESULT, "w") as f:
            f.write(text)
        print(f"wrote bench/results/{os.path.basename(RESULT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
