"""Local worlds for tests, examples and benchmarks: :func:`run_world` spawns one process
per rank (gloo on 127.0.0.1, or NCCL) for one function; a :class:`SpawnedWorld` keeps its
processes for many functions, and :class:`SpawnedWorlds` one per size and options. A
world that hangs is killed and the rank that failed is named."""

from .launch import run_world
from .worlds import SpawnedWorld, SpawnedWorlds, WorldError

__all__ = ["SpawnedWorld", "WorldError", "SpawnedWorlds", "run_world"]
