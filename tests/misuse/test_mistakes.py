"""A caller's mistake is a clear error, never a hang, never silently wrong data.

- unchecked: the offending rank raises :class:`MimoFxError` before issuing any collective
  (Flight Recorder shows none), naming its rank, what it passed and what the bridge
  expects; its peers are not called here (they would wait for it, and fail when it
  leaves);
- checked: every rank raises the same error naming every offending rank, and the world
  stays usable;
- argument mistakes (misspelt options, unknown sizes, bad dtypes) are caught identically
  on every rank before anything else.

Every world runs under a timeout that kills it: a hang fails the test.
"""

from __future__ import annotations

import os

import pytest
import torch

from mimo_fx import Grid, Layout, MimoFxError, plan
from mimo_fx.mimo import MimoParallelism, ModuleParallelism
from mimo_fx.reference import redistribute as reference_redistribute
from mimo_fx.reference import shard
from mimo_fx.testing import WorldError, run_world

SRC = Layout(Grid(tp=2, dp=2), "(dp b) s h")
DST = Layout(Grid(tp=2, dp=2), "(dp b) (tp s) h")
SIZES = {"b": 4, "s": 16, "h": 2}
ENC = Layout(Grid(dp=2), "(dp b) h")                    # ranks 0-1
LLM = Layout(Grid(tp=2, offset=2), "b (tp h)")          # ranks 2-3


def _x(sizes=SIZES, dims="bsh") -> torch.Tensor:
    return torch.arange(float(torch.Size([sizes[d] for d in dims]).numel())).reshape(
        [sizes[d] for d in dims])


def _raises(fn) -> str | None:
    """The MimoFxError text ``fn`` raises, or a description of what it did instead."""
    try:
        fn()
    except MimoFxError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - any other error is a finding
        return f"NOT A MimoFxError: {type(err).__name__}: {err}"
    return "NO ERROR"


def _alone(rank: int, offender: int, fn) -> dict:
    """``fn`` on ``offender`` only; what it raised and how many collectives it issued."""
    from mimo_fx.compiled import trace

    if rank != offender:
        return {}
    start = trace.mark()
    said = _raises(fn)
    return {"said": said, "collectives": len(trace.since(start))}


def _scenarios(rank: int, world: int) -> dict:
    from mimo_fx.compiled import Bridge, Redistributor

    out = {}
    x = _x()
    piece = shard(x, SRC)[rank]

    # a tensor longer than the bridge was built for: not truncated, an error
    bridge = Redistributor(SRC, DST, SIZES)
    longer = shard(_x({**SIZES, "s": 20}), SRC)[rank]
    out["longer_than_prepared"] = _alone(rank, 1, lambda: bridge(longer))
    out["transposed"] = _alone(rank, 2, lambda: bridge(piece.transpose(1, 2)))
    out["wrong_dtype_unchecked"] = _alone(rank, 3, lambda: bridge(piece.double()))
    out["none_on_holder"] = _alone(rank, 0, lambda: bridge(None))
    bridge.destroy()
    out["after_destroy"] = _raises(lambda: bridge(piece))

    # checked: one rank's mistake raises on every rank, and the world goes on
    bridge = Redistributor(SRC, DST, SIZES, checked=True)
    bad = piece.double() if rank == 1 else piece
    out["checked_dtype"] = _raises(lambda: bridge(bad))
    bad = piece[:, :8] if rank == 3 else piece
    out["checked_shape"] = _raises(lambda: bridge(bad))
    y = bridge(piece)
    out["checked_then_ok"] = torch.equal(y, shard(x, DST)[rank])
    bridge.destroy()

    # checked on disjoint grids: a non-empty tensor on a rank holding nothing
    bridge = Redistributor(ENC, LLM, {"b": 4, "h": 4}, checked=True)
    enc_x = shard(_x({"b": 4, "h": 4}, "bh"), ENC)
    bad = enc_x.get(rank) if rank < 2 else torch.ones(2, 2)
    out["checked_not_empty"] = _raises(lambda: bridge(bad if rank == 2 else enc_x.get(rank)))
    bridge.destroy()

    # the facade: a size typo is an error on every rank, before any collective
    from mimo_fx.compiled import trace

    start = trace.mark()
    out["size_typo"] = _raises(lambda: __import__("mimo_fx").redistribute(
        piece, SRC, DST, b=4, s=16, h=2, H=2, checked=True))
    out["size_typo_collectives"] = len(trace.since(start))

    # Bridge's imperative calls: checked, and after destroy
    bridge = Bridge(ENC, LLM, {"b": 4, "h": 4}, checked=True)
    bad = enc_x[rank][:1] if rank == 0 else enc_x.get(rank)
    out["bridge_checked_send"] = _raises(lambda: bridge.send_forward(bad))
    grads = shard(torch.ones(4, 4), LLM)
    bad = grads[rank].double() if rank == 3 else grads.get(rank)
    out["bridge_checked_backward"] = _raises(lambda: bridge.send_backward(bad))
    y = bridge.send_forward(enc_x.get(rank))
    out["bridge_then_ok"] = (y.numel() == 0 if rank < 2 else
                             torch.equal(y, shard(_x({"b": 4, "h": 4}, "bh"), LLM)[rank]))
    bridge.destroy()
    out["bridge_after_destroy"] = _raises(lambda: bridge.send_forward(enc_x.get(rank)))
    out.update(_size_mistakes(rank, x, piece))
    out.update(_option_mistakes(rank, x, piece))
    return out


