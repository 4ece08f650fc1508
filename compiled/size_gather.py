"""A call's sizes: those it gives, the bridge's fixed ones, and those its ranks learn.

A bridge whose sizes or batch vary gathers one size record per rank on every call
(:mod:`.learn` encodes and reads the records), learning what is missing and checking what is
given (the records carry the bridge's digest and the call's given sizes): ranks that give
different sizes or batches raise, never pair mismatched data. Where the records repeat the
last gather's, nothing new is learned and nothing is gathered.
"""

from __future__ import annotations

import torch

from mimo_fx.errors import MimoFxError

from . import live
from .comm import host_to
from .guard import fingerprint
from .ops import define
from .sizing import flat_sizes, read_sizes
from .timeouts import cause, wait_time

__all__ = ["SizeGather", "fold_call"]


class SizeGather:
    """One bridge's size gathers (``prepared``: the bridge's parts; ``comm``: its check
    group's, None where it never gathers)."""

    def __init__(self, prepared, comm) -> None:
        self.bridge, self.comm = prepared, comm
        self.agreed: tuple | None = None  # the last gather: (this rank's record, records, sizes)
        # the last eager call with every size given: (its shape and sizes, the gather it
        # agreed on, the sizes) -- the same call again learns nothing and checks nothing new
        self.given_last: tuple | None = None

    def sizes(self, x, sizes, dim_sizes, layouts: dict) -> tuple[dict, frozenset]:
        """Every dim's size for this call, and the dims the gather learned."""
        b = self.bridge
        sizing, fixed = b.sizing, b.sizing.fixed
        if not sizing.varies:
            if sizes is not None or dim_sizes:
                sizing.given(sizes, dim_sizes)
            return fixed, frozenset()
        given = sizing.given(sizes, dim_sizes)
        full = {**fixed, **given}
        missing = sizing.missing(given)
        if len(b.union) == 1:  # (learned from its own tensor: no one to gather from)
            if not missing:
                return full, frozenset()
            # (its host record, not a tensor of it: under torch.compile the sizes are then
            # its tensor's own, not unbacked reads that no shape of the graph matches)
            return sizing.sizes_from([sizing.size_values(x)], full), frozenset(missing)
        if not sizing.gathers_sizes(missing) and not torch.compiler.is_compiling():
            key = (None if x is None else tuple(x.shape), tuple(full.items()))
            last = self.given_last
            if last is not None and last[0] == key and last[1] is self.agreed:
                return dict(last[2]), frozenset()  # (the gather would be skipped as agreed)
            self.check_given(x, full)
            out = self._learn(x, full, layouts)
            self.given_last = (key, self.agreed, out)
            return out, frozenset()
        return self._learn(x, full, layouts), frozenset(missing)

    def check_given(self, x, full: dict) -> None:
        """Every size given: this rank's tensor judged against them before the gather (a
        rank alone in its mistake raises at once, before any collective). Eager only: a
        trace's sizes are symbols, judged when its checks run."""
        guard, rank = self.bridge.guard, self.bridge.rank
        guard.local(x, "src", guard.expect("src", rank, full).shape, full)

    def _learn(self, x, known: dict, layouts: dict) -> dict:
        """The gather: every rank's size record, then every size from them. Under
        ``torch.compile`` it is an ordered op that also judges the records when the graph
        runs, raising the eager call's error on every rank."""
        sizing = self.bridge.sizing
        values, spec = flat_sizes(known)
        if not torch.compiler.is_compiling():  # (the gather learns them as it judges)
            return self.gather(sizing.size_values(x), values, sizing.batch_values(layouts),
                               spec)[1]
        records = _GATHER_SIZES(sizing.size_record(x), values, sizing.batch(layouts),
                             self.bridge.name, spec)
        if not sizing.missing(known):
            # every size given: the op judges the records when the graph runs; reading
            # them here would only repeat its checks as run-time asserts
            return dict(known)
        return sizing.sizes_from(records.view(len(self.bridge.union), -1), known)

    def gather(self, record: list, known, batch, spec: str) -> tuple[torch.Tensor, dict]:
        """Every rank's record (on the host; this rank's ``record`` with the call's given sizes
        ``known`` and ``batch`` folded in), and every size they give."""
        known = [int(v) for v in known]
        mine = fold_call(list(record), known, spec, batch)
        sizes = read_sizes(known, spec)
        key = (tuple(mine), spec)
        agreed = self.agreed
        if agreed is not None and agreed[0] == key and not self.bridge.sizing.missing(sizes):
            # every size given, as in the last gather, whose records agreed: nothing to learn
            # and nothing new to check (a rank whose sizes changed gathers alone and times
            # out naming the size gather, and its peers time out in their data transfer)
            return agreed[1].clone(), dict(agreed[2])
        records = self._records(mine)
        learned = self.bridge.sizing.sizes_from(records, sizes)
        out = records.reshape(-1).clone()
        self.agreed = (key, out, learned)
        return out.clone(), dict(learned)

    def _records(self, record: list[int]) -> torch.Tensor:
        """Every rank's size record (``record``: this rank's host values), on the host: the one
        read of the data's device a call that learns its sizes makes."""
        b = self.bridge
        assert self.comm is not None
        try:
            mine = host_to(torch.tensor(record, dtype=torch.int64), b.device)
            return self.comm.all_gather(mine, b.union).view(len(b.union), -1).cpu()
        except (RuntimeError, MimoFxError) as err:  # a timeout or a peer gone
            raise MimoFxError(
                b.context + f"rank {b.rank} waited in vain for every rank's size record "
                f"({cause(err)}). Every rank of both grids calls the bridge, giving the "
                f"same set of sizes ({wait_time()})") from None


def fold_call(record: list, known, spec: str, batch) -> list:
    """``record`` (a size record's host values), its fingerprint folding in the sizes a call
    gives (``known``, flat as :func:`.sizing.flat_sizes` makes them, with their ``spec``)
    and its batch's data as ints (``batch``): ranks whose calls differ in either send
    different records."""
    record[1] = fingerprint(int(record[1]), [int(v) for v in known], spec,
                         [list(b) for b in batch])
    return record


def _gather_sizes_impl(record: torch.Tensor, known, batch, bridge: str, spec: str) -> torch.Tensor:
    """Every rank's size record, judged as an eager call judges them (the same error on
    every rank for a bad one)."""
    return live.named(bridge).gather.gather(record.tolist(), known, [b.tolist() for b in batch],
                                            spec)[0]


_GATHER_SIZES = define(
    "gather_sizes(Tensor record, SymInt[] known, Tensor[] batch, str bridge, str spec) -> Tensor",
    _gather_sizes_impl,
    lambda record, known, batch, bridge, spec: record.new_empty(
        record.numel() * len(live.named(bridge).union)), ordered=True)
