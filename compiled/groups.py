"""Process groups for plans, created eagerly by their members, in one order.

A bridge's groups are created when it is built, by the ranks of its grids only (ranks
outside them build nothing): :func:`acquire` creates every group a bridge needs up front,
in plan order, each by its members alone, and counts references; :func:`release`
destroys a group when its last user is gone. Creating groups lazily (inside a pipeline
schedule, or on first use under ``torch.compile``) deadlocks.

*Members only, under a name they agree on.* ``torch.distributed.new_group`` names a
group by a counter every rank of the world advances, so every rank must call it for
every group; its members-only variant names it by how many groups the process already
has, which differs between ranks that built other bridges. A group here is named by
what defines it -- its tag, its ranks and how many times its members made it before --
so its members meet under one name whatever else each of them built
(:func:`_create`). With ``init_process_group(device_id=...)`` torch would split a new
NCCL group from the world's communicator, a collective of the whole world; a bridge's
group is made by its members instead (NCCL's own initialisation, joined by every member
at once, below).

*Every member at a group's first operation.* NCCL creates a group's communicator at its
first operation, with every member taking part, and torch's ``batch_isend_irecv``
requires the same of a group's first call; a rank with nothing to send could otherwise
skip it. So every group a bridge uses, created or taken from a mesh, runs one small
all-reduce of all its members on the data's device when the bridge is built, when every
member is there (:func:`_join`); gloo does the same, so CPU runs prove it.

A group is named by its ranks and a *tag*: data groups have tag ``""``; every bridge
also has a check group over the union of its grids (tag ``"check"``; created whether or
not the bridge is checked, so ranks that disagree on ``checked=`` still create the same
groups), with the timeout of :mod:`.timeouts` (seconds; environment variable
``MIMO_FX_TIMEOUT``, read when the group is created). A checked call's header gather
runs there, so it can never pair with a data collective.

Two lifecycle rules keep gloo's connection setup safe over many build/destroy cycles:
a destroyed group stays referenced until the next group has been created (dropping the
last reference right after ``destroy_process_group`` can close sockets a peer's next
setup is still using), and the pool forgets every group when the default
process group it was built in is gone. The last reference is then dropped on a thread
of its own (:class:`_Reaper`): gloo's destructor waits, with the GIL released, for each
of its transport loops to wake from a 10 ms poll, about 20 ms per group, which a bridge's
``destroy`` or the next build would otherwise wait out.
"""

from __future__ import annotations

import atexit
import hashlib
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from mimo_fx.collective import Collective
from mimo_fx.errors import MimoFxError
from mimo_fx.grid import mesh_groups

from .comm import forget, forget_world, note
from .timeouts import waiting

__all__ = ["acquire", "release", "group_name", "process_group", "live_groups", "world_token",
           "check_world", "CHECK", "created", "reused", "settle", "data_device"]

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
    """A retired gloo group, to be dropped on the reaper's thread. (A group with a CUDA
    backend of its own, NCCL's, is dropped where it is retired: its communicators are
    not torn down beside other work.)"""

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
        self.agreed: dict[Ranks, int] = {}  # agreements completed, per set of ranks
        self.made: dict[tuple[str, Ranks], int] = {}  # groups created, per tag and ranks
        self.reaper = _Reaper()

    def sync_world(self) -> None:
        """Start afresh if the default process group is not the one it served (the old
        groups died with the old world)."""
        if self.world is not dist.group.WORLD:
            self.reaper.settle()
            self.groups.clear()
            self.in_flight.clear()
            self.agreed.clear()
            self.made.clear()
            forget_world()
            self.world = dist.group.WORLD


POOL = Pool()


def settle(timeout: float = 60.0) -> bool:
    """Wait until destroyed groups are freed (resource counts steady after); False on timeout."""
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
    """How many process groups the pool has created (on NCCL each costs device memory)."""
    return POOL.created


def reused() -> int:
    """How many times the pool took a mesh dim's own group instead of creating one."""
    return POOL.reused


def _timeout(tag: str) -> timedelta:
    # every group mimo_fx creates: a peer that never comes is an error after
    # MIMO_FX_TIMEOUT, not a wait of gloo's (or NCCL's) default 30 min
    from .timeouts import timeout_seconds

    return timedelta(seconds=timeout_seconds())


def data_device() -> torch.device:
    """Where data moves when a bridge is given no device: the current CUDA device where
    the world serves CUDA tensors with a backend of their own (NCCL, alone or as in
    ``"cpu:gloo,cuda:nccl"``), else the CPU (gloo serves CPU and CUDA tensors with one
    backend, a CPU one). Asked of the default process group, never read from a name."""
    if not dist.is_initialized() or not torch.cuda.is_available():
        return torch.device("cpu")
    if _own_backend(dist.group.WORLD, "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _own_backend(pg, device_type: str) -> bool:
    """Whether ``pg`` serves ``device_type`` tensors with a backend that serves no
    other device type it has (NCCL for CUDA; not gloo, which serves CPU and CUDA)."""
    try:
        mine = pg._get_backend(torch.device(device_type))
    except RuntimeError:
        return False
    for other in pg._device_types:
        if other.type != device_type:
            try:
                if pg._get_backend(other) is mine:
                    return False
            except RuntimeError:
                continue
    return True


def _name(tag: str, ranks: Ranks) -> str:
    """The name a group's members give it: a function of its tag, its ranks and how many
    times this process made that group before (its members make and destroy it
    together), so they agree on it whatever other groups each of them has."""
    made = POOL.made.get((tag, ranks), 0)
    POOL.made[tag, ranks] = made + 1
    text = f"{tag}|{','.join(map(str, ranks))}|{made}"
    return "mimo_fx_" + hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:20]


