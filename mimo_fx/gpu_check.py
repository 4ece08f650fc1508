"""The GPU path in one command: ``python -m mimo_fx.gpu_check``.

Run from a checkout (it runs the tests' table and helpers, ``tests/``); one verdict line
per check, all of them written to ``bench/results/gpu_check.txt``. It adapts to the
GPUs present:

- none: it says so and exits 0 (``--device cpu`` rehearses the one-GPU checks on the
  CPU, as the test suite does);
- one (or more): every rank's lowered program of the shared table on CUDA tensors,
  the ranks in threads and their collectives met in-process, against the oracle, with
  every op's operands on the data's device; a row bridge's route and program on it; a
  one-rank NCCL world whose bridges -- fixed sizes, learned sizes, a packed batch --
  run compiled with inductor, ``loss.backward()`` over 2 steps, the steady-state
  calls of the fixed bridge under ``torch.cuda.set_sync_debug_mode("error")`` and
  every bridge's reads of device tensors counted;
- two or more: also the table's sample on an NCCL world of one process per GPU
  (``tests/backends/test_compiled.py``'s), and with eight, ``bench/megatron_compare.py
  --backend nccl --quick``.

One GPU cannot run a multi-rank NCCL world; the rehearsal on the CPU runs the same code
with gloo. Each check has its own time limit; the whole finishes within 8 minutes on
one GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "gpu_check.txt"
H = 6


def _tests() -> None:
    """The tests' helpers importable (the check runs the code the tests run)."""
    folder = str(ROOT / "tests")
    if not (ROOT / "tests" / "cases.py").exists():
        raise RuntimeError("run from a checkout of mimo_fx: tests/cases.py is not there")
    if folder not in sys.path:
        sys.path.insert(0, folder)


def check_table(device: torch.device) -> str:
    """Every box case of the table, forward and backward, on ``device``."""
    _tests()
    from cases import CASES, star
    from harness import expected_input_grad, mismatch, oracle_data
    from threads import run_plan

    from mimo_fx.plan import backward_plan, plan
    from mimo_fx.reference import shard
    from mimo_fx.testing.devices import Devices

    cases = [c for c in CASES if not c.counts and not c.dst.partial]
    ops = 0
    for case in cases:
        x, g = oracle_data(case, 1)
        seen: dict[int, Devices] = {}

        def inside(rank: int, _seen=seen) -> Devices:
            return _seen.setdefault(rank, Devices(device))
        ys = run_plan_on(run_plan, plan(case.src, case.dst, case.sizes, torch.float64),
                         shard(x, case.src), len(case.src.local_dims), device, inside)
        want = shard(x.permute([case.src.dims.index(d) for d in case.dst.dims]), case.dst)
        for rank, y in ys.items():
            bad = mismatch(case, y.cpu(), want.get(rank), f"rank {rank}: output")
            if bad:
                raise AssertionError(f"{case.name}: {bad}")
        grads = run_plan_on(run_plan, backward_plan(case.src, case.dst, case.sizes,
                                                    torch.float64),
                            shard(g, star(case.dst)), len(case.dst.local_dims), device, inside)
        for rank, want_g in expected_input_grad(case, g).items():
            bad = mismatch(case, grads[rank].cpu(), want_g, f"rank {rank}: gradient",
                           exact=True)
            if bad:
                raise AssertionError(f"{case.name}: {bad}")
        problems = [f"rank {r}: {p}" for r, d in seen.items() for p in d.problems]
        if problems:
            raise AssertionError(f"{case.name}: {problems[:3]}")
        ops += sum(d.ops for d in seen.values())
    return f"{len(cases)} cases, forward and backward, equal to the oracle; {ops} ops, " \
           f"every operand on {device.type}"


def run_plan_on(run_plan: Callable, p, pieces: dict, ndim: int, device: torch.device,
                inside) -> dict:
    """``run_plan`` with the pieces on ``device``."""
    from threads import run_programs

    from mimo_fx.compiled import lowering

    ranks = sorted(set(p.src.grid.ranks) | set(p.dst.grid.ranks))
    return run_programs({r: lowering.lower(p, r) for r in ranks},
                        {r: t.to(device) for r, t in pieces.items()}, ndim, device=device,
                        inside=inside)


def check_rows(device: torch.device) -> str:
    """A packed bridge's route and row programs on ``device``: two ranks in threads."""
    _tests()
    import threading

    from threads import EXECUTORS, ThreadComm, _Rendezvous

    from mimo_fx import Grid, Layout
    from mimo_fx.compiled.row_sizing import sizing_for
    from mimo_fx.packed import PackedLayout, Packing, pack_shard
    from mimo_fx.testing.devices import Devices

    src = Layout(Grid(dp=2), "(dp t) h")
    dst = PackedLayout(Grid(cp=2), "t h", [[3, 5]])
    full = torch.arange(8.0 * H).reshape(8, H)
    sizes = {"t": 8, "h": H}
    world, outs, errors = _Rendezvous(), {}, []
    seen: dict[int, Devices] = {}

    def one(rank: int) -> None:
        try:
            sizing = sizing_for(src, dst, {"h": H}, torch.float32, (), rank, "", device)
            fwd, _, values, index, _ = sizing.programs(sizes, frozenset())
            env = dict(zip(sizing.variables, values))
            ex = EXECUTORS["interpreted"](ThreadComm(world, rank))
            with seen.setdefault(rank, Devices(device)):
                (outs[rank],) = ex.run(fwd, (full[4 * rank:4 * rank + 4].to(device),), env,
                                       index)
        except BaseException as err:  # reported below
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")
    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise AssertionError("; ".join(errors))
    want = pack_shard(full, Packing([3, 5], cp=2))
    for rank in (0, 1):
        if not torch.equal(outs[rank].cpu(), want[rank]):
            raise AssertionError(f"rank {rank}: the packed piece differs from the oracle's")
        if seen[rank].problems:
            raise AssertionError(f"rank {rank}: {seen[rank].problems}")
    return "a packed bridge's route and programs equal to the oracle, every operand on " \
           f"{device.type}"


