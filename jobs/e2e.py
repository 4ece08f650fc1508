"""End-to-end: the toy MIMO model trained on one process per rank, checked against the
undistributed model.

``python -m mimo_fx.jobs`` spawns 8 gloo processes on 127.0.0.1 and trains the toy model
(:mod:`mimo_fx.jobs.toy`) for a few SGD steps in two layouts:

- **colocated**: encoder TP2xDP4 and LLM TP2xCP2xDP2 on the same 8 ranks (fan-in bridge
  into zigzag CP);
- **pipelined**: encoder TP2xDP2 on ranks 0-3, LLM TP2xCP2 on ranks 4-7 (disjoint
  grids: the bridge is a pipeline-stage transfer);
- **variable**: the colocated layouts with text tokens after the image tokens, and
  both lengths changing every step (the LLM's sequence 16, 12, 16, 20 tokens); the
  compiled step serves every length (one graph after Dynamo's first, static, one);
- **pp_1f1b**: micro-batches in Megatron's 1F1B schedule over three stages -- encoder
  DP2 on ranks 0-1, LLM stage 1 TP2 on ranks 2-3, LLM stage 2 DP4 on ranks 4-7 -- joined
  by pipelined bridges, each stage's compute compiled (:mod:`mimo_fx.jobs.pp_1f1b`);
- **packed**: samples with 0-3 images of varying token counts and varying text, packed
  per step; the encoder on DP8, the LLM on DP4 x CP2 with per-sequence zigzag, image
  embeddings sent straight to the cp rank holding their tokens by one redistribute into
  a packed layout, a varlen causal attention in plain torch; one compiled graph for every batch
  (:mod:`mimo_fx.jobs.packed`);
- **balanced**: the packed variant's model with a data loader per rank, deliberately
  skewed (image-heavy documents on two, long text on two); every step the loaders'
  samples are shared by one all-gather and images and samples placed by cost on the
  encoder's ranks and the LLM's dp groups, all of it moved by redistribute between the
  placement's layouts (:mod:`mimo_fx.jobs.balanced`).

Each step is ``torch.func.grad_and_value`` of the SPMD loss on the process world
(:class:`mimo_fx.compiled.world.ProcessWorld`), compiled with ``torch.compile`` (backend
``aot_eager`` by default), then the multi-module gradient sync
(:class:`mimo_fx.mimo.grads.ModuleGrads`) and an SGD update. Every rank also runs the
undistributed model on the full batch (plain tensors, no mimo_fx) and compares, per
step, its synchronised gradient pieces with the matching pieces of the full gradients,
and at the end its parameters. A table gives per step: the global loss (and the
undistributed model's), the max gradient difference over all ranks and parameters, the
bytes each rank sends (max over ranks; from the bridges' plans, forward + backward +
gradient sync), and the step time (max over ranks). Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from mimo_fx.errors import MimoFxError
from mimo_fx.mimo.config import MimoParallelism
from mimo_fx.mimo.config import ModuleParallelism as M
from mimo_fx.mimo.grads import ModuleGrads
from mimo_fx.plan import format_bytes

from .report import result, step_line, step_row
from .toy import ToyConfig, ToyMimo

__all__ = ["VARIANTS", "train_worker", "main"]

VARIANTS = {
    "colocated": MimoParallelism(world_size=8, colocated=True, modules={
        "enc": M(tp=2, dp=4), "llm": M(tp=2, cp=2, dp=2)}),
    "pipelined": MimoParallelism(world_size=8, modules={
        "enc": M(tp=2, dp=2), "llm": M(tp=2, cp=2, offset=4)}),
    "fan_out": MimoParallelism(world_size=8, colocated=True, modules={
        "enc": M(tp=4, dp=2), "llm": M(cp=2, dp=4)}),
    "equal": MimoParallelism(world_size=8, colocated=True, modules={
        "enc": M(tp=2, dp=4), "llm": M(tp=2, dp=4)}),
    "variable": MimoParallelism(world_size=8, colocated=True, modules={
        "enc": M(tp=2, dp=4), "llm": M(tp=2, cp=2, dp=2)}),
}
# per step (step 0: the warm-up), image and text tokens per sample
# (the warm-up compiles at the first and the last: every length differs between them, so
# Dynamo marks them all dynamic at once)
LENGTHS = {"variable": ((8, 4), (6, 10), (10, 2), (4, 12), (2, 18))}
TOLERANCE = 1e-5  # fp32, max abs parameter difference after the last step


def _pipelined(*args, **kwargs) -> dict:
    from .pp_1f1b import train_pipelined

    return train_pipelined(*args, **kwargs)


def _packed(*args, **kwargs) -> dict:
    from .packed import train_packed

    return train_packed(*args, **kwargs)


def _balanced(*args, **kwargs) -> dict:
    from .balanced import train_balanced

    return train_balanced(*args, **kwargs)


def _llava(*args, **kwargs) -> dict:
    from .llava import train_llava

    return train_llava(*args, **kwargs)


# variants with their own training loop: (rank, steps, backend, lr, say=) -> result
EXTRA = {"pp_1f1b": _pipelined, "packed": _packed, "balanced": _balanced, "llava": _llava}
DEFAULT = ["colocated", "pipelined", "variable", "pp_1f1b", "packed", "balanced", "llava"]


def unavailable(variant: str) -> str | None:
    """Why ``variant`` cannot run here (a missing optional dependency), or None."""
    if variant == "llava":
        from .llava import available

        return available()
    return None


@dataclass(frozen=True)
class Run:
    variant: str
    steps: int = 3
    backend: str = "aot_eager"  # "eager", or a torch.compile backend
    lr: float = 0.1
    cfg: ToyConfig = ToyConfig()
    progress: bool = False  # rank 0 prints a line per phase and per step


def _data(cfg: ToyConfig, step: int, variant: str = "colocated"):
    """Image features, targets and (the variable variant) text embeddings of a step."""
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = LENGTHS.get(variant)
    images, text = lengths[step % len(lengths)] if lengths else (cfg.seq, 0)
    x = torch.randn(cfg.batch, images, cfg.features, generator=gen)
    t = torch.randn(cfg.batch, images + text, cfg.hidden, generator=gen)
    emb = torch.randn(cfg.batch, text, cfg.hidden, generator=gen) if lengths else None
    return x, t, emb


def _train(rank: int, run: Run) -> dict:
    """Train ``run`` on this rank and compare every step with the undistributed model.

    Long because it reads as the training script a user writes: the model and this rank's
    pieces, the differentiated step closing over them, warm-up, then the loop."""
    import torch.distributed as dist

    from mimo_fx.compiled.world import ProcessWorld
    from mimo_fx.reference import shard

    if run.variant in EXTRA:
        say = print if run.progress and rank == 0 else None
        return EXTRA[run.variant](rank, run.steps, run.backend, run.lr, say=say)
    mimo = VARIANTS[run.variant]
    if mimo.world_size != dist.get_world_size():
        raise MimoFxError(f"variant {run.variant!r} needs {mimo.world_size} ranks, the world "
                          f"has {dist.get_world_size()}")
    say = print if run.progress and rank == 0 else (lambda *a, **k: None)
    say(f"[{run.variant}] preparing bridges (eager warm-up step)", flush=True)
    grids = mimo.grids()
    model = ToyMimo(run.cfg, grids["enc"], grids["llm"])
    layouts = model.param_layouts
    full = model.init_params(dtype=torch.float32)
    mine = {n: shard(full[n], lay)[rank] for n, lay in layouts.items() if lay.holds(rank)}
    names = list(layouts)
    # the variable variant's sequence lengths change every step: its bridges take them
    # per call, and one compiled graph serves every length
    world = ProcessWorld(torch.float32, vary=("s", "v", "t") if run.variant in LENGTHS else ())
    llm = grids["llm"]
    counts_loss = rank in llm and llm.coord(rank)["tp"] == 0  # one replica per loss piece

    def loss_fn(p, x, t, text):
        world.begin(anchor=next(iter(p.values())))
        params = {n: ({rank: p[n]} if n in p else {}) for n in names}
        lengths = None if text is None else (x.shape[1], text.shape[1])
        losses = model.loss(world, params, {} if x is None else {rank: x},
                            {} if t is None else {rank: t},
                            text=None if text is None else {rank: text}, lengths=lengths)
        total = losses[rank] if rank in losses else next(iter(p.values())).sum() * 0
        return world.end(total)

    grad_step = torch.func.grad_and_value(loss_fn)
    grads = ModuleGrads(world, layouts, run.cfg.sizes)

    def step_grads(fn, x, t, text):
        g, value = fn(mine, x, t, text)
        grads.zero_grad()
        grads.accumulate({n: ({rank: g[n]} if n in g else {}) for n in names})
        return {n: pieces[rank] for n, pieces in grads.grads.items() if rank in pieces}, value

    def pieces(x, t, text):
        return (shard(x, model.x).get(rank), shard(t, model.target).get(rank),
                None if text is None else shard(text, model.text).get(rank))

    recorded: list = []  # the eager warm-up step's calls: the bytes a step moves

    def run_step(fn, k):
        world.calls = recorded if fn is grad_step else None
        args = pieces(*_data(run.cfg, k, run.variant))
        if fn is not grad_step and run.variant in LENGTHS:
            # the lengths vary: their dims dynamic from the first compile, one graph for
            # every length (unmarked, Dynamo compiles a static graph first, then this one:
            # its automatic dynamic shapes are tested in tests/backends/test_variable_sizes.py)
            other = pieces(*_data(run.cfg, k + 1, run.variant))
            for a, b in zip(args, other):
                for d in range(a.dim() if a is not None else 0):
                    if a.shape[d] != b.shape[d]:
                        torch._dynamo.maybe_mark_dynamic(a, d)
        try:
            return step_grads(fn, *args)
        finally:
            world.calls = None

    step_fn, compile_s = _warm_up(run, grad_step, run_step, say)

    rows = []
    for step in range(1, run.steps + 1):
        x, t, text = _data(run.cfg, step, run.variant)
        dist.barrier()
        start = time.perf_counter()
        g, value = step_grads(step_fn, *pieces(x, t, text))
        with torch.no_grad():
            for n in mine:
                mine[n] = mine[n] - run.lr * g[n]
        elapsed = time.perf_counter() - start
        full, ref_loss, grad_diff = _undistributed_step(model, full, x, t, text, run.lr, g,
                                                        rank)
        step_bytes = world.bytes_sent(model.step_sizes(x.shape[1], t.shape[1] - x.shape[1]),
                                      recorded)
        rows.append(step_row(step, float(value) if counts_loss else 0.0, float(ref_loss),
                         grad_diff, step_bytes, elapsed))
        say(step_line(run.variant, rows[-1], run.steps), flush=True)
    # (graphs counted since the warm-up cleared the counters)
    return result(run.variant, run.backend, rows, mine, full, compile_s,
                  piece=lambda n, t: shard(t, layouts[n])[rank])


def _warm_up(run: Run, grad_step, run_step, say):
    """An eager step (it prepares every bridge, in the same order on all ranks), then, for
    a compiled run, the step traced and compiled (run at two lengths when they vary): the step
    to run, compile seconds. ``run_step(fn, k)`` runs ``fn`` on step ``k``'s data."""
    import torch.distributed as dist

    run_step(grad_step, 0)
    if run.backend == "eager":
        return grad_step, 0.0
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    step_fn = torch.compile(grad_step, backend=run.backend, fullgraph=True)
    say(f"[{run.variant}] compiling the step with {run.backend}", flush=True)
    dist.barrier()
    start = time.perf_counter()
    run_step(step_fn, 0)
    if run.variant in LENGTHS:  # a second length: the dynamic graph serves it, no recompile
        run_step(step_fn, len(LENGTHS[run.variant]) - 1)
    compile_s = time.perf_counter() - start
    say(f"[{run.variant}] compiled in {compile_s:.1f} s", flush=True)
    return step_fn, compile_s


