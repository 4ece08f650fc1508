"""The NCCL-rules replay (mimo_fx.testing.nccl_rules) finds what NCCL would hang on.

Hand-written records of two or three ranks: patterns NCCL runs (grouped sends and
receives, a root gathering then sending, waits that follow the data) replay clean;
patterns gloo lets through and NCCL does not (two ranks that each send first in calls of
their own, a receive of another size, a member that skips a group's first operation, a
first operation that is point-to-point, collectives of other kinds, a cycle through two
groups' waits) are each named. The whole suite runs under the mode with
``MIMO_FX_NCCL_RULES=1 python -m pytest`` (tests/README.md).
"""

from __future__ import annotations

import pytest

from mimo_fx.testing.nccl_rules import replay

F = "torch.float32"


def _start(group: str, ranks: tuple[int, ...]) -> list[tuple]:
    """A group as mimo_fx makes it: created, then one all-reduce of every member."""
    return [("group", group, ranks), ("coll", group, "all_reduce", 1)]


def _send(group: str, peer: int, n: int = 4) -> tuple:
    return ("p2p", group, ((peer, n, F),), ())


def _recv(group: str, peer: int, n: int = 4) -> tuple:
    return ("p2p", group, (), ((peer, n, F),))


def _both(group: str, peer: int, n: int = 4, m: int = 4) -> tuple:
    return ("p2p", group, ((peer, n, F),), ((peer, m, F),))


def test_a_grouped_exchange_replays_clean():
    records = {0: [*_start("g", (0, 1)), _both("g", 1)], 1: [*_start("g", (0, 1)), _both("g", 0)]}
    report = replay(records)
    assert report.problems == [] and report.ops == 4 and report.groups == 1


def test_sends_first_in_calls_of_their_own_deadlock():
    """gloo completes both sends; NCCL blocks each until its receive is posted."""
    records = {r: [*_start("g", (0, 1)), _send("g", 1 - r), _recv("g", 1 - r)] for r in (0, 1)}
    (problem,) = replay(records).problems
    assert problem.startswith("deadlock: rank 0 stuck at its op 2 on group g (p2p: send 4 "
                              "to 1), rank 1 stuck at its op 2"), problem


def test_one_side_sending_first_is_fine():
    records = {0: [*_start("g", (0, 1)), _send("g", 1), _recv("g", 1)],
               1: [*_start("g", (0, 1)), _recv("g", 0), _send("g", 0)]}
    assert replay(records).problems == []


def test_a_receive_of_another_size_is_a_mis_pairing():
    records = {0: [*_start("g", (0, 1)), _both("g", 1, 4, 4)],
               1: [*_start("g", (0, 1)), _both("g", 0, 4, 6)]}
    assert replay(records).problems == [
        "mis-paired on group g: rank 0 sends 4 (torch.float32) to rank 1, whose receive "
        "takes 6 (torch.float32)"]


def test_a_member_that_skips_the_first_operation_is_named():
    records = {0: [("group", "g", (0, 1, 2)), _both("g", 1)],
               1: [("group", "g", (0, 1, 2)), _both("g", 0)],
               2: [("group", "g", (0, 1, 2))]}
    problems = replay(records).problems
    assert any("the first operation of ranks [0, 1] is a point-to-point call" in p
               for p in problems), problems


def test_collectives_of_other_kinds_are_a_mis_pairing():
    records = {0: [*_start("g", (0, 1)), ("coll", "g", "all_reduce", 8)],
               1: [*_start("g", (0, 1)), ("coll", "g", "all_gather", 8)]}
    (problem,) = replay(records).problems
    assert problem.startswith("mis-paired collective on group g"), problem


def test_a_root_that_gathers_then_sends_replays_clean():
    """The small-row all-gather through its first member (compiled/comm.py): the root
    receives every row, waits, then sends the whole; each other member posts its row
    and its receive of the whole in one call."""
    ranks = (0, 1, 2)
    root = [*_start("g", ranks), ("p2p", "g", (), ((1, 2, F), (2, 2, F))), ("wait", 2),
            ("p2p", "g", ((1, 6, F), (2, 6, F)), ())]
    other = {r: [*_start("g", ranks), ("p2p", "g", ((0, 2, F),), ((0, 6, F),))] for r in (1, 2)}
    assert replay({0: root, **other}).problems == []


