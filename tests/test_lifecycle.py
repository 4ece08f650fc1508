"""Process groups survive many bridge build/destroy cycles, and a dead world is reported.

A 4-rank world where every bridge creates real subgroups (not WORLD): a disjoint bridge
(ranks 0-1 to ranks 2-3, every rank a member of some groups and not others) and a
colocated one whose plan uses pairs of ranks. Many cycles must neither fail in gloo's
connection setup nor leak process groups, file descriptors or threads (200 cycles by
default: a leak of one of them per cycle shows as growth between the 100th and the 200th
as surely as over 1,000, at a fifth of the group setups a loaded machine must serve in
time; ``LIFECYCLE_CYCLES`` raises it), and every bridge
must still move data correctly at the end. After ``destroy_process_group`` a bridge
built before raises :class:`MimoFxError`, not a torch internal error, and so does a
group's setup that a member never comes to.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from mimo_fx import Grid, Layout, MimoFxError
from mimo_fx.reference import shard
from mimo_fx.testing import run_world

pytestmark = pytest.mark.slow  # spawned worlds, long: not in the fast subset (tests/README.md)

SIZES = {"b": 4, "s": 8, "h": 2}
DISJOINT = (Layout(Grid(dp=2), "(dp b) s h"), Layout(Grid(tp=2, offset=2), "b (tp s) h"))
PAIRS = (Layout(Grid(tp=2, dp=2), "(dp b) s h"), Layout(Grid(tp=2, dp=2), "(dp b) (tp s) h"))
CYCLES = int(os.environ.get("LIFECYCLE_CYCLES", "200"))


def _resources() -> tuple[int, int, int]:
    import torch.distributed as dist

    from mimo_fx.compiled import groups

    assert groups.settle(), "destroyed groups were not freed within 60 s"  # (a thread frees them)
    fds = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))  # native threads too, not only Python's
    return len(dist.distributed_c10d._world.pg_map), fds, threads + threading.active_count()


def _moves_data(rank: int, src: Layout, dst: Layout) -> str | None:
    from mimo_fx.compiled import Redistributor

    full = torch.arange(64.0).reshape(4, 8, 2)
    bridge = Redistributor(src, dst, SIZES)
    x = shard(full, src)[rank] if rank in src.grid.ranks else None
    y = bridge(x)
    bridge.destroy()
    if rank not in dst.grid.ranks:  # a rank of the src grid only gets an empty piece
        return None if y is not None and y.numel() == 0 else f"rank {rank}: gave {y}"
    want = shard(full, dst)[rank]
    if not torch.equal(y, want):
        return f"rank {rank}: {src} -> {dst} gave {y}, expected {want}"
    return None


def _cycles(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from mimo_fx.compiled import Redistributor, live_groups

    out: dict = {}
    for src, dst in (DISJOINT, PAIRS):  # warm: gloo's first connections and threads
        _moves_data(rank, src, dst)
    before = _resources()
    halfway = before
    for i in range(CYCLES):
        src, dst = (DISJOINT, PAIRS)[i % 2]
        bridge = Redistributor(src, dst, SIZES)
        bridge.destroy()
        if i == CYCLES // 2 - 1:
            halfway = _resources()
    after = _resources()
    out["no_leak"] = (None if after == halfway == before and live_groups() == 0 else
                      f"(process groups, fds, threads) {before} -> {halfway} (halfway) -> "
                      f"{after}, {live_groups()} groups registered")
    out["still_moves_data_disjoint"] = _moves_data(rank, *DISJOINT)
    out["still_moves_data_pairs"] = _moves_data(rank, *PAIRS)

    survivor = Redistributor(*PAIRS, SIZES)
    dist.barrier()
    dist.destroy_process_group()
    try:
        survivor(shard(torch.zeros(4, 8, 2), PAIRS[0])[rank])
        out["dead_world_error"] = "a call after destroy_process_group did not raise"
    except MimoFxError as e:
        out["dead_world_error"] = (None if "destroy_process_group" in str(e) else str(e))
    except Exception as e:  # noqa: BLE001 - the point is which kind
        out["dead_world_error"] = f"{type(e).__name__}, not MimoFxError: {e}"
    survivor.destroy()  # harmless once the world is gone
    return out


def test_many_cycles_on_real_subgroups():
    results = run_world(4, _cycles, timeout=600)
    problems = {(rank, name): value for rank, r in enumerate(results)
                for name, value in r.items() if value is not None}
    assert not problems, problems



def _missing_member(rank: int, world: int) -> dict:
    """A member that never comes to a group's setup (rank 1 skips it): rank 0's error
    and how long it waited, with ``MIMO_FX_TIMEOUT`` at 2 s."""
    import time

    from mimo_fx.compiled import groups

    os.environ["MIMO_FX_TIMEOUT"] = "2"
    out: dict = {}
    if rank == 0:
        start = time.monotonic()
        try:
            groups.acquire([(0, 1)], "missing", "my bridge")
            out["error"] = None
        except Exception as err:  # noqa: BLE001 - what it raised is the finding
            out["error"] = (type(err).__name__, str(err))
        out["seconds"] = time.monotonic() - start
    return out


def test_a_member_missing_from_a_groups_setup_is_named():
    """Before, the setup's timeout was torch's raw DistStoreError on the waiting rank."""
    out, _ = run_world(2, _missing_member, timeout=120)
    error, text = out["error"]
    assert error == "MimoFxError", out
    assert text.startswith("my bridge: rank 0 could not set up the process group of "
                           "ranks [0, 1] within MIMO_FX_TIMEOUT=2 s (DistStoreError"), text
    assert "a member of it did not get there in time" in text, text
    assert 2 <= out["seconds"] < 60, out
