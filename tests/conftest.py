"""Session-wide test machinery.

``worlds``: the spawned gloo worlds the multi-process tests share, one per (size,
options), each process alive for the whole session and running one test module's
function after another (:class:`mimo_fx.testing.Worlds`; tests/README.md says which
tests still spawn their own world and why). The terminal summary says how many worlds
were spawned, how many functions each ran and what ended them.
"""

from __future__ import annotations

import pytest

from mimo_fx.testing import Worlds

_POOLS: list[Worlds] = []


@pytest.fixture(scope="session")
def worlds():
    """``worlds.run(size, fn, *args, timeout=..., record=..., env=...)``: ``run_world``
    without the spawn when a world of that size and those options is already up."""
    pool = Worlds()
    _POOLS.append(pool)
    yield pool
    pool.close()


def pytest_terminal_summary(terminalreporter):
    for pool in _POOLS:
        terminalreporter.write_sep("-", f"shared worlds: {pool.spawns} spawned")
        for line in pool.summary():
            terminalreporter.write_line(line)