def _create(ranks: Ranks, tag: str, what: str):
    """A new group of ``ranks``, created by its members alone (see the module docstring),
    whose collectives (and setup) time out after ``MIMO_FX_TIMEOUT``; a setup a member
    never joins is a MimoFxError, not the store's raw error."""
    from torch.distributed import distributed_c10d as c10d

    from .timeouts import cause, wait_time

    world = c10d._get_default_group()
    rank = dist.get_rank()
    bound = world.bound_device_id
    try:
        # not split from the world's communicator (a collective of every rank): the
        # members create it, and join its first operation (_join)
        world.bound_device_id = None
        with waiting(lambda: f"the members of process group {list(ranks)} to set it up "
                             f"({what})"):
            pg, _ = c10d._new_process_group_helper(
                len(ranks), ranks.index(rank), list(ranks), c10d.get_backend(world),
                c10d._get_default_store(), _name(tag, ranks),  # type: ignore[arg-type]
                timeout=_timeout(tag),
                group_desc=f"mimo_fx {tag or 'data'} group")
    except RuntimeError as err:  # (gloo: DistStoreError, DistNetworkError)
        raise MimoFxError(
            f"{what}: rank {rank} could not set up the process group of ranks "
            f"{list(ranks)} within {wait_time()} ({cause(err)}); a member of it did "
            f"not get there in time: it is gone, raised or skipped a build, or the "
            f"machine is too loaded for that timeout (raise it)") from err
    finally:
        world.bound_device_id = bound
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


def _join(pg, ranks: Ranks, what: str, device: torch.device) -> None:
    """Every member at the group's first operation: one all-reduce of one element on
    the data's device (NCCL creates the group's communicator there, with every member;
    see the module docstring)."""
    from .timeouts import cause, wait_time

    try:
        with waiting(lambda: f"the members of process group {list(ranks)} at its first "
                             f"operation ({what})"):
            dist.all_reduce(torch.zeros(1, device=device), group=pg)
        note("wait", note("coll", pg.group_name, Collective.ALL_REDUCE.value, 1))
    except RuntimeError as err:
        raise MimoFxError(
            f"{what}: rank {dist.get_rank()} waited in vain for the members of process "
            f"group {list(ranks)} at its first operation ({wait_time()}; "
            f"{cause(err)}); a member of it is gone, raised or skipped a build") from err


def acquire(groups: Iterable[Ranks], tag: str = "", what: str = "mimo_fx",
            device: torch.device | None = None, meshes: tuple = ()) -> None:
    """Create (or reference) every group this rank is a member of; call on every rank of
    the owner (a bridge: the ranks of its grids) with the same list (``what`` names the
    owner in errors; ``device``: where the groups' data moves, default
    :func:`data_device`; ``meshes``: the DeviceMeshes its grids came from, whose dims'
    groups it takes where they match)."""
    _sync_world()
    world, rank = dist.get_world_size(), dist.get_rank()
    for ranks in groups:
        if ranks[-1] >= world:
            raise MimoFxError(f"group {ranks} needs rank {ranks[-1]} but the world has "
                              f"{world} ranks; check the grids' sizes and offsets")
        if rank not in ranks:
            continue
        entry = POOL.groups.get((tag, ranks))
        if entry is not None:
            entry[1] += 1
            continue
        mesh = mesh_groups(ranks, meshes) if tag != CHECK and "p2p" not in tag else None
        if mesh is not None:  # a mesh dim's own group: used, never created nor destroyed
            pg = mesh[0].get_group(mesh[1])
            POOL.reused += 1
        elif len(ranks) == world and not tag:
            pg = dist.group.WORLD
        else:
            pg = _create(ranks, tag, what)
            POOL.created += 1
            POOL.retired_done = True  # the retired groups' peers are through connecting
        POOL.groups[tag, ranks] = [pg, 1, mesh is not None]
        note("group", pg.group_name, ranks)
        _join(pg, ranks, what, device or data_device())


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
                note("abandon", pg.group_name)
            elif pg is not dist.group.WORLD and POOL.world is world_token() is not None:
                off_thread = not _own_backend(pg, "cuda")  # (gloo's: see _OffThread)
                forget(pg.group_name)
                dist.destroy_process_group(pg)
                # referenced until the next group is created (see the module docstring)
                POOL.retired_done = False
                keep_alive(_OffThread(pg) if off_thread else pg, lambda: POOL.retired_done)


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
