"""Sizes that change every step: one bridge and one compiled graph for every sequence
length, on 8 gloo processes (encoder TP2xDP4 -> LLM TP2xCP2xDP2 with zigzag CP, the
same ranks).

    python docs/examples/variable_sizes.py

docs/sizes.md shows lines of ``train`` verbatim; tests/backends/test_variable_sizes.py runs it
(aot_eager), counts its graphs and checks its losses against full-tensor math.
"""

from __future__ import annotations

import torch

from mimo_fx import Grid, Layout
from mimo_fx.compiled import Redistributor

LENGTHS = (512, 384, 640, 448)  # the sequence length of each step


def batch(s: int) -> torch.Tensor:
    """A step's 8 samples of ``s`` tokens, (8, s, 64), the same on every rank."""
    return torch.randn(8, s, 64, generator=torch.Generator().manual_seed(s))


def weight() -> torch.Tensor:
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) / 8


def train(rank: int, world: int, backend: str = "inductor"):  # world = 8
    """A step per length; the bridge's granules, this rank's losses, whether w has a
    gradient."""
    src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag="cp")
    bridge = Redistributor(src, dst, {"h": 64})          # b and s free: learned per call
    w = weight().requires_grad_()
    step = torch.compile(lambda x: (bridge(torch.tanh(x @ w)) ** 2).mean(),
                         backend=backend, fullgraph=True)
    losses = []
    for s in LENGTHS:                                    # multiples of bridge.granules["s"]
        x = batch(s).tensor_split(4)[rank // 2]          # rank // 2: this rank's dp index
        loss = step(x)                                   # one graph for every length
        loss.backward()
        losses.append(loss.detach())
    granules = bridge.granules
    bridge.destroy()
    return granules, losses, w.grad is not None


def check(results: list) -> None:
    """Every rank's losses against full-tensor math: the mean square of its dst piece of
    ``tanh(X @ W)``, every step (raises if not)."""
    from mimo_fx.reference import shard

    dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag="cp")
    for k, s in enumerate(LENGTHS):
        pieces = shard(torch.tanh(batch(s) @ weight()), dst)
        for rank, (_, losses, grad) in enumerate(results):
            torch.testing.assert_close(losses[k], (pieces[rank] ** 2).mean())
            assert grad, f"rank {rank}: w has no gradient"


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    results = run_world(8, train, timeout=900)
    check(results)
    print("granules", results[0][0], "losses on rank 0", [float(x) for x in results[0][1]])
    print(f"checked against full-tensor math: {len(LENGTHS)} steps x 8 ranks, OK")