def _undistributed_step(model: ToyMimo, full: dict, x, t, text, lr: float, g: dict,
                        rank: int):
    """One SGD step of the undistributed model on the full batch: its new parameters, its
    loss, and how far this rank's gradient pieces ``g`` are from its gradients."""
    from mimo_fx.reference import shard

    leaves = {n: v.clone().requires_grad_() for n, v in full.items()}
    ref_loss = model.reference_loss(leaves, x, t, text)
    ref_loss.backward()
    layouts = model.param_layouts
    grad_diff = max(float((g[n] - shard(leaves[n].grad, layouts[n])[rank]).abs().max())
                    for n in g)
    return ({n: (v - lr * leaves[n].grad).detach() for n, v in full.items()}, ref_loss.detach(),
            grad_diff)


def train_worker(rank: int, world_size: int, runs: list[Run]) -> list[dict]:
    """Every run on this rank (call on all ranks, e.g. via ``mimo_fx.testing.run_world``)."""
    return [_train(rank, run) for run in runs]


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    rows = []
    for res in results:
        for r in res["rows"]:
            rows.append([res["variant"], res["backend"], r["step"], f"{r['loss']:.6f}",
                         f"{r['ref_loss']:.6f}", f"{r['grad_diff']:.1e}",
                         format_bytes(r["bytes_max"], 1), format_bytes(r["bytes_total"], 1),
                         f"{r['seconds'] * 1e3:.1f}"])
    return tabulate(rows, headers=["variant", "backend", "step", "loss", "undistributed loss",
                                   "max grad diff", "sent/rank (max)", "sent (all ranks)",
                                   "ms/step"], disable_numparse=True)


