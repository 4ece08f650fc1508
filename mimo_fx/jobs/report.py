"""The end-to-end jobs' shared reporting: values reduced over the world, a step's row."""

from __future__ import annotations

import torch

__all__ = ["allreduce", "step_row"]


def allreduce(values: list[float], op) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def step_row(step: int, loss: float, ref_loss: float, grad_diff: float, step_bytes: int,
         elapsed: float) -> dict:
    """One step's row of the table, over all ranks: the loss summed over the ranks that
    count it, the worst gradient difference and time, bytes sent per rank and in all."""
    import torch.distributed as dist

    loss_sum, = allreduce([loss], dist.ReduceOp.SUM)
    worst, bytes_max, seconds = allreduce([grad_diff, step_bytes, elapsed],
                                           dist.ReduceOp.MAX)
    total_bytes, = allreduce([step_bytes], dist.ReduceOp.SUM)
    return {"step": step, "loss": loss_sum, "ref_loss": ref_loss, "grad_diff": worst,
            "bytes_max": bytes_max, "bytes_total": total_bytes, "seconds": seconds}
