"""Spawn one gloo world on 127.0.0.1 and run a function on every rank.

Spawning costs seconds, so a test module spawns one world and runs many checks in it;
each rank returns a picklable result. A world that does not finish in time is killed and
reported as a failure, never left hanging.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str, backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    result: object
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, don't hang the parent
        result = {"__error__": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_world(world: int, fn, *args, timeout: float = 300.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes (gloo, or nccl with one GPU
    per rank); results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker,
                                 args=(world, _free_port(), fn, args, out_dir, backend),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(1.0):
                if time.monotonic() > deadline:
                    raise AssertionError(f"the {world}-process world did not finish in "
                                         f"{timeout:.0f} s (a hang?)")
        except mp.ProcessExitedException as err:
            raise AssertionError(f"a rank of the {world}-process world died: {err}") from err
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"{rank}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} of the {world}-process world left no result")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    errors = [r["__error__"] for r in results if isinstance(r, dict) and "__error__" in r]
    if errors:
        raise AssertionError("a rank raised:\n" + errors[0])
    return results
