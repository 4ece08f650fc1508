"""A DTensor moved to another mesh, on 8 gloo processes: from an encoder's 2x2 (dp, tp)
mesh on ranks 0-3 to an LLM's cp mesh on ranks 4-7; the gradient comes back.

    python docs/examples/dtensor_mesh.py

docs/dtensor.md shows lines of ``move`` verbatim; tests/interop/test_dtensor.py runs it and
checks the pieces and the gradient against full-tensor math.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import mimo_fx


def move(rank: int, world: int):  # world = 8
    """This rank's piece of the result (None on ranks 0-3) and the local gradient its
    source piece gets back (None on ranks 4-7)."""
    enc = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    llm = DeviceMesh("cpu", [4, 5, 6, 7], mesh_dim_names=("cp",))
    full = torch.arange(32.0).reshape(4, 8).requires_grad_()
    x = distribute_tensor(full, enc, [Shard(0), Replicate()])   # a placeholder off enc
    y = mimo_fx.redistribute_dtensor(x, llm, [Shard(1)])
    # ranks 4-7: a DTensor on llm; ranks 0-3: an empty tensor tied to x by autograd
    loss = y.to_local().square().sum() if isinstance(y, DTensor) else y.sum()
    loss.backward()                                             # on every rank
    if isinstance(y, DTensor):
        return y.to_local().detach(), None
    return None, x.grad.to_local()


def check(results: list) -> None:
    """Against full-tensor math (raises if not): cp rank c holds columns 2c, 2c+1 of X;
    each (dp, tp) rank gets back its dp rows of the gradient 2X."""
    full = torch.arange(32.0).reshape(4, 8)
    for rank, (piece, grad) in enumerate(results):
        if rank < 4:
            assert piece is None and torch.equal(grad, 2 * full.tensor_split(2)[rank // 2])
        else:
            assert grad is None and torch.equal(piece, full.tensor_split(4, dim=1)[rank - 4])


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    results = run_world(8, move, timeout=600)
    for rank, (piece, grad) in enumerate(results):
        print(rank, "piece" if grad is None else "grad", (piece if grad is None else grad).tolist())
    check(results)
    print("checked against full-tensor math: every piece and gradient, OK")
