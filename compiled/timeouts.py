"""How long a bridge waits for its peers, and what a failed wait says.

Every collective a bridge issues runs on a process group created with the timeout
:func:`timeout_seconds` (environment variable ``MIMO_FX_TIMEOUT``, seconds; 300 by
default, well under gloo's and NCCL's 30 minutes), read when the group is created. A
rank whose peer never comes -- it skipped a call or its backward, or left -- gets an
error after that long instead of waiting forever.

>>> import os; os.environ.pop("MIMO_FX_TIMEOUT", None) is None or True
True
>>> timeout_seconds()
300.0
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mimo_fx.errors import MimoFxError

from .live import find

__all__ = ["timeout_seconds", "wait_time", "cause", "ENV", "DEFAULT", "Site", "SITES",
           "site", "at", "ran",
           "failed", "calls", "waiting", "NOTICE_ENV"]

ENV = "MIMO_FX_TIMEOUT"
LEGACY = "MIMO_FX_CHECK_TIMEOUT"  # the name of the check groups' timeout before it
DEFAULT = 300.0
# process groups count their timeout in whole milliseconds: a shorter one is no wait at
# all (gloo reports "after 0ms")
SHORTEST = 0.001
# ``inf`` (or any longer wait) means no limit: the longest wait a group is given, about
# 3 years (gloo adds its timeout, in nanoseconds, to the clock's now: 1e10 s overflows
# int64 and every receive times out at once)
LONGEST = 1e8


def timeout_seconds() -> float:
    """Seconds a bridge's collective waits for its peers (``MIMO_FX_TIMEOUT``): a
    positive number, at least 0.001 (a millisecond); ``inf`` (or more than 1e8) is
    no limit, a wait of 1e8 s (3 years).

    >>> os.environ["MIMO_FX_TIMEOUT"] = "inf"; timeout_seconds()
    100000000.0
    >>> os.environ["MIMO_FX_TIMEOUT"] = "1e-9"; timeout_seconds()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    mimo_fx.errors.MimoFxError: MIMO_FX_TIMEOUT='1e-9' is shorter than a millisecond, ...
    >>> del os.environ["MIMO_FX_TIMEOUT"]
    """
    name = ENV if ENV in os.environ else LEGACY if LEGACY in os.environ else None
    text = os.environ.get(name, str(DEFAULT)) if name else str(DEFAULT)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:  # (nan included)
        raise MimoFxError(f"{name}={text!r} must be a positive number of seconds (or "
                          f"'inf' for no limit); unset it for the default {DEFAULT:g}")
    if seconds < SHORTEST:
        raise MimoFxError(f"{name}={text!r} is shorter than a millisecond, the shortest "
                          f"wait a process group counts (it would time out at once); set "
                          f"it to a number of seconds of at least {SHORTEST:g}, or 'inf' "
                          f"for no limit")
    return min(seconds, LONGEST)


def wait_time() -> str:
    """The timeout, as a message states it."""
    seconds = timeout_seconds()
    return f"{ENV}={seconds:g} s" + (" (no limit)" if seconds >= LONGEST else "")


def cause(err: BaseException) -> str:
    """A runtime error in one line (gloo and NCCL errors run to many)."""
    return f"{err.__class__.__name__}: {str(err).splitlines()[0][:200]}"


# -- where a collective was issued: a bridge, a direction, an op of its program ------------
# A collective's custom op carries its site as one string (an op's schema takes no
# objects), which is never read back: :func:`at` records what each site names, a
# :class:`Site`, under its text in :data:`SITES` when the text is made (eagerly, or once
# while tracing: Dynamo runs :func:`at` then and keeps the text as a constant). The
# bridge a site names (found by name in the one registry, :mod:`.live`) keeps what
# errors call it (``described``), whether this rank holds no dst piece of it
# (``source_only``: its backward runs in ``mimo_fx.backward()``) and how many times each
# of its sites' collectives completed (``ran``).


class Site(NamedTuple):
    """What a site names: op number ``op`` of bridge ``bridge``'s ``direction`` program,
    run over ``ranks`` (as text)."""

    bridge: str
    direction: str
    op: int
    ranks: str


SITES: dict[str, Site] = {}  # every site text this process made -> what it names
SITES_KEPT = 1 << 16  # (the oldest go first beyond this many: a text names its bridge's
#                        op for as long as the bridge lives, and bridges come and go)


def site(name: str, direction: str, index: int, ranks: tuple[int, ...]) -> str:
    """The site of op ``index`` of bridge ``name``'s ``direction`` program over ``ranks``, a str."""
    return at(name, direction, index, ",".join(map(str, ranks)))


@torch.compiler.assume_constant_result
def at(name: str, direction: str, index: int, ranks_text: str) -> str:
    """:func:`site` with its ranks as text (a traced call's: no join for Dynamo to trace;
    Dynamo runs it while tracing and keeps its text)."""
    text = f"{name}|{direction}|{index}|{ranks_text}"
    if text not in SITES:
        if len(SITES) >= SITES_KEPT:
            del SITES[next(iter(SITES))]
        SITES[text] = Site(name, direction, index, ranks_text)
    return text


def _named(site_: str) -> tuple[Site | None, Any]:
    """What ``site_`` names, and its bridge (None for either where unknown)."""
    where = SITES.get(site_) if site_ else None
    return where, (None if where is None else find(where.bridge))


def ran(site_: str) -> None:
    """A collective of ``site_`` completed (counted where it runs, eager or compiled, on
    its bridge)."""
    where, bridge = _named(site_)
    if bridge is not None:
        bridge.ran[where] += 1


