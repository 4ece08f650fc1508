"""Balanced MIMO batches from per-rank data loaders, on 4 gloo processes: a loader on
every rank, the encoder on DP4 and the LLM on CP2 x DP2, all on ranks 0-3.

    python docs/examples/balanced_loader.py

docs/balance.md shows the lines between the ``# --`` markers verbatim;
tests/core/test_balance.py runs ``step`` and checks what it returns against full-tensor math.
"""

from __future__ import annotations

import torch

from mimo_fx import Grid, redistribute
from mimo_fx.mimo import share_samples
from mimo_fx.placement import Sample, place


def my_batch(step: int, rank: int):
    """Rank ``rank``'s data loader at ``step``: its own samples, skewed on purpose (rank
    0 image-heavy, rank 3 text only), with one row of pixels per image token and one row
    of text embeddings per text token, sample after sample."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    images = {0: (3, 4), 1: (1, 3), 2: (0, 2), 3: (0, 0)}[rank]  # per sample: least, most
    samples = []
    for _ in range(3):
        k = int(torch.randint(images[0], images[1] + 1, (1,), generator=gen))
        tokens = torch.randint(1, 9, (k,), generator=gen).tolist()        # per image
        text = torch.randint(0, 6, (k + 1,), generator=gen).tolist()      # runs around them
        text[-1] += 1                                                     # no empty sample
        samples.append(Sample(text=tuple(text), images=tuple(tokens)))
    pixels = torch.randn(sum(sum(s.images) for s in samples), 4, generator=gen)
    text = torch.randn(sum(sum(s.text) for s in samples), 4, generator=gen)
    return samples, pixels, text


# -- balanced loader
def step(rank: int, world: int, steps: int = 2):  # world = 4
    loaders, encoder, llm = Grid(dp=4), Grid(dp=4), Grid(cp=2, dp=2)
    w = torch.nn.Parameter(torch.eye(4))                  # the "encoder"
    out = []
    for k in range(steps):
        samples, pixels, text = my_batch(k, rank)         # this rank's loader, its samples
        text.requires_grad_()
        shared = share_samples(samples, loaders)          # every loader's: one all-gather
        plan = place(shared, loaders, encoder, llm)       # the same on every rank
        rows = redistribute(pixels, *plan.patches("t f"))         # to their encoder rank
        src, images = plan.embeddings("t h")                      # image rows -> tokens
        embedded = redistribute(rows @ w, src, images)
        src, words = plan.text("t h")                             # text rows -> tokens
        h = torch.zeros(plan.packed("t h").packing(rank).local_total, 4)  # packed storage
        h = h.index_copy(0, words.positions(rank), redistribute(text, src, words))
        h = h.index_copy(0, images.positions(rank), embedded)
        loss = h.square().sum() / plan.total_tokens       # global token count
        loss.backward()                                   # gradients back to the loaders
        out.append((h.detach(), w.grad.clone(), text.grad))
        w.grad = None
    return out
# --


def _sorted(rows: torch.Tensor) -> torch.Tensor:
    """The rows in one order, whatever order they came in."""
    return rows[(rows @ 0.5 ** torch.arange(rows.shape[1], dtype=rows.dtype)).argsort()]


def check(results: list) -> None:
    """Against full-tensor math (raises if not), every step: the LLM ranks' packed
    storages hold every loader's pixel and text rows once each (the encoder an identity
    at first) and zeros elsewhere; the loss is their squared sum over the global token
    count ``T``, so each loader's text gradient is ``2 text / T`` and the encoder ranks'
    gradients add up to ``2 P^T P / T`` over every loader's pixels ``P``."""
    for k in range(len(results[0])):
        data = [my_batch(k, rank) for rank in range(len(results))]
        pixels = torch.cat([p for _, p, _ in data])
        rows = torch.cat([pixels, *(t for _, _, t in data)])
        stored = torch.cat([res[k][0] for res in results])
        stored = stored[stored.abs().sum(1) != 0]  # (padding is zero; no row of data is)
        assert len(stored) == len(rows), (len(stored), len(rows))
        torch.testing.assert_close(_sorted(stored), _sorted(rows))
        total = len(rows)
        torch.testing.assert_close(sum(res[k][1] for res in results),
                                   2 * pixels.T @ pixels / total)
        for rank, res in enumerate(results):
            torch.testing.assert_close(res[k][2], 2 * data[rank][2] / total)


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    results = run_world(4, step, timeout=600)
    print({rank: [tuple(h.shape) for h, _, _ in res] for rank, res in enumerate(results)})
    check(results)
    print("checked against full-tensor math: every token once, every gradient, OK")
