"""The ranks of a bridge agree on its definition before its process groups are created.

Building a bridge creates process groups, a collective of their members (see
:mod:`.groups`), and what goes on the wire follows from the bridge's definition: its
layouts, sizes, dtypes, options and name. Ranks that build one bridge differently
create other groups (gloo's setup fails with a raw store error), or the same groups and
then move other bytes (an abort, or wrong data with no error). So before any group is
created every rank of the bridge's grids -- and only those: ranks outside them build
nothing -- posts its definition, a few short strings, to the default process group's
store and reads its peers': one agreement per build, none per call. A difference is a
:class:`MimoFxError` on every one of them, naming the field, the values and which ranks
hold which; a rank that never posts (it raised while building, or skipped the build) is
named after ``MIMO_FX_TIMEOUT`` seconds (see :mod:`.timeouts`), and its peers withdraw,
so they can go on building bridges.

A rank that is about to raise waits (a bounded time) until its peers have read every
record: a script without ``try`` exits as soon as it raises, and rank 0, which hosts the
store, would otherwise take the records with it. A store that is gone (its host exited)
is a :class:`MimoFxError` too, never torch's raw network error.

Agreements are keyed by the bridge's ranks, their place in this rank's sequence of
builds over those ranks (they build their bridges in one order) and a round, bumped when
an agreement is given up: a rank that skipped a build meets its peers at the next one.
Only an agreement every rank completed advances the sequence.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import NoReturn

import torch.distributed as dist
from torch.distributed import DistError

from mimo_fx.errors import MimoFxError

from .groups import POOL
from .timeouts import cause, timeout_seconds, wait_time, waiting

__all__ = ["agree", "PREFIX"]

PREFIX = "mimo_fx/agree"
READ_WAIT = 30.0  # seconds the store's host waits for its peers to read the records
HOST = 0  # the rank whose process hosts the default store (torch's TCP and env init)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def agree(name: str, fields: Mapping[str, str], what: str, ranks: tuple[int, ...]) -> None:
    """Post this rank's definition of bridge ``name`` (``fields``: field -> canonical
    value) and compare the definitions of every rank of ``ranks`` (the bridge's, this
    rank among them); raise on every one of them if they differ, or if one does not post
    within the timeout. Call on every rank of ``ranks``, before the bridge creates any
    group."""
    if not dist.is_initialized() or len(ranks) == 1:
        return
    try:
        _agree(name, fields, what, ranks)
    except DistError as err:  # the store is gone: its host, rank 0, has exited
        raise MimoFxError(
            f"{what}: rank {dist.get_rank()} lost the store while agreeing on bridge "
            f"{name!r} with ranks {list(ranks)} ({cause(err)}): rank 0, which hosts it, "
            f"has exited (it raised, or its process ended: its own error says why)"
        ) from None


def _agree(name: str, fields: Mapping[str, str], what: str, ranks: tuple[int, ...]) -> None:
    POOL.sync_world()  # (a new world counts its agreements afresh)
    seq = POOL.agreed.get(ranks, 0)
    store = dist.distributed_c10d._get_default_store()
    n, rank = len(ranks), dist.get_rank()
    root = f"{PREFIX}/{','.join(map(str, ranks))}/{seq}"
    rounds = f"{root}/rounds"
    round_ = store.add(rounds, 0)
    base = f"{root}/{round_}"
    keys = [f"{base}/{i}" for i in range(n)]
    mine = json.dumps({"name": repr(name), **fields})
    store.set(keys[ranks.index(rank)], mine)
    state = f"{base}/state"
    if store.add(f"{base}/count", 1) == n:
        state_now = store.compare_set(state, "", "done").decode()
    else:
        state_now = _wait(store, state, rank, name, keys, ranks)
    if state_now != "done":  # given up (by this rank at its deadline, or by a peer)
        # every rank that sees it closed moves the next build to a fresh round (before
        # it raises: a rank that skipped this build, or is late, meets it there)
        store.compare_set(rounds, str(round_), str(round_ + 1))
        _gave_up(store, keys, name, what, ranks)
    records = [json.loads(v) for v in store.multi_get(keys)]
    POOL.agreed[ranks] = seq + 1
    _read(store, base, keys, state, rounds, ranks)
    _judge(records, name, what, ranks)


def _gave_up(store, keys: list[str], name: str, what: str, ranks: tuple[int, ...]) -> NoReturn:
    """Raise the error of an agreement given up: who never posted, or this rank late."""
    rank = dist.get_rank()
    missing = _missing(store, keys, ranks)
    if missing:
        raise MimoFxError(
            f"{what}: {_ranks(missing)} did not build bridge {name!r} within "
            f"{timeout_seconds():g} s ({wait_time()}); rank {rank} and the others "
            f"that did gave up. Every rank of the bridge's grids "
            f"({_ranks(list(ranks))}) builds it, in the same order as its other "
            f"bridges (a rank raised while building it, skipped it, is late or is gone)")
    raise MimoFxError(
        f"{what}: rank {rank} built bridge {name!r} after the other ranks of its "
        f"grids had waited {timeout_seconds():g} s for it and given up "
        f"({wait_time()}). Every rank of the bridge's grids builds it, in the same "
        f"order as its other bridges")


def _judge(records: list[dict], name: str, what: str, ranks: tuple[int, ...]) -> None:
    """Raise if the ranks' definitions differ."""
    differ = _differences(records, ranks)
    if differ:
        renamed = "name" in (f for f, _ in differ)
        which = "a bridge" if renamed else f"bridge {name!r}"
        raise MimoFxError(
            f"{what}: the ranks built {which} differently "
            f"({'; '.join(text for _, text in differ)}), so no process group was "
            f"created and no data moved. Every rank builds every bridge with the same "
            f"layouts, sizes, dtypes and options"
            + ("; and the same name: bridges built in one order on every rank, no rank "
               "skipping one, destroying one the others keep, or letting one be "
               "garbage-collected that another reuses the name of" if renamed else ""))


