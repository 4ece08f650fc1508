"""Every rank agrees on a bridge's definition before its process groups are created.

Building a bridge creates process groups, a collective over the whole world (see
:mod:`.groups`), and what goes on the wire follows from the bridge's definition: its
layouts, sizes, dtypes, options and name. Ranks that build one bridge differently
create other groups (gloo's setup fails with a raw store error), or the same groups and
then move other bytes (an abort, or wrong data with no error). So before any group is
created every rank posts its definition -- a few short strings -- to the default
process group's store and reads every other rank's: one agreement per build, none per
call. A difference is a :class:`MimoFxError` on every rank, naming the field, the
values and which ranks hold which; a rank that never posts is named after
``MIMO_FX_TIMEOUT`` seconds (see :mod:`.timeouts`), and its peers withdraw, so the
world can go on building bridges.

Agreements are keyed by their place in this rank's sequence of builds (ranks build
bridges in one order) and a round, bumped when an agreement is given up: a rank that
skipped a build meets its peers at the next one. Only an agreement every rank completed
advances the sequence.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

import torch.distributed as dist

from mimo_fx.errors import MimoFxError

from .groups import POOL
from .timeouts import timeout_seconds, wait_time

__all__ = ["agree", "PREFIX"]

PREFIX = "mimo_fx/agree"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def agree(name: str, fields: Mapping[str, str], what: str) -> None:
    """Post this rank's definition of bridge ``name`` (``fields``: field -> canonical
    value) and compare every rank's; raise on every rank if they differ, or if a rank
    does not post within the timeout. Call on every rank of the world, before the
    bridge creates any group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    POOL.sync_world()  # (a new world counts its agreements afresh)
    seq = POOL.agreed
    store = dist.distributed_c10d._get_default_store()
    n, rank = dist.get_world_size(), dist.get_rank()
    rounds = f"{PREFIX}/{seq}/rounds"
    round_ = store.add(rounds, 0)
    base = f"{PREFIX}/{seq}/{round_}"
    mine = json.dumps({"name": repr(name), **fields})
    store.set(f"{base}/{rank}", mine)
    state = f"{base}/state"
    if store.add(f"{base}/count", 1) == n:
        state_now = store.compare_set(state, "", "done").decode()
    else:
        state_now = _wait(store, state, rank)
    if state_now != "done":  # given up (by this rank at its deadline, or by a peer)
        # every rank that sees it closed moves the next build to a fresh round (before
        # it raises: a rank that skipped this build, or is late, meets it there)
        store.compare_set(rounds, str(round_), str(round_ + 1))
        missing = [r for r in range(n) if not store.check([f"{base}/{r}"])]
        if missing:
            raise MimoFxError(
                f"{what}: {_ranks(missing)} did not build bridge {name!r} within "
                f"{timeout_seconds():g} s ({wait_time()}); rank {rank} and the others "
                f"that did gave up. Every rank of the world builds every bridge, in the "
                f"same order (a rank raised while building it, skipped it, is late or "
                f"is gone)")
        raise MimoFxError(
            f"{what}: rank {rank} built bridge {name!r} after the other ranks had waited "
            f"{timeout_seconds():g} s for it and given up ({wait_time()}). Every rank of "
            f"the world builds every bridge, in the same order")
    records = [json.loads(v) for v in store.multi_get([f"{base}/{r}" for r in range(n)])]
    POOL.agreed = seq + 1
    if store.add(f"{base}/read", 1) == n:  # every rank has read: the records can go
        for key in [f"{base}/{r}" for r in range(n)] + [f"{base}/count", state,
                                                       f"{base}/read", rounds]:
            store.delete_key(key)
    differ = _differences(records)
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


def _wait(store, state: str, rank: int) -> str:
    """Wait for the agreement's state: ``done``, or closed (by this rank at the deadline,
    atomically: a last rank completing it at that moment wins)."""
    deadline = time.monotonic() + timeout_seconds()
    pause = 0.0005
    while time.monotonic() < deadline:
        if store.check([state]):
            return store.get(state).decode()
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return store.compare_set(state, "", f"closed by {rank}").decode()


def _differences(records: list[dict]) -> list[tuple[str, str]]:
    """Per field whose value differs by rank: the field and which ranks hold which."""
    out = []
    for field in records[0]:
        holders: dict[str, list[int]] = {}
        for r, rec in enumerate(records):
            holders.setdefault(rec.get(field, "(none)"), []).append(r)
        if len(holders) > 1:
            parts = sorted(holders.items(), key=lambda kv: (-len(kv[1]), kv[1]))
            out.append((field, f"{field} differs: " + ", ".join(
                f"{value} on {_ranks(ranks)}" for value, ranks in parts)))
    return out
