"""Packed sequences split over CP per sequence (mimo_fx.packed) against independent math.

Expectations come from list slicing of each padded sequence (``model_ranks``), never from
the implementation: hand-written cases, then hypothesis over random lengths (empty
sequences, all-empty batches, cp 1..4, zigzag and contiguous). A plain-torch causal
attention per rank, built from the helpers alone, equals the full packed attention on the
rank's tokens; image_rows hands every image embedding to exactly the rank holding its
token.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mimo_fx import Grid, MimoFxError
from mimo_fx.packed import PackedLayout, Packing, image_rows, pack_shard, pack_unshard
from mimo_fx.reference import shard, unshard

FAST = settings(max_examples=60, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors here are tiny; on a busy machine the intra-op thread pool (entered by
    triu and softmax even for a few elements) would cost milliseconds per call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_ranks(lengths, cp, zigzag, multiple=None):
    """Per rank, its tokens in storage order as (position, sequence, place in sequence,
    unpadded index or -1), by slicing each padded sequence into chunks."""
    chunks = 2 * cp if zigzag else cp
    m = multiple or chunks
    out = {r: [] for r in range(cp)}
    start = unpadded = 0
    for s, n in enumerate(lengths):
        padded = (n + m - 1) // m * m
        tokens = [(start + q, s, q, unpadded + q if q < n else -1) for q in range(padded)]
        c = padded // chunks
        pieces = [tokens[k * c:(k + 1) * c] for k in range(chunks)]
        for r in range(cp):
            out[r] += pieces[r] + (pieces[chunks - 1 - r] if zigzag else [])
        start += padded
        unpadded += n
    return out


def column(rows, k):
    return [row[k] for row in rows]


# -- hand-derived cases -------------------------------------------------------------------
def test_one_sequence_zigzag_is_a_plain_zigzag_cut_of_a_padded_arange():
    for n, cp in [(5, 2), (8, 2), (13, 3), (1, 4), (16, 4)]:
        p = Packing([n], cp)
        padded = math.ceil(n / (2 * cp)) * (2 * cp)
        chunks = torch.arange(padded).chunk(2 * cp)
        for r in range(cp):
            expected = torch.cat([chunks[r], chunks[2 * cp - 1 - r]])
            assert p.positions(r).tolist() == expected.tolist()
            assert p.position_in_sequence(r).tolist() == expected.tolist()
            real = torch.where(expected < n, expected, -1)
            assert p.token_index(r).tolist() == real.tolist()


def test_two_sequences_and_an_empty_one_by_hand():
    p = Packing([3, 0, 6], cp=2)
    assert p.padded_lengths == (4, 0, 8)
    assert p.cu_seqlens.tolist() == [0, 3, 3, 9]
    assert p.cu_seqlens_padded.tolist() == [0, 4, 4, 12]
    assert (p.total, p.total_padded, p.local_total) == (9, 12, 6)
    # sequence 0: chunks of 1 -> rank 0 [0],[3]; sequence 2 (from 4): chunks of 2
    assert p.positions(0).tolist() == [0, 3, 4, 5, 10, 11]
    assert p.positions(1).tolist() == [1, 2, 6, 7, 8, 9]
    assert p.token_index(0).tolist() == [0, -1, 3, 4, -1, -1]
    assert p.token_index(1).tolist() == [1, 2, 5, 6, 7, 8]
    assert p.position_in_sequence(0).tolist() == [0, 3, 0, 1, 6, 7]
    assert p.segment_ids(0).tolist() == [0, -1, 2, 2, -1, -1]
    assert p.segment_ids(1).tolist() == [0, 0, 2, 2, 2, 2]
    assert p.local_cu_seqlens(0).tolist() == [0, 2, 2, 6]
    assert p.local_cu_seqlens(1).tolist() == [0, 2, 2, 6]
    assert p.local_cu_seqlens(0, padded=False).tolist() == [0, 1, 1, 3]
    assert p.local_cu_seqlens(1, padded=False).tolist() == [0, 2, 2, 6]


def test_contiguous_by_hand():
    p = Packing([3, 5], cp=2, zigzag=False)
    assert p.padded_lengths == (4, 6)
    assert p.positions(0).tolist() == [0, 1, 4, 5, 6]
    assert p.positions(1).tolist() == [2, 3, 7, 8, 9]
    assert p.token_index(1).tolist() == [2, -1, 6, 7, -1]
    assert p.position_in_sequence(1).tolist() == [2, 3, 3, 4, 5]


def test_multiple_pads_further_and_cp1_zigzag_is_the_identity_order():
    p = Packing([5], cp=2, multiple=8)
    assert p.padded_lengths == (8,)
    assert p.positions(0).tolist() == [0, 1, 6, 7]
    one = Packing([3, 2], cp=1)
    assert one.padded_lengths == (4, 2)
    assert one.positions(0).tolist() == [0, 1, 2, 3, 4, 5]
    assert one.token_index(0).tolist() == [0, 1, 2, -1, 3, 4]


def test_no_sequences():
    p = Packing([], cp=3)
    assert p.cu_seqlens.tolist() == [0] and p.total_padded == 0
    assert p.positions(2).tolist() == [] and p.local_cu_seqlens(2).tolist() == [0]
    assert pack_unshard(pack_shard(torch.zeros(0, 4), p), p).shape == (0, 4)
    assert {r: m.rows.tolist() for r, m in image_rows(p, []).items()} == {0: [], 1: [], 2: []}


def test_helpers_are_int64():
    p = Packing([3, 6], cp=2)
    for t in (p.cu_seqlens, p.cu_seqlens_padded, p.positions(1), p.token_index(1),
              p.position_in_sequence(1), p.segment_ids(1), p.local_cu_seqlens(1),
              p.local_cu_seqlens(1, padded=False), image_rows(p, [2]).get(1).rows):
        assert t.dtype == torch.int64


def test_pack_shard_is_differentiable():
    p = Packing([3, 6], cp=2)
    x = torch.randn(9, 2, requires_grad=True)
    pieces = pack_shard(x, p)
    (pieces[0].sum() * 2 + pieces[1].sum() * 3).backward()
    owner = torch.tensor([2.0 if i in (0, 3, 4) else 3.0 for i in range(9)])
    assert torch.equal(x.grad, owner[:, None].expand(9, 2))
    y = pack_unshard({r: t.detach().requires_grad_() for r, t in pieces.items()}, p)
    assert torch.equal(y, x.detach())


# -- properties ---------------------------------------------------------------------------
packings = st.builds(
    lambda lengths, cp, zigzag: (lengths, cp, zigzag),
    st.lists(st.integers(0, 13), max_size=5), st.integers(1, 4), st.booleans())


@FAST
@given(packings)
@example(([], 3, True))
@example(([0, 0, 0], 2, True))
@example(([0, 0], 4, False))
def test_helpers_match_the_sliced_model(case):
    lengths, cp, zigzag = case
    p = Packing(lengths, cp, zigzag)
    model = model_ranks(lengths, cp, zigzag)
    for r in range(cp):
        rows = model[r]
        assert p.positions(r).tolist() == column(rows, 0)
        assert p.position_in_sequence(r).tolist() == column(rows, 2)
        assert p.token_index(r).tolist() == column(rows, 3)
        assert p.segment_ids(r).tolist() == [s if t >= 0 else -1 for _, s, _, t in rows]


@FAST
@given(packings)
@example(([0, 0, 0], 2, True))
def test_every_token_on_exactly_one_rank_and_ranks_balanced(case):
    lengths, cp, zigzag = case
    p = Packing(lengths, cp, zigzag)
    index = torch.cat([p.token_index(r) for r in range(cp)])
    assert sorted(index[index >= 0].tolist()) == list(range(sum(lengths)))
    positions = torch.cat([p.positions(r) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(p.total_padded))
    bounds = p.cu_seqlens_padded
    for r in range(cp):
        assert len(p.positions(r)) == p.local_total == p.total_padded // cp
        per_seq = torch.bucketize(p.positions(r), bounds[1:], right=True)
        counts = torch.bincount(per_seq, minlength=len(lengths)).tolist()
        assert counts == [n // cp for n in p.padded_lengths]
        assert all(n % p.chunks == 0 and n - length < p.chunks
                   for n, length in zip(p.padded_lengths, lengths))


@FAST
@given(packings)
def test_helpers_agree_with_one_another(case):
    lengths, cp, zigzag = case
    p = Packing(lengths, cp, zigzag)
    length = torch.tensor(lengths, dtype=torch.int64)
    for r in range(cp):
        pos, index = p.positions(r), p.token_index(r)
        place, seg = p.position_in_sequence(r), p.segment_ids(r)
        seq = torch.bucketize(pos, p.cu_seqlens_padded[1:], right=True)  # incl. padding
        assert torch.equal(pos, p.cu_seqlens_padded[seq] + place)
        real = index >= 0
        assert torch.equal(real, place < length[seq])
        assert torch.equal(seg[real], seq[real]) and bool((seg[~real] == -1).all())
        assert torch.equal(index[real], p.cu_seqlens[seq[real]] + place[real])
        assert bool((pos[1:] > pos[:-1]).all())  # storage order is rising
        storage, counts = p.local_cu_seqlens(r), p.local_cu_seqlens(r, padded=False)
        for s in range(len(lengths)):
            block = slice(int(storage[s]), int(storage[s + 1]))
            assert bool((seq[block] == s).all())
            n_real = int(counts[s + 1] - counts[s])
            assert real[block].tolist() == [True] * n_real + [False] * (block.stop -
                                                                        block.start - n_real)


@FAST
@given(packings, st.integers(1, 3))
def test_shard_unshard_round_trip(case, width):
    lengths, cp, zigzag = case
    p = Packing(lengths, cp, zigzag)
    x = torch.randn(sum(lengths), width, dtype=torch.float64) + 10  # never zero
    pieces = pack_shard(x, p)
    assert torch.equal(pack_unshard(pieces, p), x)
    for r, piece in pieces.items():
        rows = model_ranks(lengths, cp, zigzag)[r]
        for k, (_, _, _, t) in enumerate(rows):
            assert torch.equal(piece[k], x[t] if t >= 0 else torch.zeros(width, dtype=x.dtype))


def full_causal_attention(q, k, v, lengths):
    """Causal attention inside each sequence of the unpadded packed q, k, v (T, d)."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        scores = qs @ ks.T / math.sqrt(q.shape[1])
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(scores.softmax(-1) @ vs)
        start += n
    return torch.cat([q[:0], *out])


