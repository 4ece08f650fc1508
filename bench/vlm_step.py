"""A real VLM step on 4 gloo processes: mimo_fx's bridge against two hand-written ones.

    python bench/vlm_step.py            # writes bench/results/vlm_step.txt
    python bench/vlm_step.py --quick    # fewer repetitions, writes nothing

The model and its parallelism are docs/examples/llava_step.py's: a tiny Hugging Face
LLaVA, the vision tower and projector on ranks 0-1 (FSDP2, compute compiled), the
language model on ranks 2-3 (DTensor TP), the images per sample changing every step
(zero included). One training step (forward and backward; no optimizer step, so every
bridge sees the same weights) with three ways of moving the image-token rows from the
encoder ranks to both LM ranks and their gradients back:

- **mimo_fx**: a ``Redistributor`` ragged over the encoder's dp, called inside the LM's
  compiled step (``fullgraph=True``), ``mimo_fx.backward`` on every rank; the encoder
  ranks call it eagerly (FSDP2's hooks keep the encoder's module call out of a graph).
  It learns the row counts every call (one small all-gather over the 4 ranks);
- **mimo_fx, counts given**: the same, every rank giving the step's row counts (the
  LM's compiled step reads them from a tensor: unbacked sizes, no recompile), so no
  size gather;
- **p2p**: a hand-written ``autograd.Function`` over ``dist.isend``/``irecv`` (eager): each
  encoder rank sends its row count, then its rows, to both LM ranks; backward, one LM
  rank per encoder rank sends that rank's gradient rows back;
- **gather**: every rank all-gathers every encoder rank's rows (padded to the largest
  count, the counts all-gathered first) and the LM ranks index the real ones out;
  backward, one all-reduce of the whole gradient.

For p2p and gather the LM's compute is compiled (``fullgraph=True``) with the rows as
its input, the bridge around it eager. Repetitions are interleaved (the order rotating,
a barrier before each step), times are the max over ranks, medians over repetitions.
Bytes are each rank's sends per step from the plans (mimo_fx: forward + backward plans
and its size gather) or from the counts (p2p, gather; gloo's ring all-gather and
all-reduce), averaged over the step mix, for the busiest rank. Compile status: each
bridge's call traced with ``fullgraph=True`` and compiled by aot_eager on fake tensors
(forward and backward), nothing run; the error text if that fails. The warm-up steps
(one per image pattern) check that p2p's and gather's gradients equal mimo_fx's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vlm_step.txt")
KINDS = ("mimo_fx", "mimo_fx, counts given", "p2p", "gather")
ENC, LM = (0, 1), (2, 3)


# -- the hand-written bridges ------------------------------------------------------------
class P2P(torch.autograd.Function):
    """(a) isend/irecv: each encoder rank sends its row count, then its rows, to every LM
    rank; the LM ranks concatenate them in encoder order. Backward: LM rank
    ``LM[i % 2]`` sends encoder rank ``i`` the gradient of its rows."""

    @staticmethod
    def forward(ctx, x, h):
        import torch.distributed as dist

        rank = dist.get_rank()
        ctx.rank, ctx.h = rank, h
        if rank in ENC:
            n = torch.tensor([x.shape[0]], dtype=torch.int64)
            for w in [dist.isend(n, d) for d in LM]:
                w.wait()
            if x.shape[0]:
                rows = x.detach().contiguous()
                for w in [dist.isend(rows, d) for d in LM]:
                    w.wait()
            ctx.n = x.shape[0]
            return x.new_empty(0, h)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in ENC]
        for w in [dist.irecv(c, s) for c, s in zip(counts, ENC)]:
            w.wait()
        ctx.counts = [int(c) for c in counts]
        bufs = [torch.empty(c, h) for c in ctx.counts]
        for w in [dist.irecv(b, s) for b, s in zip(bufs, ENC) if b.numel()]:
            w.wait()
        return torch.cat(bufs)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        if ctx.rank in ENC:
            i = ENC.index(ctx.rank)
            gx = torch.empty(ctx.n, ctx.h)
            if ctx.n:
                dist.irecv(gx, LM[i % len(LM)]).wait()
            return gx, None
        at = 0
        for i, (s, c) in enumerate(zip(ENC, ctx.counts)):
            if c and LM[i % len(LM)] == ctx.rank:
                dist.isend(g[at:at + c].contiguous(), s).wait()
            at += c
        return g.new_zeros(0, ctx.h), None


class Gather(torch.autograd.Function):
    """(b) gather everything: every rank all-gathers every rank's rows (padded to the
    largest count; the counts all-gathered first); the LM ranks keep the encoder ranks'
    real rows. Backward: one all-reduce of the whole gradient, each LM rank adding half
    (its tp replica's share), and each encoder rank takes its rows."""

    @staticmethod
    def forward(ctx, x, h):
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        n = x.shape[0] if rank in ENC else 0
        counts_t = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts_t, torch.tensor([n], dtype=torch.int64))
        counts = [int(c) for c in counts_t]
        m = max(counts)
        pieces = [torch.zeros(m, h) for _ in range(world)]
        if m:
            mine = torch.zeros(m, h)
            if n:
                mine[:n] = x.detach()
            dist.all_gather(pieces, mine)
        ctx.counts, ctx.rank, ctx.h = counts, rank, h
        if rank in LM:
            return torch.cat([pieces[r][:counts[r]] for r in ENC])
        return x.new_empty(0, h)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        total = sum(ctx.counts[r] for r in ENC)
        buf = (g / len(LM) if ctx.rank in LM else torch.zeros(total, ctx.h)).contiguous()
        if total:
            dist.all_reduce(buf)
        if ctx.rank in ENC:
            at = sum(ctx.counts[r] for r in ENC[:ENC.index(ctx.rank)])
            return buf[at:at + ctx.counts[ctx.rank]], None
        return g.new_zeros(0, ctx.h), None


