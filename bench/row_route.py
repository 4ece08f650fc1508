"""What a row bridge pays per new batch, in this tree against an older one, in one run.

A bridge into or out of a packed layout plans each new batch: the router's routing, then
this rank's route (its numbers and index vectors), which its programs run at. Packed
batches change every micro-batch, so this is a per-call cost of a packed bridge. The
bench times ``RowSizing.route`` (the same call in every tree since the row bridge has
existed) on fresh batches, so no cached route is hit.

Case: an encoder's ragged ``(dp t) h`` on TP2xDP4 into a ``t h`` packed layout on
TP2xCP2xDP2 (zigzag), 8 samples of 200-1,200 tokens per batch (about 5,600 rows),
ranks 0 and 5; then the reverse (packed into the encoder's layout). One process per tree
per round, the trees alternating and their order flipping each round; each process
times ``--batches`` batches after one untimed. Reported: ms per route (a process's median
route, and its mean, which carries the garbage collections its allocations cause; then
the median over rounds per tree), and the ratio this tree / before computed per round
(its range shows the noise).

    python bench/row_route.py --before <checkout of an older commit>
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _batches(n: int, seed: int) -> list:
    from mimo_fx import Grid
    from mimo_fx.packed import PackedLayout

    rng = random.Random(seed)
    out = []
    for _ in range(n + 1):
        lengths = [[rng.randint(200, 1200) for _ in range(4)] for _ in range(2)]
        packed = PackedLayout(Grid(tp=2, cp=2, dp=2), "t h", lengths)
        cuts = sorted(rng.sample(range(1, packed.n_rows), 3))
        counts = tuple(b - a for a, b in zip([0, *cuts], [*cuts, packed.n_rows]))
        out.append((packed, {"t": counts, "h": 64}))
    return out


def _time(params: dict) -> dict:
    """Runs in a tree's process: ms per route, per direction."""
    import torch

    from mimo_fx import Grid, Layout
    from mimo_fx.compiled.row_sizing import RowSizing

    enc = Layout(Grid(tp=2, dp=4), "(dp t) h", ragged="dp")
    batches = _batches(params["batches"], params["seed"])
    out = {}
    for name in ("into packed", "out of packed"):
        took = []
        for rank in (0, 5):
            first = batches[0][0]
            pair = (enc, first) if name == "into packed" else (first, enc)
            sizing = RowSizing(*pair, None, torch.float32, (), rank, "")
            for k, (packed, sizes) in enumerate(batches):
                src, dst = (enc, packed) if name == "into packed" else (packed, enc)
                start = time.perf_counter()
                sizing.route(src, dst, sizes)
                if k:  # (the first batch warms the process)
                    took.append(time.perf_counter() - start)
        # the median route, and the mean: a garbage collection lands on some calls (at
        # the same allocation counts in every run), which only the mean carries
        out[name] = statistics.median(took) * 1e3
        out[name + ", mean"] = statistics.mean(took) * 1e3
    return out


def _run(root: str, tree: str, params: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + HERE}
    code = ("import json, sys, mimo_fx, row_route; "
            f"assert mimo_fx.__file__.startswith({root!r}), mimo_fx.__file__; "
            f"print(json.dumps(row_route._time({params!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, cwd=root,
                          text=True, timeout=600, check=False)
    if done.returncode:
        raise SystemExit(f"the {tree} tree's process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="a checkout of an older commit")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args(argv)
    from versions import _import_root  # (this folder is on sys.path: run as a script)

    params = {"batches": args.batches, "seed": 0}
    results: dict[str, list[dict]] = {"this": [], "before": []}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"this": _import_root(ROOT, os.path.join(tmp, "this")),
                 "before": _import_root(os.path.abspath(args.before),
                                        os.path.join(tmp, "before"))}
        for k in range(args.rounds):
            for tree in (("before", "this") if k % 2 == 0 else ("this", "before")):
                results[tree].append(_run(roots[tree], tree, params))
            print(f"  round {k + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for case in results["this"][0]:
        this = [r[case] for r in results["this"]]
        before = [r[case] for r in results["before"]]
        ratios = [a / b for a, b in zip(this, before)]
        rows.append([case, f"{statistics.median(before):.2f}", f"{statistics.median(this):.2f}",
                     f"{statistics.median(ratios):.2f}x",
                     f"{min(ratios):.2f}x to {max(ratios):.2f}x"])
    print(f"Row route of a new batch, ms per route (median of {args.rounds} rounds; ranks 0 "
          f"and 5, {args.batches} batches each)")
    print(tabulate(rows, headers=["case", "before ms", "this ms", "this/before",
                                  "per-round ratio"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
