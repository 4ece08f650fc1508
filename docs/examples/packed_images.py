"""Image tokens straight to their positions in a packed, CP-split sequence, on 4 gloo
processes: an encoder on DP2 (ranks 0-1), an LLM on CP2 (ranks 2-3).

    python docs/examples/packed_images.py

The code between the ``# --`` markers is the README's example, verbatim (a test checks
that, and checks what ``step`` returns against full-tensor math).
"""

from __future__ import annotations

import torch

from mimo_fx import Grid
from mimo_fx.compiled.index import IndexBridge
from mimo_fx.packed import Packing, image_rows


def batch(step: int):
    """A step's data, the same on every rank: per sample, which tokens are image tokens."""
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 12, (3,), generator=gen).tolist()       # 3 samples
    is_image = torch.rand(sum(lengths), generator=gen) < 0.3          # packed order
    features = torch.randn(int(is_image.sum()), 4, generator=gen)     # one row per image token
    text = torch.randn(sum(lengths), 4, generator=gen)                # text embeddings, packed
    return lengths, is_image, features, text


# -- packed images
def step(rank: int, world: int, steps: int = 3, backend: str = "inductor"):  # world = 4
    enc, llm = Grid(dp=2), Grid(cp=2, offset=2)          # encoder ranks 0-1, LLM ranks 2-3
    bridge = IndexBridge(range(world))                   # one group, every plan, eagerly
    w = torch.nn.Parameter(torch.eye(4))                 # the "encoder"

    @torch.compile(backend=backend, fullgraph=True)      # one graph for every packing
    def llm_input(features, route, local, text_local):
        images = bridge(features @ w, route)             # exactly this rank's image rows
        return text_local.index_copy(0, local, images)   # ... at their token positions

    out = []
    for k in range(steps):
        lengths, is_image, features, text = batch(k)
        packing = Packing(lengths, cp=2)                 # per-sequence zigzag over cp
        n = len(features)
        src = {r: list(range(n))[r::2] for r in enc.ranks}        # image rows per encoder rank
        rows = image_rows(packing, torch.nonzero(is_image).flatten())
        dst = {llm.rank(cp=c): rows[c].rows for c in range(2)}
        plan = bridge.plan(src, dst, n_rows=n)           # the same on every rank
        mine = features[src.get(rank, [])]               # an LLM-only rank passes no rows
        local = torch.zeros(0, dtype=torch.int64)
        text_local = torch.zeros(0, 4)
        if rank in llm:
            c = llm.coord(rank)["cp"]
            local = rows[c].local_rows
            token = packing.token_index(c)               # -1 at padding
            text_local = torch.where(token[:, None] >= 0, text[token.clamp(min=0)], 0.0)
        for t in (mine, local, text_local):              # any length, 0 or 1 too
            torch._dynamo.decorators.mark_unbacked(t, 0)
        h = llm_input(mine, bridge.route(plan), local, text_local)
        h.square().sum().backward()                      # the gradient returns to the encoders
        out.append((h.detach(), w.grad.clone()))
        w.grad = None
    bridge.destroy()
    return out
# --


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    results = run_world(4, step, timeout=600)
    print({rank: [tuple(h.shape) for h, _ in res] for rank, res in enumerate(results)})