def rank_causal_attention(p, rank, q_local, k_global, v_global):
    """A varlen causal attention on one rank: its local queries, sequence by sequence, the
    keys/values of the whole padded sequence (gathered over cp), masked by RoPE positions."""
    storage, bounds = p.local_cu_seqlens(rank), p.cu_seqlens_padded
    place = p.position_in_sequence(rank)
    out = []
    for s in range(len(p.lengths)):
        lo, hi = int(storage[s]), int(storage[s + 1])
        ks = k_global[int(bounds[s]):int(bounds[s + 1])]
        vs = v_global[int(bounds[s]):int(bounds[s + 1])]
        scores = q_local[lo:hi] @ ks.T / math.sqrt(q_local.shape[1])
        later = torch.arange(len(ks))[None, :] > place[lo:hi, None]
        out.append(scores.masked_fill(later, float("-inf")).softmax(-1) @ vs)
    return torch.cat([q_local[:0], *out])


@FAST
@given(packings)
@example(([7, 0, 12, 1], 3, True))
def test_per_rank_causal_attention_equals_the_full_one(case):
    lengths, cp, zigzag = case
    p = Packing(lengths, cp, zigzag)
    gen = torch.Generator().manual_seed(sum(lengths) * 7 + cp)
    q, k, v = (torch.randn(sum(lengths), 4, dtype=torch.float64, generator=gen)
               for _ in range(3))
    full = full_causal_attention(q, k, v, lengths)
    q_pieces, k_pieces, v_pieces = pack_shard(q, p), pack_shard(k, p), pack_shard(v, p)
    # the all-gather over cp, put back in padded packed order by positions
    k_global = torch.zeros(p.total_padded, 4, dtype=torch.float64)
    v_global = torch.zeros(p.total_padded, 4, dtype=torch.float64)
    for r in range(cp):
        k_global[p.positions(r)] = k_pieces[r]
        v_global[p.positions(r)] = v_pieces[r]
    for r in range(cp):
        out = rank_causal_attention(p, r, q_pieces[r], k_global, v_global)
        index = p.token_index(r)
        real = index >= 0
        assert torch.allclose(out[real], full[index[real]], rtol=1e-10, atol=1e-12)