# -- bytes per rank ------------------------------------------------------------------------
def bytes_per_rank(kind: str, rows: tuple[int, int], h: int, world: int = 4) -> dict[int, int]:
    """Bytes each rank sends in a step whose encoder ranks hold ``rows`` image rows."""
    from mimo_fx import Grid, Layout, backward_plan, plan
    from mimo_fx.compiled.guard import HEADER_LEN

    row = 4 * h
    out = dict.fromkeys(range(world), 0)
    if kind.startswith("mimo_fx"):
        src, dst = Layout(Grid(dp=2), "(dp t) h", ragged="dp"), Layout(Grid(tp=2, offset=2),
                                                                       "t h")
        sizes = {"t": rows, "h": h}
        for p in (plan(src, dst, sizes), backward_plan(src, dst, sizes)):
            for r, n in p.bytes_sent.items():
                out[r] += n
        for r in out:  # the size gather: one int64 row per rank, all-gathered (ring)
            out[r] += (world - 1) * HEADER_LEN * 8 if kind == "mimo_fx" else 0
    elif kind == "p2p":
        for i, r in enumerate(ENC):
            out[r] += len(LM) * (8 + rows[i] * row)  # its count and rows to each LM rank
            out[LM[i % len(LM)]] += rows[i] * row    # their gradient back
    else:
        m = max(rows)
        for r in out:  # ring all-gathers of the counts and the padded rows, ring all-reduce
            out[r] += (world - 1) * (8 + m * row)
            out[r] += 2 * (world - 1) * sum(rows) * row // world
    return out


# -- compile status ------------------------------------------------------------------------
class _Traced(Exception):
    """Raised by the trace-only backend once aot_eager has compiled the graph."""


def _trace_only(gm, example_inputs):
    torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    raise _Traced


def compile_status(fn, *args) -> str:
    """Whether ``fn(*args)`` compiles with ``fullgraph=True`` (traced, forward and
    backward compiled by aot_eager on fake tensors, never run), else the error's first
    line."""
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=_trace_only, fullgraph=True)(*args)
        return "ran?!"  # (the backend raises: never reached)
    except Exception as err:  # noqa: BLE001 -- the message is the finding
        cause: BaseException | None = err
        while cause is not None:
            if isinstance(cause, _Traced):
                return "compiles"
            cause = cause.__cause__ or getattr(cause, "inner_exception", None)
        text = " ".join(str(err).split())
        return f"{type(err).__name__}: {text[:160]}"
    finally:
        torch._dynamo.reset()


