"""docs/examples/compiled_step.py, the README's compiled training step, on 4 gloo
processes (aot_eager): each LLM rank's loss is the sum over its zigzag piece of the
full-tensor activations, and the encoder ranks' weight gradients add up to the
full-tensor gradient, every step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mimo_fx import Grid, Layout
from mimo_fx.reference import shard
from mimo_fx.testing import run_world

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "compiled_step.py"
pytestmark = pytest.mark.slow  # a 4-process world and a compile: about 20 s on 2 cores
STEPS = 3


def _example():
    spec = importlib.util.spec_from_file_location("compiled_step", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(rank: int, world: int):
    return _example().train(rank, world, steps=STEPS)


@pytest.fixture(scope="module")
def results():
    return run_world(4, _train, timeout=600)


def _full(example):
    """Per step the LLM's input ``tanh(X @ W)``, and ``W``'s gradient summed over steps."""
    w = example.weight().requires_grad_()
    ys = [torch.tanh(example.batch(k) @ w) for k in range(STEPS)]
    sum(y.square().sum() for y in ys).backward()
    return [y.detach() for y in ys], w.grad


def test_llm_losses_are_their_pieces_of_the_full_loss(results):
    example = _example()
    ys, _ = _full(example)
    dst = Layout(Grid(cp=2, offset=2), "b (cp s) h", zigzag="cp")
    for k, y in enumerate(ys):
        for rank in (2, 3):
            torch.testing.assert_close(results[rank][0][k], shard(y, dst)[rank].square().sum())
        assert results[0][0][k] == results[1][0][k] == 0  # the encoder ranks hold no dst
        torch.testing.assert_close(results[2][0][k] + results[3][0][k], y.square().sum())


def test_encoder_gradients_add_up_to_the_full_gradient(results):
    _, grad = _full(_example())
    torch.testing.assert_close(results[0][1] + results[1][1], grad)
    assert results[2][1] is None and results[3][1] is None  # the LLM ranks never use w
