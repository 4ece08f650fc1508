"""Process groups for plans, created eagerly in one order on every rank.

``torch.distributed.new_group`` is a collective over the whole world: every rank must
call it for every group, in the same order. Creating groups lazily (inside a pipeline
schedule, or on first use under ``torch.compile``) deadlocks, so :func:`acquire` creates
all groups a bridge needs up front, in plan order, and counts references; :func:`release`
destroys a group when its last user is gone.

A group is named by its ranks and a *tag*: data groups have tag ``""``; every bridge
also has a check group over the union of its grids (tag ``"check"``; created whether or
not the bridge is checked, so ranks that disagree on ``checked=`` still create the same
groups), with the timeout of :mod:`.timeouts` (seconds; environment variable
``MIMO_FX_TIMEOUT``, read when the group is created). A checked call's header gather
runs there, so it can never pair with a data collective.

Two lifecycle rules keep gloo's connection setup safe over many build/destroy cycles:
a destroyed group stays referenced until the next group has been created (dropping the
last reference right after ``destroy_process_group`` can close sockets a peer's next
``new_group`` is still using), and the pool forgets every group when the default
process group it was built in is gone. The last reference is then dropped on a thread
of its own (:class:`_Reaper`): gloo's destructor waits, with the GIL released, for each
of its transport loops to wake from a 10 ms poll, about 20 ms per group, which a bridge's
``destroy`` or the next build would otherwise wait out.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch.distributed as dist

from mimo_fx.errors import MimoFxError
from mimo_fx.grid import mesh_groups

from .comm import forget

__all__ = ["acquire", "release", "group_name", "process_group", "live_groups", "world_token",
           "check_world", "CHECK", "created", "reused", "settle"]

CHECK = "check"  # the tag of check groups

Ranks = tuple[int, ...]


def world_token():
    """The default process group now (compared by identity)."""
    return dist.group.WORLD if dist.is_initialized() else None


def check_world(token, what: str = "this bridge") -> None:
    """Raise if the default process group ``token`` was taken from is gone."""
    if token is None or world_token() is not token:
        raise MimoFxError(
            f"{what} was built in a torch.distributed world that is gone "
            f"(destroy_process_group was called): build a new one after "
            f"init_process_group")


def keep_alive(obj: object, done: Callable[[], bool] = lambda: False) -> None:
    """Keep ``obj`` referenced until ``done()`` (checked whenever something is kept or a
    group is created); forgotten when the world it lives in is destroyed."""
    POOL.in_flight.append((obj, done))
    _purge()


def _purge() -> None:
    held = POOL.in_flight
    done = [d() for _, d in held]
    if any(done):
        gone = [entry for entry, d in zip(held, done) if d]
        held[:] = [entry for entry, d in zip(held, done) if not d]
        # gloo groups handed over with no reference left on this thread (a destructor
        # runs where the last one goes); the rest dropped here
        POOL.reaper.take([o for o in (gone.pop()[0] for _ in range(len(gone)))
                      if isinstance(o, _OffThread)])


class _OffThread:
    """A retired gloo group, to be dropped on the reaper's thread. (NCCL's are dropped
    where they are retired: its communicators are not torn down beside other work.)"""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj


class _Reaper:
    """Drops process groups on a daemon thread of its own (see the module docstring);
    :meth:`settle` waits until it has dropped all it was given (at exit too)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: list = []
        self._busy = 0  # objects being dropped now
        self._thread: threading.Thread | None = None

    def take(self, objs: list) -> None:
        with self._cv:
            self._queue.extend(objs)
            objs.clear()
            if self._thread is None or not self._thread.is_alive():
                if self._thread is None:
                    atexit.register(self.settle, 10.0)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="mimo_fx group reaper")
                self._thread.start()
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                obj = self._queue.pop(0)
                self._busy += 1
            del obj  # the last reference: freed here, off the lock
            with self._cv:
                self._busy -= 1
                self._cv.notify_all()

    def settle(self, timeout: float = 60.0) -> bool:
        """Wait (at most ``timeout`` s) until every object given is dropped."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)


class Pool:
    """The process groups of every bridge, pooled (bridges over the same ranks share
    them), and everything this process holds for them, in one place: the groups by
    ``(tag, ranks)`` with their reference counts, what must outlive its owner
    (:func:`keep_alive`), the reaper, the releases of bridges dropped without
    ``destroy()`` (run by the next lease, :func:`.lease.release_later`) and the count of
    agreements (:mod:`.agree`). All of it belongs to one default process group: a new
    world starts it afresh (:meth:`sync_world`)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, Ranks], list] = {}  # -> [group, references, a mesh's]
        self.world: object = None  # the default group it serves
        self.created = 0  # process groups created so far
        self.reused = 0  # mesh dims' groups taken instead
        self.in_flight: list[tuple[object, Callable[[], bool]]] = []  # (object, done?)
        self.retired_done = True  # set when a group is created: retired groups may go
        self.dropped: list[Callable[[], None]] = []  # releases for the next lease
        self.agreed = 0  # bridges agreed in this world
        self.reaper = _Reaper()

    def sync_world(self) -> None:
        """Start afresh if the default process group is not the one it served (the old
        groups died with the old world)."""
        if self.world is not dist.group.WORLD:
            self.reaper.settle()
            self.groups.clear()
            self.in_flight.clear()
            self.agreed = 0
            self.world = dist.group.WORLD


