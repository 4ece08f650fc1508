"""A compiled training step across two modules on 4 gloo processes: an encoder on DP2
(ranks 0-1) feeds a language model on CP2 (ranks 2-3) through a ``Redistributor``.

    python docs/examples/compiled_step.py

The README shows the lines between the ``# --`` markers verbatim, a whole program but
for its launch; tests/backends/test_compiled_step.py runs ``train`` and checks the losses and the
gradients against full-tensor math, as ``__main__`` does for a smaller check.
"""

from __future__ import annotations

# -- compiled step
import torch

from mimo_fx import Grid, Layout
from mimo_fx.compiled import Redistributor

B, S, F, H = 4, 8, 3, 4  # samples, tokens per sample, image features, hidden

def batch(step: int) -> torch.Tensor:                    # a step's images, on every rank
    return torch.randn(B, S, F, generator=torch.Generator().manual_seed(step))

def weight() -> torch.Tensor:                            # the encoder's weight
    return torch.randn(F, H, generator=torch.Generator().manual_seed(100))

def train(rank: int, world: int, steps: int = 3, backend: str = "aot_eager"):  # world = 4
    w, losses = torch.nn.Parameter(weight()), []        # the "encoder"
    enc, llm = Grid(dp=2), Grid(cp=2, offset=2)          # encoder ranks 0-1, LLM ranks 2-3
    bridge = Redistributor(Layout(enc, "(dp b) s h"), Layout(llm, "b (cp s) h", zigzag="cp"),
                           {"b": B, "s": S, "h": H})     # every process group made here
    @torch.compile(backend=backend, fullgraph=True)
    def step(x):                                         # x: this rank's images, or None
        y = bridge(None if x is None else torch.tanh(x @ w))  # this rank's LLM input
        return y.square().sum()                          # 0 on encoder ranks: y is empty

    for k in range(steps):
        x = batch(k).tensor_split(2)[rank] if rank in enc else None
        loss = step(x)
        loss.backward()                                  # the gradient crosses back
        losses.append(loss.detach())
    bridge.destroy()
    return losses, w.grad
# --


def check(results: list, steps: int = 3) -> None:
    """The ranks' results against full-tensor math (raises if not): an LLM rank's loss is
    the square sum of its zigzag piece of ``tanh(X @ W)``, the encoder ranks' gradients
    add up to the full gradient."""
    from mimo_fx.reference import shard

    w = weight().requires_grad_()
    ys = [torch.tanh(batch(k) @ w) for k in range(steps)]
    sum(y.square().sum() for y in ys).backward()
    dst = Layout(Grid(cp=2, offset=2), "b (cp s) h", zigzag="cp")
    for k, y in enumerate(ys):
        pieces = shard(y.detach(), dst)
        for rank in (2, 3):
            torch.testing.assert_close(results[rank][0][k], pieces[rank].square().sum())
        assert results[0][0][k] == results[1][0][k] == 0
    torch.testing.assert_close(results[0][1] + results[1][1], w.grad)


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    results = run_world(4, train, timeout=600)
    check(results)
    print({rank: [round(float(x), 4) for x in res[0]] for rank, res in enumerate(results)})
    print("checked against full-tensor math: every loss and the encoder gradient, OK")