# -- one rank ------------------------------------------------------------------------------
def worker(rank: int, world: int, warmup: int, reps: int, backend: str) -> dict:
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    import mimo_fx
    from mimo_fx import Layout
    from mimo_fx.compiled import Redistributor
    from mimo_fx.jobs.llava import example
    from mimo_fx.mimo import fsdp_sums
    from mimo_fx.reference import shard

    ex = example()
    H = ex.H
    compiled = torch.compile(backend=backend, fullgraph=True)
    enc = DeviceMesh("cpu", list(ENC), mesh_dim_names=("dp",))
    lm = DeviceMesh("cpu", list(LM), mesh_dim_names=("tp",))
    model = ex.tiny_llava()
    if rank in ENC:
        encoder = fsdp_sums(fully_shard(ex.Encoder(model), mesh=enc))
        encoder.features = compiled(encoder.features)
        params = dict(encoder.named_parameters(prefix="model"))
    else:
        parallelize_module(model, lm, ex.tp_plan(model))
        params = {n: p for n, p in model.named_parameters()
                  if n.startswith(("model.language_model", "lm_head"))}
    bridge = Redistributor(Layout(enc, "(dp t) h", ragged="dp"), Layout(lm, "t h"), {"h": H})
    images = Layout(enc, "(dp i) c y x", ragged="dp")
    placeholder = torch.empty(0, H, requires_grad=True)  # the LM ranks' input to p2p/gather

    def lm_loss(ids, labels, rows):
        image = BaseModelOutputWithPooling(pooler_output=[rows])
        return model(input_ids=ids, labels=labels, mm_encoder_outputs={"image": image}).loss

    lm_mimo = compiled(lambda ids, labels: lm_loss(ids, labels, bridge(None)))
    # the row counts as a tensor, read inside the graph: unbacked sizes, no recompile
    lm_given = compiled(lambda ids, labels, t: lm_loss(ids, labels,
                                                       bridge(None, t=tuple(t.tolist()))))
    lm_rows = compiled(lm_loss)
    hand = {"p2p": P2P, "gather": Gather}

    def step(kind: str, k: int) -> float:
        """One step of ``kind``; the seconds until its forward returned."""
        ids, labels, pixels, counts = ex.batch(k)
        start = time.perf_counter()
        t = tuple(ex.TOKENS * sum(counts[i * 2:i * 2 + 2]) for i in range(2))  # rows per rank
        if rank in ENC:
            mine = shard(pixels, images, rank=rank, i=counts)
            torch._dynamo.decorators.mark_unbacked(mine, 0)
            rows = encoder(mine)
            if kind.startswith("mimo_fx"):
                bridge(rows) if kind == "mimo_fx" else bridge(rows, t=t)
                forward = time.perf_counter() - start
                mimo_fx.backward()
            else:
                y = hand[kind].apply(rows, H)
                forward = time.perf_counter() - start
                y.sum().backward()
        elif kind.startswith("mimo_fx"):
            loss = (lm_mimo(ids, labels) if kind == "mimo_fx" else
                    lm_given(ids, labels, torch.tensor(t)))
            forward = time.perf_counter() - start
            mimo_fx.backward(loss)
        else:
            rows = hand[kind].apply(placeholder, H)
            torch._dynamo.decorators.mark_unbacked(rows, 0)
            loss = lm_rows(ids, labels, rows)
            forward = time.perf_counter() - start
            loss.backward()
        return forward

    def grads() -> dict[str, torch.Tensor]:
        out = {}
        for n, p in params.items():  # full_tensor(): the same order on every mesh rank
            g = p.grad
            if g is not None:
                out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
            p.grad = None
        return out

    torch._dynamo.reset()
    counters.clear()
    diffs = dict.fromkeys(KINDS[1:], 0.0)
    for k in range(warmup):  # every image pattern once: compiles, then the gradient check
        got = {}
        for kind in KINDS:
            step(kind, k)
            got[kind] = grads()
        for kind in KINDS[1:]:
            for n in set(got[kind]) | set(got["mimo_fx"]):
                a, b = got[kind].get(n), got["mimo_fx"].get(n)
                d = (a - b if a is not None and b is not None else a if a is not None else b)
                assert d is not None
                diffs[kind] = max(diffs[kind], float(d.abs().max()))
    graphs = counters["stats"]["unique_graphs"]
    seconds = torch.zeros(2, reps, len(KINDS))  # step, forward
    for i in range(reps):
        k = warmup + i
        for j in range(len(KINDS)):
            c = (i + j) % len(KINDS)
            dist.barrier()
            start = time.perf_counter()
            seconds[1, i, c] = step(KINDS[c], k)
            seconds[0, i, c] = time.perf_counter() - start
            for p in params.values():
                p.grad = None
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    # compile status: each bridge's call alone, traced on fakes, nothing sent
    x = torch.randn(3, H, requires_grad=True) if rank in ENC else None
    status = {"mimo_fx": compile_status(lambda t: bridge(t), x)}
    status[KINDS[1]] = compile_status(lambda u, t: bridge(u, t=tuple(t.tolist())), x,
                                      torch.tensor((3, 3)))
    for kind, fn in hand.items():
        status[kind] = compile_status(lambda t, f=fn: f.apply(t, H),
                                      x if x is not None else placeholder)
    bridge.destroy()
    return {"seconds": seconds, "diffs": diffs, "graphs": graphs, "status": status,
            "images": [ex.batch(warmup + i)[3] for i in range(reps)],
            "tokens": ex.TOKENS, "h": H}


