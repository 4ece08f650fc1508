"""Two pipeline stages of different parallelism under torch's Schedule1F1B.

Stage 0, ranks 0-1, tensor-parallel: each rank computes half the columns of
tanh(x @ w), its piece of the activation "b (tp h)". Stage 1, ranks 2-3, data-parallel:
each rank takes half the rows, "(dp b) h", and computes tanh(. @ v) and the loss. A
mimo_fx bridge moves each micro-batch between the two (and its gradient back).

    python docs/examples/pipelining_stage.py      # 4 gloo processes on this machine
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B

from mimo_fx import Grid, Layout
from mimo_fx.compiled.pipelining import BridgedPipeline
from mimo_fx.testing import run_world

BATCH, MICROBATCHES, HIDDEN = 8, 4, 6


class Layer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


def data():
    """The full weights and batch (every rank makes the same)."""
    gen = torch.Generator().manual_seed(0)
    w, v, x, target = (torch.randn(*shape, generator=gen) for shape in
                       [(HIDDEN, HIDDEN)] * 2 + [(BATCH, HIDDEN)] * 2)
    return w, v, x, target


def loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # a sum divided by the step's global element count (mimo_fx's convention,
    # hence scale_grads=False below)
    return ((y - target) ** 2).sum() / (BATCH * HIDDEN)


def train(rank: int, world: int) -> torch.Tensor:
    """One training step; returns this rank's weight gradient (dp replicas summed)."""
    enc, llm = Grid(tp=2), Grid(dp=2, offset=2)
    pipe = BridgedPipeline(
        [(Layout(enc, "b (tp h)"), Layout(llm, "(dp b) h"))],  # stage 0 -> stage 1
        sizes={"b": BATCH // MICROBATCHES, "h": HIDDEN},        # one micro-batch
        output=Layout(llm, "(dp b) h"))                          # what the loss sees
    dp_group = dist.new_group([2, 3])  # every rank creates every group
    w, v, x, target = data()
    layer = Layer(w.chunk(2, dim=1)[rank] if rank < 2 else v)
    schedule = Schedule1F1B(pipe.stage(layer), MICROBATCHES, loss_fn=pipe.loss(loss),
                            scale_grads=False)
    if rank < 2:
        schedule.step(x)
    else:
        schedule.step(target=target)
    grad = layer.weight.grad
    assert grad is not None
    if rank >= 2:
        dist.all_reduce(grad, group=dp_group)  # dp replicas' gradients sum
    pipe.destroy()
    return grad


def main() -> None:
    grads = run_world(4, train)
    w, v, x, target = (t.requires_grad_() for t in data())
    loss(torch.tanh(torch.tanh(x @ w) @ v), target).backward()
    want = [*w.grad.chunk(2, dim=1), v.grad, v.grad]
    error = max((g - e).abs().max().item() for g, e in zip(grads, want))
    assert error < 1e-5, f"the gradients differ from full-tensor math by {error:.1e}"
    print(f"1F1B over a TP2 -> DP2 bridge: largest gradient error {error:.1e}: checked "
          f"against full-tensor math, OK")


if __name__ == "__main__":
    main()
