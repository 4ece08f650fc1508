"""Local worlds for tests, examples and benchmarks: :func:`run_world` spawns one process
per rank (gloo on 127.0.0.1, or NCCL), kills a world that hangs and names the rank that
failed."""

from .launch import WorldError, run_world

__all__ = ["WorldError", "run_world"]
