"""MIMO config -> grids, validation errors, the data-loader contract, pipeline stages."""

from __future__ import annotations

import pytest

from mimo_fx import Grid, MimoFxError
from mimo_fx.mimo import (
    MimoParallelism,
    ModuleParallelism,
    embedding_group,
    is_first_stage,
    is_last_stage,
    position_embedding_group,
)

M = ModuleParallelism


def colocated():
    return MimoParallelism(8, {"encoder": M(tp=2, dp=4), "llm": M(tp=2, cp=2, dp=2)},
                           colocated=True)


def pipelined():
    return MimoParallelism(16, {"encoder": M(tp=2, pp=2, dp=2),
                                "llm": M(tp=4, pp=2, offset=8)})


def test_colocated_grids_share_ranks_in_default_order():
    grids = colocated().grids()
    assert grids["encoder"] == Grid(tp=2, cp=1, pp=1, dp=4)
    assert grids["llm"] == Grid(tp=2, cp=2, pp=1, dp=2)
    assert list(grids["llm"].ranks) == list(range(8))
    # rank = tp + 2*(cp + 2*dp) for the LLM
    assert grids["llm"].coord(5) == {"tp": 1, "cp": 0, "pp": 0, "dp": 1}


def test_pipelined_modules_tile_the_world():
    cfg = pipelined()
    grids = cfg.grids()
    assert list(grids["encoder"].ranks) == list(range(8))
    assert list(grids["llm"].ranks) == list(range(8, 16))
    assert cfg.modules_of(3) == ("encoder",) and cfg.modules_of(12) == ("llm",)
    assert colocated().modules_of(3) == ("encoder", "llm")


def test_custom_axis_order():
    g = M(tp=2, dp=2, order=("dp", "tp", "cp", "pp")).grid()
    assert g.names == ("dp", "tp", "cp", "pp")
    assert g.coord(1) == {"dp": 1, "tp": 0, "cp": 0, "pp": 0}


@pytest.mark.parametrize("build,message", [
    (lambda: MimoParallelism(12, {"encoder": M(tp=2, dp=4), "llm": M(tp=2, offset=8)}),
     r"ranks \[10, 11\] join no module"),
    (lambda: MimoParallelism(12, {"encoder": M(tp=2, dp=4), "llm": M(tp=4, offset=6)}),
     r"modules 'encoder' \(ranks 0..7\) and 'llm' \(ranks 6..9\) overlap"),
    (lambda: MimoParallelism(7, {"encoder": M(dp=4), "llm": M(dp=3, offset=4)}),
     r"DP sizes must divide one another.*'llm' has dp=3, 'encoder' has dp=4"),
    (lambda: MimoParallelism(8, {"encoder": M(tp=2, dp=4), "llm": M(tp=2, dp=8)},
                             colocated=True),
     r"module 'llm' needs ranks 0..15 .* the world has 8 ranks"),
    (lambda: M(tp=2, order=("tp", "dp", "pp")), r"axis order .* must list each of"),
    (lambda: M(tp=2, order=("tp", "tp", "pp", "dp")), r"axis order .* must list each of"),
    (lambda: M(tp=0), r"tp=0 must be a positive integer"),
    (lambda: M(offset=-1), r"offset=-1 must be a non-negative"),
    (lambda: MimoParallelism(8, {}), r"at least one module"),
    (lambda: MimoParallelism("8", {"llm": M(dp=8)}), r"world_size='8' must be a positive"),
    (lambda: MimoParallelism(8, [M(dp=8)]), r"modules must be a dict \{name: Module.*got list"),
    (lambda: MimoParallelism(8, {"llm": {"dp": 8}}),
     r"modules must be a dict .* values of types \['dict'\]"),
    (lambda: MimoParallelism(8, {"llm": M(dp=8)}, colocated="yes"),
     r"colocated='yes' must be True or False"),
])
def test_invalid_configs(build, message):
    with pytest.raises(MimoFxError, match=message):
        build()


def test_data_loader_contract():
    cfg = colocated()  # dp 4 and 2
    cfg.check_batches(global_batch=16, micro_batch=4, microbatches=4)
    with pytest.raises(MimoFxError, match=r"4 x 4 = 16, but the global batch is 12"):
        cfg.check_batches(global_batch=12, micro_batch=4, microbatches=4)
    with pytest.raises(MimoFxError, match=r"micro-batch 2 is not divisible by module "
                                          r"'encoder''s dp=4"):
        cfg.check_batches(global_batch=8, micro_batch=2, microbatches=4)


def test_batch_slices_partition_the_batch_per_module():
    cfg = colocated()
    for name, dp in (("encoder", 4), ("llm", 2)):
        rows = {}
        for rank in range(8):
            start, stop = cfg.batch_slice(name, rank, 16)
            rows.setdefault((start, stop), set()).add(rank)
        # dp contiguous blocks of 16/dp rows, each fed to 8/dp ranks
        assert sorted(rows) == [(i * 16 // dp, (i + 1) * 16 // dp) for i in range(dp)]
        assert all(len(ranks) == 8 // dp for ranks in rows.values())
    with pytest.raises(MimoFxError, match="unknown module 'vision'"):
        cfg.batch_slice("vision", 0, 16)


def test_pipeline_stages_and_embedding_groups():
    grid = pipelined().grids()["encoder"]  # tp2 cp1 pp2 dp2: rank = tp + 2*(pp + 2*dp)
    for rank in grid.ranks:
        pp = (rank // 2) % 2
        assert is_first_stage(grid, rank) == (pp == 0)
        assert is_last_stage(grid, rank) == (pp == 1)
        first = rank - 2 * pp
        assert position_embedding_group(grid, rank) == (first,)
        assert embedding_group(grid, rank) == (first, first + 2)
    flat = Grid(tp=2)
    assert is_first_stage(flat, 1) and is_last_stage(flat, 1)
    assert embedding_group(flat, 1) == (1,)
