"""mimo_fx.testing: run_world's results by rank, and a failing rank reported as the cause
rather than the peers that lost it; a SpawnedWorld running many functions in the same
processes, each from the same state, torn down and spawned again after a function that
raises, dies, hangs or ends its world; SpawnedWorlds keeping at most so many processes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mimo_fx import MimoFxError
from mimo_fx.testing import SpawnedWorld, SpawnedWorlds, WorldError, run_world


def _sum_of_ranks(rank: int, world: int, scale: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t.item())


def _one_rank_fails(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one's own mistake")
    dist.all_reduce(torch.ones(1))  # rank 0 loses its peer here


def _rank_one_hangs(rank: int, world: int) -> None:
    import time

    if rank == 1:
        time.sleep(600)  # never returns in time


def _rank_one_dies(rank: int, world: int) -> None:
    import os

    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _waits_then_sums(rank: int, world: int, seconds: float) -> int:
    import time

    time.sleep(seconds)
    return _sum_of_ranks(rank, world, 1)


def _leaves_its_world(rank: int, world: int) -> int:
    import torch.distributed as dist

    dist.destroy_process_group()
    return rank


def _state(rank: int, world: int) -> dict:
    """What a function could find changed by the one before it."""
    import logging
    import os
    import warnings

    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters

    return {"pid": os.getpid(), "env": {k: os.environ.get(k) for k in
                                        ("LEFT_BEHIND", "GIVEN", "TORCH_FR_BUFFER_SIZE")},
            "cwd": os.getcwd(), "random": torch.rand(2).tolist(),
            "dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
            "grad": torch.is_grad_enabled(), "counters": sum(map(len, counters.values())),
            "cache_size_limit": torch._dynamo.config.cache_size_limit,
            "compile_threads": torch._inductor.config.compile_threads,
            "logger": (logging.getLogger("mimo_fx").level,
                       len(logging.getLogger("mimo_fx").handlers)),
            "warnings": len(warnings.filters)}


def _dirty(rank: int, world: int) -> None:
    import logging
    import os
    import warnings

    import torch._dynamo
    import torch._inductor.config

    os.environ["LEFT_BEHIND"] = "1"
    os.environ.pop("GIVEN")
    os.chdir("/")
    torch.manual_seed(rank + 1)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch._dynamo.config.cache_size_limit = 1
    torch._inductor.config.compile_threads = 7
    logging.getLogger("mimo_fx").setLevel(logging.DEBUG)
    logging.getLogger("mimo_fx").addHandler(logging.NullHandler())
    warnings.simplefilter("error")
    torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2))  # counters, caches
    torch.set_grad_enabled(False)


def test_results_by_rank_and_errors():
    assert run_world(2, _sum_of_ranks, 10) == [10, 10]
    # the rank that raised is reported, not the peer whose collective lost it
    with pytest.raises(WorldError, match=r"(?s)rank 1 raised.*rank one's own mistake"):
        run_world(2, _one_rank_fails, timeout=120)
    with pytest.raises(MimoFxError, match="world=0: need at least one process"):
        run_world(0, _sum_of_ranks, 1)


def _inherited(rank: int, world: int, name: str) -> str | None:
    import os
    import sys

    print(f"rank {rank} writes to its stderr", file=sys.stderr, flush=True)
    return os.environ.get(name)


def test_a_world_inherits_its_parents_environment_and_streams_when_started(capfd,
                                                                          monkeypatch):
    """As a spawned process would: a world's processes are forked from a server started
    earlier, with the environment and streams of that moment (mimo_fx.testing.worlds)."""
    with capfd.disabled():  # the server runs from here on (if it did not), outside capfd
        run_world(1, _sum_of_ranks, 1)
    monkeypatch.setenv("MIMO_FX_SET_LATER", "now")
    assert run_world(2, _inherited, "MIMO_FX_SET_LATER") == ["now", "now"]
    err = capfd.readouterr().err
    assert "rank 0 writes to its stderr" in err and "rank 1 writes to its stderr" in err, err


@pytest.fixture(scope="module")
def world():
    with SpawnedWorld(2, record=True, env={"GIVEN": "yes"}) as w:
        yield w


def test_a_world_runs_each_function_in_the_same_state(world):
    first = world.run(_state)
    world.run(_dirty)
    again = world.run(_state)
    assert again == first  # the same processes (pid), nothing left behind
    assert first[0]["env"] == {"LEFT_BEHIND": None, "GIVEN": "yes",
                               "TORCH_FR_BUFFER_SIZE": "20000"}
    assert world.run(_sum_of_ranks, 3) == [3, 3]
    assert world.spawns == 1


@pytest.mark.parametrize("fn, timeout, words", [
    (_one_rank_fails, 60, r"(?s)rank 1 raised.*rank one's own mistake"),
    (_rank_one_dies, 60, r"rank 1 of the 2-process world died \(exit code 3\)"),
    (_rank_one_hangs, 3, r"(?s)did not finish in 3 s.*ranks \[1\] never finished.*"
                         r"rank 1 is at: File .*test_launch.py.* in _rank_one_hangs"),
])
def test_a_failed_function_is_reported_and_its_world_replaced(world, fn, timeout, words):
    world.run(_sum_of_ranks, 1)  # up before the failure
    spawns = world.spawns
    with pytest.raises(WorldError, match=words):
        world.run(fn, timeout=timeout)
    assert not world.alive
    assert world.run(_sum_of_ranks, 10) == [10, 10]
    assert world.spawns == spawns + 1


def test_a_function_that_ends_its_world_retires_it(world):
    assert world.run(_leaves_its_world) == [0, 1]
    assert not world.alive
    assert world.run(_sum_of_ranks, 2) == [2, 2]


def test_worlds_keep_one_world_per_key_within_a_process_budget():
    worlds = SpawnedWorlds(max_processes=3, env={"GIVEN": "everywhere"})
    try:
        assert worlds.run(1, _state)[0]["env"]["GIVEN"] == "everywhere"
        assert worlds.run(1, _sum_of_ranks, 5) == [0]
        plain = worlds.world(1)
        assert worlds.spawns == 1 and plain.alive
        assert worlds.run(1, _state, env={"GIVEN": "other"})[0]["env"]["GIVEN"] == "other"
        other = worlds.world(1, env={"GIVEN": "other"})
        assert plain.alive  # two processes fit
        assert worlds.run(2, _sum_of_ranks, 1) == [1, 1]  # one of the two older makes room
        pair = worlds.world(2)
        assert not plain.alive and other.alive and worlds.spawns == 3
        assert worlds.run(1, _sum_of_ranks, 2, env={"GIVEN": "other"}) == [0]  # (now newer)
        # room is made from the smallest worlds first, not the least recently used
        assert worlds.run(1, _sum_of_ranks, 3, env={"GIVEN": "third"}) == [0]
        assert pair.alive and not other.alive and worlds.spawns == 4
    finally:
        worlds.close()
    with pytest.raises(MimoFxError, match="world=0: need at least one process"):
        SpawnedWorld(0)


def test_a_started_world_runs_beside_the_caller_and_is_never_closed_for_room():
    worlds = SpawnedWorlds(max_processes=3)
    try:
        assert worlds.run(2, _sum_of_ranks, 1) == [1, 1]
        pair = worlds.world(2)
        started = worlds.start(1, _waits_then_sums, 2.0)
        busy = worlds.world(1)
        assert busy.busy
        # room for another world while the busy one waits: the smallest idle world goes
        # (the busy one would have gone first, being smaller)
        assert worlds.run(1, _sum_of_ranks, 7, env={"GIVEN": "other"}) == [0]
        assert busy.alive and busy.busy and not pair.alive
        assert started.result() == [0] and started.result() == [0]
        assert not busy.busy and busy.runs == 1
        # a run of a world whose function was started but not collected takes its
        # results first (kept for the handle), then runs
        again = worlds.start(2, _sum_of_ranks, 2)
        # results collected after the deadline of a function that met it are its results
        late = worlds.start(1, _sum_of_ranks, 5, timeout=1.0)
        time.sleep(2.0)
        assert late.result() == [0]
        assert worlds.run(2, _sum_of_ranks, 3) == [3, 3] and again.result() == [2, 2]
        failing = worlds.start(2, _one_rank_fails)
        with pytest.raises(WorldError, match="rank one's own mistake"):
            failing.result()
        pair = worlds.world(2)
        assert not pair.alive and not pair.busy  # torn down; the next run spawns again
        assert worlds.run(2, _sum_of_ranks, 1) == [1, 1]
    finally:
        worlds.close()


# -- last in the module: its wait overlaps the tests above when run alone ---------------
class _InThread:
    """``fn()`` on a thread of this process, from now on; :meth:`result` waits for it and
    returns its value or raises its error (the handle ``START_EARLY`` wants)."""

    def __init__(self, fn) -> None:
        self._outcome: tuple = (False, RuntimeError("never ran"))
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._outcome = (True, fn())
        except BaseException as err:  # noqa: BLE001 - re-raised by result()
            self._outcome = (False, err)

    def result(self):
        self._thread.join()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def _start_hang(worlds=None) -> _InThread:
    # (the timeout covers the spawn, which a loaded machine can make slow: started
    # early, the wait costs the suite nothing)
    return _InThread(lambda: run_world(2, _rank_one_hangs, timeout=40))


# run_world's hang waits out its timeout: started with the session's first test, it
# waits beside the tests that compute (tests/conftest.py)
START_EARLY = {"hang": _start_hang}


@pytest.fixture(scope="module")
def hang(started_early):
    return started_early.pop(_start_hang, None) or _start_hang()


@pytest.mark.slow
def test_a_hang_names_the_rank_and_where_it_is(hang):
    with pytest.raises(WorldError, match=r"(?s)ranks \[1\] never finished.*rank 1 is at: "
                                         r"File .*test_launch.py.* in _rank_one_hangs"):
        hang.result()