def test_a_cycle_through_two_groups_waits_deadlocks():
    """Rank 0 waits for its receive on g before it sends on h; rank 1 waits for its
    receive on h before it sends on g: each stream waits for the other."""
    records = {0: [*_start("g", (0, 1)), *_start("h", (0, 1)), _recv("g", 1), ("wait", 4),
                   _send("h", 1)],
               1: [*_start("g", (0, 1)), *_start("h", (0, 1)), _recv("h", 0), ("wait", 4),
                   _send("g", 0)]}
    (problem,) = replay(records).problems
    assert problem.startswith("deadlock:"), problem


@pytest.mark.parametrize("waits", [False, True])
def test_sends_left_in_flight_on_one_channel_do_not_block_another(waits):
    """A pipelined bridge's sends complete in the background (1F1B: the source sends F0
    and F1, then takes B0; the destination takes F0, sends B0 and waits for it, then
    takes F1): the source's second send waits for its receive, which follows B0, while
    the source's receive of B0 on the other channel runs -- unless the source waited for
    that send first: then each waits for the other."""
    fwd, bwd = "fwd", "bwd"
    src = [*_start(fwd, (0, 1)), *_start(bwd, (0, 1)), _send(fwd, 1), _send(fwd, 1)]
    src += [("wait", 5)] if waits else []
    src += [_recv(bwd, 1)]
    dst = [*_start(fwd, (0, 1)), *_start(bwd, (0, 1)), _recv(fwd, 0), _send(bwd, 0),
           ("wait", 5), _recv(fwd, 0)]
    problems = replay({0: src, 1: dst}).problems
    assert (problems != []) == waits, problems


def test_a_failed_wait_forgives_what_its_rank_left_in_flight():
    """A test of a mistake: rank 1 skips its receive, rank 0's wait times out (a
    MimoFxError on gloo; NCCL's watchdog on NCCL). Its lone send is no deadlock of the
    transport's; the same record without the failure is."""
    skipped = {0: [*_start("g", (0, 1)), _send("g", 1), ("fail",)],
               1: [*_start("g", (0, 1))]}
    assert replay(skipped).problems == []
    unfailed = {0: skipped[0][:-1], 1: skipped[1]}
    (problem,) = replay(unfailed).problems
    assert problem.startswith("deadlock: rank 0 stuck at its op 2 on group g"), problem
    # a group first used after the failure is still checked
    later = {0: [*skipped[0], *_start("h", (0, 1)), _send("h", 1)],
             1: [*skipped[1], *_start("h", (0, 1))]}
    (problem,) = replay(later).problems
    assert "group h" in problem and "group g" not in problem, problem


def test_what_a_rank_waited_for_before_a_failure_does_not_hold_up_what_it_does_next():
    """The reliability table's record: a rank's grouped call sends its size record and
    waits for the table back, which never comes (its peer's wait failed first); its own
    wait fails too, and both go on to a new bridge. The failed call is forgiven and no
    longer holds up the next; without the failures it is a deadlock."""
    gather = ("p2p", "g", ((0, 19, F),), ((0, 76, F),))  # rank 1: its row out, the table in
    records = {0: [*_start("g", (0, 1)), _recv("g", 1, 19), ("fail",), *_start("h", (0, 1)),
                   _both("h", 1)],
               1: [*_start("g", (0, 1)), gather, ("wait", 2), ("fail",), *_start("h", (0, 1)),
                   _both("h", 0)]}
    assert replay(records).problems == []
    unfailed = {r: [e for e in events if e != ("fail",)] for r, events in records.items()}
    (problem,) = replay(unfailed).problems
    assert problem.startswith("deadlock") and "rank 1 stuck at its op 2 on group g" in problem
