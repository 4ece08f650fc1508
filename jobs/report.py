"""The end-to-end jobs' shared parts: values reduced over the world, a step's row, the
gradients of parameters every rank holds whole, and the undistributed model's step."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["allreduce", "step_row", "step_line", "grad_of", "summed_grads", "sgd", "reference_step",
           "warm_up", "result"]


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


def step_line(tag: str, row: dict, steps: int, reference: str = "undistributed",
              extra: str = "") -> str:
    """A step's progress line, as docs/mimo.md gives it: the loss (and the reference
    model's), the largest gradient difference, the bytes each rank sends (max over
    ranks) and the step's time (max over ranks)."""
    from mimo_fx.text import format_bytes

    return (f"[{tag}] step {row['step']}/{steps}{extra}: loss {row['loss']:.6f} ({reference} "
            f"{row['ref_loss']:.6f}), max grad diff {row['grad_diff']:.1e}, sent/rank "
            f"{format_bytes(row['bytes_max'], 1)}, {row['seconds'] * 1e3:.1f} ms")


def grad_of(leaf: torch.Tensor) -> torch.Tensor:
    assert leaf.grad is not None  # every parameter takes part in the loss
    return leaf.grad


def summed_grads(params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """The gradients of ``params`` (whole on every rank) summed over the world, by name
    (one all-reduce of them all, flattened), and how many elements that reduced."""
    import torch.distributed as dist

    flat = torch.cat([grad_of(v).flatten() for v in params.values()])
    dist.all_reduce(flat)
    grads, at = {}, 0
    for n, v in params.items():
        grads[n] = flat[at:at + v.numel()].view_as(v)
        at += v.numel()
    return grads, flat.numel()


def sgd(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        for n, v in params.items():
            v -= lr * grads[n]


def reference_step(full: dict[str, torch.Tensor], loss_of, batch,
                   grads: dict[str, torch.Tensor], lr: float, piece=None
                   ) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """The undistributed model's step at parameters ``full`` on ``batch``: its loss
    (``loss_of(parameters, batch)``), the largest difference of its gradients from
    ``grads`` (this rank's, by name; ``piece(name, gradient)``: this rank's piece of a
    whole gradient, where the rank holds pieces), and its parameters after the same SGD
    step."""
    leaves = {n: v.clone().requires_grad_() for n, v in full.items()}
    ref = loss_of(leaves, batch)
    ref.backward()
    mine = piece or (lambda n, g: g)
    diff = max(float((g - mine(n, grad_of(leaves[n]))).abs().max()) for n, g in grads.items())
    return ref, diff, {n: (v - lr * grad_of(leaves[n])).detach() for n, v in full.items()}


def warm_up(tag: str, backend: str, run_step, say) -> float:
    """Step 0, which compiles (Dynamo's caches and counters cleared first, so that the
    graphs counted are this job's), announced by ``say``; its seconds."""
    import time

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    say(f"[{tag}] compiling the step with {backend}", flush=True)
    dist.barrier()
    start = time.perf_counter()
    run_step(0)  # (Dynamo's one graph for every batch)
    seconds = time.perf_counter() - start
    say(f"[{tag}] compiled in {seconds:.1f} s", flush=True)
    return seconds


def result(variant: str, backend: str, rows: list[dict], mine: dict[str, torch.Tensor],
           full: dict[str, torch.Tensor], compile_s: float,
           piece: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> dict:
    """A job's result dict, over all ranks: its rows, the largest difference of its
    parameters (``mine``) from the undistributed model's (``full``), the compile seconds
    and graphs (worst rank); its bridges destroyed. ``piece(name, tensor)``: this
    rank's piece of a whole parameter, where ``mine`` holds pieces (default: whole)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from mimo_fx.compiled import destroy

    piece_of = piece or (lambda name, t: t)
    param_diff = max((float((mine[n].detach() - piece_of(n, full[n])).abs().max())
                      for n in mine), default=0.0)
    param_diff, compile_s, graphs = allreduce(
        [param_diff, compile_s, counters["stats"]["unique_graphs"]], dist.ReduceOp.MAX)
    destroy()
    torch._dynamo.reset()
    return {"variant": variant, "backend": backend, "rows": rows, "param_diff": param_diff,
            "compile_s": compile_s, "graphs": int(graphs)}