def calls(name: str, direction: str) -> int:
    """How many ``direction`` calls of live bridge ``name`` this rank completed (those
    whose program issues a collective)."""
    bridge = find(name)
    if bridge is None:
        return 0
    return sum(n for where, n in bridge.ran.items()
               if where.direction == direction and where.op == 0)


def failed(site_: str, kind, err: BaseException, peer: int | None = None) -> MimoFxError:
    """The error for a collective of ``site_`` whose wait failed: which bridge,
    direction, call and group, the likely cause, and what this rank has run; ``peer``:
    the (global) rank at the other end of the failed message, where known."""
    if peer is None:  # (a message whose posting failed names its peer: comm._posted)
        peer = getattr(err, "peer", None)
    gone = any(m in str(err) for m in ("closed by peer", "reset by peer", "Broken pipe",
                                       "Connection closed"))
    where, bridge = _named(site_)
    if where is None:
        return MimoFxError(f"a mimo_fx {kind} failed" + (
            "" if peer is None else f" (rank {peer} left)" if gone else
            f" waiting for rank {peer}") + f" ({cause(err)})")
    name, direction, ranks = where.bridge, where.direction, where.ranks
    n = (0 if bridge is None else bridge.ran[where]) + 1
    why = ("a rank of the group left" + ("" if peer is None else f": rank {peer}") +
           " (it raised, or its process ended: its own error says why)" if gone else
           "a rank skipped this call or the backward of an earlier one, or called another "
           "bridge first, or left; or a rank called it under torch.no_grad() while the "
           "others ran it under autograd (that rank runs no backward)" +
           ("" if peer is None else f"; this rank waited for rank {peer}'s message"))
    forward, backward = calls(name, "forward"), calls(name, "backward")
    # (this rank's own state: its peer gone or not)
    if bridge is not None and bridge.source_only and forward > backward:
        why += (f"; this rank holds no dst piece and ran {forward} forward but {backward} "
                f"backward calls: its backward runs in mimo_fx.backward() (inside a "
                f"torch.func transform: return mimo_fx.joined(loss)), which it may have "
                f"skipped")
    described = name if bridge is None else bridge.described
    return MimoFxError(
        f"{described}: the {direction} of call {n} failed in {kind} over "
        f"ranks ({ranks}) ({cause(err)}). Likely cause: {why}. This rank has completed "
        f"{forward} forward and {backward} backward calls of "
        f"this bridge; every rank of both grids runs every call and its backward "
        f"({wait_time()})")


# -- a wait that lasts: said once, long before the timeout ---------------------------------
# A rank that waits for its peers more than a few seconds says once, on the "mimo_fx"
# logger (a warning: one line on stderr without a handler, as under torchrun), what it
# waits for: the bridge, the call and the ranks. One daemon thread looks at the wait
# under way every second; a wait only sets and clears a slot (no thread per wait).
NOTICE_ENV = "MIMO_FX_WAIT_NOTICE"  # seconds before a wait is said (default 5)
LOG = logging.getLogger("mimo_fx")


class _Watch:
    """The wait under way on this process's main path (at most one at a time: waits do
    not nest), and the thread that says it once it has lasted."""

    def __init__(self) -> None:
        self.slot: tuple[int, float, Callable[[], str]] | None = None
        self.count = 0
        self.said = -1
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="mimo_fx wait notice")
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(1.0)
            slot = self.slot
            if slot is None or slot[0] == self.said:
                continue
            number, since, describe = slot
            waited = time.monotonic() - since
            if waited >= notice_seconds():
                self.said = number
                try:
                    what = describe()
                except Exception:  # noqa: BLE001 (a description is best effort)
                    what = "its peers"
                LOG.warning("mimo_fx: rank %s has waited %.0f s for %s; it gives up after %s",
                            _rank(), waited, what, wait_time())


WATCH = _Watch()


def notice_seconds() -> float:
    """After how long a wait is said (``MIMO_FX_WAIT_NOTICE``, default 5 s, at most half
    the timeout)."""
    try:
        seconds = float(os.environ.get(NOTICE_ENV, "5"))
    except ValueError:
        seconds = 5.0
    return min(seconds, timeout_seconds() / 2)


def _rank() -> str:
    import torch.distributed as dist

    return str(dist.get_rank()) if dist.is_initialized() else "?"


class waiting:
    """``with waiting(describe):`` marks a wait for peers, said once if it lasts
    (``describe()``: what for, called only then, on the watching thread). A class, not
    a generator: it is on every collective's path."""

    __slots__ = ("describe", "outer")

    def __init__(self, describe: Callable[[], str]) -> None:
        self.describe = describe

    def __enter__(self) -> None:
        if WATCH.thread is None:
            WATCH.start()
        WATCH.count += 1
        self.outer, WATCH.slot = WATCH.slot, (WATCH.count, time.monotonic(), self.describe)

    def __exit__(self, *exc) -> None:
        WATCH.slot = self.outer


def described(site_: str, kind, peers: Callable[[], list[int]] | None = None) -> str:
    """What a collective of ``site_`` waits for, as the notice says it."""
    who = ""
    if peers is not None:
        pending = peers()
        if pending:
            who = f" rank {pending[0]}" if len(pending) == 1 else f" ranks {pending}"
    where, bridge = _named(site_)
    if where is None:
        return f"a mimo_fx {getattr(kind, 'value', kind)}" + (f" ({who.strip()})" if who else "")
    n = (0 if bridge is None else bridge.ran[where]) + 1
    what = where.bridge if bridge is None else bridge.described
    return (f"{who.strip() or 'its peers'} in the {where.direction} of call {n} of {what} "
            f"({getattr(kind, 'value', kind)} over ranks {where.ranks})")
