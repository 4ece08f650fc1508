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

import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mimo_fx.plan import Collective

from . import inductor_order, timeouts
from .ops import define, register_ordered

__all__ = ["Comm", "CommOp", "FunctionalComm", "OPS", "host_to", "ordered", "register_ordered"]

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

    def start(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
              out_splits: Splits = (), in_splits: Splits = (), site: str = "") -> Handle:
        """:meth:`collective`, posted; the handle's ``wait()`` gives its output (default: eager)."""
        return Handle(self.collective(kind, flat, ranks, out_splits, in_splits, site))

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
        """Member j gets ``in_splits[j]`` of ``flat``; returns ``out_splits[i]`` from member i."""
        return self.collective(Collective.ALL_TO_ALL, flat, ranks, out_splits, in_splits)


class Handle:
    """A posted collective's output, there once :meth:`wait` returns it."""

    def __init__(self, out: torch.Tensor, works: Sequence = (), site: str = "",
                 kind: Collective | None = None) -> None:
        self.out, self.works, self.site, self.kind = out, list(works), site, kind

    def wait(self) -> torch.Tensor:
        works, self.works = self.works, []
        wait_all(works, self.site, self.kind)
        if works:
            timeouts.ran(self.site)
        return self.out


_c10d = torch.ops._c10d_functional
_c10d_py: Any = torch._C._distributed_c10d  # type: ignore[attr-defined]
# the kinds whose op may return with its messages in flight (waited by wait_tensor)
POSTED = frozenset({Collective.ALL_TO_ALL, Collective.ALL_GATHER})


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
        out = self.op(*self.args(flat, ranks, group, out_splits, in_splits), site)
        if self.kind in POSTED:
            # the wait, an op of its own: under torch.compile the graph holds it where
            # the call's result is first used, after any compute it does not depend on
            out = _c10d.wait_tensor(out)
        return out

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
    def guarded(*args):
        *rest, site = args
        try:
            with timeouts.waiting(lambda: timeouts.described(site, kind)):
                out = run(*rest, site=site)
        except RuntimeError as err:
            raise _failed(site, kind, err) from None
        if isinstance(out, tuple):  # posted messages: waited by wait_tensor
            return _in_flight(*out, site, kind)
        if rules():  # a process group's own collective, run and waited
            note("wait", note("coll", rest[-1], kind.value, rest[0].numel()))
        timeouts.ran(site)
        return out

    op = define(f"{kind.value}({params}, str site) -> Tensor", guarded,
                lambda *a: fake(*a[:-1]))
    return CommOp(kind, op, args, fake, compute, recorded)


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


# -- point-to-point: an all-to-all (and, on gloo, an all-gather) as messages -----------------
# A collective synchronises every member of its group: an all-to-all over both grids in
# which four pairs exchange data costs every rank a round with every other, and gloo runs
# each collective through its process group's worker thread. Messages pair only the ranks
# that exchange data: a rank with nothing to send or receive returns at once. Messages
# pair per (sender, receiver, process group) in posting order, and every member posts an
# op's messages in program order, so they pair as the collective's parts would.
RECORD_ENV = "TORCH_FR_BUFFER_SIZE"  # recording on: Flight Recorder, and the journal
JOURNAL_KEPT = 20000
# the NCCL-rules record (mimo_fx.testing.nccl_rules replays it): every group this process
# uses, every grouped point-to-point call, collective and wait, in the order they ran
RULES_ENV = "MIMO_FX_NCCL_RULES"


