"""Single-process reference backend: runs a plan for every rank at once.

``shard`` and ``unshard`` move between a global tensor and per-rank pieces with plain
indexing (the oracle); ``redistribute`` executes a plan on a dict of pieces through the
same custom vjp as the compiled backend.
"""

from .executor import ReferenceExecutor, redistribute
from .oracle import shard, unshard
from .world import ReferenceWorld

__all__ = ["ReferenceExecutor", "ReferenceWorld", "redistribute", "shard", "unshard"]
