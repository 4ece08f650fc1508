"""The MIMO layer, built on the core: per-module parallelism from a config
(:mod:`.config`), model code written once for every backend (:mod:`.spmd`), gradients of
several modules (:mod:`.grads`), gradient sums for plain ``nn.Module`` s and tied
embeddings (:mod:`.sync`), and every loader's samples on every rank (:mod:`.loader`).
The jobs that train a model with it live in :mod:`mimo_fx.jobs`."""

from .config import (
    MimoParallelism,
    ModuleParallelism,
    embedding_group,
    is_first_stage,
    is_last_stage,
    position_embedding_group,
)
from .loader import share_samples
from .sync import Bucket, GradSync, TiedGrads, data_axes, embedding_groups, fsdp_sums

__all__ = ["ModuleParallelism", "MimoParallelism", "is_first_stage", "is_last_stage",
           "embedding_group", "position_embedding_group", "GradSync", "TiedGrads", "Bucket",
           "data_axes", "embedding_groups", "fsdp_sums", "share_samples"]