def _option_mistakes(rank: int, x: torch.Tensor, piece: torch.Tensor) -> dict:
    """grad_partial as Options reads it on every path: None is none (a raw TypeError
    from the bridge's own tuple() before), an int an error on its rank before any
    collective."""
    from mimo_fx.compiled import Redistributor

    bridge = Redistributor(SRC, DST, SIZES, grad_partial=None)
    out: dict = {"grad_partial_none": torch.equal(bridge(piece), shard(x, DST)[rank])}
    bridge.destroy()
    out["grad_partial_int"] = _alone(
        rank, 2, lambda: Redistributor(SRC, DST, SIZES, grad_partial=3))
    return out


def _size_mistakes(rank: int, x: torch.Tensor, piece: torch.Tensor) -> dict:
    """Sizes that disagree, learned or given."""
    from mimo_fx.compiled import Redistributor, trace

    out: dict = {}
    # learned: the rows show it, so every rank raises the same error, checked or not
    bridge = Redistributor(SRC, DST, {"h": 2})
    bad = piece[:, :8] if rank == 1 else piece          # rank 1's replica (rank 0) differs
    out["learned_replicas_disagree"] = _raises(lambda: bridge(bad))
    out["learned_none_on_holder"] = _raises(lambda: bridge(None if rank == 2 else piece))
    out["learned_dtype"] = _raises(lambda: bridge(piece.double() if rank == 3 else piece))
    y = bridge(piece)
    out["learned_then_ok"] = torch.equal(y, shard(x, DST)[rank])
    # a size given that the bridge was built with otherwise: before any collective
    start = trace.mark()
    out["fixed_size_contradicted"] = _raises(lambda: bridge(piece, h=3))
    out["fixed_size_collectives"] = len(trace.since(start))
    bridge.destroy()
    # given sizes that disagree across ranks: checked, every rank raises
    bridge = Redistributor(SRC, DST, {"h": 2}, checked=True)
    s = 8 if rank == 3 else 16
    out["checked_given_disagree"] = _raises(lambda: bridge(
        piece[:, :s], b=4, s=s))
    bridge.destroy()
    # unchecked, a rank whose tensor disagrees with the sizes it gives raises alone
    bridge = Redistributor(SRC, DST, {"h": 2})
    out["given_disagree_with_tensor"] = _alone(rank, 2, lambda: bridge(piece, b=4, s=8))
    bridge.destroy()
    return out


@pytest.fixture(scope="module")
def scenarios(worlds):
    return worlds.run(4, _scenarios, record=True, timeout=300)


