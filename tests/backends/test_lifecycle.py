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


# -- a bridge is built by the ranks of its grids only ----------------------------------------
def _members_only(rank: int, world: int) -> dict:
    """Bridges over ranks 0-1, over 2-3 (each pair building its own, in its own order)
    and over all four, each built only by its grids' ranks: values, and the groups this
    rank holds."""
    import torch.distributed as dist

    from mimo_fx.compiled import Redistributor, groups

    out: dict = {"values": [], "held": []}
    full = torch.arange(32.0).reshape(4, 8)

    def run(src: Layout, dst: Layout) -> None:
        bridge = Redistributor(src, dst, {"b": 4, "h": 8})
        out["held"].append(sorted(r for _, r in groups.POOL.groups))
        y = bridge(shard(full, src)[rank] if src.holds(rank) else None)
        out["values"].append(y is not None and dst.holds(rank)
                             and torch.equal(y, shard(full, dst)[rank]))
        bridge.destroy()

    pair = (0, 1) if rank < 2 else (2, 3)
    grid = Grid(dp=2, offset=pair[0])
    for _ in range(2 if rank < 2 else 3):  # other numbers of builds on each pair
        run(Layout(grid, "(dp b) h"), Layout(Grid(tp=2, offset=pair[0]), "b (tp h)"))
    run(Layout(Grid(dp=4), "(dp b) h"), Layout(Grid(tp=4), "b (tp h)"))
    out["left"] = groups.live_groups()
    out["torch_groups"] = dist.distributed_c10d._world.group_count  # new_group's counter
    return out


def test_a_bridge_is_built_by_its_grids_ranks_only():
    """Ranks 0-1 and 2-3 each build their own bridges (a different number of them), then
    all four build one: nobody builds what is not theirs, every group a rank holds has
    it as a member, every value is the oracle's; torch's world-wide group counter never
    moves (no group is made by the whole world)."""
    results = run_world(4, _members_only, timeout=300)
    for rank, r in enumerate(results):
        assert all(r["values"]), (rank, r)
        assert all(rank in g for held in r["held"] for g in held), (rank, r["held"])
        assert r["left"] == 0, (rank, r)
    assert len({r["torch_groups"] for r in results}) == 1, results


def _host_raises(rank: int, world: int, out_dir: str) -> None:
    """Rank 3 builds the bridge with another dtype; every rank records its error, and
    rank 0 (the store's host) then exits at once, as a script without ``try`` does."""
    import json

    from mimo_fx.compiled import Redistributor

    dtype = torch.float64 if rank == 3 else torch.float32
    try:
        Redistributor(DISJOINT[0], DISJOINT[1], SIZES, dtype)
        text = "built"
    except Exception as err:  # noqa: BLE001 - what it raised is the finding
        text = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(text, f)
    if rank == 0:
        os._exit(0)  # the store goes with it


def test_ranks_that_differ_all_hear_it_though_the_stores_host_exits_at_once(tmp_path):
    """Before, rank 0 raised and exited while its peers still read the definitions from
    its store: they got torch's raw DistNetworkError. Now rank 0 raises only after every
    peer has read them."""
    import json

    from mimo_fx.testing import WorldError

    with pytest.raises(WorldError, match="rank 0 of the 4-process world died"):
        run_world(4, _host_raises, str(tmp_path), timeout=120)
    texts = {int(p.stem): json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(texts) == [0, 1, 2, 3], texts
    for rank, text in texts.items():
        assert text.startswith("MimoFxError: mimo_fx: the ranks built bridge"), (rank, text)
        assert "dtype differs: torch.float32 on ranks [0, 1, 2], torch.float64 on rank 3" \
            in text, (rank, text)


def _host_gone(rank: int, world: int, out_dir: str) -> None:
    """Rank 0 exits before it builds the bridge its peers build: they must hear that the
    store is gone, as a MimoFxError, long before the timeout."""
    import json
    import time

    from mimo_fx.compiled import Redistributor

    os.environ["MIMO_FX_TIMEOUT"] = "60"
    if rank == 0:
        os._exit(0)
    start = time.monotonic()
    try:
        Redistributor(DISJOINT[0], DISJOINT[1], SIZES)
        text = "built"
    except Exception as err:  # noqa: BLE001
        text = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump([text, time.monotonic() - start], f)


def test_a_peer_of_the_stores_host_gets_a_mimo_fx_error_when_it_is_gone(tmp_path):
    import json

    from mimo_fx.testing import WorldError

    with pytest.raises(WorldError, match="rank 0 of the 4-process world died"):
        run_world(4, _host_gone, str(tmp_path), timeout=120)
    got = {int(p.stem): json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(got) == [1, 2, 3], got
    for rank, (text, seconds) in got.items():
        assert text.startswith("MimoFxError: mimo_fx: rank"), (rank, text)
        assert "lost the store" in text and "rank 0, which hosts it, has exited" in text, text
        assert seconds < 50, (rank, seconds)
