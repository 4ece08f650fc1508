"""The pipelined MIMO job: an encoder and a two-stage LLM in Megatron's 1F1B schedule.

Three stages, each on a grid of its own parallelism, joined by
:class:`~mimo_fx.compiled.Bridge` s:

- **encoder** on ranks 0-1 (DP2): an MLP over image-token features, ``(dp b) s h`` out;
- **LLM stage 1** on ranks 2-3 (TP2): a column-parallel then row-parallel MLP block with
  a residual, ``b s h`` in and out (replicated over tp); its TP collectives are
  mimo_fx redistributions inside the compiled stage step (the row-parallel output is
  partial over tp; the input passes through ``grad_partial=("tp",)``);
- **LLM stage 2** on ranks 4-7 (DP4): a linear layer and the loss, ``(dp b) s h``.

A step runs ``micro`` micro-batches in Megatron's non-interleaved 1F1B order (each stage
runs ``stages - k - 1`` warm-up forwards ahead; the steady state uses the combined
calls), each stage's compute compiled with ``torch.compile``, then the stages' gradients
are summed over their data axes (:class:`~mimo_fx.mimo.sync.GradSync`) and SGD updates.
The loss is a sum over the global batch divided by its element count, so the summed
gradients are the step's gradients. Every rank also runs the undistributed model (plain
full tensors) and compares its gradients each step and its parameters at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from mimo_fx.grid import Grid
from mimo_fx.layout import Layout

__all__ = ["PipeConfig", "train_pipelined", "megatron_1f1b"]


@dataclass(frozen=True)
class PipeConfig:
    micro: int = 4      # micro-batches per step
    batch: int = 4      # samples per micro-batch
    seq: int = 4        # image tokens per sample
    features: int = 6
    enc_hidden: int = 8
    hidden: int = 8
    ffn: int = 16

    @property
    def sizes(self) -> dict[str, int]:
        return {"b": self.batch, "s": self.seq, "h": self.hidden}


GRIDS = {"enc": Grid(dp=2), "llm1": Grid(tp=2, offset=2), "llm2": Grid(dp=4, offset=4)}


def full_params(cfg: PipeConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)

    def w(*shape):
        return torch.randn(*shape, generator=gen) / shape[0] ** 0.5
    return {"enc.w1": w(cfg.features, cfg.enc_hidden), "enc.w2": w(cfg.enc_hidden, cfg.hidden),
            "llm1.w1": w(cfg.hidden, cfg.ffn), "llm1.w2": w(cfg.ffn, cfg.hidden),
            "llm2.w": w(cfg.hidden, cfg.hidden)}


def step_data(cfg: PipeConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's image features ``(micro, batch, seq, features)`` and targets."""
    gen = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(cfg.micro, cfg.batch, cfg.seq, cfg.features, generator=gen)
    t = torch.randn(cfg.micro, cfg.batch, cfg.seq, cfg.hidden, generator=gen)
    return x, t


