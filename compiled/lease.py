"""The lease: the process groups something runs on, for as long as it lives.

Every user of process groups -- a bridge, a pipelined bridge's channels, gradient sums --
holds a :class:`Lease`: it creates (or references) every group eagerly on construction,
in one order on every rank of them (see :mod:`.groups`: lazily created groups deadlock), checks
before each use that it is still alive and that its ``torch.distributed`` world is the
one it was built in, and releases the groups once. :func:`keep_alive` is the one place
that keeps in-flight work (a send its receiver has not taken, a destroyed group a peer
may still be connecting through) referenced until it is through: dropping it early can
cancel a message under the peer.

>>> # on ranks 0-3: lease = Lease("my bridge", [(0, 1), (0, 1, 2, 3)])
>>> # lease.comm().all_gather(x, (0, 1)); lease.release()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mimo_fx.errors import MimoFxError

from . import groups
from .comm import FunctionalComm
from .groups import _purge, keep_alive, require_world

__all__ = ["Lease", "require_world", "keep_alive", "release_later", "release_dropped"]

Ranks = tuple[int, ...]

def release_later(release: Callable[[], None]) -> None:
    """Run a dropped owner's ``release`` at the next lease's build, not inside the collector."""
    groups.POOL.dropped.append(release)


def release_dropped() -> None:
    """Release what dropped owners held (safe points only: not from a finalizer)."""
    dropped = groups.POOL.dropped
    while dropped:
        dropped.pop(0)()


class Lease:
    """Process groups held by ``what`` (named in errors): ``data`` groups (tag ``""``,
    shared with every other lease of the same ranks) and groups of a ``tag`` of its own
    (e.g. check groups, channels), whose data moves on ``device`` (default: the world's,
    :func:`.groups.data_device`). Build it on every rank of its groups, in the same
    order; a rank holds the groups it is a member of."""

    def __init__(self, what: str, data: Sequence[Ranks] = (),
                 tagged: Sequence[tuple[str, Ranks]] = (), device=None,
                 meshes: tuple = ()) -> None:
        self.what = what
        self.rank = require_world(what)
        release_dropped()
        self.data = tuple(dict.fromkeys(data))
        self.tagged = tuple(dict.fromkeys(tagged))
        before = groups.created(), groups.reused()
        groups.acquire(self.data, what=what, device=device, meshes=meshes)
        for tag, ranks in self.tagged:
            groups.acquire([ranks], tag, what, device, meshes)
        self.created = groups.created() - before[0]  # process groups this lease made
        self.reused = groups.reused() - before[1]    # mesh dims' groups it took instead
        self.world = groups.world_token()
        self.live = True
        _purge()

    def check(self) -> None:
        """Raise if the lease was released or its world is gone."""
        if not self.live:
            raise MimoFxError(f"{self.what} was destroyed; build a new one")
        groups.check_world(self.world, self.what)

    def comm(self, tag: str | None = None) -> FunctionalComm:
        """Collectives over this rank's groups: the data groups, or those of ``tag``."""
        if tag is None:
            mine = [g for g in self.data if self.rank in g]
            return FunctionalComm({g: groups.group_name(g) for g in mine})
        mine = [g for t, g in self.tagged if t == tag and self.rank in g]
        return FunctionalComm({g: groups.group_name(g, tag) for g in mine})

    def process_group(self, ranks: Ranks, tag: str = ""):
        """A held group itself (point-to-point calls take a group object)."""
        return groups.process_group(ranks, tag)

    def release(self, abandon: bool = False) -> None:
        """Release every group (once). ``abandon``: groups with messages a peer will never
        take are kept alive instead of destroyed (destroying them would wait for it)."""
        if self.live:
            self.live = False
            groups.release(self.data)
            for tag, ranks in self.tagged:
                groups.release([ranks], tag, abandon=abandon)