@FAST
@given(packings, st.data())
def test_image_rows_partition_and_deliver(case, data):
    lengths, cp, zigzag = case
    p = Packing(lengths, cp, zigzag)
    total = sum(lengths)
    chosen = data.draw(st.lists(st.integers(0, max(total - 1, 0)), unique=True,
                                max_size=total))
    positions = torch.tensor(chosen, dtype=torch.int64)  # any order
    embeddings = torch.randn(len(chosen), 3)
    mapping = image_rows(p, positions)
    assert sorted(mapping) == list(range(cp))
    every = torch.cat([mapping[r].rows for r in range(cp)])
    assert sorted(every.tolist()) == list(range(len(chosen)))
    # the oracle: image embeddings placed in the packed sequence, then sharded
    packed = torch.zeros(total, 3)
    packed[positions] = embeddings
    is_image = torch.zeros(total, dtype=torch.bool)
    is_image[positions] = True
    holds = pack_shard(is_image, p)
    for r, piece in pack_shard(packed, p).items():
        rows, local = mapping[r]
        assert len(rows) == len(local) == int(holds[r].sum())
        assert bool((local[1:] > local[:-1]).all())
        assert bool(holds[r][local].all())
        assert torch.equal(piece[local], embeddings[rows])


# -- mistakes -----------------------------------------------------------------------------
@pytest.mark.parametrize("make, words", [
    (lambda: Packing([3, -1], 2), ["lengths[1] = -1", "negative", ">= 0"]),
    (lambda: Packing([3], 0), ["cp = 0", ">= 1"]),
    (lambda: Packing([3], 1.5), ["cp", "integer", "1.5"]),
    (lambda: Packing([3], True), ["cp", "integer"]),
    (lambda: Packing([2.5], 2), ["lengths[0]", "integer", "2.5"]),
    (lambda: Packing("abc", 2), ["sequence of token counts", "'abc'"]),
    (lambda: Packing(torch.ones(2, 2, dtype=torch.int64), 2), ["1-D", "(2, 2)"]),
    (lambda: Packing([3], 2, zigzag="yes"), ["zigzag", "True or False", "'yes'"]),
    (lambda: Packing([3], 2, multiple=6), ["multiple = 6", "2*cp = 4", "multiple=12"]),
    (lambda: Packing([3], 3, zigzag=False, multiple=0), ["multiple = 0", "cp = 3"]),
    (lambda: Packing([3], 2).positions(2), ["rank = 2", "cp = 2", "0..1"]),
    (lambda: Packing([3], 2).token_index(-1), ["rank = -1", "0..1"]),
    (lambda: pack_shard(torch.zeros(4, 2), Packing([3], 2)), ["(4, 2)", "sum(lengths) = 3"]),
    (lambda: pack_shard(torch.zeros(3), [3]), ["needs a Packing"]),
    (lambda: pack_unshard({0: torch.zeros(2)}, Packing([3], 2)), ["0..1", "[0]"]),
    (lambda: pack_unshard({0: torch.zeros(2), 1: torch.zeros(3)}, Packing([3], 2)),
     ["rank 1", "(3,)", "(2, ...)"]),
    (lambda: pack_unshard({0: torch.zeros(2, 1), 1: torch.zeros(2, 2)}, Packing([3], 2)),
     ["rank 1", "(2, 2)", "same trailing dims"]),
    (lambda: image_rows(Packing([3, 2], 2), [1, 5]), ["[5]", "0..4", "padding"]),
    (lambda: image_rows(Packing([3, 2], 2), [1, 2, 1]), ["repeat [1]", "distinct"]),
    (lambda: image_rows(Packing([3, 2], 2), torch.tensor([1.0])), ["integer", "float32"]),
    (lambda: image_rows(Packing([3, 2], 2), [1.5]), ["integer", "float32"]),
    (lambda: image_rows(Packing([3, 2], 2), [[1]]), ["1-D", "(1, 1)"]),
    (lambda: image_rows(Packing([3, 2], 2), ["a"]), ["integer positions", "'a'"]),
])
def test_mistakes_are_explained(make, words):
    with pytest.raises(MimoFxError) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_zero_lengths_are_allowed_and_packing_is_a_value():
    assert Packing([0], 4).padded_lengths == (0,)
    assert Packing((3, 6), 2) == Packing([3, 6], 2)
    assert hash(Packing((3, 6), 2)) == hash(Packing(torch.tensor([3, 6]), 2))
    assert Packing([3, 6], 2) != Packing([3, 6], 2, zigzag=False)


