"""The comm seam: the collectives a lowered program issues, over groups of ranks.

An executor never touches ``torch.distributed``: it calls a :class:`Comm` with a flat
buffer, the kind of collective and the ranks of the group. :class:`FunctionalComm` is
the production one; tests pass an emulated one (threads meeting in a rendezvous) to run
every rank's program in one process.

Everything about one kind of collective is one entry of :data:`OPS`, keyed by
:class:`~mimo_fx.plan.Collective`: the *ordered* custom op (``mimo_fx::all_gather`` and
so on, registered with an ORDERED effect) that runs the ``torch.distributed`` functional
collective and waits for it, how a comm's arguments become the op's, and what the
collective computes in plain tensor math over every member's input at once (how an
in-process comm runs it). Under ``torch.compile`` an ordered effect threads a token
through every such op, forward and backward, so no graph pass may move, duplicate or
reorder them: a backward collective stays in the backward graph even on a rank whose
cotangent the compiler can prove constant (e.g. a loss ``y.sum() * 0`` on a rank that
only sends), and every rank issues its collectives in program order. Plain functional
collectives give no such guarantee: a collective that does not depend on a tangent may
be hoisted into the forward graph, and the ranks desync. Eagerly, the ops are called as
they are, one after the other.

>>> sorted(kind.value for kind in OPS)
['all_gather', 'all_reduce', 'all_to_all', 'reduce_scatter']
>>> [t.tolist() for t in OPS[Collective.REDUCE_SCATTER].compute(
...     [torch.tensor([1., 2.]), torch.tensor([10., 20.])], [(), ()], [(), ()])]
[[11.0], [22.0]]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mimo_fx.plan import Collective

from . import inductor_order, timeouts

__all__ = ["Comm", "CommOp", "FunctionalComm", "OPS", "ordered", "register_ordered"]

Ranks = tuple[int, ...]
Splits = Sequence[int]


class Comm(ABC):
    """Collectives over a group given by its ranks; each returns a new flat tensor.

    A comm implements :meth:`collective` for every kind of :data:`OPS`; the named
    methods are that call for one kind, for callers outside programs.
    """

    @abstractmethod
    def collective(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
                   out_splits: Splits = (), in_splits: Splits = (),
                   site: str = "") -> torch.Tensor:
        """This member's output of ``kind`` over ``ranks`` (see :data:`OPS`); the splits
        are a member's parts of its output and its input where members exchange uneven
        parts (an all-to-all), else empty. ``site`` names the call for errors (see
        :mod:`.timeouts`)."""

    def all_gather(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        """Every member's ``flat`` (equal sizes), concatenated in member order."""
        return self.collective(Collective.ALL_GATHER, flat, ranks)

    def reduce_scatter(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        """Member i's chunk i of the sum of every member's ``flat``."""
        return self.collective(Collective.REDUCE_SCATTER, flat, ranks)

    def all_reduce(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        """The sum of every member's ``flat``."""
        return self.collective(Collective.ALL_REDUCE, flat, ranks)

    def all_to_all(self, flat: torch.Tensor, out_splits: Splits, in_splits: Splits,
                   ranks: Ranks) -> torch.Tensor:
        """Member j gets ``in_splits[j]`` elements of ``flat`` (in member order) and
        returns what every member sent it, ``out_splits[i]`` from member i."""
        return self.collective(Collective.ALL_TO_ALL, flat, ranks, out_splits, in_splits)


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


@dataclass(frozen=True)
class CommOp:
    """One kind of collective: its ordered custom op ``mimo_fx::<kind>`` (``op``, run on
    a group's registered name), how a comm's arguments ``(flat, ranks, group, out_splits,
    in_splits)`` become the op's (``args``), the op's output for tracing (``fake``, on the
    op's arguments), ``compute``: every member's output from every member's
    ``(flat, out_splits, in_splits)``, in member order -- the collective's meaning in
    plain tensor math, which in-process comms run -- and the names other than its own
    that torch's Flight Recorder gives it (``recorded``, read by :mod:`.trace`)."""

    kind: Collective
    op: Any
    args: Callable[..., tuple]
    fake: Callable[..., torch.Tensor]
    compute: Callable[[list[torch.Tensor], list[Splits], list[Splits]], list[torch.Tensor]]
    recorded: tuple[str, ...]

    def __call__(self, flat: torch.Tensor, ranks: Ranks, group: str, out_splits: Splits = (),
                 in_splits: Splits = (), site: str = "") -> torch.Tensor:
        return self.op(*self.args(flat, ranks, group, out_splits, in_splits), site)

    def output(self, flat: torch.Tensor, ranks: Ranks, out_splits: Splits = (),
               in_splits: Splits = ()) -> torch.Tensor:
        """A new tensor of this member's output size, values unset (moves nothing)."""
        return self.fake(*self.args(flat, ranks, "", out_splits, in_splits))


def _comm_op(kind: Collective, params: str, run, fake, args, compute,
             recorded: tuple[str, ...]) -> CommOp:
    """The entry of ``kind``: its op ``mimo_fx::<kind>(<params>, str site) -> Tensor``,
    defined once (``run`` on real tensors, every device, a failed wait -- a timeout, a
    peer gone -- raised as the :class:`MimoFxError` :mod:`.timeouts` words for the call
    ``site`` names; ``fake`` for tracing)."""
    name = kind.value
    if not _defined(name):
        def guarded(*args):
            *rest, site = args
            try:
                out = run(*rest)
            except RuntimeError as err:
                raise timeouts.failed(site, kind, err) from None
            timeouts.ran(site)
            return out

        _LIB.define(f"{name}({params}, str site) -> Tensor")
        _LIB.impl(name, guarded, "CompositeExplicitAutograd")
        torch.library.register_fake(f"mimo_fx::{name}", lambda *a: fake(*a[:-1]), lib=_LIB)
    return CommOp(kind, getattr(torch.ops.mimo_fx, name).default, args, fake, compute, recorded)


def _gathered(flats, out_splits, in_splits) -> list[torch.Tensor]:
    assert len({f.numel() for f in flats}) == 1, "all_gather inputs differ in size"
    return [torch.cat(flats) for _ in flats]


def _reduced(flats, out_splits, in_splits) -> list[torch.Tensor]:
    total = torch.stack(flats).sum(0)
    return [total.clone() for _ in flats]


def _reduced_scattered(flats, out_splits, in_splits) -> list[torch.Tensor]:
    total = torch.stack(flats).sum(0)
    return [chunk.clone() for chunk in total.chunk(len(flats))]


def _exchanged(flats, out_splits, in_splits) -> list[torch.Tensor]:
    out = []
    for j in range(len(flats)):
        pieces = []
        for i, splits in enumerate(in_splits):
            assert out_splits[j][i] == splits[j], "all_to_all split sizes disagree"
            start = sum(splits[:j])
            pieces.append(flats[i][start:start + splits[j]])
        out.append(torch.cat(pieces))
    return out


OPS: dict[Collective, CommOp] = {op.kind: op for op in (
    _comm_op(
        Collective.ALL_GATHER, "Tensor flat, int group_size, str group",
        lambda flat, n, group: _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, n, group)),
        lambda flat, n, group: flat.new_empty(flat.numel() * n),
        lambda flat, ranks, group, out_splits, in_splits: (flat, len(ranks), group),
        _gathered, ("_allgather_base", "all_gather_into_tensor")),
    _comm_op(
        Collective.REDUCE_SCATTER, "Tensor flat, int group_size, str group",
        lambda flat, n, group: _c10d.wait_tensor(
            _c10d.reduce_scatter_tensor(flat, "sum", n, group)),
        lambda flat, n, group: flat.new_empty(flat.numel() // n),
        lambda flat, ranks, group, out_splits, in_splits: (flat, len(ranks), group),
        _reduced_scattered, ("_reduce_scatter_base", "reduce_scatter_tensor")),
    _comm_op(
        Collective.ALL_REDUCE, "Tensor flat, str group",
        lambda flat, group: _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group)),
        lambda flat, group: flat.new_empty(flat.numel()),
        lambda flat, ranks, group, out_splits, in_splits: (flat, group),
        _reduced, ("allreduce",)),
    _comm_op(
        Collective.ALL_TO_ALL,
        "Tensor flat, SymInt[] out_splits, SymInt[] in_splits, str group",
        lambda flat, out_splits, in_splits, group: _c10d.wait_tensor(
            _c10d.all_to_all_single(flat, out_splits, in_splits, group)),
        lambda flat, out_splits, in_splits, group: flat.new_empty(sum(out_splits)),
        lambda flat, ranks, group, out_splits, in_splits: (
            flat, list(out_splits), list(in_splits), group),
        _exchanged, ("alltoall_base",)),
)}


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
    return all([register_ordered(entry.op) for entry in OPS.values()])


ordered = _register_ordered()
inductor_order.install()


class FunctionalComm(Comm):
    """Collectives on prepared process groups, by the groups' registered names.

    ``names`` maps each group's ranks to its process group's name; every group a
    program uses must be there (the bridge that lowered it prepared them).
    """

    def __init__(self, names: Mapping[Ranks, str]) -> None:
        self.names = dict(names)

    def collective(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
                   out_splits: Splits = (), in_splits: Splits = (),
                   site: str = "") -> torch.Tensor:
        return OPS[kind](flat, ranks, self.names[ranks], out_splits, in_splits, site)
