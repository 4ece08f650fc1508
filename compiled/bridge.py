"""A bridge between two modules, for functional steps and imperative pipeline schedules.

``Bridge(src, dst, sizes)`` is a :class:`Redistributor` (call it inside a traced or
eager step; autograd carries the gradient back) that also offers the pipelined bridge's
imperative calls:

=====================================  =====================================
src (sending) ranks                    dst (receiving) ranks
=====================================  =====================================
``send_forward(x)``                    ``y = recv_forward()``
``g = recv_backward()``                ``send_backward(grad_y)``
``g = send_forward_recv_backward(x)``  ``y = send_backward_recv_forward(grad)``
=====================================  =====================================

Each side issues its forwards in micro-batch order and its backwards in the order of
their forwards, and nothing else needs to match: the calls may interleave differently
on the two sides. Data between the grids travels over one point-to-point channel per
direction (:mod:`.p2p`), so forwards pair with forwards and backwards with backwards
whatever the schedule -- Megatron's 1F1B, where the source runs its warm-up forwards
ahead (it issues ``F0, F1, B0, B1`` while the destination issues ``F0, B0, F1, B1``),
interleaved 1F1B, GPipe. Collectives inside one grid (a reduction over the source's TP
ranks, the destination's second-phase gathers) stay collectives: a grid's ranks run one
schedule. A rank only ever waits for what it receives; its sends complete in the
background (:meth:`Bridge.flush` waits for them). So a step that sends before it
receives -- the combined calls do: ``send_forward_recv_backward`` forwards then
receives, ``send_backward_recv_forward`` sends the gradient then receives -- cannot
deadlock, also across several bridges (interleaved schedules: issue a step's sends
first, then its receives).

Sizes: on a bridge with free dims each forward learns its sizes (the receivers too: this
is the pipelined bridge's size gather, also point-to-point) or takes them from the call,
and each backward runs at the sizes of the oldest forward whose backward has not run
yet. Unchecked, only the senders' size records travel: gathered at the first sender, which
sends the table on to every other rank (two messages for most ranks); a receiver checks
its own call against it (a row bridge's calls bring their batch: there every rank's record
goes to every rank, as checked, so a receiver that passed another batch raises on the
senders too). Built with ``told=True`` the senders give every call's sizes and the
receivers none (as a pipeline's first stage knows its shapes and the next does not,
Megatron's shape exchange): each sender posts its record straight to each receiver, which
learns them in one hop, and no sender waits. Checked, a call posts every record it sends to
every rank taking part (size records, or check headers) before it waits for anything; the
receiving side waits for every record, the sending side only for its own grid's (a stage
never waits for one that may be behind it) and checks the receivers' records as they
arrive: a mistake still raises on every rank of both grids, on the senders at a later
call of the bridge or at :meth:`Bridge.flush`.

Between two grids only the ranks holding a piece of either side take part in a call:
elsewhere (a rank of neither grid, or a pinned layout's other pipeline stages) a call
returns None at once, and such a rank may skip the calls, as Megatron's schedules do off
the boundary stages.
The imperative calls run eagerly (compile the stages' compute; or call the bridge itself
inside a compiled step, which uses ordinary collectives). Bridges must be built in the
same order on every rank (as every bridge: building one creates process groups).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator

import torch

from mimo_fx.errors import MimoFxError

from .comm import Comm, host_to, note
from .executor import CompiledExecutor, NumbersAt
from .lease import Lease, keep_alive, release_later
from .p2p import CHECKS, SIZES, Channel, Routed
from .prepared import placeholder
from .redistributor import Redistributor
from .size_gather import fold_call
from .sizing import flat_sizes
from .timeouts import cause, wait_time

__all__ = ["Bridge"]

# the most calls whose records from the other grid are checked later (a sender checks the
# receivers' records as they arrive); beyond it a call first waits for the oldest's, records
# their senders posted calls ago, before they waited for anything
DEFERRED = 16
RECENT = 8  # the size records of so many calls a bridge remembers what they gave



class Bridge(Redistributor):
    """A prepared redistribution between two modules with imperative send/recv calls."""

    def __init__(self, *args, told: bool = False, **kwargs) -> None:
        if not isinstance(told, bool):
            raise MimoFxError(f"told={told!r} must be True (the senders give every call's "
                              f"sizes, the receivers none) or False")
        super().__init__(*args, **kwargs)
        # a bridge whose calls bring their batch (a row bridge): its size records go to every
        # rank, so a receiver that passed another batch raises on the senders too
        self._batched = bool(self.sizing.batch_of(self.src, self.dst))
        if told and self._batched:
            Redistributor.destroy(self)  # (on every rank: every rank raises)
            raise MimoFxError(self.context + "told=True is for box layouts (a row "
                              "bridge's receivers take the batch from their call)")
        # told: each forward's sizes are the senders' to give and the receivers' to
        # learn, from every sender's record (a pipeline's first stage knows its shapes, the
        # next does not); moot where no size is free
        self.told = told and bool(self.sizing.missing({})) and set(
            self.src.grid.ranks) != set(self.dst.grid.ranks)
        # (a told bridge between disjoint grids, unchecked, guesses each call's sizes)
        self._speculates = self.told and not self.checked and not (
            set(self.src.grid.ranks) & set(self.dst.grid.ranks))
        self._seen: deque[dict] = deque(maxlen=2)  # the last calls' sizes (see _guess)
        self.guesses = [0, 0]  # forwards whose guessed sizes held, and failed
        self.last_sizes: dict = dict(self.fixed)  # the sizes this rank's last forward moved
        # (sizes, batch) of the forwards awaiting their backward, when these vary by call
        self._in_flight: deque[tuple[dict, dict]] = deque()
        self._deferred: list = []  # (gather, check): records checked when they arrive
        self._failed = False
        self._recent: dict = {}  # the sizes recent calls' records gave (see _learned)
        self._told_record: tuple = (None, None)
        src, dst = tuple(self.src.grid.ranks), tuple(self.dst.grid.ranks)
        # one channel per direction, of this bridge alone (two bridges between the same
        # grids, as interleaved schedules have, never pair each other's messages)
        self._tags = ((f"{self.name} p2p>", f"{self.name} p2p<")
                      if set(src) != set(dst) else ())
        # the ranks a call involves: between two grids, those holding a piece of either
        # side (a pinned layout's other stages hold none: they may skip the calls, as in
        # Megatron's pipeline schedules, where only the boundary stages call a bridge);
        # on one grid every rank (its checks are collectives of the whole grid)
        self.party = (tuple(r for r in self.union if self.src.holds(r) or self.dst.holds(r))
                      if self._tags else self.union)
        self._channel_lease = Lease(self.lease.what + " (its channels)", (),
                                    [(tag, self.union) for tag in self._tags], self.device)
        self._channels: tuple[Channel, ...] = ()
        self._pipe: tuple[CompiledExecutor, ...] = ()
        if self.involved:
            local = (self.executor.comms["forward"], self.executor.comms["backward"])
            if self._tags:
                self._channels = tuple(
                    Channel(self._channel_lease.process_group(self.union, t), self.rank)
                    for t in self._tags)
                comms: list[Comm] = [Routed(loc, c, src, dst)
                                     for loc, c in zip(local, self._channels)]
            else:  # one grid: a collective pairs calls its ranks all issue alike
                comms = list(local)
            self._pipe = tuple(CompiledExecutor(c, self.executor.comm_dtype, name=self.name,
                                                wires=self.executor.wires)
                               for c in comms)
        # dropped without destroy(): its channels go with its other groups
        weakref.finalize(self, _dropped, self._channel_lease, self._channels)

    # -- one direction ------------------------------------------------------------------
    def _gather_records(self, direction: int, record: torch.Tensor, kind: int):
        """Post this rank's ``record`` to every rank of both grids (over the direction's
        channel, or the check group on one grid); returns ``(records, ranks, rest)``: a wait
        for the records this rank needs before it moves data, whose ranks they are, and the
        posted gather whose other records are checked as they arrive (None: no others).

        A rank receiving in this direction needs every record; a sender only its own grid's
        (sizes come from the senders' shapes): it never waits for a stage that may be
        behind it, which is what keeps checked and learned calls deadlock-free in any
        schedule."""
        party = self.party
        if not self._channels:
            assert self.guard.comm is not None
            comm = self.guard.comm
            return (lambda: self._waited(lambda: comm.all_gather(record, party), kind)
                    .view(len(party), -1)), party, None
        receivers = (self.dst if direction == 0 else self.src).grid.ranks
        senders = (self.src if direction == 0 else self.dst).grid.ranks
        if kind == SIZES and not self.checked and not self._batched:
            return self._rooted_records(record, self._senders())
        now = party if self.rank in receivers else tuple(r for r in party if r in senders)
        # (the records it waits for in a grouped call of their own: on NCCL a group's
        # messages complete together, and the others' senders may be behind)
        gathered = self._channels[direction].start_gather(record, party, first=now)
        index = [party.index(r) for r in now]

        def records() -> torch.Tensor:
            return self._waited(lambda: gathered.wait(now), kind)[index]
        return records, now, (gathered if now != party else None)

    def _told_call(self, missing: tuple, x, full: dict, batch: dict) -> bool:
        """A told bridge's forward: whether this rank gathers size records (a receiver;
        every rank, checked). An unchecked sender posts its own record, the sizes it gives
        folded into its fingerprint, to every rank of the union off the senders: a
        receiver learns the sizes from the holders' shapes as always, and senders that
        told different sizes send different records, which it refuses. No sender waits."""
        senders = self._senders()
        sending = self.rank in senders
        if sending and missing:
            raise MimoFxError(
                self.context + f"rank {self.rank}: a told bridge's senders give every "
                f"call's sizes; this call misses {', '.join(missing)}")
        if not sending and not missing:
            raise MimoFxError(
                self.context + f"rank {self.rank}: a told bridge's receivers learn the "
                f"sizes from the senders; pass none (this call gives every free size)")
        if self.checked:
            return True  # (every rank's record to every rank: the senders' give the sizes)
        if sending:
            key = (tuple(sorted(full.items())), tuple(x.shape))
            if self._told_record[0] != key:  # (the record of the last sizes told, kept)
                values, spec = flat_sizes(full)
                record = fold_call(self._size_values(x, {}, {}), values, spec, [])
                self._told_record = (key, host_to(torch.tensor(record, dtype=torch.int64),
                                               self.device))
            self._channels[0].exchange(
                [(p, self._told_record[1]) for p in self.party if p not in senders], [])
        return not sending

    def _senders(self) -> tuple[int, ...]:
        """The ranks whose records give the sizes, in the union's order: the sending grid's
        (a rank without a piece says so), a told bridge's src holders."""
        if self.told:
            return tuple(r for r in self.party if self.src.holds(r))
        return tuple(r for r in self.party if r in self.src.grid.ranks)

    def _rooted_records(self, record: torch.Tensor, senders: tuple[int, ...]):
        """An unchecked call's size records: only the senders' (sizes come from their
        shapes), gathered at the first sender and sent on whole to every other rank of
        both grids (:meth:`.p2p.Channel.start_rooted`). A receiver checks its own record
        against them (that it made the same call, with the same given sizes and batch);
        no sender waits for a receiver. A told bridge's receiver takes every sender's
        record straight from it. As in :func:`_gather_records`."""
        if self.told:
            told = self._channels[0].start_receives(record, senders)
            return (lambda: self._waited(told.wait, SIZES)), senders, None
        gathered = self._waited(
            lambda: self._channels[0].start_rooted(record, senders, self.party), SIZES)
        if self.rank in senders:
            return (lambda: self._waited(gathered.wait, SIZES)), senders, None

        def records() -> torch.Tensor:
            return torch.cat([self._waited(gathered.wait, SIZES), record.view(1, -1)])
        return records, (*senders, self.rank), None

    def _waited(self, wait: Callable, kind: int):
        try:
            return wait()
        except (RuntimeError, MimoFxError) as err:  # a timeout, or a peer gone
            note("fail")
            raise MimoFxError(
                self.context + f"rank {self.rank} waited in vain for the other ranks' "
                f"{'size records' if kind == SIZES else 'check headers'} "
                f"({cause(err)}); every rank "
                f"of both grids makes the same calls in the same order "
                f"({wait_time()})") from None

    def _later(self, rest, check: Callable[[torch.Tensor], None]) -> None:
        """Check the rest of a gather's records when they have arrived."""
        if rest is not None:
            self._deferred.append((rest, check))

    def _settle_checks(self, wait: bool = False) -> None:
        """Run the deferred checks whose records arrived (all, waiting, with ``wait``; the
        oldest, waiting, beyond :data:`DEFERRED`: some backends, gloo among them, say a
        record arrived only once its work was waited for)."""
        keep = []
        old = len(self._deferred) - DEFERRED
        for i, (rest, check) in enumerate(self._deferred):
            if wait or i < old:
                self._waited(rest.wait, CHECKS)
            if wait or i < old or rest.done():
                check(rest.out)
            else:
                keep.append((rest, check))
        self._deferred = keep

    def _run(self, direction: int, program, tensor: torch.Tensor, env: dict | None = None,
             index: tuple = ()) -> torch.Tensor:
        (out,) = self._attempt(direction, lambda: self._pipe[direction].run(
            program, (tensor,), env, index, direction=("forward", "backward")[direction]))
        return out

    def _attempt(self, direction: int, step: Callable):
        """``step()`` without autograd, a failed transfer raised as a MimoFxError."""
        try:
            with torch.no_grad():
                return step()
        except RuntimeError as err:
            raise MimoFxError(
                self.context + f"rank {self.rank}: the {('forward', 'backward')[direction]} "
                f"transfer failed ({cause(err)}); every rank of both grids makes the "
                f"same calls in the same order") from None

    def _programs(self, full: dict, learned: frozenset, x, batch: dict) -> _Programs:
        return _Programs(self.sizing, full, learned, x, batch)

    def _size_record(self, x, known: dict, batch: dict) -> torch.Tensor:
        """This rank's size record; a row bridge's fingerprint folds in the sizes given and
        the call's batch, so ranks that pass different batches raise, as in a call of
        the bridge itself."""
        return host_to(torch.tensor(self._size_values(x, known, batch), dtype=torch.int64),
                       self.device)

    def _size_values(self, x, known: dict, batch: dict) -> list:
        record = self.sizing.size_values(x)
        data = self.sizing.batch_values(batch)
        if data:
            values, spec = flat_sizes(known)
            fold_call(record, values, spec, data)
        return record

    def _forward(self, x: torch.Tensor | None, sizes: dict | None, batch: dict) -> Iterator:
        """A forward in two steps: post its records (``yield``), then validate ``x`` (this
        rank's src piece or None) and run the forward program (``yield`` the result).
        ``batch``: a row bridge's layouts for this call (``src=``/``dst=``)."""
        sizing, guard = self.sizing, self.guard
        given = sizing.given(sizes, {})
        full = {**self.fixed, **given}
        missing = sizing.missing(given)
        gather = sizing.gathers_sizes(missing)  # the size records also check the call
        if self.told:
            gather = self._told_call(missing, x, full, batch)
        if gather:
            records, now, rest = self._gather_records(0, self._size_record(x, full, batch), SIZES)
        elif self.checked:
            shape = self._programs(full, frozenset(), x, batch).src_shape
            header, fingerprint = guard.header(x, "src", shape, full,
                                               self._checked_fingerprint(full))
            records, now, rest = self._gather_records(0, header, CHECKS)
        guess = self._guess()
        ahead = None  # a receiver's transfer posted at the guessed sizes
        if guess is not None and gather:
            ahead = self._start(guess, batch)
        yield None
        if guess is not None and not gather and full != guess:
            self._run_at(guess, batch)  # (what the receivers posted at the guess takes)
        if gather:
            known = full
            full = self._learned(records(), known, now)
            self._later(rest, lambda got: self._same_sizes(got, known, full, self.party))
        programs = self._programs(full, frozenset(missing), x, batch)
        if self.checked and not gather:
            guard.verdict(records(), "src", fingerprint, full, now)
            self._later(rest, lambda got: guard.verdict(got, "src", fingerprint, full, self.party))
        else:
            guard.local(x, "src", programs.src_shape, full)
        self.last_sizes = full
        if self.sizing.varies:
            self._in_flight.append((full, batch))
        if self._speculates:
            self._seen.append(full)
        if guess is not None:
            self.guesses[full != guess] += 1
        if ahead is not None:
            y = self._finish(ahead)
            if full == guess:
                yield y
                return
        x = self._placeholder(self.src) if x is None else x.detach()
        yield self._run(0, programs.fwd, x, programs.env, programs.index)

    # -- a told bridge's guess: the transfer posted before the sizes are there -----------
    def _guess(self) -> dict | None:
        """The sizes a told call is guessed to move: the last call's, where the two last
        calls moved the same (every rank of both grids guesses alike). A receiver posts
        its transfer at the guess with the records' receives, so where the guess holds, the
        data arrives in the same hop as the records; where it fails, the senders first send
        what the guess posted (zeros, dropped), then the call at its sizes."""
        if not self._speculates or len(self._seen) < 2 or self._seen[0] != self._seen[1]:
            return None
        return self._seen[1]

    def _start(self, full: dict, batch: dict):
        """This receiver's forward program at ``full`` sizes, posted (not waited)."""
        programs = self._programs(full, frozenset(), None, batch)
        return self._attempt(0, lambda: self._pipe[0].start(
            programs.fwd, (self._placeholder(self.src),), programs.env, programs.index,
            direction="forward"))

    def _finish(self, started) -> torch.Tensor:
        (out,) = self._attempt(0, started.finish)
        return out

    def _run_at(self, full: dict, batch: dict) -> None:
        """This sender's forward program at ``full`` sizes on zeros (its holders' piece
        shapes there): the messages a guess at ``full`` posted receives for."""
        programs = self._programs(full, frozenset(), None, batch)
        shape = programs.src_shape
        x = (self._placeholder(self.src) if shape is None
             else torch.zeros(shape, dtype=self.dtype, device=self.device))
        self._run(0, programs.fwd, x, programs.env, programs.index)

    def _learned(self, records: torch.Tensor, known: dict, ranks: tuple) -> dict:
        """The sizes ``records`` give (:meth:`.sizing.CallSizes.sizes_from`), read once: a
        call whose records and given sizes equal a recent call's takes its sizes (the records
        are all the learning reads), the last few kept."""
        listed = records.view(len(ranks), -1).tolist()
        key = (tuple(map(tuple, listed)), tuple(sorted(known.items())), ranks)
        full = self._recent.get(key)
        if full is None:
            full = self.sizing.sizes_from(listed, known, ranks)
            if len(self._recent) >= RECENT:
                del self._recent[next(iter(self._recent))]
            self._recent[key] = full
        return dict(full)

    def _checked_fingerprint(self, full: dict, side: str = "src") -> int | None:
        """The fingerprint a checked call of ``side`` at ``full`` sizes carries."""
        from .guard import fingerprint
        from .sizing import _size_key

        return None if not self.free else fingerprint(side, *self.guard.key, _size_key(full))

    def _placeholder(self, layout) -> torch.Tensor:
        return placeholder(len(layout.local_dims), self.dtype, self.device)

    def _same_sizes(self, records: torch.Tensor, known: dict, learned: dict,
                    ranks: tuple) -> None:
        # (sizes_from's own errors name the rank)
        if self.sizing.sizes_from(records, known, ranks) != learned:
            raise MimoFxError(self.context + "the receivers' size records disagree with the "
                              "sizes the senders learned")

    def _backward(self, grad: torch.Tensor | None, after_forward: bool = False) -> Iterator:
        """A backward in two steps, at the sizes and batch of the oldest forward still
        waiting for it (``grad``: this rank's dst cotangent or None; ``after_forward``: a
        forward runs before it in the same call)."""
        varies = self.sizing.varies
        if varies and not self._in_flight and not after_forward:
            raise MimoFxError(self.context + f"rank {self.rank}: a backward with no "
                              f"forward waiting for it; every backward follows its forward")
        posted = None
        if self.checked and (self._in_flight or not varies):
            posted = self._backward_header(grad)
        yield None
        full, batch = self._in_flight.popleft() if varies else (self.fixed, {})
        if self.checked and posted is None:  # its forward ran in this very call
            posted = self._backward_header(grad, (full, batch))
        programs = self._programs(full, frozenset(), None, batch)
        if posted is not None:
            (records, now, rest), fingerprint = posted
            self.guard.verdict(records(), "dst", fingerprint, full, now)
            self._later(rest, lambda got: self.guard.verdict(got, "dst", fingerprint, full,
                                                            self.party))
        else:
            self.guard.local(grad, "dst", programs.grad_shape, full)
        grad = self._placeholder(self.dst) if grad is None else grad.detach()
        yield self._run(1, programs.bwd, grad, programs.env, programs.index)

    def _backward_header(self, grad, call: tuple[dict, dict] | None = None) -> tuple:
        if call is None:
            call = self._in_flight[0] if self.sizing.varies else (self.fixed, {})
        full, batch = call
        shape = self._programs(full, frozenset(), None, batch).grad_shape
        header, fingerprint = self.guard.header(grad, "dst", shape, full,
                                           self._checked_fingerprint(full, "dst"))
        return self._gather_records(1, header, CHECKS), fingerprint

    def _calls(self, *halves: tuple) -> list[torch.Tensor | None]:
        """Run ``("forward", x, sizes)`` / ``("backward", grad)`` halves in order, every
        half's records posted before any half waits."""
        self.lease.check()
        if torch.compiler.is_compiling():
            raise MimoFxError(self.context + "the imperative send/recv calls run eagerly; "
                              "compile the stages' compute around them, or call the bridge "
                              "itself (bridge(x)) inside a compiled step")
        if self.rank not in self.party:  # (off a pinned layout's stage: nothing to move)
            for h in halves:
                if h[1] is not None:
                    raise MimoFxError(
                        self.context + f"rank {self.rank} holds no piece of either side "
                        f"but passed a {h[0]} tensor of shape {tuple(h[1].shape)}; pass None "
                        f"there (or skip the call: only the ranks holding pieces take part)")
            return [None] * len(halves)
        self._settle_checks()
        frozen = self._frozen_calls()
        if frozen:  # (a source tensor that requires grad is refused, as in a call)
            for h in halves:
                if h[0] == "forward":
                    self.prepared.freeze.backward_runs(h[1])
        steps = [self._forward(h[1], h[2], h[3]) if h[0] == "forward"
                 else _nothing() if frozen  # (a frozen source's backward moves nothing)
                 else self._backward(h[1], any(g[0] == "forward" for g in halves[:i]))
                 for i, h in enumerate(halves)]
        try:
            for step in steps:
                next(step)
            return [next(step) for step in steps]
        except MimoFxError:
            self._failed = True  # its peers may never take what it sent: destroy won't wait
            raise

    # -- the calls ----------------------------------------------------------------------
    def send_forward(self, x: torch.Tensor | None, sizes: dict | None = None, *, src=None,
                     dst=None) -> torch.Tensor | None:
        """Send this rank's src piece; returns what it receives under dst (often empty).
        A row bridge (a packed layout on a side) takes the call's batch as ``src=`` /
        ``dst=``, as a call of the bridge does; its backward runs at that batch."""
        return self._calls(("forward", x, sizes, self.prepared.layouts(src, dst)))[0]

    def recv_forward(self, x: torch.Tensor | None = None, sizes: dict | None = None, *,
                     src=None, dst=None) -> torch.Tensor | None:
        """This rank's dst piece, as a leaf that requires grad (a stage input; a frozen
        source's needs none)."""
        y = self._calls(("forward", x, sizes, self.prepared.layouts(src, dst)))[0]
        return self._stage_input(y)

    def _stage_input(self, y: torch.Tensor | None) -> torch.Tensor | None:
        if y is None or self._frozen_calls():
            return y
        return y.requires_grad_(torch.is_floating_point(y))

    def _frozen_calls(self) -> bool:
        """Whether the imperative calls treat the source as frozen: only when built with
        ``frozen=True`` (a schedule sends detached stage outputs, so a tensor's
        requires_grad says nothing here; by default the backward runs, as a pipeline
        schedule expects)."""
        return self.options.frozen is True

    def send_backward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Send the gradient of this rank's dst piece; returns its src gradient if any
        (a frozen source's backward moves nothing: None)."""
        return self._calls(("backward", grad))[0]

    def recv_backward(self, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """The gradient of this rank's src piece (``shard(G, src*)``; None for a frozen
        source)."""
        return self._calls(("backward", grad))[0]

    def send_forward_recv_backward(self, x: torch.Tensor | None,
                                   grad: torch.Tensor | None = None,
                                   sizes: dict | None = None, *, src=None,
                                   dst=None) -> torch.Tensor | None:
        """Forward ``x``, then receive the gradient of the oldest forward still waiting
        for one (src side of a 1F1B step)."""
        return self._calls(("forward", x, sizes, self.prepared.layouts(src, dst)),
                           ("backward", grad))[1]

    def send_backward_recv_forward(self, grad: torch.Tensor | None,
                                   x: torch.Tensor | None = None,
                                   sizes: dict | None = None, *, src=None,
                                   dst=None) -> torch.Tensor | None:
        """Send ``grad`` back, then receive the next activation (dst side of a 1F1B step)."""
        y = self._calls(("backward", grad),
                        ("forward", x, sizes, self.prepared.layouts(src, dst)))[1]
        return self._stage_input(y)

    def flush(self) -> None:
        """Wait until every send of this rank was received and every record it was sent
        arrived and was checked (e.g. at the end of a step)."""
        try:
            self._settle_checks(wait=True)
        except MimoFxError:
            self._failed = True
            raise
        for channel in self._channels:
            channel.settle(wait=True)

    def destroy(self) -> None:
        """Release this bridge's process groups, after its sends were received (unless a
        call of it failed: then its channels are left alive with what it sent, since
        destroying them would wait for receivers that will never come). Call it on
        every rank."""
        if self.lease.live:
            if not self._failed:
                self.flush()
            for channel in self._channels:
                for work, buffer in channel.in_flight():
                    keep_alive((work, buffer), work.is_completed)
            self._channel_lease.release(abandon=self._failed)
            self._channels = ()
        super().destroy()


def _nothing() -> Iterator:
    """A half that moves nothing (the backward of a frozen source): posts nothing, then
    gives None."""
    yield None
    yield None


def _dropped(lease: Lease, channels: tuple[Channel, ...]) -> None:
    """A bridge garbage-collected: its channels are released with its other groups at
    the next safe point (abandoned, i.e. kept alive, if a send is still in flight:
    destroying a channel waits for its receiver)."""
    if lease.live:
        sending = False
        for channel in channels:
            for work, buffer in channel.in_flight():
                keep_alive((work, buffer), work.is_completed)
                sending = sending or not work.is_completed()
        release_later(lambda: lease.release(abandon=sending))


class _Programs:
    """A call's forward and backward programs at ``full`` sizes and ``batch`` (a row
    bridge's layouts for the call): the numbers a template or row program runs at
    (``env``), a row program's index vectors, and the local shapes each side passes."""

    def __init__(self, sizing, full: dict, learned: frozenset, x, batch: dict) -> None:
        self.fwd, self.bwd, values, self.index, _ = sizing.programs(full, learned, x, **batch)
        self.env = None if values is None else dict(zip(sizing.variables, values))
        num = NumbersAt(self.env)
        self.src_shape = None if self.fwd.src_shape is None else num.all(self.fwd.src_shape)
        self.grad_shape = None if self.bwd.src_shape is None else num.all(self.bwd.src_shape)