@pytest.mark.parametrize("name, rank, words", [
    ("longer_than_prepared", 1, ["rank 1", "shape (2, 20, 2)", "gives it shape (2, 16, 2)",
                                 "needs a bridge built for those sizes"]),
    ("transposed", 2, ["rank 2", "shape (2, 2, 16)", "gives it shape (2, 16, 2)"]),
    ("wrong_dtype_unchecked", 3, ["rank 3", "torch.float64", "moves torch.float32"]),
    ("none_on_holder", 0, ["rank 0 holds a piece of src", "passed None"]),
    ("grad_partial_int", 2, ["grad_partial=3 must name grid axes"]),
])
def test_unchecked_mistake_raises_on_its_rank_before_any_collective(scenarios, name, rank,
                                                                     words):
    got = scenarios[rank][name]
    assert all(w in got["said"] for w in words), got["said"]
    assert got["collectives"] == 0


@pytest.mark.parametrize("name, words", [
    ("learned_replicas_disagree", ["ranks 0 and 1 hold the same shard of 's'", "16 and 8"]),
    ("learned_none_on_holder", ["the size gather found", "rank 2 holds a piece of src",
                                "passed None"]),
    ("learned_dtype", ["rank 3 passed a tensor of another dtype than torch.float32"]),
    ("checked_given_disagree", ["the ranks made different calls",
                                "the sizes or batch a call gives differ",
                                "one on ranks [0, 1, 2], another on rank 3"]),
])
def test_sizes_that_disagree_raise_the_same_error_on_every_rank(scenarios, name, words):
    said = [r[name] for r in scenarios]
    assert len(set(said)) == 1, said
    assert all(w in said[0] for w in words), said[0]


def test_sizes_that_disagree_with_the_bridge_or_the_tensor_raise_before_any_collective(
        scenarios):
    for r in scenarios:
        assert "h=3 but the bridge was built with h=2" in r["fixed_size_contradicted"]
        assert r["fixed_size_collectives"] == 0 and r["learned_then_ok"]
    got = scenarios[2]["given_disagree_with_tensor"]
    assert "rank 2" in got["said"] and "gives it shape (2, 8, 2)" in got["said"], got
    assert got["collectives"] == 0


def test_grad_partial_none_is_no_axes(scenarios):
    assert all(r["grad_partial_none"] for r in scenarios)


def test_a_destroyed_bridge_says_so(scenarios):
    for r in scenarios:
        assert "was destroyed; build a new one" in r["after_destroy"]
        assert "was destroyed; build a new one" in r["bridge_after_destroy"]


@pytest.mark.parametrize("name, words", [
    ("checked_dtype", ["does not match on every rank", "rank 1: tensor dtype torch.float64"]),
    ("checked_shape", ["rank 3: local tensor has shape (2, 8, 2)", "gives it shape (2, 16, 2)"]),
    ("checked_not_empty", ["rank 2 holds no piece of src", "shape (2, 2)"]),
    ("bridge_checked_send", ["rank 0: local tensor has shape (1, 4)"]),
    ("bridge_checked_backward", ["rank 3: tensor dtype torch.float64"]),
    ("size_typo", ["'H' is not a dim", "dims: b, s, h", "checked"]),
])
def test_checked_mistake_raises_the_same_error_on_every_rank(scenarios, name, words):
    said = [r[name] for r in scenarios]
    assert len(set(said)) == 1, said
    assert all(w in said[0] for w in words), said[0]


def test_the_world_goes_on_after_checked_errors(scenarios):
    assert all(r["checked_then_ok"] and r["bridge_then_ok"] for r in scenarios)
    assert [r["size_typo_collectives"] for r in scenarios] == [0] * 4


# -- checked on one rank, unchecked on the other ------------------------------------------
def _mixed(rank: int, world: int, out_dir: str) -> None:
    """Each rank writes what it saw before anything else can happen to it: when rank 0
    leaves, gloo may abort rank 1's pending collective (SIGABRT) instead of raising."""
    from mimo_fx.compiled import Redistributor

    def report(text: str) -> None:
        with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
            f.write(text)

    src, dst = Layout(Grid(dp=2), "(dp b) h"), Layout(Grid(dp=2), "b (dp h)")
    try:
        bridge = Redistributor(src, dst, {"b": 4, "h": 4}, checked=rank == 0)
        y = bridge(shard(_x({"b": 4, "h": 4}, "bh"), src)[rank])
        report(f"returned {y.tolist()}")
    except Exception as err:  # noqa: BLE001 - what each rank saw is the finding
        import torch.distributed as dist

        report(f"raised {type(err).__name__}: {err}")
        dist.destroy_process_group()  # a rank that failed leaves, as its process would


