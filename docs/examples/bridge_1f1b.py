"""Megatron's 1F1B by hand over a Bridge: an encoder stage (TP2, ranks 0-1) ahead of an
LLM stage (DP2, ranks 2-3) by one warm-up forward, with the combined calls.

    python docs/examples/bridge_1f1b.py      # 4 gloo processes on this machine
"""

import torch

from mimo_fx import Grid, Layout
from mimo_fx.compiled import Bridge
from mimo_fx.testing import run_world

M, B, H = 4, 4, 8  # micro-batches, rows per micro-batch, hidden


def data():
    """The full weights and micro-batches (every rank makes the same)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(H, H, generator=gen), torch.randn(M, B, H, generator=gen)


def train(rank: int, world: int):
    """One step; returns this rank's weight gradient (ranks 0-1) or loss (ranks 2-3)."""
    w, xs = data()
    bridge = Bridge(Layout(Grid(tp=2), "b (tp h)"),           # on every rank, in one order
                    Layout(Grid(dp=2, offset=2), "(dp b) h"), {"b": B, "h": H})
    if rank < 2:  # encoder: its columns of x @ w; one warm-up forward ahead
        wt = w.chunk(2, dim=1)[rank].clone().requires_grad_()
        outs = [xs[m] @ wt for m in range(M)]
        bridge.send_forward(outs[0].detach())
        for m in range(1, M):  # forward m, and the gradient of m - 1 back
            outs[m - 1].backward(bridge.send_forward_recv_backward(outs[m].detach()))
        outs[M - 1].backward(bridge.recv_backward())
        result = wt.grad
    elif rank < 4:  # LLM: its rows; the loss sums over the step's M * B * H elements
        y, result = bridge.recv_forward(), 0.0
        for m in range(M):
            loss = torch.tanh(y).square().sum() / (M * B * H)
            loss.backward()
            result += loss.item()
            if m + 1 < M:  # the gradient of m back, and forward m + 1
                y = bridge.send_backward_recv_forward(y.grad)
            else:
                bridge.send_backward(y.grad)
    bridge.destroy()
    return result if rank < 4 else None


def main() -> None:
    results = run_world(4, train)
    w, xs = data()
    w.requires_grad_()
    full = torch.tanh(xs @ w).square().sum() / (M * B * H)
    full.backward()
    error = max((g - e).abs().max().item() for g, e in zip(results[:2], w.grad.chunk(2, 1)))
    assert error < 1e-5, f"the gradient differs from full-tensor math by {error:.1e}"
    assert abs(sum(results[2:]) - full.item()) < 1e-5, (sum(results[2:]), full.item())
    print(f"1F1B over a TP2 -> DP2 bridge: loss {sum(results[2:]):.6f}, largest gradient "
          f"error {error:.1e}: checked against full-tensor math, OK")


if __name__ == "__main__":
    main()
