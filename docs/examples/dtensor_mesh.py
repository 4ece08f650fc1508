"""A DTensor moved to another mesh, on 8 gloo processes: from an encoder's 2x2 (dp, tp)
mesh on ranks 0-3 to an LLM's cp mesh on ranks 4-7; the gradient comes back.

    python docs/examples/dtensor_mesh.py

docs/dtensor.md shows lines of ``move`` verbatim; tests/test_dtensor.py runs it and
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


if __name__ == "__main__":
    from mimo_fx.testing import run_world

    for rank, (piece, grad) in enumerate(run_world(8, move, timeout=600)):
        print(rank, "piece" if grad is None else "grad", (piece if grad is None else grad).tolist())