@pytest.mark.slow
def test_checked_and_unchecked_ranks_fail_instead_of_pairing_wrong_data(tmp_path):
    """Rank 0 builds the bridge checked, rank 1 unchecked: both raise when building it,
    naming ``checked`` and which rank holds which (the ranks agree on every bridge's
    definition before its groups exist). Before that, rank 0 timed out in its header
    exchange while rank 1's data all-to-all failed or aborted; and before the check had
    its own group, rank 1 returned garbage from rank 0's header."""
    os.environ["MIMO_FX_CHECK_TIMEOUT"] = "5"
    try:
        run_world(2, _mixed, str(tmp_path), timeout=120)
    except WorldError as err:  # gloo aborted a process while its peer tore down: its
        # record below says what it saw first; a hang is still a failure
        assert "did not finish" not in str(err), err
    finally:
        del os.environ["MIMO_FX_CHECK_TIMEOUT"]
    said = {p.stem: p.read_text() for p in tmp_path.glob("*.txt")}
    for rank in "01":
        assert said.get(rank, "").startswith("raised MimoFxError"), said
        assert "checked differs: True on rank 0, False on rank 1" in said[rank], said


# -- arguments, validated identically on every rank (no world needed) ----------------------
@pytest.mark.parametrize("kwargs, words", [
    ({"chekced": True}, ["'chekced' is not a dim", "checked"]),
    ({"comm_dtyp": torch.bfloat16}, ["'comm_dtyp' is not a dim", "comm_dtype"]),
    ({"B": 4}, ["'B' is not a dim", "dims: b, s, h"]),
    ({"b": 0}, ["size b=0 must be a positive integer"]),
    ({"sizes": {"b": 4}, "b": 4}, ["given twice"]),
])
def test_facade_rejects_unknown_keywords_before_anything_else(kwargs, words):
    import mimo_fx

    said = _raises(lambda: mimo_fx.compiled.redistribute(torch.zeros(2, 16, 2), SRC, DST,
                                                         **kwargs))
    assert all(w in said for w in words), said


def test_a_dim_named_like_an_option_goes_through_sizes():
    from mimo_fx.plan import size_arguments

    src = Layout(Grid(dp=2), "(dp dtype) h")
    given = size_arguments(src, src, {"dtype": 4}, {"h": 2}, "redistribute", ("dtype",))
    assert given == {"dtype": 4, "h": 2}


def test_reference_backend_names_the_rank_with_the_bad_piece():
    layout = Layout(Grid(tp=2, dp=2), "(dp b) h")     # ranks 0, 1 replicate one shard
    pieces = shard(torch.zeros(4, 3), layout)
    pieces[1] = torch.zeros(3, 3)
    said = _raises(lambda: reference_redistribute(pieces, layout, Layout(Grid(tp=4), "b h")))
    assert "ranks 0 and 1 hold the same shard" in said and "3" in said, said


def test_reference_backend_rejects_unknown_size_keywords():
    layout = Layout(Grid(dp=2), "(dp b) h")
    pieces = shard(torch.zeros(4, 3), layout)
    said = _raises(lambda: reference_redistribute(pieces, layout, layout, H=3))
    assert "'H' is not a dim" in said, said


@pytest.mark.parametrize("dtype", [0, -2, True, "float32"])
def test_plan_rejects_a_dtype_without_a_positive_itemsize(dtype):
    said = _raises(lambda: plan(SRC, DST, SIZES, dtype))
    assert "give a torch.dtype" in said, said


@pytest.mark.parametrize("args", [(0, 0, 4), (8, 0, 4), (8, 2, 0), (-8, -2, 4)])
def test_check_batches_rejects_non_positive_counts(args):
    cfg = MimoParallelism(world_size=2, modules={"enc": ModuleParallelism(dp=2)})
    said = _raises(lambda: cfg.check_batches(*args))
    assert "must be a positive integer" in said, said
