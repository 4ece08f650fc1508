"""GradSync and TiedGrads in one training step each, on 8 gloo processes.

    python docs/examples/sync_example.py

The code between the ``# --`` markers is the README's example, verbatim (a test checks
that, and runs both functions against the undistributed model).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mimo_fx import Grid
from mimo_fx.mimo import GradSync, TiedGrads, is_first_stage


# -- GradSync
def encoder_and_llm_step(rank: int, world: int):  # world = 8
    enc_grid, llm_grid = Grid(dp=4), Grid(cp=2, dp=2, offset=4)   # ranks 0-3 and 4-7
    torch.manual_seed(0)                          # the same initial weights on every rank
    encoder, llm = nn.Linear(16, 16), nn.Linear(16, 16)
    grads = GradSync({"encoder": (encoder if rank in enc_grid else None, enc_grid),
                      "llm": (llm if rank in llm_grid else None, llm_grid)})
    x = torch.randn(8, 32, 16)                    # the global batch: 8 samples x 32 tokens
    tokens = x.shape[0] * x.shape[1]              # every loss is divided by the global count
    if rank in enc_grid:                          # a quarter of the samples
        mine = x.tensor_split(4)[enc_grid.coord(rank)["dp"]]
        loss = encoder(mine).square().sum() / tokens
    else:                                         # half the samples, half the sequence
        at = llm_grid.coord(rank)
        mine = x.tensor_split(2)[at["dp"]].tensor_split(2, dim=1)[at["cp"]]
        loss = llm(mine).square().sum() / tokens
    loss.backward()
    grads.sync()    # sums over dp (and cp): every .grad is now the full batch's gradient
    grads.destroy()
    return encoder, llm, x
# --


# -- TiedGrads
def tied_embedding_step(rank: int, world: int):  # world = 8; the LLM: pp=2 x dp=2
    grid = Grid(pp=2, dp=2)                       # ranks 0-3; rank = pp + 2 * dp
    stage = None
    torch.manual_seed(0)                          # the same initial weights on every rank
    if rank in grid:            # the first stage embeds, the last predicts the next token
        first = is_first_stage(grid, rank)
        stage = nn.Embedding(32, 16) if first else nn.Linear(16, 32, bias=False)
    grads = GradSync({"llm": (stage, grid)})      # sums over dp, within each stage
    tied = TiedGrads(grid, stage.weight if stage else None)   # both weights are 32 x 16
    tied.broadcast_from_first_stage()             # the two copies start equal
    torch.manual_seed(0)
    tokens = torch.randint(32, (4, 8))            # the global batch: 4 samples x 8 tokens
    count = tokens.shape[0] * (tokens.shape[1] - 1)   # predicted tokens, globally
    if stage is not None:
        mine = tokens.tensor_split(2)[grid.coord(rank)["dp"]]
        if first:                                 # embed, send forward, get the gradient
            h = stage(mine)
            dist.send(h.detach(), rank + 1)
            grad = torch.empty_like(h)
            dist.recv(grad, rank + 1)
            h.backward(grad)
        else:
            h = torch.empty(mine.shape + (16,))
            dist.recv(h, rank - 1)
            h.requires_grad_()
            logits = stage(h[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), mine[:, 1:].reshape(-1),
                                   reduction="sum") / count
            loss.backward()
            dist.send(h.grad, rank - 1)
    grads.sync()
    tied.sync()     # first + last stage: both now hold the tied weight's full gradient
    grads.destroy()
    tied.destroy()
    return stage, tokens
# --


def with_grads(rank: int, world: int, step: str):
    """``step``'s results on this rank, and the gradients of the modules among them
    (which pickling a module leaves behind)."""
    out = globals()[step](rank, world)
    return out, {i: [p.grad for p in m.parameters()] for i, m in enumerate(out)
                 if isinstance(m, nn.Module)}


def check_encoder_and_llm(results: list) -> None:
    """Every rank's synced gradients are the undistributed model's (raises if not)."""
    (encoder, llm, x), _ = results[0]
    tokens = x.shape[0] * x.shape[1]
    full = {}
    for name, module in (("encoder", encoder), ("llm", llm)):
        model = nn.Linear(16, 16)
        model.load_state_dict(module.state_dict())
        (model(x).square().sum() / tokens).backward()
        full[name] = (model.weight.grad, model.bias.grad)
    for rank, (_, grads) in enumerate(results):
        got, name = (grads[0], "encoder") if rank < 4 else (grads[1], "llm")
        torch.testing.assert_close(tuple(got), full[name])


def check_tied_embedding(results: list) -> None:
    """The first and the last stage's tied weight hold the undistributed model's
    gradient (the embedding's and the head's uses summed; raises if not)."""
    (first, tokens), _ = results[0]
    weight = first.weight.detach().clone().requires_grad_()
    logits = weight[tokens][:, :-1] @ weight.T
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    (F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1), reduction="sum")
     / count).backward()
    for rank in range(4):
        torch.testing.assert_close(results[rank][1][0][0], weight.grad)


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    for step, check in ((encoder_and_llm_step, check_encoder_and_llm),
                        (tied_embedding_step, check_tied_embedding)):
        check(run_world(8, with_grads, step.__name__))
        print(f"{step.__name__}: ran on 8 processes, checked against full-tensor math: OK")