# -- packed layouts over dp x cp (x tp) grids ---------------------------------------------
@st.composite
def packed_layouts(draw):
    dp, cp, tp = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    lengths = [draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)) for _ in range(dp)]
    return PackedLayout(Grid(tp=tp, cp=cp, dp=dp), "t h", lengths, draw(st.booleans()))


@FAST
@given(packed_layouts())
def test_a_packed_layouts_pieces_are_each_groups_pack_shard(layout):
    """The oracle of a packed layout (``shard``: each rank's rows) is, group by group,
    ``pack_shard`` of that group's tokens, on every tp replica; ``unshard`` inverts it."""
    x = torch.randn(layout.total, 3, dtype=torch.float64)
    pieces = shard(x, layout)
    offset = 0
    for d, packing in enumerate(layout.packings):
        want = pack_shard(x[offset:offset + packing.total], packing)
        for r in layout.grid.ranks:
            coord = layout.grid.coord(r)
            if coord["dp"] == d:
                assert torch.equal(pieces[r], want[coord["cp"]])
        offset += packing.total
    assert torch.equal(unshard(pieces, layout), x)


def test_packed_layout_rows_of_a_rank_outside_its_grid():
    lay = PackedLayout(Grid(cp=2), "t h", [[3, 4]])
    with pytest.raises(MimoFxError, match="rank 5 is not in"):
        lay.rows(5)
