"""The reference backend against full-tensor math, over the shared table of layout pairs.

Forward: ``redistribute(shard(X, src))`` equals ``shard(X, dst)``. Backward: feeding
``shard(G, dst)`` returns ``shard(G, src*)`` (src with partial axes replicated). Both are
checked through autograd, ``torch.func.vjp`` and ``torch.func.grad``.
"""

from __future__ import annotations

import pytest
import torch
from cases import CASES, Case, by_name, case_ids, star

import mimo_fx
from mimo_fx.reference import redistribute, shard, unshard


def global_tensor(case: Case, seed: int, dims=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dims = dims or case.src.dims
    return torch.randn([case.sizes[d] for d in dims], generator=g, dtype=torch.float64)


def to_dst_order(x: torch.Tensor, case: Case) -> torch.Tensor:
    return x.permute([case.src.dims.index(d) for d in case.dst.dims])


def sizes_kw(case: Case) -> dict[str, int]:
    return dict(case.sizes)


def run_forward(case: Case, pieces):
    return redistribute(pieces, case.src, case.dst, **sizes_kw(case))


@pytest.mark.parametrize("case", CASES, ids=case_ids())
def test_forward_equals_shard_of_dst(case: Case):
    x = global_tensor(case, 0)
    y = run_forward(case, shard(x, case.src))
    x_dst = to_dst_order(x, case)
    if case.dst.partial:
        assert sorted(y) == list(case.dst.holders)
        torch.testing.assert_close(unshard(y, case.dst, **sizes_kw(case)), x_dst)
        return
    expected = shard(x_dst, case.dst)
    assert sorted(y) == sorted(expected)
    for rank, piece in expected.items():
        if case.src.partial:
            torch.testing.assert_close(y[rank], piece)
        else:  # pure data movement: bitwise
            assert torch.equal(y[rank], piece), f"rank {rank}"


@pytest.mark.parametrize("case", CASES, ids=case_ids())
def test_backward_returns_shard_of_src_star(case: Case):
    x = global_tensor(case, 1)
    pieces = {r: t.requires_grad_() for r, t in shard(x, case.src).items()}
    y = run_forward(case, pieces)
    g_dst = global_tensor(case, 2, case.dst.dims)
    cot = shard(g_dst, star(case.dst))
    torch.autograd.backward([y[r] for r in sorted(y)], [cot[r] for r in sorted(y)])
    g_src = g_dst.permute([case.dst.dims.index(d) for d in case.src.dims])
    expected = shard(g_src, star(case.src))
    for rank, piece in pieces.items():
        assert torch.equal(piece.grad, expected[rank]), f"rank {rank}"


@pytest.mark.parametrize("case", [c for c in CASES if not c.dst.partial][::3],
                         ids=case_ids([c for c in CASES if not c.dst.partial][::3]))
def test_func_vjp_matches_autograd(case: Case):
    x = global_tensor(case, 3)
    src_pieces = shard(x, case.src)
    ranks = sorted(src_pieces)

    def f(*tensors):
        out = run_forward(case, dict(zip(ranks, tensors)))
        return tuple(out[r] for r in sorted(out))

    outputs, vjp_fn = torch.func.vjp(f, *(src_pieces[r] for r in ranks))
    g_dst = global_tensor(case, 4, case.dst.dims)
    cot = shard(g_dst, case.dst)
    grads = vjp_fn(tuple(cot[r] for r in case.dst.holders))
    g_src = g_dst.permute([case.dst.dims.index(d) for d in case.src.dims])
    expected = shard(g_src, star(case.src))
    for rank, grad in zip(ranks, grads):
        assert torch.equal(grad, expected[rank])


def test_func_grad_of_scalar_matches_full_tensor_gradient():
    """L(X) = sum(W * tanh(X)) computed on dst pieces: grad is W * (1 - tanh^2) per src rank."""
    case = next(c for c in CASES if c.name == "fan_in_cp_zigzag")
    # dst replicates over tp: each tp replica computes the same loss; count one of them
    # by summing the replicas' contributions (grad_partial over tp).
    x = global_tensor(case, 5)
    w = global_tensor(case, 6)
    w_dst = shard(w, case.dst)
    src_pieces = shard(x, case.src)
    ranks = sorted(src_pieces)
    tp = case.dst.grid.axis_size("tp")

    def loss(*tensors):
        y = redistribute(dict(zip(ranks, tensors)), case.src, case.dst, grad_partial=("tp",))
        return sum((w_dst[r] * torch.tanh(y[r])).sum() for r in y) / tp

    grads = torch.func.grad(loss, argnums=tuple(range(len(ranks))))(
        *(src_pieces[r] for r in ranks))
    full = torch.func.grad(lambda t: (w * torch.tanh(t)).sum())(x)
    expected = shard(full, case.src)
    for rank, grad in zip(ranks, grads):
        torch.testing.assert_close(grad, expected[rank])
    value = loss(*(src_pieces[r] for r in ranks))
    torch.testing.assert_close(value, (w * torch.tanh(x)).sum())


def test_grad_partial_sums_per_replica_contributions():
    """The seeds' CP case: cotangents zero-padded per CP replica are summed over cp."""
    case = next(c for c in CASES if c.name == "fan_in")
    x = global_tensor(case, 7)
    pieces = {r: t.requires_grad_() for r, t in shard(x, case.src).items()}
    y = redistribute(pieces, case.src, case.dst, grad_partial=("cp",))
    g = global_tensor(case, 8)
    grid = case.dst.grid
    cot = {}
    for rank, full in shard(g, case.dst).items():
        # each cp replica only holds the gradient of its half of the sequence
        cp = grid.coord(rank)["cp"]
        mask = torch.zeros_like(full)
        mask[:, cp * 4:(cp + 1) * 4] = 1
        cot[rank] = full * mask
    torch.autograd.backward([y[r] for r in sorted(y)], [cot[r] for r in sorted(y)])
    expected = shard(g, case.src)
    for rank, piece in pieces.items():
        torch.testing.assert_close(piece.grad, expected[rank])


def test_public_op_dispatches_dicts_to_reference():
    case = by_name("fan_in")
    x = global_tensor(case, 9)
    y = mimo_fx.redistribute(shard(x, case.src), case.src, case.dst)
    for rank, piece in shard(x, case.dst).items():
        assert torch.equal(y[rank], piece)


def test_public_op_single_tensor_without_process_group_raises():
    case = by_name("fan_in")
    with pytest.raises(mimo_fx.MimoFxError, match="torch.distributed"):
        mimo_fx.redistribute(torch.zeros(2, 8, 6), case.src, case.dst)


def test_sizes_inferred_exactly_for_uneven_pieces():
    case = next(c for c in CASES if c.name == "uneven_fan_in")
    x = global_tensor(case, 10)
    y = redistribute(shard(x, case.src), case.src, case.dst)  # no sizes given
    for rank, piece in shard(x, case.dst).items():
        assert torch.equal(y[rank], piece)


def test_bf16_and_int_dtypes_move_bitwise():
    case = next(c for c in CASES if c.name == "pp_disjoint_to_cp")
    for dtype in (torch.bfloat16, torch.int64):
        x = (global_tensor(case, 11) * 100).to(dtype)
        y = redistribute(shard(x, case.src), case.src, case.dst)
        for rank, piece in shard(x, case.dst).items():
            assert y[rank].dtype == dtype and torch.equal(y[rank], piece)


def test_pieces_that_are_not_a_dict_of_tensors_are_named():
    case = next(c for c in CASES if c.name == "fan_in")
    pieces = shard(global_tensor(case, 1), case.src)
    first = min(pieces)
    with pytest.raises(mimo_fx.MimoFxError,
                       match=rf"every piece must be a torch.Tensor.*ranks \[{first}\] have "
                             r"\['NoneType'\]"):
        redistribute({**pieces, first: None}, case.src, case.dst)
    with pytest.raises(mimo_fx.MimoFxError, match=r"pieces must be a dict \{rank: local"):
        redistribute(list(pieces.values()), case.src, case.dst)
    # integer scalars of other types as rank keys are those ranks
    import numpy as np

    y = redistribute({np.int64(r): t for r, t in pieces.items()}, case.src, case.dst)
    want = shard(global_tensor(case, 1), case.dst)
    assert all(torch.equal(y[r], want[r]) for r in want)


def _input_grads(case: Case, **kwargs) -> dict:
    pieces = {r: t.requires_grad_() for r, t in shard(global_tensor(case, 7), case.src).items()}
    y = redistribute(pieces, case.src, case.dst, **kwargs)
    cot = shard(global_tensor(case, 8), case.dst)
    torch.autograd.backward([y[r] for r in sorted(y)], [cot[r] for r in sorted(y)])
    return {r: t.grad for r, t in pieces.items()}


@pytest.mark.parametrize(("given", "same_as"), [("cp", ("cp",)), (["cp"], ("cp",)),
                                                (None, ())])
def test_grad_partial_is_axis_names(given, same_as):
    """One name or a list of names is that tuple (a string is one name, never its
    characters); None is () (test_grad_partial_sums_per_replica_contributions checks
    the tuple form against full-tensor math)."""
    case = next(c for c in CASES if c.name == "fan_in")
    got, want = _input_grads(case, grad_partial=given), _input_grads(case, grad_partial=same_as)
    assert all(torch.equal(got[r], want[r]) for r in want)
    with pytest.raises(mimo_fx.MimoFxError, match=r"grad_partial=3 must name grid axes"):
        _input_grads(case, grad_partial=3)


@pytest.mark.parametrize(("counts", "match"), [
    ({"b": 7}, r"shard: b=7 but x has size 8 along 'b'"),  # (b=8, its size, is taken)
    ({"b": -8}, r"shard: b=-8 but x has size 8 along 'b'"),
    ({"b": (1, 6)}, r"shard: counts b=\(1, 6\) must sum to its size 8"),
    ({"q": (4, 4)}, r"shard: counts q=\(4, 4\) name no dim of '\(dp b\) h'"),
])
def test_shard_checks_counts_of_any_dim(counts, match):
    """Counts of a dim the layout cuts evenly are checked (a script passes one batch's
    counts to the shard of either side) and do not change the pieces."""
    from mimo_fx import Grid, Layout

    even = Layout(Grid(dp=2), "(dp b) h")
    x = torch.arange(32.0).reshape(8, 4)
    with pytest.raises(mimo_fx.MimoFxError, match=match):
        shard(x, even, **counts)
    assert all(torch.equal(a, b) for a, b in zip(shard(x, even, b=(1, 7)).values(),
                                                 shard(x, even).values()))


@pytest.mark.parametrize("t", [(12, -1), (6.0, 5), (), (True, 10)])
def test_shard_refuses_bad_ragged_counts(t):
    from mimo_fx import Grid, Layout

    ragged = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    with pytest.raises(mimo_fx.MimoFxError, match=r"shard: counts t=.* must be a non-empty"):
        shard(torch.zeros(11, 4), ragged, t=t)
