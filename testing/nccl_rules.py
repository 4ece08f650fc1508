"""NCCL's rules, checked on a gloo run: replay every rank's record with NCCL's semantics.

gloo lets a send complete before its receive is posted, accepts ranks that skip a group's
first operation and pairs messages by tag; NCCL does none of that, so a CPU run can pass
where a GPU run hangs. With ``MIMO_FX_NCCL_RULES=1`` every process of a world keeps a
record of what mimo_fx's transport did (:data:`mimo_fx.compiled.comm.MESSAGES` ``.rules``,
written by :func:`~mimo_fx.compiled.comm.note`): the groups it uses, each grouped
point-to-point call (its sends and receives: peer, elements, dtype), each collective, and
each wait. :func:`replay` runs every rank's record together as NCCL would:

- each process group is a communicator with one stream per rank: a rank's operations on
  it run one after another, in posting order;
- an operation posted after the rank waited for another starts only once that one is
  complete (the wait makes the rank's stream wait, and a later operation's stream syncs
  with it), on whichever group;
- a grouped point-to-point call runs as one unit: its sends and receives progress
  together, and it is complete when every one has met its partner; a send meets the
  receive its peer posted in the same order on the same group (tags play no part), and
  the two must agree on elements and dtype;
- a collective runs when every member's current operation on the group is that
  collective, of one kind and size;
- every member takes part in a group's first operation (NCCL makes the communicator
  there): a first operation that is a point-to-point call, or that a member skips, is an
  error.

Operations left when nothing can progress are a deadlock, reported with each stuck
rank's operation -- but for those on a group abandoned after a failed call (its peers
never took what it sent: mimo_fx keeps such a group alive and never uses it again), or
on a group a rank had used before one of its waits failed (``"fail"``: a test of a
mistake, which times out on gloo and meets NCCL's watchdog on NCCL). What
is not modelled: host syncs (``.item()`` of device data), and other libraries'
collectives (DeviceMesh's, DTensor's), which mimo_fx does not issue.

>>> from mimo_fx.testing.nccl_rules import replay
>>> ok = {0: [("group", "g", (0, 1)), ("coll", "g", "all_reduce", 1),
...           ("p2p", "g", ((1, 4, "f"),), ()), ("p2p", "g", (), ((1, 4, "f"),))],
...       1: [("group", "g", (0, 1)), ("coll", "g", "all_reduce", 1),
...           ("p2p", "g", ((0, 4, "f"),), ()), ("p2p", "g", (), ((0, 4, "f"),))]}
>>> replay(ok).problems[0][:65]  # each sends first, in a call of its own: NCCL deadlocks
'deadlock: rank 0 stuck at its op 2 on group g (p2p: send 4 to 1),'

"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

__all__ = ["Report", "replay", "TOTALS"]

# what every spawned world's functions replayed in this process (a test session's summary)
TOTALS = {"functions": 0, "ops": 0, "groups": 0, "problems": 0}


@dataclass
class _Op:
    rank: int
    index: int            # in the rank's record
    kind: str             # "p2p" or a collective's name
    group: str
    sends: list = field(default_factory=list)   # [peer, elements, dtype, met]
    recvs: list = field(default_factory=list)
    size: int = 0
    deps: list = field(default_factory=list)    # ops that must be complete first
    done: bool = False

    def describe(self) -> str:
        if self.kind != "p2p":
            return f"{self.kind} of {self.size}"
        parts = [f"send {n} to {p}" for p, n, _, _ in self.sends]
        parts += [f"receive {n} from {p}" for p, n, _, _ in self.recvs]
        return "p2p: " + ", ".join(parts)


@dataclass
class Report:
    """What a replay found: ``ops`` replayed, ``groups`` seen, ``problems`` (deadlocks,
    mis-pairings, skipped first operations; empty when every rule held)."""

    ops: int = 0
    groups: int = 0
    problems: list[str] = field(default_factory=list)


def _ops(records: dict[int, list[tuple]]) -> tuple[dict, dict, list[str], set[str]]:
    """Per rank and group, its operations in order; each group's members."""
    queues: dict[tuple[int, str], deque] = defaultdict(deque)
    members: dict[str, tuple[int, ...]] = {}
    problems: list[str] = []
    abandoned: set[str] = set()
    for rank, events in records.items():
        by_index: dict[int, _Op] = {}
        last: dict[str, _Op] = {}
        waited: list[_Op] = []
        for i, event in enumerate(events):
            if event[0] == "group":
                members.setdefault(event[1], tuple(event[2]))
                continue
            if event[0] == "abandon":
                abandoned.add(event[1])
                continue
            if event[0] == "fail":
                # a wait that failed (a timeout, a peer gone: an error the program sees
                # on gloo, NCCL's watchdog on NCCL): what this rank had posted may never
                # be taken, so its groups so far are forgiven as abandoned ones are; and
                # what it waited for before does not hold up what it does next (the
                # program saw the error and went on: gloo's wait returned it)
                abandoned.update(last)
                waited = []
                continue
            if event[0] == "wait":
                op = by_index.get(event[1])
                if op is not None:
                    waited.append(op)
                continue
            if event[0] == "p2p":
                op = _Op(rank, i, "p2p", event[1],
                         sends=[[p, n, d, False] for p, n, d in event[2]],
                         recvs=[[p, n, d, False] for p, n, d in event[3]])
            else:
                op = _Op(rank, i, event[2], event[1], size=event[3])
            op.deps = list(waited) + ([last[op.group]] if op.group in last else [])
            last[op.group] = op
            by_index[i] = op
            queues[rank, op.group].append(op)
    return queues, members, problems, abandoned


