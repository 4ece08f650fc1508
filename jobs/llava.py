"""The main job's llava variant: a real vision-language model on PyTorch's own parallelism.

A tiny Hugging Face ``LlavaForConditionalGeneration`` (CLIP vision tower, projector,
Llama; float32, the same seed on every rank) trained by ``docs/examples/llava_step.py``:

- ranks 0-1: the vision tower and the projector, FSDP2 (``fully_shard`` on a 1-D mesh,
  gradients summed by :func:`mimo_fx.mimo.fsdp_sums`), their compute compiled;
- ranks 2-3: the language model and its head, DTensor tensor parallel
  (``parallelize_module`` with the model's own ``tp_plan``), the step compiled;
- between them one :class:`~mimo_fx.compiled.Redistributor`: the image-token rows,
  ragged over the encoder's dp (each rank encodes the images of its half of the batch,
  a count that changes every step, zero included), to every LM rank (replicated over
  tp), where HF's own placeholder scatter puts them at their tokens; every rank's
  backward is one ``mimo_fx.backward(loss)``.

Ranks 4 and up of the job's 8-rank world are idle: they take part in making the device
meshes (torch's ``DeviceMesh`` asks every rank of the world) and in the job's report; the
bridge is built by its grids' ranks alone. No context parallelism: transformers'
CP is torch's ``context_parallel``, which has no sharding strategy for CPU's SDPA kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``).

Every rank also trains the same model on one process (the whole batch, HF's own forward
with ``pixel_values``) and compares its gradients every step and its parameters at the
end (DTensor pieces gathered with ``full_tensor()``). Needs ``transformers``
(``pip install -e ".[hf]"``) and a source checkout (it runs the file under ``docs/``).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType

import torch

from mimo_fx import Layout, backward_plan, plan
from mimo_fx.errors import MimoFxError

from .report import allreduce, step_line, step_row

__all__ = ["EXAMPLE", "INSTALL", "available", "example", "reference", "train_llava"]

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "llava_step.py"
INSTALL = 'pip install -e ".[hf]"  (or: pip install transformers)'
WORLD = 4  # the ranks the model runs on


def available() -> str | None:
    """None if the variant can run here, else why not."""
    if importlib.util.find_spec("transformers") is None:
        return f"the llava variant needs transformers: {INSTALL}"
    if not EXAMPLE.exists():
        return f"the llava variant runs {EXAMPLE}, which is missing (a source checkout has it)"
    return None


def example() -> ModuleType:
    """``docs/examples/llava_step.py`` as a module (the model, the batch, ``train``)."""
    why = available()
    if why:
        raise MimoFxError(why)
    spec = importlib.util.spec_from_file_location("llava_step", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(ex: ModuleType, steps: int, lr: float) -> list[dict]:
    """The same model trained on one process, the whole batch, HF's own forward: per step
    the loss, the gradients (None where the model used no parameter) and the parameters
    after the SGD step."""
    model = ex.tiny_llava()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for k in range(steps):
        ids, labels, pixels, _ = ex.batch(k)
        loss = model(input_ids=ids, labels=labels,
                     pixel_values=pixels if len(pixels) else None).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        out.append({"loss": loss.item(), "grads": grads,
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return out


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter or gradient as one plain tensor (a DTensor's ``full_tensor()``: a
    collective over its mesh, which every rank of that mesh calls in the same order)."""
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _max_diff(mine: dict, ref: dict) -> float:
    """Max |mine - ref| over the names of ``mine`` (a missing tensor counts as zeros: on a
    step without images the one-process model gives its vision tower no gradient, FSDP2
    zeros)."""
    worst = 0.0
    for name, t in mine.items():
        r = ref.get(name)
        d = t - r if t is not None and r is not None else t if t is not None else r
        if d is not None:
            worst = max(worst, float(d.abs().max()))
    return worst


def _bridge_bytes(ex: ModuleType, counts, rank: int) -> int:
    """Bytes ``rank`` sends through the image bridge on a step with ``counts`` images per
    sample, forward and backward (from the plans; DTensor's TP and FSDP2's collectives
    are not counted)."""
    from mimo_fx import Grid

    enc, lm = Grid(dp=2), Grid(tp=2, offset=2)
    half = len(counts) // 2
    rows = (ex.TOKENS * sum(counts[:half]), ex.TOKENS * sum(counts[half:]))
    src, dst = Layout(enc, "(dp t) h", ragged="dp"), Layout(lm, "t h")
    sizes = {"t": rows, "h": ex.H}
    return (plan(src, dst, sizes).bytes_sent.get(rank, 0)
            + backward_plan(src, dst, sizes).bytes_sent.get(rank, 0))


def train_llava(rank: int, steps: int, backend: str, lr: float, say=None) -> dict:
    """Train the llava variant on this rank (every rank of the world calls it, 4 or more);
    the e2e result dict, with ``graphs_per_rank``."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    say = say or (lambda *a, **k: None)
    world = dist.get_world_size()
    if world < WORLD:
        raise MimoFxError(f"the llava variant needs {WORLD} ranks, the world has {world}")
    ex = example()
    active = rank < WORLD
    ref = reference(ex, steps, lr) if active else []
    torch._dynamo.reset()
    counters.clear()
    say(f"[llava] {steps} steps, the first one compiling with {backend}", flush=True)
    run = ex.train(rank, world, steps=steps, backend=backend, lr=lr)
    if not active:  # the larger world's other ranks: the generator's setup, to its end
        for _ in run:
            pass
    rows, mine = [], {}
    for k in range(steps):
        dist.barrier()
        start = time.perf_counter()
        loss = None
        if active:
            _, loss, mine = next(run)  # (runs the previous step's optimizer step first)
        elapsed = time.perf_counter() - start
        grad_diff = _max_diff({n: _full(p.grad) for n, p in mine.items()},
                              ref[k]["grads"]) if active else 0.0
        counts = ex.batch(k)[3]
        rows.append(step_row(k + 1, loss.item() if rank == 2 and loss is not None else 0.0,
                             ref[k]["loss"] if active else 0.0, grad_diff,
                             _bridge_bytes(ex, counts, rank), elapsed))
        rows[-1]["images"] = list(counts)
        say(step_line("llava", rows[-1], steps, "one process",
                      f" (images per sample {list(counts)})"), flush=True)
    if active:
        for _ in run:  # the last optimizer step, and the bridge destroyed
            pass
    param_diff = _max_diff({n: _full(p) for n, p in mine.items()},
                           ref[-1]["params"]) if active else 0.0
    graphs = torch.zeros(world)
    graphs[rank] = counters["stats"]["unique_graphs"]
    dist.all_reduce(graphs)
    param_diff, = allreduce([param_diff], dist.ReduceOp.MAX)
    torch._dynamo.reset()
    return {"variant": "llava", "backend": backend, "rows": rows, "param_diff": param_diff,
            "compile_s": rows[0]["seconds"], "graphs": int(graphs.max()),
            "graphs_per_rank": [int(g) for g in graphs.tolist()]}
