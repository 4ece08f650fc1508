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
    from mimo_fx.compiled.redistributor import LOG

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
