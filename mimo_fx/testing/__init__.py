"""Local worlds for tests, examples and benchmarks: :func:`run_world` spawns one process
per rank (gloo on 127.0.0.1, or NCCL) for one function; a :class:`World` keeps its
processes for many functions, and :class:`Worlds` one World per size and options. A
world that hangs is killed and the rank that failed is named."""

from .launch import run_world
from .worlds import World, WorldError, Worlds

__all__ = ["World", "WorldError", "Worlds", "run_world"]