class Messages:
    """What this process keeps for the ops it runs as messages, in one place: the
    process groups by name (``groups``: name -> (process group, coalesce, its global
    ranks)); the rank at the other end of each posted message until it is waited for
    (``peers``: a failed wait names the rank that left, or never came); and, when
    recording, the journal of ops run (``journal``, newest last: (time ns, kind, group
    ranks, elements in, elements out, ((peer, elements) sent), ((peer, elements)
    received)); read by :mod:`.trace`, since Flight Recorder does not see gloo's
    messages) with ``journaled``, the number ever journaled (the oldest kept is number
    ``journaled - len(journal)``); with ``MIMO_FX_NCCL_RULES=1``, the NCCL-rules record
    (``rules``: events :func:`note` appends; ``op_of``: the event of each work)."""

    def __init__(self) -> None:
        self.groups: dict[str, tuple[Any, tuple[int, ...]]] = {}
        self.peers: dict[int, int] = {}
        self.journal: deque[tuple] = deque(maxlen=JOURNAL_KEPT)
        self.journaled = 0
        self.rules: list[tuple] = []
        self.op_of: dict[int, int] = {}


MESSAGES = Messages()


def _group(name: str) -> tuple[Any, tuple[int, ...]]:
    """The process group registered under ``name`` and its members' global ranks
    (whether it coalesces is asked per device: :func:`coalesces`)."""
    known = MESSAGES.groups
    entry = known.get(name)
    if entry is None or entry[0].group_name != name:
        import torch.distributed as dist

        pg = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]
        if len(known) > 4096:  # (names of destroyed groups are never used again)
            known.clear()
        entry = known[name] = (pg, tuple(dist.get_process_group_ranks(pg)))
    return entry


_COALESCES: dict[tuple[str, str], bool] = {}


def coalesces(pg, device: torch.device) -> bool:
    """Whether ``pg``'s backend for ``device`` coalesces a grouped call's operations
    (``supports_coalescing``: NCCL does, gloo does not): asked of the backend object,
    never read from its name. There its own all-gather is the faster one; elsewhere an
    all-gather goes as messages (gloo's is a ring through its worker thread)."""
    key = (pg.group_name, device.type)
    known = _COALESCES.get(key)
    if known is None:
        try:
            known = bool(pg._get_backend(device).supports_coalescing)
        except RuntimeError:  # (no backend for that device)
            known = False
        if len(_COALESCES) > 4096:
            _COALESCES.clear()
        _COALESCES[key] = known
    return known


def rules() -> bool:
    """Whether this process keeps the NCCL-rules record (``MIMO_FX_NCCL_RULES=1``)."""
    return os.environ.get(RULES_ENV, "0") not in ("", "0")


def note(*event) -> int:
    """Append ``event`` to the NCCL-rules record; its index (-1 when it is off)."""
    if not rules():
        return -1
    MESSAGES.rules.append(event)
    return len(MESSAGES.rules) - 1


def post(pg, members: tuple[int, ...], sends: list, recvs: list) -> list:
    """Post ``sends`` and ``recvs`` (``(group rank, tensor)`` pairs) of one exchange in
    one grouped call (``batch_isend_irecv``: NCCL runs them as one group, gloo posts them
    in turn), no tags: messages of a pair of ranks on a process group pair in posting
    order. The works to wait for (one per message, or one for the group where the
    backend coalesces)."""
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, t, group=pg, group_peer=j) for j, t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=pg, group_peer=j) for j, t in recvs]
    if not ops:
        return []
    pairs = [*sends, *recvs]
    if coalesces(pg, pairs[0][1].device):
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as err:  # (its peer may have left already)
            peers = {members[j] for j, _ in pairs}
            if len(peers) == 1:
                err.peer = peers.pop()  # type: ignore[attr-defined]
            raise
    else:
        works = _in_turn(ops, [members[j] for j, _ in pairs])
    if rules():
        i = note("p2p", pg.group_name,
                 tuple((members[j], t.numel(), str(t.dtype)) for j, t in sends),
                 tuple((members[j], t.numel(), str(t.dtype)) for j, t in recvs))
        for w in works:
            MESSAGES.op_of[id(w)] = i
    peers_ = MESSAGES.peers
    if len(peers_) > 4096:  # (works never waited for: a failed call's)
        peers_.clear()
    if len(works) == len(ops):  # (one work per message: its peer known)
        for work, (j, _) in zip(works, [*sends, *recvs]):
            peers_[id(work)] = members[j]
    return works


