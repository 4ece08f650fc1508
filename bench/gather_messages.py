"""An all-gather on gloo three ways: mimo_fx's messages through the group's first member
(records of at most ``comm.ROOTED_BYTES``, groups of ``comm.ROOTED_MEMBERS`` or more), its
direct messages (a record to and from every other member), and gloo's own all-gather.

A bridge's size records and check headers are all-gathers of a few integers over both grids
(:mod:`mimo_fx.compiled.redistributor`, :mod:`mimo_fx.compiled.guard`): latency-bound,
their cost is the number of messages. Each row: every rank's median of interleaved calls
(a barrier before each, untimed), the max over ranks; the gathered values are checked
against the members' records concatenated.

    python bench/gather_messages.py          # 4 and 8 processes, 200 calls each
    python bench/gather_messages.py --quick  # 40 calls
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from tabulate import tabulate

from mimo_fx.testing import run_world

ROW_BYTES = (64, 2 << 10, 16 << 10, 128 << 10, 1 << 20)


def _variants(record: torch.Tensor, want: torch.Tensor, world: int, group,
              wrong: list[str]) -> dict:
    """The three all-gathers of ``record``, each checking its output against ``want``."""
    import torch.distributed as dist

    from mimo_fx.compiled import comm

    full = torch.empty(world * record.numel())

    def messages(root: bool) -> None:
        saved = comm.ROOTED_BYTES
        comm.ROOTED_BYTES = (1 << 62) if root else -1
        try:
            got, works, _ = comm._gather_messages(record, world, group.group_name)
            comm.wait_all(works, "", None)
        finally:
            comm.ROOTED_BYTES = saved
        if not torch.equal(got, want):
            wrong.append("messages")

    def gloo() -> None:
        dist.all_gather_into_tensor(full, record, group=group)
        if not torch.equal(full, want):
            wrong.append("gloo")

    return {"root": lambda: messages(True), "direct": lambda: messages(False), "gloo": gloo}


def _world(rank: int, world: int, calls: int) -> list[dict]:
    import torch.distributed as dist
    from common import timed

    group = dist.new_group(list(range(world)))
    out = []
    for nbytes in ROW_BYTES:
        record = torch.arange(nbytes // 4, dtype=torch.float32) + 1000 * rank
        want = torch.cat([torch.arange(nbytes // 4, dtype=torch.float32) + 1000 * r
                          for r in range(world)])
        wrong: list[str] = []
        times = timed(_variants(record, want, world, group, wrong), calls, 5)
        out.append({"bytes": nbytes, "wrong": sorted(set(wrong)),
                    **{k: wall for k, (wall, _) in times.items()}})
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    calls = 40 if args.quick else 200
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"an all-gather of one record per rank on gloo: median of {calls} interleaved calls "
          f"per variant, barrier before each, max over ranks\nmachine: {os.cpu_count()} "
          f"CPUs, load average before {load}; torch {torch.__version__}\n", flush=True)
    from mimo_fx.compiled.comm import ROOTED_BYTES, ROOTED_MEMBERS

    table, bad = [], False
    for world in (4, 8):
        results = run_world(world, _world, calls, timeout=900)
        for i, nbytes in enumerate(ROW_BYTES):
            r = {k: max(res[i][k] for res in results) for k in ("root", "direct", "gloo")}
            wrong = sorted({w for res in results for w in res[i]["wrong"]})
            bad = bad or bool(wrong)
            used = ("root" if world >= ROOTED_MEMBERS and nbytes <= ROOTED_BYTES
                    else "direct")
            table.append([world, _size(nbytes), f"{r['root'] * 1e3:.2f}",
                         f"{r['direct'] * 1e3:.2f}", f"{r['gloo'] * 1e3:.2f}",
                         f"{r['root'] / r['direct']:.2f}", used,
                         "WRONG: " + ", ".join(wrong) if wrong else "exact"])
    print(tabulate(table, headers=["ranks", "record", "root ms", "direct ms", "gloo ms",
                                  "root / direct", "mimo_fx uses", "values"],
                   disable_numparse=True))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