def _first_operations(queues: dict, members: dict) -> list[str]:
    """Every member's first operation on a group is one collective of all of them."""
    out = []
    for group, ranks in members.items():
        firsts = {r: queues[r, group][0] if queues.get((r, group)) else None for r in ranks}
        used = [r for r, op in firsts.items() if op is not None]
        if not used:
            continue
        skipped = [r for r, op in firsts.items() if op is None]
        p2p = [r for r, op in firsts.items() if op is not None and op.kind == "p2p"]
        if p2p:
            out.append(f"group {group} {list(ranks)}: the first operation of ranks {p2p} is "
                       f"a point-to-point call (NCCL needs every member at a group's first "
                       f"operation)")
        elif skipped:
            out.append(f"group {group} {list(ranks)}: ranks {skipped} never take part in its "
                       f"first operation, which ranks {used} run")
    return out


def _current(heads: dict, rank: int, group: str) -> _Op | None:
    q = heads.get((rank, group))
    return q[0] if q else None


def _ready(op: _Op) -> bool:
    return all(d.done for d in op.deps)


def _p2p_step(op: _Op, heads: dict, problems: list[str]) -> bool:
    """Pair what ``op`` sends with its peers' current receives; whether any paired."""
    progress = False
    for item in op.sends:
        if item[3]:
            continue
        peer, n, dtype, _ = item
        other = _current(heads, peer, op.group)
        if other is None or other.kind != "p2p" or not _ready(other):
            continue
        match = next((r for r in other.recvs if r[0] == op.rank and not r[3]), None)
        if match is None:
            continue
        if (match[1], match[2]) != (n, dtype):
            problems.append(f"mis-paired on group {op.group}: rank {op.rank} sends {n} "
                            f"({dtype}) to rank {peer}, whose receive takes {match[1]} "
                            f"({match[2]})")
        item[3] = match[3] = True
        progress = True
    if all(i[3] for i in op.sends + op.recvs):
        op.done = progress = True
    return progress


def _collective_step(op: _Op, heads: dict, members: dict, problems: list[str]) -> bool:
    """Run ``op``'s collective if every member of its group is at it; whether it ran."""
    ops = [_current(heads, r, op.group) for r in members.get(op.group, ())]
    if any(o is None or o.kind == "p2p" or not _ready(o) for o in ops):
        return False
    if len({(o.kind, o.size) for o in ops if o is not None}) > 1:
        problems.append(f"mis-paired collective on group {op.group}: "
                        + ", ".join(f"rank {o.rank} runs {o.describe()}"
                                    for o in ops if o is not None))
    for o in ops:
        if o is not None:
            o.done = True
    return True


def replay(records: dict[int, list[tuple]]) -> Report:
    """Replay every rank's record (``{rank: events}``) with NCCL's semantics (see the
    module docstring); the report's problems are empty when every rule held."""
    queues, members, problems, abandoned = _ops(records)
    report = Report(ops=sum(len(q) for q in queues.values()), groups=len(members))
    problems += _first_operations(queues, members)
    heads: dict[tuple[int, str], deque] = {k: deque(q) for k, q in queues.items()}
    progress = True
    while progress:
        progress = False
        for q in list(heads.values()):
            if not q or q[0].done or not _ready(q[0]):
                continue
            if q[0].kind == "p2p":
                progress |= _p2p_step(q[0], heads, problems)
            else:
                progress |= _collective_step(q[0], heads, members, problems)
        for q in heads.values():
            while q and q[0].done:
                q.popleft()
    stuck = [q[0] for q in heads.values() if q and q[0].group not in abandoned]
    if stuck:
        shown = sorted(stuck, key=lambda o: (o.rank, o.index))[:8]
        problems.append("deadlock: " + ", ".join(
            f"rank {o.rank} stuck at its op {o.index} on group {o.group} ({o.describe()})"
            for o in shown) + ("" if len(stuck) <= 8 else f", ... ({len(stuck)} stuck)"))
    report.problems = problems
    return report