def check(results: list[dict]) -> list[str]:
    """Failed checks, as messages."""
    failures = []
    for res in results:
        if res["variant"] in LENGTHS and res["backend"] != "eager" and res["graphs"] > 1:
            failures.append(f"{res['variant']}: {res['graphs']} compiled graphs for changing "
                            f"lengths (one: their dims are marked dynamic)")
        if res["variant"] == "pp_1f1b" and res["backend"] != "eager" and res["graphs"] > 1:
            failures.append(f"pp_1f1b: a stage compiled {res['graphs']} graphs (one serves "
                            f"every micro-batch and step)")
        if res["variant"] == "llava" and res["backend"] != "eager":
            want = [1] * 4 + [0] * (len(res["graphs_per_rank"]) - 4)
            if res["graphs_per_rank"] != want:
                failures.append(f"llava: compiled graphs per rank {res['graphs_per_rank']}, "
                                f"not {want} (one per rank serves every image count)")
        if res["variant"] == "llava":
            for r in res["rows"]:
                if not r["grad_diff"] <= TOLERANCE:
                    failures.append(f"llava step {r['step']}: gradients differ from the "
                                    f"one-process model by {r['grad_diff']:.2e}")
        if res["variant"] == "packed" and res["backend"] != "eager" and res["graphs"] > 1:
            failures.append(f"packed: {res['graphs']} compiled graphs (one serves every "
                            f"batch and packing)")
        if res["variant"] == "balanced":
            failures += _check_balanced(res)
        if res["variant"] == "packed":
            for r in res["rows"]:
                if not r["image_bytes"] * 2 <= r["seed_image_bytes"]:
                    failures.append(f"packed step {r['step']}: image delivery moved "
                                    f"{r['image_bytes']} B, not CP=2x below the seed "
                                    f"scheme's {r['seed_image_bytes']} B")
        name = res["variant"]
        if not res["param_diff"] <= TOLERANCE:
            failures.append(f"{name}: parameters differ from the undistributed model by "
                            f"{res['param_diff']:.2e} > {TOLERANCE:.0e}")
        for r in res["rows"]:
            if abs(r["loss"] - r["ref_loss"]) > TOLERANCE * max(1.0, abs(r["ref_loss"])):
                failures.append(f"{name} step {r['step']}: loss {r['loss']:.8f} vs "
                                f"undistributed {r['ref_loss']:.8f}")
    return failures