def _read(store, base: str, keys: list[str], state: str, rounds: str, ranks: tuple[int, ...]
          ) -> None:
    """This rank is through with the records. Their last reader deletes them -- or the
    store's host, once every rank has read them, where it is among the ranks: it may
    raise next, and a script without ``try`` would then exit, taking the store with it
    (a bounded wait: :data:`READ_WAIT`)."""
    read = f"{base}/read"
    done = store.add(read, 1) == len(keys)
    if HOST in ranks:
        if dist.get_rank() != HOST:
            return
        deadline = time.monotonic() + min(timeout_seconds(), READ_WAIT)
        pause = 0.0005
        while not done and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
            done = int(store.add(read, 0)) >= len(keys)
        if not done:
            return  # (a peer never read: its keys stay)
    if done:
        for key in [*keys, f"{base}/count", state, read, rounds]:
            store.delete_key(key)


def _wait(store, state: str, rank: int, name: str, keys: list[str],
          ranks: tuple[int, ...]) -> str:
    """Wait for the agreement's state: ``done``, or closed (by this rank at the deadline,
    atomically: a last rank completing it at that moment wins)."""
    deadline = time.monotonic() + timeout_seconds()
    pause = 0.0005
    with waiting(lambda: f"its peers to build bridge {name!r} (the agreement on its "
                         f"definition; ranks that have not: {_missing(store, keys, ranks)})"):
        while time.monotonic() < deadline:
            if store.check([state]):
                return store.get(state).decode()
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    return store.compare_set(state, "", f"closed by {rank}").decode()


def _missing(store, keys: list[str], ranks: tuple[int, ...]) -> list[int]:
    return [r for r, key in zip(ranks, keys) if not store.check([key])]


def _differences(records: list[dict], ranks: tuple[int, ...]) -> list[tuple[str, str]]:
    """Per field whose value differs by rank: the field and which ranks hold which."""
    out = []
    for field in records[0]:
        holders: dict[str, list[int]] = {}
        for r, rec in zip(ranks, records):
            holders.setdefault(rec.get(field, "(none)"), []).append(r)
        if len(holders) > 1:
            parts = sorted(holders.items(), key=lambda kv: (-len(kv[1]), kv[1]))
            out.append((field, f"{field} differs: " + ", ".join(
                f"{value} on {_ranks(ranks)}" for value, ranks in parts)))
    return out
