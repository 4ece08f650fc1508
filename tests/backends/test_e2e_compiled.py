"""End-to-end oracle on gloo with the compiled backend: the toy MIMO model trained on 8
processes equals the undistributed model (one spawned world for every configuration).

The colocated fan-in into zigzag CP, the pipelined disjoint grids and the variable
variant (image and text lengths changing every step) run compiled
(``torch.compile(fullgraph=True)``, aot_eager: a graph break would raise); fan-out and
equal run eager. Every rank compares its synchronised gradients each step and its
parameters at the end with the undistributed model's (``mimo_fx.jobs.e2e``); the
variable variant compiles one graph for every length (its length dims marked dynamic).
The pp_1f1b variant trains 4 micro-batches per step in Megatron's 1F1B over three
stages with each stage's compute compiled by inductor, ``loss.backward()`` per
micro-batch, one graph per stage. The packed variant draws a new batch every step (0-3
images per sample, varying text, packed over CP2 per sequence with zigzag) and runs
eager here, the images delivered by a redistribute into a packed layout at least CP
times below the seed scheme's bytes: its model and its bridges are compiled in the
balanced variant (``tests/core/test_balance.py``: aot_eager, ``loss.backward()``, one graph
for every batch on 8 ranks), whose step is the packed step with two more bridges, and
packed bridges under aot_eager and inductor in ``tests/core/test_rows.py`` and the balanced
placement's under inductor in ``tests/core/test_balance.py`` (4 ranks): a compile on 8
processes sharing 2 cores costs up to a minute, paid once per model.
"""

from __future__ import annotations

import pytest

from mimo_fx.jobs.e2e import TOLERANCE, Run, check, train_worker

pytestmark = pytest.mark.slow  # spawned worlds, long: not in the fast subset (tests/README.md)

RUNS = [Run("colocated", steps=2), Run("pipelined", steps=2), Run("variable", steps=4),
        Run("fan_out", steps=2, backend="eager"), Run("equal", steps=2, backend="eager"),
        Run("pp_1f1b", steps=3, backend="inductor"), Run("packed", steps=3, backend="eager")]


@pytest.fixture(scope="module")
def results(worlds):
    # record: the suite's one 8-rank world (tests/README.md, "Spawned worlds")
    runs = worlds.run(8, train_worker, RUNS, timeout=900, record=True)
    return {r["variant"]: r for r in runs[0]}


@pytest.mark.parametrize("run", RUNS, ids=[r.variant for r in RUNS])
def test_parameters_and_gradients_match_undistributed_model(results, run):
    res = results[run.variant]
    assert res["backend"] == run.backend
    assert len(res["rows"]) == run.steps
    assert check([res]) == []
    assert res["param_diff"] <= TOLERANCE
    for row in res["rows"]:
        assert row["grad_diff"] <= TOLERANCE, row
        assert row["bytes_max"] > 0


def test_variable_lengths_change_every_step_in_one_graph(results):
    res = results["variable"]
    assert res["graphs"] == 1, res["graphs"]
    assert len({row["bytes_max"] for row in res["rows"]}) > 1  # the lengths did change


def test_pipelined_1f1b_stages_compile_once(results):
    res = results["pp_1f1b"]
    assert res["graphs"] == 1, res["graphs"]


def test_packed_batches_change_every_step(results):
    res = results["packed"]
    assert len({row["bytes_total"] for row in res["rows"]}) > 1  # the packings did change
    for row in res["rows"]:
        assert 0 < 2 * row["image_bytes"] <= row["seed_image_bytes"], row
