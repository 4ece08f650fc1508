"""Spawn one local world of processes and run a function on every rank.

Used by the tests, the benchmarks and the end-to-end example: gloo on 127.0.0.1 (or
NCCL with one GPU per rank). Spawning costs seconds, so callers spawn one world and run
many checks in it; each rank returns a picklable result. A world that does not finish in
time is killed and reported, never left hanging; a rank that raises has its traceback
re-raised in the parent.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mimo_fx.errors import MimoFxError

__all__ = ["WorldError", "run_world"]


class WorldError(MimoFxError, AssertionError):
    """A spawned world hung, lost a rank, or a rank raised (its traceback is the message)."""


def _where_stuck(ctx, world: int, out_dir: str) -> str:
    """The ranks that never finished their function, each with the innermost frames of
    its stack (asked for with SIGUSR1, see ``_worker``)."""
    stuck = [r for r in range(world) if not os.path.exists(os.path.join(out_dir, f"{r}.done"))]
    for rank in stuck:
        if ctx.processes[rank].is_alive():
            os.kill(ctx.processes[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)
    lines = [f"; ranks {stuck} never finished"]
    for rank in stuck:
        with open(os.path.join(out_dir, f"{rank}.stack")) as f:
            frames = [ln.strip() for ln in f if ln.strip().startswith("File")]
        lines.append(f"rank {rank} is at: " + (" <- ".join(frames[:3]) or "(no stack)"))
    return "\n  ".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str, backend: str,
            threads: int, record: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if record:  # Flight Recorder, read by mimo_fx.compiled.trace
        os.environ["TORCH_FR_BUFFER_SIZE"] = "20000"
    torch.set_num_threads(threads)
    # where this rank is, on request: the parent asks ranks that hang (see run_world)
    stack = open(os.path.join(out_dir, f"{rank}.stack"), "w")  # noqa: SIM115 (process-long)
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=False)
    result: object
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        try:
            result = fn(rank, world, *args)
            open(os.path.join(out_dir, f"{rank}.done"), "w").close()
            # every rank done before any tears down: rank 0 hosts the store, and a peer
            # still creating a group (non-members return from new_group early) needs it
            if dist.is_initialized():  # fn may have torn its world down itself
                dist.barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # report, don't hang the parent
        result = {"__error__": traceback.format_exc(), "__when__": time.monotonic()}
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


# what a rank's error says when it failed only because another rank went away
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "gloo/transport/tcp", "NCCL communicator was aborted")


def run_world(world: int, fn, *args, timeout: float = 300.0, backend: str = "gloo",
              threads: int = 1, record: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; results by rank.

    ``fn`` must be importable by the children (a module-level function). Each process
    runs with ``threads`` intra-op threads (1 by default: many ranks share few cores).
    With ``record`` every process keeps a Flight Recorder of its collectives
    (:mod:`mimo_fx.compiled.trace`).
    """
    if world < 1:
        raise MimoFxError(f"world={world}: need at least one process")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker, args=(world, _free_port(), fn, args, out_dir, backend, threads, record),
            nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(1.0):
                if time.monotonic() > deadline:
                    raise WorldError(f"the {world}-process world did not finish in "
                                     f"{timeout:.0f} s (a hang?); raise timeout= if it is "
                                     f"just slow" + _where_stuck(ctx, world, out_dir))
        except mp.ProcessExitedException as err:
            raise WorldError(f"a rank of the {world}-process world died: {err} (its stderr "
                             f"says why; a script that spawns worlds needs the "
                             f"'if __name__ == \"__main__\":' guard)") from err
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pkl")
            if not os.path.exists(path):
                raise WorldError(f"rank {rank} of the {world}-process world left no result")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    errors = [(rank, r["__error__"], r["__when__"]) for rank, r in enumerate(results)
              if isinstance(r, dict) and "__error__" in r]
    if errors:
        # a rank that fails makes its peers' collectives fail (the connection to it is
        # closed or reset): report a rank that failed by itself, the earliest first
        errors.sort(key=lambda e: (any(m in e[1] for m in _LOST_PEER), e[2]))
        rank, text, _ = errors[0]
        others = [r for r, _, _ in errors[1:]]
        raise WorldError(f"rank {rank} raised" + (f" (ranks {others} too)" if others else "")
                         + ":\n" + text)
    return results