POOL = Pool()


def settle(timeout: float = 60.0) -> bool:
    """Wait until destroyed groups are freed (their sockets and threads closed); False if
    ``timeout`` s passed first. Resource counts (file descriptors, threads) are steady
    only after it."""
    return POOL.reaper.settle(timeout)


def require_world(what: str) -> int:
    """This process's rank; raises (the one message for it) unless torch.distributed is
    initialised."""
    if not dist.is_initialized():
        raise MimoFxError(f"{what} needs torch.distributed initialised first: call "
                          f"torch.distributed.init_process_group on every rank (for a "
                          f"whole world in one process, pass a dict {{rank: tensor}} to "
                          f"mimo_fx.redistribute: the reference backend)")
    return dist.get_rank()


def _sync_world() -> None:
    require_world("preparing process groups")
    POOL.sync_world()


def created() -> int:
    """How many process groups the pool has created so far (on NCCL each costs
    device memory: a lease reports its own)."""
    return POOL.created


def reused() -> int:
    """How many times the pool took a mesh dim's own group instead of creating one."""
    return POOL.reused


def _timeout(tag: str) -> timedelta:
    # every group mimo_fx creates: a peer that never comes is an error after
    # MIMO_FX_TIMEOUT, not a wait of gloo's (or NCCL's) default 30 min
    from .timeouts import timeout_seconds

    return timedelta(seconds=timeout_seconds())


def _new_group(ranks: Ranks, tag: str, what: str):
    """A new group whose collectives (and setup) time out after ``MIMO_FX_TIMEOUT``; a
    setup a rank of the world never joins is a MimoFxError, not the store's raw error."""
    from .timeouts import cause, wait_time

    try:
        return dist.new_group(list(ranks), timeout=_timeout(tag))
    except RuntimeError as err:  # (gloo: DistStoreError, DistNetworkError)
        raise MimoFxError(
            f"{what}: rank {dist.get_rank()} could not set up the process group of ranks "
            f"{list(ranks)} within {wait_time()} ({cause(err)}); a rank of the world did "
            f"not get there in time: it is gone, raised or skipped a build, or the "
            f"machine is too loaded for that timeout (raise it)") from err


def acquire(groups: Iterable[Ranks], tag: str = "", what: str = "mimo_fx") -> None:
    """Create (or reference) every group; call on every rank with the same list
    (``what`` names the owner in errors)."""
    _sync_world()
    world = dist.get_world_size()
    for ranks in groups:
        if ranks[-1] >= world:
            raise MimoFxError(f"group {ranks} needs rank {ranks[-1]} but the world has "
                              f"{world} ranks; check the grids' sizes and offsets")
        entry = POOL.groups.get((tag, ranks))
        if entry is not None:
            entry[1] += 1
            continue
        mesh = mesh_groups(ranks) if tag != CHECK and "p2p" not in tag else None
        if mesh is not None:  # a mesh dim's own group: used, never created nor destroyed
            pg = mesh[0].get_group(mesh[1]) if dist.get_rank() in ranks else None
            POOL.reused += 1
        elif len(ranks) == world and not tag:
            pg = dist.group.WORLD
        else:
            pg = _new_group(ranks, tag, what)
            POOL.created += 1
            POOL.retired_done = True  # the retired groups' peers are through connecting
        POOL.groups[tag, ranks] = [pg, 1, mesh is not None]


def release(groups: Iterable[Ranks], tag: str = "", abandon: bool = False) -> None:
    """Drop one reference to each group; destroy groups nobody uses any more. With
    ``abandon`` (a group with sends its peers will never take: destroying it would wait
    for them) the group is forgotten but kept alive instead."""
    for ranks in groups:
        entry = POOL.groups.get((tag, ranks))
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] == 0:
            pg, _, reused = POOL.groups.pop((tag, ranks))
            if reused:
                continue  # the mesh's: it lives as long as the mesh
            if abandon:
                keep_alive(pg)  # never destroyed: a peer may still take its messages
            elif pg is not dist.group.WORLD and POOL.world is world_token() is not None:
                gloo = False
                if isinstance(pg, dist.ProcessGroup):  # not on non-members
                    gloo = dist.get_backend(pg) == "gloo"
                    forget(pg.group_name)
                    dist.destroy_process_group(pg)
                # referenced until the next group is created (see the module docstring)
                POOL.retired_done = False
                keep_alive(_OffThread(pg) if gloo else pg, lambda: POOL.retired_done)


def group_name(ranks: Ranks, tag: str = "") -> str:
    """The registered name of a prepared group this rank belongs to (a constant under
    ``torch.compile``)."""
    entry = POOL.groups.get((tag, ranks))
    if entry is None:
        raise MimoFxError(
            f"process group {ranks} is not prepared. Groups must be created eagerly on every "
            f"rank, in the same order, before the first call and before torch.compile: call "
            f"mimo_fx.compiled.prepare(src, dst, sizes, dtype) (or build a Redistributor) on "
            f"every rank first"
        )
    return entry[0].group_name


def process_group(ranks: Ranks, tag: str = ""):
    """The prepared group itself (for point-to-point calls, which take a group object)."""
    group_name(ranks, tag)  # the error if it is not prepared
    return POOL.groups[tag, ranks][0]


def live_groups() -> int:
    """How many groups the pool holds (for leak checks)."""
    return len(POOL.groups)
