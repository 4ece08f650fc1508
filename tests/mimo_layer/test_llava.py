"""The main job's llava variant (jobs/llava.py running docs/examples/llava_step.py):
a tiny Hugging Face LLaVA, its vision tower and projector on FSDP2 (ranks 0-1), its
language model on DTensor TP (ranks 2-3), trained 3 SGD steps compiled with aot_eager on
4 gloo processes while the images per sample change every step (an encoder rank with
none, then a step with none at all). Every step's gradients and the final parameters
equal the same model trained on one process within 1e-5, in one compiled graph per rank
for every image count. Skipped only where transformers is not importable; without it
``--variant llava`` names the install command (checked without transformers).
"""

from __future__ import annotations

import importlib.util

import pytest

from mimo_fx.jobs import e2e, llava
from mimo_fx.jobs.e2e import TOLERANCE, Run, check, train_worker
from mimo_fx.testing import run_world

STEPS = 3


@pytest.fixture(scope="module")
def result():
    pytest.importorskip("transformers", reason="the llava variant needs transformers: "
                                               + llava.INSTALL)
    (res,), *_ = run_world(4, train_worker, [Run("llava", steps=STEPS)], timeout=900)
    return res


@pytest.mark.slow  # a 4-process world that compiles a real model: about a minute
def test_gradients_and_parameters_match_one_process(result):
    assert result["backend"] == "aot_eager"
    assert len(result["rows"]) == STEPS
    assert check([result]) == []
    for row in result["rows"]:
        assert row["grad_diff"] <= TOLERANCE, row
        assert abs(row["loss"] - row["ref_loss"]) <= TOLERANCE, row
    assert result["param_diff"] <= TOLERANCE


@pytest.mark.slow
def test_one_graph_per_rank_for_every_image_count(result):
    images = [row["images"] for row in result["rows"]]
    assert sum(images[1][:2]) == 0 < sum(images[1][2:])  # encoder rank 0 without images
    assert sum(images[2]) == 0                           # no images at all
    assert result["graphs_per_rank"] == [1, 1, 1, 1]


@pytest.mark.slow
def test_bytes_follow_the_image_count(result):
    rows = result["rows"]
    assert rows[0]["bytes_total"] > rows[1]["bytes_total"] > rows[2]["bytes_total"] == 0


def test_without_transformers_the_variant_says_how_to_install_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(llava.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert "pip install" in (llava.available() or "")
    assert "llava" not in [v for v in e2e.DEFAULT if e2e.unavailable(v) is None]
    with pytest.raises(SystemExit):
        e2e.main(["--variant", "llava"])
    assert 'pip install -e ".[hf]"' in capsys.readouterr().err