def reference_loss(p: dict, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The undistributed model on the whole step (every micro-batch): the oracle."""
    z = torch.tanh(x @ p["enc.w1"]) @ p["enc.w2"]
    z = z + torch.relu(z @ p["llm1.w1"]) @ p["llm1.w2"]
    y = z @ p["llm2.w"]
    return ((y - t) ** 2).sum() / t.numel()


class _Stage(nn.Module):
    """One stage's parameters (this rank's pieces) and its compute."""

    def __init__(self, name: str, pieces: dict[str, torch.Tensor], fn) -> None:
        super().__init__()
        self.name = name
        self.params = nn.ParameterDict({k.split(".")[1]: nn.Parameter(v.clone())
                                        for k, v in pieces.items()})
        self.fn = fn

    def forward(self, x):
        return self.fn(self.params, x)


def megatron_1f1b(stages: int, stage: int, micro: int) -> list[tuple]:
    """Megatron's non-interleaved 1F1B for ``stage``: ``("F", m)``, ``("B", m)`` and, in
    the steady state, ``("FB", m_forward, m_backward)`` (one combined call each side)."""
    warmup = min(stages - stage - 1, micro)
    return ([("F", m) for m in range(warmup)]
            + [("FB", warmup + i, i) for i in range(micro - warmup)]
            + [("B", m) for m in range(micro - warmup, micro)])


def train_pipelined(rank: int, steps: int = 3, backend: str = "aot_eager", lr: float = 0.1,
                    cfg: PipeConfig = PipeConfig(), say=None) -> dict:
    """Train the pipelined job on this rank (8 ranks); the e2e table's result dict.

    Long because it reads as the training script a user writes: grids, layouts and
    bridges, this rank's stage, compiled, warm-up, then the loop with its checks."""
    import torch.distributed as dist

    from mimo_fx.compiled import Bridge, Redistributor
    from mimo_fx.mimo.sync import GradSync
    from mimo_fx.reference import shard

    from .report import reference_step, step_line, step_row

    say = say or (lambda *a, **k: None)
    enc, llm1, llm2 = GRIDS["enc"], GRIDS["llm1"], GRIDS["llm2"]
    acts = {"enc": Layout(enc, "(dp b) s h"), "llm1": Layout(llm1, "b s h"),
            "llm2": Layout(llm2, "(dp b) s h")}
    feats = Layout(enc, "(dp b) s f")
    target = acts["llm2"]
    sizes = cfg.sizes
    layouts = {"enc.w1": Layout(enc, "f e"), "enc.w2": Layout(enc, "e h"),
               "llm1.w1": Layout(llm1, "h (tp g)"), "llm1.w2": Layout(llm1, "(tp g) h"),
               "llm2.w": Layout(llm2, "h o")}
    full = full_params(cfg)
    # every rank builds every bridge and redistribution, in one order (they create groups)
    bridges = [Bridge(acts["enc"], acts["llm1"], sizes), Bridge(acts["llm1"], acts["llm2"], sizes)]
    partial = Layout(llm1, "b s h", partial=("tp",))
    tp_in = Redistributor(acts["llm1"], acts["llm1"], sizes, grad_partial=("tp",))
    tp_out = Redistributor(partial, acts["llm1"], sizes)

    def enc_fn(p, x):
        return torch.tanh(x @ p["w1"]) @ p["w2"]

    def llm1_fn(p, x):
        h = torch.relu(tp_in(x) @ p["w1"]) @ p["w2"]  # partial over tp
        return x + tp_out(h)

    def llm2_fn(p, x):
        return x @ p["w"]

    fns = {"enc": enc_fn, "llm1": llm1_fn, "llm2": llm2_fn}
    order = ["enc", "llm1", "llm2"]
    k = next(i for i, n in enumerate(order) if rank in GRIDS[n])
    name = order[k]
    mine = {n: shard(v, layouts[n])[rank] for n, v in full.items() if n.startswith(name + ".")}
    stage = _Stage(name, mine, fns[name])
    compute = stage if backend == "eager" else torch.compile(stage, backend=backend,
                                                             fullgraph=True)
    sync = GradSync({n: (stage if n == name else None, GRIDS[n]) for n in order})
    last = k == 2
    runner = _Runner(rank, k, compute, bridges, cfg, feats, target)

    step_bytes = _step_bytes(rank, acts, partial, sizes, sync, cfg.micro)
    torch._dynamo.utils.counters.clear()
    say(f"[pp_1f1b] warm-up step (compiles each stage with {backend})", flush=True)
    start = time.perf_counter()
    runner.step(0)  # a warm-up on step 0's data: compiles; its gradients are dropped
    stage.zero_grad(set_to_none=True)
    compile_s = time.perf_counter() - start
    rows = []
    for step in range(1, steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = runner.step(step)
        sync.sync()
        grads = {f"{name}.{n}": p.grad.clone() for n, p in stage.params.items()}
        with torch.no_grad():
            for p in stage.params.values():
                p -= lr * p.grad
        stage.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        ref, diff, full = reference_step(
            full, lambda leaves, data: reference_loss(leaves, *data), step_data(cfg, step),
            grads, lr, lambda n, g: shard(g, layouts[n])[rank])
        rows.append(step_row(step, loss.item() if last else 0.0, ref.item(), diff,
                         step_bytes, elapsed))
        say(step_line("pp_1f1b", rows[-1], steps), flush=True)
    param_diff = max(float((p.detach() - shard(full[f"{name}.{n}"], layouts[f"{name}.{n}"])[rank])
                           .abs().max()) for n, p in stage.params.items())
    from .report import allreduce

    # (this rank's stage graphs over the warm-up and every step: 1 means no recompile)
    param_diff, compile_s, graphs = allreduce(
        [param_diff, compile_s, torch._dynamo.utils.counters["stats"]["unique_graphs"]],
        dist.ReduceOp.MAX)
    sync.destroy()
    for r in (*bridges, tp_in, tp_out):
        r.destroy()
    torch._dynamo.reset()
    return {"variant": "pp_1f1b", "backend": backend, "rows": rows,
            "param_diff": param_diff, "compile_s": compile_s, "graphs": int(graphs)}


class _Runner:
    """One rank's stage in the 1F1B schedule: receives, computes, sends, per micro-batch."""

    def __init__(self, rank: int, k: int, compute, bridges, cfg: PipeConfig, feats: Layout,
                 target: Layout) -> None:
        self.rank, self.compute, self.cfg = rank, compute, cfg
        self.k, self.feats, self.target = k, feats, target
        self.prev = bridges[k - 1] if k > 0 else None
        self.next = bridges[k] if k < len(bridges) else None
        self.bridges = bridges
        self.count = cfg.micro * cfg.batch * cfg.seq * cfg.hidden  # the loss's global count

    def step(self, step: int) -> torch.Tensor:
        """One step's 1F1B schedule on this rank; returns its part of the loss."""
        from mimo_fx.reference import shard

        x_all, t_all = step_data(self.cfg, step)
        self.ins: dict = {}
        self.outs: dict = {}
        self.loss = torch.zeros(())
        self.targets = [shard(t, self.target).get(self.rank) for t in t_all]
        prev, nxt = self.prev, self.next

        def receive(m):
            return shard(x_all[m], self.feats)[self.rank] if prev is None else prev.recv_forward()

        pending = None
        for action in megatron_1f1b(len(self.bridges) + 1, self.k, self.cfg.micro):
            if action[0] == "F":
                self._forward(action[1], receive(action[1]))
                if nxt is not None:
                    nxt.send_forward(self.outs[action[1]].detach())
            elif action[0] == "B":
                g = self._backward(action[1], nxt.recv_backward() if nxt is not None else None)
                if prev is not None:
                    prev.send_backward(g)
            else:  # steady state: forward mf, backward mb, with the combined calls
                mf, mb = action[1], action[2]
                self._forward(mf, pending if pending is not None else receive(mf))
                pending = None
                grad = (nxt.send_forward_recv_backward(self.outs[mf].detach())
                        if nxt is not None else None)
                g = self._backward(mb, grad)
                if prev is not None and mf + 1 < self.cfg.micro:
                    pending = prev.send_backward_recv_forward(g)
                elif prev is not None:
                    prev.send_backward(g)
        for bridge in self.bridges:
            bridge.flush()
        return self.loss

    def _forward(self, m: int, x: torch.Tensor) -> None:
        self.ins[m] = x
        self.outs[m] = self.compute(x)

    def _backward(self, m: int, grad):
        if self.next is None:
            piece = ((self.outs[m] - self.targets[m]) ** 2).sum() / self.count
            self.loss = self.loss + piece.detach()
            piece.backward()
        else:
            self.outs[m].backward(grad)
        return self.ins[m].grad if self.prev is not None else None


def _step_bytes(rank: int, acts: dict, partial: Layout, sizes: dict, sync, micro: int) -> int:
    """Bytes a step sends from ``rank``: the bridges' and the TP redistributions' plans per
    micro-batch (forward and backward), and the gradient sums (ring all-reduce)."""
    from mimo_fx.plan import backward_layouts, plan

    per_micro: dict[int, int] = {}
    for s, d, gp in ((acts["enc"], acts["llm1"], ()), (acts["llm1"], acts["llm2"], ()),
                     (acts["llm1"], acts["llm1"], ("tp",)), (partial, acts["llm1"], ())):
        for a, b in ((s, d), backward_layouts(s, d, gp)):
            for r, n in plan(a, b, sizes).bytes_sent.items():
                per_micro[r] = per_micro.get(r, 0) + n
    sync_bytes = sum(2 * (len(bk.ranks) - 1) * bk.numel * bk.dtype.itemsize // len(bk.ranks)
                     for bk in sync.buckets if rank in bk.ranks)
    return micro * per_micro.get(rank, 0) + sync_bytes
