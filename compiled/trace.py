"""Which collectives this process ran, read back from torch's Flight Recorder.

Flight Recorder keeps, per process, a ring buffer of the collectives its process groups
ran -- gloo and NCCL alike, whether an eager call, an aot_eager graph or inductor's
generated code issued them. It is on when the environment has ``TORCH_FR_BUFFER_SIZE``
(entries kept) before ``init_process_group``; :func:`mimo_fx.testing.run_world` sets it
with ``record=True``. Comparing the records of every rank is how the tests check the
invariant that every rank of a bridge issues the same collectives in the same order.

A collective mimo_fx runs as point-to-point messages (an all-to-all; an all-gather on
gloo, see :mod:`.comm`) is not a process group's collective, and Flight Recorder does not
see gloo's messages: each such op journals itself instead (``comm.MESSAGES.journal``), once
per call on every member -- also a member with nothing to send or receive -- with the
messages it posted. :func:`since` returns both kinds of record in the order they ran
(and leaves out Flight Recorder's own point-to-point records, which NCCL keeps).

>>> # on every rank, with TORCH_FR_BUFFER_SIZE=20000 set before init_process_group:
>>> # start = mark(); bridge(x).sum().backward(); calls = since(start)
>>> # [str(c.kind) for c in calls]   ->  ['all_to_all', 'all_to_all']
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from mimo_fx.errors import MimoFxError
from mimo_fx.plan import Collective

from .comm import JOURNAL_KEPT, MESSAGES, OPS, RECORD_ENV, recording

__all__ = ["ENV", "Call", "Mark", "enabled", "mark", "since"]

ENV = RECORD_ENV


@dataclass(frozen=True)
class Call:
    """One collective as the process group ran it."""

    record: int                   # Flight Recorder's id, increasing (-1: journaled)
    kind: Collective | str        # a Collective, or torch's name for anything else
    ranks: tuple[int, ...]        # the group's global ranks
    numel_in: int
    numel_out: int
    # a journaled op's messages: (peer's global rank, elements), sent and received
    sent: tuple[tuple[int, int], ...] = ()
    received: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Mark:
    """Where the records stood (:func:`mark`): Flight Recorder's newest id, and the
    journal's length."""

    record: int
    journaled: int


def enabled() -> bool:
    return recording()


def _entries() -> list[dict]:
    if not enabled():
        raise MimoFxError(f"Flight Recorder is off: set {ENV}=20000 in the environment before "
                          f"torch.distributed.init_process_group (run_world(..., record=True) "
                          f"does)")
    import torch

    dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined]
    return pickle.loads(dump()).get("entries", [])


def mark() -> Mark:
    """Where the records stand now: pass it to :func:`since`."""
    entries = _entries()
    return Mark(entries[-1]["record_id"] if entries else -1, MESSAGES.journaled)


def _group_ranks() -> dict[str, tuple[int, ...]]:
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    return {name: tuple(dist.get_process_group_ranks(pg)) for pg, name in world.pg_names.items()}


def _kind(name: str) -> Collective | str:
    """The collective a record names (itself, or per :data:`.comm.OPS`), else torch's name (a
    send, a barrier); gloo records a reduce-scatter as the all-reduce it emulates it with."""
    kind = name.split(":", 1)[-1]
    return next((k for k, op in OPS.items() if kind == k.value or kind in op.recorded), kind)


def since(mark_: Mark) -> list[Call]:
    """The collectives recorded after :func:`mark` returned ``mark_``, oldest first."""
    entries = _entries()
    start = mark_.record
    fresh = [e for e in entries if e["record_id"] > start and not e.get("is_p2p")]
    if fresh and entries[0]["record_id"] > start + 1:
        raise MimoFxError(f"Flight Recorder dropped records after {start} (its ring buffer "
                          f"holds {len(entries)}): raise {ENV}")
    groups = _group_ranks()
    out = []
    for e in fresh:
        name = e["process_group"][0]
        numel = [1 if not s else _prod(s) for s in (e["input_sizes"] or [[0]])]
        numel_out = [1 if not s else _prod(s) for s in (e["output_sizes"] or [[0]])]
        out.append((e["time_created_ns"], Call(e["record_id"], _kind(e["profiling_name"]),
                                               groups.get(name, ()), sum(numel),
                                               sum(numel_out))))
    journal = MESSAGES.journal
    first = MESSAGES.journaled - len(journal)  # the number of the oldest record kept
    if mark_.journaled < first:
        raise MimoFxError(f"the message journal dropped records after the mark (it keeps "
                          f"{JOURNAL_KEPT}): read since() sooner")
    out += [(t, Call(-1, *rest)) for t, *rest in list(journal)[mark_.journaled - first:]]
    return [call for _, call in sorted(out, key=lambda tc: tc[0])]


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
