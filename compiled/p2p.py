"""Point-to-point channels: how a pipelined bridge moves data between two stages.

A collective pairs the n-th call of every member, so two stages may only share one if
they issue their forwards and backwards in the same interleaving. Pipeline schedules do
not: in 1F1B the first stage runs warm-up forwards ahead of the last, so one side issues
``F0, F1, B0`` while the other issues ``F0, B0, F1``. Point-to-point messages pair per
sender, receiver and channel instead, in the order each side posts them (no tags: NCCL
ignores them); so a :class:`Bridge <.bridge.Bridge>` gives each direction its own
:class:`Channel` (a process group of its own), and forwards pair with forwards,
backwards with backwards, whatever the interleaving. A rank posts one exchange's sends
and receives in one grouped call (``batch_isend_irecv``), as NCCL needs.

A :class:`Channel` offers the collectives of the comm seam (:class:`~.comm.Comm`) built
from ``isend``/``irecv``, which is what lets a lowered program run unchanged over
it. Receives are waited for before a collective returns (its output is needed); sends
are not: they complete in the background, and the channel keeps each sent buffer until
its receiver took it (:meth:`Channel.settle`). That is what makes a step that sends and
then receives deadlock-free for any schedule whose data dependencies are: a rank never
waits for its own sends, only for what its peers send before they wait in turn.

:class:`Routed` gives a program the channel for the collectives whose group spans the
two stages, and the ordinary collectives for groups inside one stage (a stage's ranks
run the same schedule, so they issue those in the same order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mimo_fx.plan import Collective

from .comm import OPS, Comm, Handle, post, waited
from .timeouts import waiting

__all__ = ["Channel", "Gathered", "Routed", "SIZES", "CHECKS"]

Ranks = tuple[int, ...]
# the kinds of small row a call gathers (what a failed wait says it waited for); the
# messages carry no tag (NCCL ignores tags): a pair's messages on a channel pair in the
# order both sides post them, the same order
SIZES, CHECKS = 1, 2
# the most sends a channel keeps in flight: beyond it a new exchange first waits for its
# oldest (some backends, gloo among them, say a message is through only once its work
# was waited for, so without a bound the list of sends grows by every call's messages
# and each call scans it). A send that old was posted calls ago: its receiver, which
# takes each pair's messages in posting order, has posted its receive or is behind on
# messages already sent, so the wait never waits for this rank's later messages.
IN_FLIGHT = 64


class Channel(Comm):
    """Point-to-point collectives of one direction of a bridge, over ``group``."""

    def __init__(self, group, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.members = tuple(dist.get_process_group_ranks(group))
        self._sent: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: list[tuple[dist.Work, torch.Tensor]] = []  # receives, until they end
        self.messages = 0  # messages posted over the channel (sends and receives)

    def settle(self, wait: bool = False) -> int:
        """Forget the sends their receivers took (all of them, waiting, with ``wait``);
        returns how many are still in flight."""
        if wait:
            for work, _ in self._sent:
                work.wait()
            self._sent.clear()
        else:
            self._sent = [(w, t) for w, t in self._sent if not w.is_completed()]
        self._posted = [(w, t) for w, t in self._posted if not w.is_completed()]
        return len(self._sent)

    def _bound(self) -> None:
        """Wait for the oldest sends beyond :data:`IN_FLIGHT`."""
        self.settle()
        if len(self._sent) > IN_FLIGHT:
            old, self._sent = self._sent[:-IN_FLIGHT], self._sent[-IN_FLIGHT:]
            with waiting(lambda: f"the receivers of this rank's sends on a pipelined "
                                 f"bridge's channel, {len(old)} sends back"):
                for work, _ in old:
                    work.wait()
            waited([w for w, _ in old])

    def in_flight(self) -> list:
        """Every send and receive not finished yet, with its buffer: what must stay alive
        (a dropped work can cancel its message under the peer)."""
        self.settle()
        return self._sent + self._posted

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]]) -> list:
        """Post ``sends`` and ``recvs`` (``(peer, tensor)``; a peer equal to this rank is
        a local copy) in one grouped call (:func:`.comm.post`: no tags, messages of a pair
        pair in posting order); returns the works to wait for before the receives are
        there (each receive's, or the group's one)."""
        self._bound()
        local = {p: t for p, t in sends if p == self.rank}
        out = [(p, t.contiguous()) for p, t in sends if p != self.rank]
        into = [(p, t) for p, t in recvs if p != self.rank]
        for peer, t in recvs:
            if peer == self.rank:
                t.copy_(local[peer])
        index = self.members.index
        works = post(self.group, self.members, [(index(p), t) for p, t in out],
                     [(index(p), t) for p, t in into])
        self.messages += len(out) + len(into)
        if len(works) == len(out) + len(into):  # (one work per message)
            self._sent += [(w, t) for w, (_, t) in zip(works, out)]
            received = works[len(out):]
            self._posted += [(w, t) for w, (_, t) in zip(received, into)]
        else:  # (one work for the group: the sends are through when it is)
            self._sent += [(w, t) for w in works for _, t in out]
            received = works if into else []
            self._posted += [(w, t) for w in received for _, t in into]
        self.settle()
        return received

    # -- the comm seam ------------------------------------------------------------------
    def collective(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
                   out_splits: Sequence[int] = (), in_splits: Sequence[int] = (),
                   site: str = "") -> torch.Tensor:
        """The all-to-all and the all-gather are built from messages; a reduce-scatter
        is an all-to-all of the chunks, summed; any other kind gathers every member's
        input (equal sizes) and computes its output as :data:`~.comm.OPS` says."""
        if kind is Collective.ALL_TO_ALL:
            return self.all_to_all(flat, out_splits, in_splits, ranks)
        if kind is Collective.ALL_GATHER:
            return self.all_gather(flat, ranks)
        n = len(ranks)
        if kind is Collective.REDUCE_SCATTER:
            chunk = flat.numel() // n
            got = self.all_to_all(flat, [chunk] * n, [chunk] * n, ranks)
            return got.view(n, chunk).sum(0)
        rows = list(self.all_gather(flat, ranks).view(n, -1))
        return OPS[kind].compute(rows, [out_splits] * n, [in_splits] * n)[ranks.index(self.rank)]

    def start(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
              out_splits: Sequence[int] = (), in_splits: Sequence[int] = (),
              site: str = "") -> Handle:
        """An all-to-all posted (its receives waited by the handle's ``wait()``); any
        other kind runs here."""
        if kind is not Collective.ALL_TO_ALL:
            return super().start(kind, flat, ranks, out_splits, in_splits, site)
        out, works = self._post_all_to_all(flat, out_splits, in_splits, ranks)
        return Handle(out, works, site, kind)

    def all_to_all(self, flat: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int], ranks: Ranks) -> torch.Tensor:
        out, works = self._post_all_to_all(flat, out_splits, in_splits, ranks)
        if works:
            with waiting(lambda: f"ranks {sorted(self._peers(out_splits, ranks))}'s "
                                 f"messages on a pipelined bridge's channel"):
                for work in works:
                    work.wait()
            waited(works)
        return out

    def _peers(self, out_splits: Sequence[int], ranks: Ranks) -> set[int]:
        return {p for p, n in zip(ranks, out_splits) if n and p != self.rank}

    def _post_all_to_all(self, flat: torch.Tensor, out_splits: Sequence[int],
                         in_splits: Sequence[int], ranks: Ranks) -> tuple[torch.Tensor, list]:
        out = flat.new_empty(sum(out_splits))
        sends, recvs = [], []
        at = 0
        for peer, n in zip(ranks, in_splits):
            if n:
                sends.append((peer, flat[at:at + n]))
            at += n
        at = 0
        for peer, n in zip(ranks, out_splits):
            if n:
                recvs.append((peer, out[at:at + n]))
            at += n
        return out, self.exchange(sends, recvs)

    def all_gather(self, flat: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        return self.start_gather(flat, ranks).wait().view(-1)

    def start_gather(self, flat: torch.Tensor, ranks: Ranks,
                     first: Ranks | None = None) -> Gathered:
        """Post an all-gather of ``flat`` over ``ranks``; its rows arrive in the
        background (:class:`Gathered`). ``first``: the ranks whose rows are waited for
        first, posted in a grouped call of their own (the rest in another: where a
        backend completes a group's messages together, waiting for them never waits
        for the rest)."""
        out = flat.new_empty((len(ranks), flat.numel()))
        works: dict[int, object] = {}
        parts = [ranks] if first is None or tuple(first) == tuple(ranks) else [
            tuple(first), tuple(p for p in ranks if p not in first)]
        for part in parts:
            others = [p for p in part if p != self.rank]
            got = self.exchange([(p, flat) for p in part],
                                [(p, out[ranks.index(p)]) for p in part])
            works.update(_by_peer(got, others))
        return Gathered(out, works, ranks)

    def start_receives(self, like: torch.Tensor, rows_of: Ranks) -> Gathered:
        """Post the receive of one row shaped as ``like`` from each rank of ``rows_of``
        (each posts its row to this rank with :meth:`exchange`); they arrive in the
        background."""
        out = like.new_empty((len(rows_of), like.numel()))
        got = self.exchange([], [(p, out[i]) for i, p in enumerate(rows_of)])
        return Gathered(out, _by_peer(got, [p for p in rows_of if p != self.rank]), rows_of)


    def start_rooted(self, flat: torch.Tensor, rows_of: Ranks, to: Ranks) -> Gathered:
        """Gather the rows of ``rows_of`` at its first rank, which sends the whole table
        to every other rank of ``to``: a contributor posts its row and the table's
        receive, the root waits for the rows (posted by their senders before they wait
        for anything) and then posts the table's sends. 2 messages for most ranks,
        where an all-gather over ``to`` posts ``2 (len(to) - 1)`` on every rank."""
        root = rows_of[0]
        out = flat.new_empty((len(rows_of), flat.numel()))
        if self.rank != root:
            sends = [(root, flat)] if self.rank in rows_of else []
            got = self.exchange(sends, [(root, out)])
            return Gathered(out, {root: got[-1]}, (root,))  # (the table's, or the group's)
        out[0].copy_(flat)
        got = self.exchange([], [(p, out[i]) for i, p in enumerate(rows_of) if p != root])
        with waiting(lambda: f"the rows of ranks {list(rows_of[1:])} on a pipelined "
                             f"bridge's channel"):
            for work in got:
                work.wait()
        waited(got)
        self.exchange([(p, out) for p in to if p != root], [])
        return Gathered(out, {}, (root,))


def _by_peer(works: list, peers: Sequence[int]) -> dict:
    """Each peer's work of one grouped call: its receive's, or the group's one."""
    if len(works) == len(peers):
        return dict(zip(peers, works))
    return {p: w for w in works for p in peers}


class Gathered:
    """The rows of a posted all-gather, one per rank of ``ranks``, as they arrive."""

    def __init__(self, out: torch.Tensor, works: dict, ranks: Ranks) -> None:
        self.out, self.works, self.ranks = out, works, ranks

    def wait(self, peers: Ranks | None = None) -> torch.Tensor:
        """Wait for the rows of ``peers`` (default: all); returns every row (rows not
        waited for are not there yet)."""
        with waiting(lambda: f"the rows of ranks {sorted(self.works)} on a pipelined "
                             f"bridge's channel"):
            for peer in self.ranks if peers is None else peers:
                work = self.works.pop(peer, None)
                if work is not None:
                    work.wait()
                    waited([work])
        return self.out

    def done(self) -> bool:
        """Whether every row arrived (never waits)."""
        self.works = {p: w for p, w in self.works.items() if not w.is_completed()}
        return not self.works


class Routed(Comm):
    """A comm that issues a group's collective over ``channel`` when the group spans
    both stages (neither ``src`` nor ``dst`` holds all of it), else over ``local``."""

    def __init__(self, local: Comm, channel: Channel, src: Ranks, dst: Ranks) -> None:
        self.local, self.channel = local, channel
        self._src, self._dst = frozenset(src), frozenset(dst)

    def _comm(self, ranks: Ranks) -> Comm:
        members = set(ranks)
        if members <= self._src or members <= self._dst:
            return self.local
        return self.channel

    def collective(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
                   out_splits: Sequence[int] = (), in_splits: Sequence[int] = (),
                   site: str = "") -> torch.Tensor:
        return self._comm(ranks).collective(kind, flat, ranks, out_splits, in_splits, site)

    def start(self, kind: Collective, flat: torch.Tensor, ranks: Ranks,
              out_splits: Sequence[int] = (), in_splits: Sequence[int] = (),
              site: str = "") -> Handle:
        return self._comm(ranks).start(kind, flat, ranks, out_splits, in_splits, site)
