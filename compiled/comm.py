"""The comm seam: the four collectives a lowered program issues, over groups of ranks.

An executor never touches ``torch.distributed``: it calls a :class:`Comm` with a flat
buffer and the ranks of the group. :class:`FunctionalComm` is the production one; tests
pass an emulated one (threads meeting in a rendezvous) to run every rank's program in
one process.

Each collective of :class:`FunctionalComm` is one *ordered* custom op
(``mimo_fx::all_gather`` and so on, registered with an ORDERED effect) that runs the
``torch.distributed`` functional collective and waits for it. Under ``torch.compile`` an
ordered effect threads a token through every such op, forward and backward, so no graph
pass may move, duplicate or reorder them: a backward collective stays in the backward
graph even on a rank whose cotangent the compiler can prove constant (e.g. a loss
``y.sum() * 0`` on a rank that only sends), and every rank issues its collectives in
program order. Plain functional collectives give no such guarantee: a collective that
does not depend on a tangent may be hoisted into the forward graph, and the ranks
desync. Eagerly, the ops are called as they are, one after the other.

>>> sorted(KINDS)
['all_gather', 'all_reduce', 'all_to_all', 'reduce_scatter']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from . import inductor_order

__all__ = ["Comm", "FunctionalComm", "KINDS", "ordered", "register_ordered"]

Ranks = tuple[int, ...]


class Comm(Protocol):
    """Collectives over a group given by its ranks; each returns a new flat tensor."""

    def all_gather(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        """Every member's ``flat`` (equal sizes), concatenated in member order."""
        ...

    def reduce_scatter(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        """Member i's chunk i of the sum of every member's ``flat``."""
        ...

    def all_reduce(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        """The sum of every member's ``flat``."""
        ...

    def all_to_all(self, flat: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int], ranks: Ranks) -> torch.Tensor:
        """Member j gets ``in_splits[j]`` elements of ``flat`` (in member order) and
        returns what every member sent it, ``out_splits[i]`` from member i."""
        ...


_c10d = torch.ops._c10d_functional
# a fragment: this module may be executed twice (e.g. imported under a second name by a
# doctest run); the ops are then defined once and reused
_LIB = torch.library.Library("mimo_fx", "FRAGMENT")


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.mimo_fx, name)
    except AttributeError:
        return False
    return True


def _define(schema: str, run, fake) -> Any:
    """One op: ``run`` on real tensors (every device), ``fake`` for tracing."""
    name = schema.split("(", 1)[0]
    if not _defined(name):
        _LIB.define(schema)
        _LIB.impl(name, run, "CompositeExplicitAutograd")
        torch.library.register_fake(f"mimo_fx::{name}", fake, lib=_LIB)
    return getattr(torch.ops.mimo_fx, name).default


KINDS = {
    "all_gather": _define(
        "all_gather(Tensor flat, int group_size, str group) -> Tensor",
        lambda flat, n, group: _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, n, group)),
        lambda flat, n, group: flat.new_empty(flat.numel() * n)),
    "reduce_scatter": _define(
        "reduce_scatter(Tensor flat, int group_size, str group) -> Tensor",
        lambda flat, n, group: _c10d.wait_tensor(
            _c10d.reduce_scatter_tensor(flat, "sum", n, group)),
        lambda flat, n, group: flat.new_empty(flat.numel() // n)),
    "all_reduce": _define(
        "all_reduce(Tensor flat, str group) -> Tensor",
        lambda flat, group: _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group)),
        lambda flat, group: flat.new_empty(flat.numel())),
    "all_to_all": _define(
        "all_to_all(Tensor flat, SymInt[] out_splits, SymInt[] in_splits, str group) -> Tensor",
        lambda flat, out_splits, in_splits, group: _c10d.wait_tensor(
            _c10d.all_to_all_single(flat, out_splits, in_splits, group)),
        lambda flat, out_splits, in_splits, group: flat.new_empty(sum(out_splits))),
}


def register_ordered(op) -> bool:
    """Give ``op`` an ORDERED effect; False where this torch cannot (then it is a plain
    custom op: correct eagerly, but a compiler may move it)."""
    try:
        from torch._library.effects import EffectType
        register: Any = torch.library._register_effectful_op
    except (ImportError, AttributeError):
        try:  # torch < 2.9
            from torch._higher_order_ops.effects import _EffectType as EffectType
            from torch._higher_order_ops.effects import _register_effectful_op as register
        except ImportError:
            return False
    register(op, EffectType.ORDERED)
    return True


def _register_ordered() -> bool:
    return all([register_ordered(op) for op in KINDS.values()])


ordered = _register_ordered()
inductor_order.install()
_ALL_GATHER, _REDUCE_SCATTER, _ALL_REDUCE, _ALL_TO_ALL = (
    KINDS[k] for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))


class FunctionalComm:
    """Collectives on prepared process groups, by the groups' registered names.

    ``names`` maps each group's ranks to its process group's name; every group a
    program uses must be there (the bridge that lowered it prepared them).
    """

    def __init__(self, names: Mapping[Ranks, str]) -> None:
        self.names = dict(names)

    def all_gather(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        return _ALL_GATHER(flat, len(ranks), self.names[ranks])

    def reduce_scatter(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        return _REDUCE_SCATTER(flat, len(ranks), self.names[ranks])

    def all_reduce(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        return _ALL_REDUCE(flat, self.names[ranks])

    def all_to_all(self, flat: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int], ranks: Ranks) -> torch.Tensor:
        return _ALL_TO_ALL(flat, list(out_splits), list(in_splits), self.names[ranks])