@contextlib.contextmanager
def _one_rank_world(device: torch.device):
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        yield backend
    finally:
        import mimo_fx.compiled

        mimo_fx.compiled.destroy()
        dist.destroy_process_group()


def _sync_debug(device: torch.device, mode: str):
    if device.type != "cuda":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def debug():
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return debug()


def check_one_rank_world(device: torch.device) -> str:
    """Bridges in a one-rank world, compiled with inductor, 2 training steps each, then
    steady-state calls: values against the input, device reads counted."""
    import torch._dynamo

    from mimo_fx import Grid, Layout
    from mimo_fx.compiled import Redistributor
    from mimo_fx.packed import PackedLayout
    from mimo_fx.testing.syncs import HostReads

    out = []
    with _one_rank_world(device) as backend:
        g = Grid(dp=1)
        bridges = {
            "fixed": (Redistributor(Layout(g, "(dp b) h"), Layout(g, "b (dp h)"),
                                    {"b": 4, "h": H}), lambda: torch.randn(4, H)),
            "learned": (Redistributor(Layout(g, "(dp t) h", ragged="dp"), Layout(g, "t h"),
                                      {"h": H}), lambda: torch.randn(5, H)),
            "packed": (Redistributor(Layout(g, "(dp t) h"),
                                     PackedLayout(g, "t h", [[3, 5]], cp=None), {"h": H}),
                       lambda: torch.randn(8, H)),
        }
        for name, (bridge, make) in bridges.items():
            weight = torch.randn(H, H, device=device, requires_grad=True)

            def step(x, _b=bridge, _w=weight):
                return (_b(x @ _w) ** 2).sum()
            compiled = torch.compile(step, backend="inductor", fullgraph=True)
            for _ in range(2):  # (compiles, then runs compiled)
                x = make().to(device)
                if name == "learned":
                    torch._dynamo.decorators.mark_unbacked(x, 0)
                loss = compiled(x)
                want = step(x).detach()
                loss.backward()
                if not torch.allclose(loss.detach(), want, rtol=1e-4, atol=1e-4):
                    raise AssertionError(f"{name}: loss {loss.item()} != {want.item()}")
            x = make().to(device)
            if name == "learned":
                torch._dynamo.decorators.mark_unbacked(x, 0)
            debug = "error" if name == "fixed" else "default"
            with HostReads() as reads, _sync_debug(device, debug):
                for _ in range(3):
                    compiled(x).backward()
            on_device = sum(1 for e in reads.events if e.device != "cpu")
            out.append(f"{name} {reads.count() / 3:g} ({on_device / 3:g})")
    return (f"one-rank {backend} world: fixed, learned and packed bridges compiled with "
            f"inductor, 2 steps each equal to eager; host reads per steady call (of "
            f"them, of {device.type} tensors): "
            + ", ".join(out) + (" (fixed under set_sync_debug_mode('error'))"
                                if device.type == "cuda" else ""))


def _command(args: list[str], timeout: float) -> str:
    """Run a command from the checkout; its last line, or raise with its tail."""
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(args)}: exit {done.returncode}:\n  "
                             + "\n  ".join(tail))
    return tail[-1] if tail else "ok"


def checks(gpus: int, device: torch.device) -> list[tuple[str, Callable[[], str]]]:
    """The checks for ``gpus`` GPUs (0: the rehearsal on ``device``, the CPU)."""
    out = [("lowered table", lambda: check_table(device)),
           ("row route", lambda: check_rows(device)),
           ("one-rank world", lambda: check_one_rank_world(device))]
    if gpus >= 2:
        out.append(("NCCL table sample", lambda: _command(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
             "tests/backends/test_compiled.py::test_table_sample_on_nccl"], 300)))
    if gpus >= 8:
        out.append(("Megatron side by side", lambda: _command(
            [sys.executable, "bench/megatron_compare.py", "--backend", "nccl", "--quick"],
            300)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cpu: rehearse the one-GPU checks on the CPU (default: cuda "
                             "where there is one)")
    parser.add_argument("--out", default=str(RESULT),
                        help="where the verdicts go (default bench/results/gpu_check.txt)")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    head = (f"mimo_fx GPU check: torch {torch.__version__}, "
            f"{gpus} CUDA device(s)"
            + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""))
    lines = [head]
    print(head, flush=True)
    if args.device == "cuda" and not gpus or args.device is None and not gpus:
        line = ("no CUDA device on this machine: nothing to check here (run it where a "
                "GPU is; --device cpu rehearses the one-GPU checks on the CPU)")
        print(line)
        _write(args.out, lines + [line])
        return 0
    device = torch.device("cuda", 0) if args.device != "cpu" else torch.device("cpu")
    failed = 0
    for name, run in checks(gpus if device.type == "cuda" else 0, device):
        start = time.perf_counter()
        try:
            verdict = f"ok   {name}: {run()}"
        except Exception as err:  # one verdict per check; the others still run
            failed += 1
            detail = "".join(traceback.format_exception_only(type(err), err)).strip()
            verdict = f"FAIL {name}: {detail}"
        line = f"{verdict} ({time.perf_counter() - start:.1f} s)"
        print(line, flush=True)
        lines.append(line)
    lines.append(f"{len(lines) - 1 - failed} passed, {failed} failed")
    print(lines[-1])
    _write(args.out, lines)
    return 1 if failed else 0


def _write(path: str, lines: list[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