def _in_turn(ops: list, peers: list[int]) -> list:
    """``batch_isend_irecv(ops)`` where the backend does not coalesce: torch's own call
    posts each operation in turn there, as here, one call each; a posting that fails (its
    peer has left: gloo's send to a closed pair raises at once) names that peer."""
    import torch.distributed as dist

    works = []
    for op, peer in zip(ops, peers):
        try:
            works += dist.batch_isend_irecv([op])
        except RuntimeError as err:
            err.peer = peer  # type: ignore[attr-defined]
            raise
    return works


def host_to(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor (metadata made from ints) on ``device``, without waiting for the
    work queued there: on CUDA through pinned memory, asynchronously."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _failed(site: str, kind, err: BaseException, peer: int | None = None) -> Exception:
    """:func:`.timeouts.failed`'s error, noted in the NCCL-rules record (its replay
    forgives what this rank had in flight: see :mod:`mimo_fx.testing.nccl_rules`)."""
    note("fail")
    return timeouts.failed(site, kind, err, peer)


def waited(works) -> None:
    """Note, in the NCCL-rules record, that this rank waited for ``works``."""
    if rules():
        ops = sorted({MESSAGES.op_of.pop(id(w)) for w in works if id(w) in MESSAGES.op_of})
        for i in ops:
            note("wait", i)


def forget(name: str) -> None:
    """Forget a destroyed group, so the cache does not keep its threads and sockets alive."""
    MESSAGES.groups.pop(name, None)


def forget_world() -> None:
    """Forget every group of a world that is gone: a new world makes groups of the same
    names (:func:`~.groups._name`), and a cached old one is destroyed."""
    MESSAGES.groups.clear()
    _COALESCES.clear()


def _messages_gather(name: str, device: torch.device) -> bool:
    """Whether an all-gather on ``name`` goes as messages (its backend, gloo, does not coalesce)."""
    return not coalesces(_group(name)[0], device)


def recording() -> bool:
    """Whether this process records what it runs (``TORCH_FR_BUFFER_SIZE`` > 0)."""
    return int(os.environ.get(RECORD_ENV, "0") or 0) > 0


def _journal(*record) -> None:
    import time

    MESSAGES.journaled += 1
    MESSAGES.journal.append((time.time_ns(), *record))


def _post(kind: Collective, name: str, flat: torch.Tensor, out: torch.Tensor, sends: list,
          recvs: list, journal: bool = True) -> list:
    """Send ``(group rank, tensor)`` pairs and receive into the ``recvs`` tensors; the
    works to wait for (a rank waits for its own sends too: their buffers may be views of
    what the caller reuses). The op is journaled (``MESSAGES.journal``) when recording, unless
    ``journal`` is False (an op posted in parts journals itself)."""
    pg, members = _group(name)
    if journal and recording():
        _journal(kind, members, flat.numel(), out.numel(),
                 tuple((members[j], t.numel()) for j, t in sends),
                 tuple((members[j], t.numel()) for j, t in recvs))
    return post(pg, members, sends, recvs)


def wait_all(works: list, site: str, kind: Collective | None) -> None:
    """Wait for ``works``; a failed wait raised as :mod:`.timeouts` words it, naming
    the rank at the other end of the failed message where known."""
    if not works:
        return
    peers = MESSAGES.peers

    def pending() -> list[int]:
        return sorted({peers[id(w)] for w in works if id(w) in peers
                       and not w.is_completed()})

    with timeouts.waiting(lambda: timeouts.described(site, kind, pending)):
        _wait_each(works, site, kind)
    waited(works)


def _wait_each(works: list, site: str, kind: Collective | None) -> None:
    peers = MESSAGES.peers
    for work in works:
        try:
            work.wait()
        except RuntimeError as err:
            peer = peers.get(id(work))
            for w in works:
                peers.pop(id(w), None)
            raise _failed(site, kind, err, peer) from None
        peers.pop(id(work), None)


def _exchange_messages(flat: torch.Tensor, out_splits, in_splits, name: str
                       ) -> tuple[torch.Tensor, list, int]:
    """An all-to-all posted as messages: its output buffer, the works to wait for (its
    sends first) and how many of them are sends."""
    me = _group(name)[0].rank()
    flat = flat.contiguous()  # (a packed 1-d view may be strided)
    out = flat.new_empty(sum(out_splits))
    sends, recvs = [], []
    at = 0
    for j, n in enumerate(in_splits):
        if n and j != me:
            sends.append((j, flat[at:at + n]))
        elif n:
            own = flat[at:at + n]
        at += n
    at = 0
    for j, n in enumerate(out_splits):
        if n and j != me:
            recvs.append((j, out[at:at + n]))
        elif n:
            out[at:at + n].copy_(own)
        at += n
    return out, _post(Collective.ALL_TO_ALL, name, flat, out, sends, recvs), len(sends)


# An all-gather of small records among ROOTED_MEMBERS or more goes through its first member:
# the records in, then the whole out, 2(n - 1) messages in two hops instead of n(n - 1) in
# one. Latency-bound, the message count is the cost: 4 and 8 gloo processes on 2 cores,
# records of 64 B to 16 KiB took 0.4-0.6x the direct messages' time, 128 KiB 0.9-1.0x, 1 MiB
# 1.2-1.4x (bench/gather_messages.py). Size records and check headers are such records.
ROOTED_MEMBERS = 4
ROOTED_BYTES = 64 << 10  # a member's record at most this


def _gather_messages(flat: torch.Tensor, n: int, name: str, site: str = ""
                     ) -> tuple[torch.Tensor, list, int]:
    """An all-gather posted as messages: its output buffer, the works to wait for (its
    sends first) and how many of them are sends."""
    me = _group(name)[0].rank()
    flat = flat.contiguous()
    out = flat.new_empty(n * flat.numel())
    rows = out.view(n, flat.numel())
    if n >= ROOTED_MEMBERS and flat.numel() * flat.element_size() <= ROOTED_BYTES:
        return _rooted(flat, out, rows, me, name, site)
    rows[me].copy_(flat)
    return out, _post(Collective.ALL_GATHER, name, flat, out,
                      [(j, flat) for j in range(n) if j != me],
                      [(j, rows[j]) for j in range(n) if j != me]), n - 1


def _rooted(flat: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, me: int, name: str,
            site: str) -> tuple[torch.Tensor, list, int]:
    """:func:`_gather_messages` through member 0: a member sends it its row and receives
    the whole; member 0 waits for every row, then sends the whole (so its post waits: a
    member posts an op's messages in program order, so every row of this op comes). One
    journal record per member, its messages as posted."""
    n = rows.shape[0]
    if me:
        return out, _post(Collective.ALL_GATHER, name, flat, out, [(0, flat)], [(0, out)]), 1
    rows[0].copy_(flat)  # (the others receive theirs with the whole)
    if recording():
        members = _group(name)[1]
        _journal(Collective.ALL_GATHER, members, flat.numel(), out.numel(),
                 tuple((members[j], out.numel()) for j in range(1, n)),
                 tuple((members[j], flat.numel()) for j in range(1, n)))
    recvs = [(j, rows[j]) for j in range(1, n)]
    wait_all(_post(Collective.ALL_GATHER, name, flat, out, [], recvs, journal=False), site,
             Collective.ALL_GATHER)
    sends = [(j, out) for j in range(1, n)]
    return out, _post(Collective.ALL_GATHER, name, flat, out, sends, [], journal=False), n - 1


def _in_flight(out: torch.Tensor, works: list, sends: int, site: str,
               kind: Collective) -> torch.Tensor:
    """``out``, its receives in flight: registered as one work that
    ``_c10d_functional.wait_tensor(out)`` waits for (the op's wait, which a compiler
    may place at the output's first use), raising a failed wait as :mod:`.timeouts`
    words it. The sends are waited for here: the op's input is the compiler's buffer,
    which it may reuse as soon as the op returns (every receive is posted already, so
    no two ranks wait for each other's sends)."""
    wait_all(works[:sends], site, kind)
    works = works[sends:]
    if not works:
        timeouts.ran(site)
        return out

    def wait(*_) -> bool:
        wait_all(works, site, kind)
        timeouts.ran(site)
        return True

    _c10d_py._register_work(out, _c10d_py.PythonCallbackWork(wait))
    return out


OPS: dict[Collective, CommOp] = {op.kind: op for op in (
    _comm_op(
        Collective.ALL_GATHER, "Tensor flat, int group_size, str group",
        lambda flat, n, group, site: _gather_messages(flat, n, group, site)
        if _messages_gather(group, flat.device) else
        _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, n, group)),
        lambda flat, n, group: flat.new_empty(flat.numel() * n),
        lambda flat, ranks, group, out_splits, in_splits: (flat, len(ranks), group),
        _gathered, ("_allgather_base", "all_gather_into_tensor")),
    _comm_op(
        Collective.REDUCE_SCATTER, "Tensor flat, int group_size, str group",
        lambda flat, n, group, site: _c10d.wait_tensor(
            _c10d.reduce_scatter_tensor(flat, "sum", n, group)),
        lambda flat, n, group: flat.new_empty(flat.numel() // n),
        lambda flat, ranks, group, out_splits, in_splits: (flat, len(ranks), group),
        _reduced_scattered, ("_reduce_scatter_base", "reduce_scatter_tensor")),
    _comm_op(
        Collective.ALL_REDUCE, "Tensor flat, str group",
        lambda flat, group, site: _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group)),
        lambda flat, group: flat.new_empty(flat.numel()),
        lambda flat, ranks, group, out_splits, in_splits: (flat, group),
        _reduced, ("allreduce",)),
    _comm_op(
        Collective.ALL_TO_ALL,
        "Tensor flat, SymInt[] out_splits, SymInt[] in_splits, str group",
        lambda flat, out_splits, in_splits, group, site: _exchange_messages(
            flat, out_splits, in_splits, group),
        lambda flat, out_splits, in_splits, group: flat.new_empty(sum(out_splits)),
        lambda flat, ranks, group, out_splits, in_splits: (
            flat, list(out_splits), list(in_splits), group),
        _exchanged, ("alltoall_base",)),
)}


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
        if len(ranks) == 1:  # (every kind over one member gives it its own input)
            return flat.clone()
        return OPS[kind](flat, ranks, self.names[ranks], out_splits, in_splits, site)

    def start(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
              out_splits: Splits = (), in_splits: Splits = (), site: str = "") -> Handle:
        """Eagerly, a collective that goes as messages is posted and left in flight
        (the others, and every collective under ``torch.compile``, run at once)."""
        if len(ranks) == 1:
            return Handle(self.collective(kind, flat, ranks, out_splits, in_splits, site))
        name = self.names[ranks]
        if torch.compiler.is_compiling() or not (
                kind is Collective.ALL_TO_ALL or kind is Collective.ALL_GATHER
                and _messages_gather(name, flat.device)):
            return Handle(self.collective(kind, flat, ranks, out_splits, in_splits, site))
        try:
            if kind is Collective.ALL_TO_ALL:
                out, works, _ = _exchange_messages(flat, list(out_splits), list(in_splits),
                                                   name)
            else:
                out, works, _ = _gather_messages(flat, len(ranks), name, site)
        except RuntimeError as err:
            raise _failed(site, kind, err) from None
        if not works:
            timeouts.ran(site)
        return Handle(out, works, site, kind)
