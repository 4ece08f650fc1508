"""mimo_fx.testing.run_world: results by rank, and a failing rank reported as the cause."""

from __future__ import annotations

import pytest
import torch

from mimo_fx import MimoFxError
from mimo_fx.testing import WorldError, run_world


def _sum_of_ranks(rank: int, world: int, scale: int) -> int:
    import torch.distributed as dist

    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t.item())


def _one_rank_fails(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one's own mistake")
    dist.all_reduce(torch.ones(1))  # rank 0 loses its peer here


def _rank_one_hangs(rank: int, world: int) -> None:
    import time

    if rank == 1:
        time.sleep(600)  # never returns in time


def test_results_by_rank_and_errors():
    assert run_world(2, _sum_of_ranks, 10) == [10, 10]
    # the rank that raised is reported, not the peer whose collective lost it
    with pytest.raises(WorldError, match=r"(?s)rank 1 raised.*rank one's own mistake"):
        run_world(2, _one_rank_fails, timeout=120)
    with pytest.raises(MimoFxError, match="world=0: need at least one process"):
        run_world(0, _sum_of_ranks, 1)


def test_a_hang_names_the_rank_and_where_it_is():
    with pytest.raises(WorldError, match=r"(?s)ranks \[1\] never finished.*rank 1 is at: "
                                         r"File .*test_launch.py.* in _rank_one_hangs"):
        run_world(2, _rank_one_hangs, timeout=15)