def _balanced_summary(res: dict) -> str:
    rows = res["rows"]

    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    return (f"balanced: busiest/mean over {len(rows)} steps, encoder {mean('enc naive'):.2f}x "
            f"naive -> {mean('enc balanced'):.2f}x balanced, LLM {mean('llm naive'):.2f}x "
            f"-> {mean('llm balanced'):.2f}x; bridges moved {format_bytes(mean('bytes naive'))}"
            f" naive, {format_bytes(mean('bytes balanced'))} balanced per step (all ranks, "
            f"both ways); one sample gather per step "
            f"({format_bytes(rows[0]['gather_bytes'])} sent per rank)")


def _check_balanced(res: dict) -> list[str]:
    """One graph for every batch and placement; one sample gather per step; the busiest
    group nearer the mean than the naive placement's, for both modules."""
    out = []
    if res["backend"] != "eager" and res["graphs"] > 1:
        out.append(f"balanced: {res['graphs']} compiled graphs (one serves every batch and "
                   f"placement)")
    for r in res["rows"]:
        if r["gathers"] != 1:
            out.append(f"balanced step {r['step']}: {r['gathers']} sample gathers, not 1")
        for module in ("enc", "llm"):
            if not r[f"{module} balanced"] < r[f"{module} naive"]:
                out.append(f"balanced step {r['step']}: {module} busiest/mean "
                           f"{r[f'{module} balanced']:.3f} balanced, not below the naive "
                           f"{r[f'{module} naive']:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimo_fx.jobs", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS) + sorted(EXTRA),
                        help="layouts to train (repeatable; default: colocated, pipelined, "
                             "variable, pp_1f1b, packed, balanced, and llava where "
                             "transformers is installed)")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps (default 3)")
    parser.add_argument("--backend", default="aot_eager",
                        help="torch.compile backend (aot_eager, inductor) or 'eager'")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the "
                        "world is declared hung")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: need at least one step")
    from mimo_fx.testing import run_world

    variants = args.variant or [v for v in DEFAULT if unavailable(v) is None]
    for v in variants:
        why = unavailable(v)
        if why:
            parser.error(why)
    runs = [Run(v, steps=args.steps, backend=args.backend, progress=True) for v in variants]
    print(f"training on 8 gloo processes: {', '.join(variants)}; "
          f"{args.steps} steps, backend {args.backend} ...", flush=True)
    start = time.perf_counter()
    results = run_world(8, train_worker, runs, timeout=args.timeout)[0]
    print(table(results))
    for res in results:
        print(f"{res['variant']}: max parameter difference after {args.steps} steps "
              f"{res['param_diff']:.1e} (tolerance {TOLERANCE:.0e}); compile "
              f"{res['compile_s']:.1f} s, {res['graphs']} graph(s)")
        if "graphs_per_rank" in res:
            print(f"{res['variant']}: compiled graphs per rank {res['graphs_per_rank']} (the "
                  f"first step, compile included, took {res['compile_s']:.1f} s)")
        if "image_bytes" in res["rows"][0]:
            ours = sum(r["image_bytes"] for r in res["rows"])
            seed = sum(r["seed_image_bytes"] for r in res["rows"])
            print(f"{res['variant']}: image delivery moved {format_bytes(ours, 1)} over "
                  f"{args.steps} steps (forward + backward, all ranks), the seeds' "
                  f"replicate-and-all-reduce scheme {format_bytes(seed, 1)} "
                  f"({seed / max(ours, 1):.1f}x more)")
    for res in results:
        if res["variant"] == "balanced":
            print(_balanced_summary(res))
    failures = check(results)
    print(f"world run took {time.perf_counter() - start:.0f} s; "
          + ("all checks passed" if not failures else "FAILED:\n  " + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
