"""Session-wide test machinery.

``worlds``: the spawned gloo worlds the multi-process tests share, one per (size,
options), each process alive for the whole session and running one test module's
function after another (:class:`mimo_fx.testing.SpawnedWorlds`; tests/README.md says which
tests still spawn their own world and why). The terminal summary says how many worlds
were spawned, how many functions each ran and what ended them.

``started_early``: world functions that mostly wait, started with the session's first
test so that their waits overlap the other tests' work (a module's ``START_EARLY``).

``two_rounds``: plans whose exchanges across disjoint grids always take two rounds (the
tests' sizes are small enough for one), for tests of the two-round structure.

``touched_modules``: the library modules the run touched (:mod:`mimo_fx.testing.touched`)
for ``tests/project/test_touched.py``, which runs last.
"""

from __future__ import annotations

import importlib

import pytest

from mimo_fx.testing import SpawnedWorlds, touched

touched.track()  # with MIMO_FX_TRACK_CALLS=1 only

_POOLS: list[SpawnedWorlds] = []
# the library modules imported here when doctest collection starts (imports by the test
# modules) and when collection ends (the doctests import every module)
_IMPORTED: dict[str, set[str]] = {}


@pytest.fixture(scope="session")
def worlds():
    """``worlds.run(size, fn, *args, timeout=..., record=..., env=...)``: ``run_world``
    without the spawn when a world of that size and those options is already up."""
    # many ranks share few cores: Inductor compiles in each rank's own process, without
    # a pool of compile workers per rank (as test_invariant and test_variable_sizes set)
    pool = SpawnedWorlds(env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    _POOLS.append(pool)
    yield pool
    pool.close()


@pytest.fixture(scope="session", autouse=True)
def started_early(request, worlds) -> dict:
    """World functions started with the session's first test, while the tests before
    theirs run: a test module's ``START_EARLY`` maps a fixture name to a function
    ``start(worlds)`` (returning :meth:`SpawnedWorlds.start`'s handle) for a world
    function that mostly waits (hangs timing out), so that its waits overlap the
    compiles of the others; started only when a selected test uses that fixture, which
    takes the handle from this dict (keyed by ``start``) and collects the results."""
    started: dict = {}
    for item in request.session.items:
        early = getattr(getattr(item, "module", None), "START_EARLY", {})
        for fixture, start in early.items():
            if fixture in getattr(item, "fixturenames", ()) and start not in started:
                started[start] = start(worlds)
    return started


@pytest.fixture
def two_rounds(monkeypatch):
    """Plans whose exchanges across disjoint grids are never small enough for one round
    (the planner's two-round structure, at the small sizes tests use)."""
    plan_module = importlib.import_module("mimo_fx.plan")  # (mimo_fx.plan is the function)
    plan_module.clear_caches()
    monkeypatch.setattr(plan_module, "ONE_ROUND_ELEMENTS", 0)
    yield
    plan_module.clear_caches()


@pytest.fixture
def touched_modules(request) -> dict[str, set[str]]:
    """The library modules the tests run so far touched: "imported" by a test module or
    a test (in this process, not counting imports for doctest collection, or in a
    world's), and "called" (a function of it ran; with ``MIMO_FX_TRACK_CALLS=1``)."""
    now = touched.imported()
    by_tests = _IMPORTED.get("doctests", now) | (now - _IMPORTED.get("collected", now))
    return {"imported": by_tests | touched.IN_WORLDS["imported"],
            "called": touched.called() | touched.IN_WORLDS["called"]}


def pytest_collectstart(collector):
    if "doctests" not in _IMPORTED and type(collector).__name__ == "DoctestModule" \
            and touched.library_name(str(collector.path)):
        _IMPORTED["doctests"] = touched.imported()


def pytest_collection_finish(session):
    _IMPORTED["collected"] = touched.imported()


def pytest_collection_modifyitems(items):
    """The touched-modules check last, after everything it accounts for."""
    last = [item for item in items if item.nodeid.startswith("tests/project/test_touched.py")]
    items[:] = [item for item in items if item not in last] + last


def pytest_terminal_summary(terminalreporter):
    for pool in _POOLS:
        terminalreporter.write_sep("-", f"shared worlds: {pool.spawns} spawned")
        for line in pool.summary():
            terminalreporter.write_line(line)
    from mimo_fx.testing.nccl_rules import TOTALS

    if TOTALS["functions"]:
        terminalreporter.write_sep("-", "NCCL rules (MIMO_FX_NCCL_RULES=1)")
        terminalreporter.write_line(
            f"{TOTALS['functions']} world functions replayed with NCCL's semantics: "
            f"{TOTALS['ops']} operations on {TOTALS['groups']} process groups, "
            f"{TOTALS['problems']} deadlocks, mis-pairings or skipped first operations")
