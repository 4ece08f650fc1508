"""What a bridge call costs ``torch.compile``: bytecode instructions Dynamo traces per
call, and the wall time of a step's first (compiling) call, this tree against another.

A bridge call is traced at every compile of every step that calls it, so the suite and a
user's first step pay for each instruction of the call's Python (the custom vjp, the
executor, the numbers of a template program, the size gather's inference). Cases, on
4 gloo ranks, ``aot_eager``, a zigzag fan-in TP2xDP2 -> CP2xDP2 (``(dp b) s h`` ->
``(dp b) (cp s) h``):

- ``fixed``: every size given when the bridge is built (a plain program);
- ``learned``: only ``h`` given, ``b`` and ``s`` learned per call (a template program
  evaluated at the call's sizes, and the size gather).

Per case and tree: the instructions Dynamo steps through while compiling a step with one
call of the bridge (rank 0; counted by wrapping Dynamo's instruction step, so the count
is of this torch release's tracer), and the median over ``--rounds`` of the wall time
of the first call of a step with ``--bridges`` calls (max over ranks; after a warm-up
compile, so the world's first-compile cost is not in it). With ``--before PATH`` the two
trees take turns, round by round, each in its own world (a subprocess whose
``PYTHONPATH`` starts with an import root for its tree, as ``versions.py`` builds).

    python bench/compile_cost.py --before /path/to/older/checkout   # -> results/compile_cost.txt
    python bench/compile_cost.py --rounds 1                        # this tree only, quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
CASES = {"fixed": {"b": 4, "s": 8, "h": 16}, "learned": {"h": 16}}


def _first_call(calls: list, x, count: bool) -> tuple[float, int]:
    """The wall seconds of the first call of a step calling every bridge of ``calls``,
    and (with ``count``) the instructions Dynamo traced for it."""
    import time

    import torch
    import torch.distributed as dist
    from torch._dynamo import symbolic_convert

    def step(t):
        loss = t.sum() * 0
        for bridge in calls:
            loss = loss + bridge(t).sum()
        return loss

    stepped = [0]
    original = symbolic_convert.InstructionTranslatorBase.step

    def counted(self):
        stepped[0] += 1
        return original(self)

    if count:
        symbolic_convert.InstructionTranslatorBase.step = counted
    f = torch.compile(step, backend="aot_eager", fullgraph=True)
    dist.barrier()
    start = time.perf_counter()
    try:
        f(x).backward()
    finally:
        symbolic_convert.InstructionTranslatorBase.step = original
    return time.perf_counter() - start, stepped[0]


def _world(rank: int, size: int, bridges: int) -> dict:
    import torch
    import torch._dynamo

    from mimo_fx import Grid, Layout
    from mimo_fx.compiled import Redistributor

    src = Layout(Grid(tp=2, dp=2), "(dp b) s h")
    dst = Layout(Grid(cp=2, dp=2), "(dp b) (cp s) h", zigzag="cp")
    x = torch.randn(2, 8, 16, requires_grad=True)
    warm = torch.compile(lambda t: (t * 2).sum(), backend="aot_eager", fullgraph=True)
    warm(x).backward()
    out: dict = {}
    for case, sizes in CASES.items():
        for n in (1, bridges):
            torch._dynamo.reset()
            calls = [Redistributor(src, dst, sizes, name=f"{case}{n}.{i}") for i in range(n)]
            seconds, stepped = _first_call(calls, x, count=n == 1)
            if n == 1:
                out[f"{case}_instructions"] = stepped
            else:
                out[f"{case}_seconds"] = seconds
            for bridge in calls:
                bridge.destroy()
    return out


def _run(tree: str, bridges: int, timeout: float) -> dict:
    """One world of ``tree``: per case, rank 0's instructions and the max seconds."""
    from versions import _import_root

    with tempfile.TemporaryDirectory(prefix="mimo_fx_compile_cost_") as tmp:
        env = dict(os.environ)
        if os.path.realpath(tree) != os.path.realpath(TREE):
            env["PYTHONPATH"] = _import_root(tree, tmp) + os.pathsep + env.get("PYTHONPATH", "")
        code = (f"import json, sys; sys.path.insert(0, {HERE!r}); import compile_cost as c; "
                f"from mimo_fx.testing import run_world; "
                f"r = run_world(4, c._world, {bridges}, timeout={timeout!r}); "
                f"print('RESULT ' + json.dumps(r))")
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=timeout + 60)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            ranks = json.loads(line[7:])
            return {k: (ranks[0][k] if k.endswith("instructions")
                        else max(r[k] for r in ranks)) for k in ranks[0]}
    raise SystemExit(f"the world of {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="an older checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bridges", type=int, default=4, help="calls in the timed step")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from tabulate import tabulate
    from versions import _commit

    trees = {"before": args.before, "this tree": TREE} if args.before else {"this tree": TREE}
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for k in range(args.rounds):
        for label, tree in trees.items():
            runs[label].append(_run(tree, args.bridges, args.timeout))
            print(f"round {k + 1}/{args.rounds}, {label}: {runs[label][-1]}", flush=True)
    rows = []
    for case in CASES:
        row = [case]
        for label in trees:
            row += [runs[label][0][f"{case}_instructions"],
                    statistics.median(r[f"{case}_seconds"] for r in runs[label])]
        if args.before:
            row += [f"{row[3] / row[1]:.2f}x", f"{row[4] / row[2]:.2f}x"]
        rows.append(row)
    heads = ["case"]
    for label in trees:
        heads += [f"{label}: instructions / call", f"{label}: s, step of {args.bridges} calls"]
    if args.before:
        heads += ["instructions after / before", "seconds after / before"]
    lines = [f"compile cost of a bridge call: 4 gloo ranks, aot_eager, median of "
             f"{args.rounds} round(s) taken in turns",
             *(f"{label}: {_commit(tree)}" for label, tree in trees.items()), "",
             tabulate(rows, heads, floatfmt=".2f")]
    text = "\n".join(lines)
    print(text)
    if args.before and args.rounds >= 3:
        with open(os.path.join(HERE, "results", "compile_cost.txt"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
