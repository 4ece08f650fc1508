"""What a user sees of a bridge: a labelled span in the profiler, a one-time debug log of
each plan's collectives and bytes, the package version."""

from __future__ import annotations

import logging

import mimo_fx
from mimo_fx import Grid, Layout

SRC = Layout(Grid(dp=2), "(dp b) h")
DST = Layout(Grid(tp=2), "b (tp h)")


def _observe(rank: int, world: int) -> dict:
    import torch

    from mimo_fx.compiled import Redistributor
    from mimo_fx.compiled.prepared import LOG

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    LOG.addHandler(Keep())
    LOG.setLevel(logging.DEBUG)
    bridge = Redistributor(SRC, DST, {"b": 4, "h": 8})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        bridge(torch.ones(2, 8))
        bridge(torch.ones(2, 8))
    bridge.destroy()
    spans = [e.name for e in prof.events() if e.name.startswith("mimo_fx.")]
    return {"spans": spans, "log": records}


def test_bridge_calls_are_labelled_spans_and_plans_logged_once(worlds):
    results = worlds.run(2, _observe)
    for rank, r in enumerate(results):
        assert r["spans"] == ["mimo_fx.redistribute (dp b) h -> b (tp h)"] * 2, r["spans"]
        forward = [m for m in r["log"] if " forward: " in m]
        backward = [m for m in r["log"] if " backward: " in m]
        assert len(forward) == len(backward) == 1, r["log"]
        # (dp b) h -> b (tp h): each rank keeps a quarter of the 4x8 float32 tensor and
        # receives another quarter, 32 bytes, in one collective over both ranks
        assert forward[0].startswith(f"rank {rank}: "), forward[0]
        assert " over 2 ranks; sends 32 B, receives 32 B" in forward[0], forward[0]
        assert "," not in forward[0].split(" forward: ")[1].split(";")[0]  # one collective


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    assert mimo_fx.__version__ == version("mimo-fx")


def _waits(rank: int, world: int) -> list[str]:
    """Rank 3 comes 4 s late to a bridge's first call, and rank 2 to its build: what the
    others say while they wait (``MIMO_FX_WAIT_NOTICE=1``)."""
    import os
    import time

    import torch

    from mimo_fx.compiled import Redistributor
    from mimo_fx.compiled.timeouts import LOG

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    os.environ["MIMO_FX_WAIT_NOTICE"] = "1"
    keep = Keep()
    LOG.addHandler(keep)
    try:
        if rank == 2:
            time.sleep(4)
        bridge = Redistributor(Layout(Grid(dp=2), "(dp b) h"),
                               Layout(Grid(tp=2, offset=2), "b (tp h)"), {"b": 4, "h": 4},
                               frozen=False)
        if rank == 3:
            time.sleep(4)
        bridge(torch.ones(2, 4) if rank < 2 else None)
        bridge.destroy()
    finally:
        LOG.removeHandler(keep)
    return records


def test_a_rank_that_waits_says_once_what_for(worlds):
    """Before, a mistake under torchrun was silent until MIMO_FX_TIMEOUT (300 s)."""
    said = worlds.run(4, _waits)
    for rank in (0, 1, 3):
        build = [m for m in said[rank] if "the agreement on its definition" in m]
        assert len(build) == 1 and "ranks that have not: [2]" in build[0], (rank, said[rank])
        assert build[0].startswith(f"mimo_fx: rank {rank} has waited "), build
        assert "'(dp b) h -> b (tp h) #0'" in build[0] and "MIMO_FX_TIMEOUT=" in build[0]
    for rank in (0, 1):
        call = [m for m in said[rank] if "call 1" in m]
        assert len(call) == 1, (rank, said[rank])
        assert "for rank 3 in the forward of call 1 of redistribute '(dp b) h' -> " \
               "'b (tp h)' (all_to_all over ranks 0,1,2,3)" in call[0], call
