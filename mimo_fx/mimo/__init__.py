"""The MIMO layer, built on the core: per-module parallelism from a config
(:mod:`.config`), model code written once for every backend (:mod:`.spmd`), gradients of
several modules (:mod:`.grads`), gradient sums for plain ``nn.Module`` s and tied
embeddings (:mod:`.sync`), a toy MIMO model (:mod:`.toy`) and the end-to-end job
that trains it against the undistributed model (:mod:`.e2e`, ``python -m
mimo_fx.mimo.e2e``)."""

from .config import (
    MimoParallelism,
    ModuleParallelism,
    embedding_group,
    is_first_stage,
    is_last_stage,
    position_embedding_group,
)
from .sync import Bucket, GradSync, TiedGrads, data_axes, embedding_groups

__all__ = ["ModuleParallelism", "MimoParallelism", "is_first_stage", "is_last_stage",
           "embedding_group", "position_embedding_group", "GradSync", "TiedGrads", "Bucket",
           "data_axes", "embedding_groups"]
