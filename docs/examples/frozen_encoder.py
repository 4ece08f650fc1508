"""A frozen encoder feeding a tensor-parallel layer, written the natural way: the encoder
(DP2, ranks 0-1) runs under ``torch.no_grad()``, its output crosses a bridge to a TP2
layer (ranks 2-3), the step is compiled with inductor and only the layer trains. Nothing
crosses the bridge backward, on any rank, and no rank needs a ``.detach()`` or a
``mimo_fx.backward()``: the bridge's first call finds that no source rank's input
requires grad and freezes it (``frozen=True`` when the bridge is built says so up
front, and also spares its backward's process groups).

    python docs/examples/frozen_encoder.py [inductor|aot_eager|eager]

docs/compiled.md shows the lines between the ``# --`` markers verbatim;
tests/mimo_layer/test_frozen.py runs ``train`` on 4 gloo processes and checks it against the
undistributed model.
"""

from __future__ import annotations

import torch

B, S, F, H, OUT = 4, 6, 3, 8, 5  # samples, tokens, image features, hidden, layer outputs
LR = 0.1


def images(step: int) -> torch.Tensor:
    """A step's images, the same on every rank."""
    return torch.randn(B, S, F, generator=torch.Generator().manual_seed(step))


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen encoder's weight and the layer's initial weight, the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    return torch.randn(F, H, generator=gen), torch.randn(H, OUT, generator=gen)


def train(rank: int, world: int, steps: int = 3, backend: str = "inductor", **bridge_options):
    """``steps`` SGD steps of the layer; per step this rank's loss (None on the encoder
    ranks), then the layer's weight rows this rank holds, and the bridge's counts of
    completed forward and backward transfers."""
    from mimo_fx import Grid, Layout
    from mimo_fx.compiled import Redistributor, timeouts

    # -- the frozen encoder and the layer

    enc, layer = Grid(dp=2), Grid(tp=2, offset=2)      # encoder ranks 0-1, layer ranks 2-3
    frozen_w, full_w = weights()
    w = torch.nn.Parameter(full_w.tensor_split(2)[rank - 2]) if rank in layer else None
    bridge = Redistributor(Layout(enc, "(dp b) s h"), Layout(layer, "b s (tp h)"),
                           {"b": B, "s": S, "h": H}, **bridge_options)

    @torch.compile(backend=backend, fullgraph=True)
    def step(features):                                # this rank's features, or None
        y = bridge(features)                           # b s h/2 on ranks 2-3
        return (y @ w).square().sum() if rank in layer else None

    losses = []
    for k in range(steps):
        features = None
        if rank in enc:                                # the encoder needs no gradient
            with torch.no_grad():
                features = torch.tanh(images(k).tensor_split(2)[rank] @ frozen_w)
        loss = step(features)
        if loss is not None:                           # the layer's ranks
            loss.backward()
            with torch.no_grad():
                w -= LR * w.grad
            w.grad = None
        losses.append(None if loss is None else loss.detach())
    # --
    counts = (timeouts.calls(bridge.name, "forward"), timeouts.calls(bridge.name, "backward"))
    out = (losses, None if w is None else w.detach(), counts, bridge.frozen(),
           bridge.groups_created)
    bridge.destroy()
    return out


def reference(steps: int = 3) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """The same training on one process: per step the losses of the layer's two ranks
    (each the loss of its half of the hidden dim), and the final weight."""
    frozen_w, full_w = weights()
    w = full_w.clone().requires_grad_()
    losses = []
    for k in range(steps):
        features = torch.tanh(images(k) @ frozen_w)
        halves = [(f @ part).square().sum() for f, part in
                  zip(features.tensor_split(2, dim=2), w.tensor_split(2))]
        sum(halves).backward()
        with torch.no_grad():
            w -= LR * w.grad
        w.grad = None
        losses.append([h.detach() for h in halves])
    return losses, w.detach()


if __name__ == "__main__":
    import sys

    from mimo_fx.testing import run_world

    results = run_world(4, train, 3, sys.argv[1] if len(sys.argv) > 1 else "inductor",
                        timeout=600)
    want, w = reference()
    for k, ranks in enumerate(want):
        for rank, loss in zip((2, 3), ranks):
            assert torch.allclose(results[rank][0][k], loss, rtol=1e-5), (k, rank)
    assert torch.allclose(torch.cat([results[2][1], results[3][1]]), w, rtol=1e-5)
    assert all(r[2] == (3, 0) for r in results), [r[2] for r in results]
    print("checked against the undistributed model: every loss and the trained weight; "
          "per rank (forward, backward) transfers:", [r[2] for r in results])