# -- the report ----------------------------------------------------------------------------
def report(results: list[dict], warmup: int, reps: int, backend: str) -> str:
    from tabulate import tabulate

    from mimo_fx.plan import format_bytes

    res = results[0]
    med = {kind: statistics.median(res["seconds"][0, :, c].tolist()) for c, kind in
           enumerate(KINDS)}
    fwd = {kind: statistics.median(res["seconds"][1, :, c].tolist()) for c, kind in
           enumerate(KINDS)}
    rows_per_step = [tuple(res["tokens"] * sum(c[i * 2:i * 2 + 2]) for i in range(2))
                     for c in res["images"]]
    table = []
    for kind in KINDS:
        sent = [bytes_per_rank(kind, rows, res["h"]) for rows in rows_per_step]
        busiest = max(statistics.mean(s[r] for s in sent) for r in range(4))
        total = statistics.mean(sum(s.values()) for s in sent)
        status = {"encoder": results[ENC[0]]["status"][kind],
                  "LM": results[LM[0]]["status"][kind]}
        compiled = (status["encoder"] if status["encoder"] == status["LM"] else
                    f"encoder ranks: {status['encoder']}; LM ranks: {status['LM']}")
        table.append([kind, f"{med[kind] * 1e3:.1f}", f"{fwd[kind] * 1e3:.1f}",
                      f"{med[kind] / med['mimo_fx']:.2f}x",
                      format_bytes(int(busiest), 1), format_bytes(int(total), 1),
                      "(reference)" if kind == "mimo_fx"
                      else f"{max(r['diffs'][kind] for r in results[:4]):.1e}", compiled])
    graphs = [r["graphs"] for r in results]
    head = (f"a real VLM step (tiny HF LLaVA: CLIP vision + projector on FSDP2 ranks 0-1, "
            f"Llama on DTensor TP ranks 2-3), 4 gloo ranks, {backend}; forward + backward; "
            f"median of {reps} interleaved repetitions after {warmup} warm-up steps, max "
            f"over ranks; the steps cycle through {len(set(map(tuple, res['images'])))} image "
            f"patterns (0-8 images, 0-32 rows of {res['h']} floats); compiled graphs per rank "
            f"after "
            f"the warm-up {graphs}")
    return head + "\n\n" + tabulate(table, headers=[
        "bridge", "step ms", "forward ms", "step vs mimo_fx", "sent/step, busiest rank",
        "sent/step, all ranks", "max grad diff vs mimo_fx", "fullgraph compile of the bridge call"],
        disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; writes "
                        "no result file")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--backend", default="aot_eager", help="aot_eager or inductor")
    args = parser.parse_args(argv)
    from mimo_fx.jobs.llava import available

    why = available()
    if why:
        print(f"vlm_step: skipped: {why}")
        return 0
    from mimo_fx.testing import run_world

    warmup, reps = 6, 6 if args.quick else args.reps
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    start = time.perf_counter()
    results = run_world(4, worker, warmup, reps, args.backend, timeout=1800)
    text = report(results, warmup, reps, args.backend)
    after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text += (f"\n\nmachine: {os.cpu_count()} CPUs, load average before {load}, after {after}; "
             f"torch {torch.__version__}; world run {time.perf_counter() - start:.0f} s\n")
    print(text)
    worst = max(r["diffs"][k] for r in results[:4] for k in KINDS[1:])
    if worst > 1e-5:
        print(f"FAILED: a hand-written bridge's gradients differ from mimo_fx's by {worst:.1e}")
        return 1
    if not args.quick:
        with open(RESULT, "w") as f:
            f.write(f"# python bench/vlm_step.py, {datetime.date.today().isoformat()}\n"
                    + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
