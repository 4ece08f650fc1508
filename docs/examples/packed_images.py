"""Image tokens straight to their positions in a packed, CP-split sequence, on 4 gloo
processes: an encoder on DP2 (ranks 0-1), an LLM on CP2 (ranks 2-3).

    python docs/examples/packed_images.py

The README and docs/packed.md show lines between the ``# --`` markers verbatim;
tests/core/test_rows.py runs ``step`` and checks what it returns against full-tensor math.
"""

from __future__ import annotations

import torch

from mimo_fx import Grid, Layout, redistribute
from mimo_fx.compiled import prepare
from mimo_fx.packed import PackedLayout
from mimo_fx.reference import shard


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
    w = torch.nn.Parameter(torch.eye(4))                 # the "encoder"
    out = []
    src = Layout(enc, "(dp t) h", ragged="dp")           # a block of image rows per encoder rank
    @torch.compile(backend=backend, fullgraph=True)      # one graph for every batch
    def llm_input(features, images, where, text_local):
        rows = redistribute(features @ w, src, images)   # this rank's image rows, in order
        return text_local.index_copy(0, where, rows)     # ... at their token positions

    for k in range(steps):
        lengths, is_image, features, text = batch(k)
        tokens = PackedLayout(llm, "t h", [lengths])     # zigzag over cp, sequence by sequence
        images = tokens.select(torch.nonzero(is_image).flatten())  # row j: image token j
        where = images.positions(rank) if rank in llm else torch.zeros(0, dtype=torch.int64)
        if k == 0:
            prepare(src, images)                         # process groups, eagerly, every rank
        mine = features.tensor_split(2)[rank] if rank in enc else torch.zeros(0, 4)
        text_local = shard(text, tokens)[rank] if rank in llm else torch.zeros(0, 4)
        for t in (mine, where, text_local):              # any length, 0 or 1 too
            torch._dynamo.decorators.mark_unbacked(t, 0)
        h = llm_input(mine, images, where, text_local)
        h.square().sum().backward()                      # the gradient returns to the encoders
        out.append((h.detach(), w.grad.clone()))
        w.grad = None
    return out
# --


def check(results: list) -> None:
    """Against full-tensor math (raises if not): the LLM ranks' inputs are the packed
    sequence's tokens (an image token's row its features, the encoder an identity at
    first), each where the packing puts it, and the encoder ranks' gradients add up to
    that of the squared sum over every image token, ``2 F^T F``."""
    llm = Grid(cp=2, offset=2)
    for k in range(len(results[0])):
        h, grad = [res[k][0] for res in results], [res[k][1] for res in results]
        lengths, is_image, features, text = batch(k)
        full = text.clone()
        full[is_image] = features
        want = shard(full, PackedLayout(llm, "t h", [lengths]))
        for rank in (2, 3):
            torch.testing.assert_close(h[rank], want[rank])
        torch.testing.assert_close(grad[0] + grad[1], 2 * features.T @ features)


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    results = run_world(4, step, timeout=600)
    print({rank: [tuple(h.shape) for h, _ in res] for rank, res in enumerate(results)})
    check(results)
    print("checked against full-tensor math: every LLM input and encoder gradient, OK")
