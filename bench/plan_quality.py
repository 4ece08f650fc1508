"""How good mimo_fx's plans are: bytes per rank against the lower bound, a leader-based
bridge and an all-reduce-over-CP backward, and what the difference costs on a cluster;
then the same for image tokens delivered to the CP ranks that use them (Table 3).

For a table of realistic bridges at 8 to 4096 ranks (s = h = 4096, bf16, one sample per
rank on the wider data-parallel side, so b = lcm of the two DP sizes) it prints:

**Table 1, forward bytes per rank** (MiB; from ``mimo_fx.plan``):

- mimo_fx max recv / max sent / total: ``plan.max_recv``, ``plan.max_sent``,
  ``plan.total_bytes``; collectives: the plan's steps with their number of groups.
- recv/bound: ``plan.max_recv / plan.max_lower_bound``, the lower bound being, per dst
  rank, the bytes it needs and does not hold. It must be 1.00 on every row; a row where
  it is not is flagged ``CHECK`` and the script exits with status 1.
- a2a sender balance: for an all-to-all step, the busiest sender's bytes over an even
  split of the step's bytes among the src ranks holding data (1.00 = balanced; 2.00 =
  one rank sends twice its share, so on a slow link the step takes twice as long).
- leader max recv / max sent / total, and leader/mimo_fx: the same bridge done the way
  the seeds' pipelined bridge does it, computed here from its rules and nothing of
  mimo_fx's planner: one leader per DP replica (its first TP x CP rank) on each side;
  each src leader sends its replica's samples to the dst leaders whose replica needs
  them (a point-to-point message, nothing when src and dst leader are the same rank);
  each dst leader broadcasts its whole replica (b/DP_dst x s x h) inside its TP x CP
  group, counted as a pipelined chain (every member receives it once, every member but
  the last forwards it once). A partial src is first all-reduced over its TP group
  (ring: 2(k-1)/k of the replica per rank), since the scheme needs TP-replicated input.
  With CP on the dst the leader still broadcasts the full sequence; each rank then
  keeps its CP chunks (as the seeds' CP change does with ``index_select``). On
  colocated grids the seeds use another communicator (fan-in: all-gather over DP, which
  moves what mimo_fx moves when dst has no CP; fan-out and equal DP: a local narrow); the
  leader columns there show what the leader rules would cost, for comparison.

**Table 2, modelled time and the CP backward** (alpha-beta model, see below):

- fwd mimo_fx ms / fwd leader ms: each scheme's forward time; speedup = leader/mimo_fx.
- bwd: for rows with CP on the dst side, the gradient's way back. mimo_fx: the adjoint
  plan (``mimo_fx.backward_plan``; every CP rank contributes only its own chunks, which
  are gathered where needed), its max recv and its bound. The seeds' CP change instead
  zero-pads each CP rank's gradient to the full sequence and all-reduces it over CP
  (ring all-reduce of the padded replica gradient G = b/DP_dst x s x h: 2(n-1)/n x G per
  rank for CP size n), then narrows to the src batch (colocated fan-in and equal DP: no
  traffic) or, across disjoint grids, takes the leader path back (dst leaders -> src
  leaders -> broadcast over each src replica). Its peak per-rank bytes and modelled time
  stand beside mimo_fx's.

**Table 3, image-token delivery** (MiB per CP rank; ``plan()`` of a ``PackedLayout``): image
embeddings (hidden 4096, bf16: 8192 bytes a row) go from an encoder on DP over ranks
0..N/2-1 to an LLM on CP x DP (cp inner) over ranks N/2..N-1, cp in 2, 4, 8 where it
fits. Every LLM replica packs the same synthetic batch (``synthetic_batch``: 16 samples,
64-2048 text tokens and 0-3 images of 256, 576 or 1024 tokens each, seed 0) into one
zigzag ``mimo_fx.packed.Packing``; encoder rank d*cp + k holds, as one contiguous block,
the image rows of the k-th block of replica d's samples; CP rank k of replica d needs
the rows in its zigzag chunks: the layouts are ``(dp t) h`` (ragged) and the batch's
``PackedLayout(...).select(image tokens)``, planned by ``mimo_fx.plan`` (the same entry
point as the other tables). It plans the whole world up to 64 ranks; above, it plans one
replica with its encoder ranks (replicas are independent and identical, and at 64 ranks
the whole world's numbers equal one replica's), the ``planned`` column says which.

- fwd recv / bound / bwd sent: the most any CP rank receives forward, the lower bound
  (``plan.needed_rows()``: the distinct rows it needs), the most it sends back. Every
  CP rank must receive exactly its bound and send exactly that back, and every encoder
  rank must get back what it sent; a row where not is flagged ``CHECK`` (exit status 1).
- seed fwd / seed bwd: the seed scheme per CP rank (``mimo_fx.rows.seed_bytes`` / cp):
  every CP rank receives all the replica's image rows; back, a ring all-reduce of the
  whole gradient over CP, then each row's gradient to its encoder rank.
- seed/mimo_fx total (fwd | bwd): both schemes' bytes summed over all ranks; must be
  >= cp in both directions, else ``CHECK``. seed/mimo_fx peak: seed per CP rank over
  the busiest CP rank of mimo_fx; below total when the zigzag gives CP ranks unequal
  shares of the image tokens (it balances tokens, not image tokens).
- fwd ms / bwd ms: the row plan, one all_to_all each way (point-to-point, as below).
  seed fwd ms: encoder rank k sends its block to CP rank k (point-to-point), then a ring
  all-gather over CP; seed bwd ms: ring all-reduce over CP, then CP rank k returns block
  k's gradient to encoder rank k. speedup: seed over mimo_fx, forward plus backward.

**The alpha-beta model.** Ranks sit 8 to a node (rank // 8), one NIC per GPU. Link
classes (constants below; change them for another cluster):

- NVLink inside a node: alpha = 3 µs, beta = 300 GB/s per GPU (NVLink 4 on H100 runs
  ~450 GB/s per direction nominal, NCCL bus bandwidth ~300-370 GB/s);
- InfiniBand between nodes: alpha = 10 µs, beta = 25 GB/s per GPU (a 200 Gb/s HDR NIC;
  400 Gb/s NDR would be ~50 GB/s, halving the IB terms).

A ring collective (all-gather, reduce-scatter, all-reduce, broadcast chain) over k
ranks costs rounds x alpha + (bytes a member receives) / beta, rounds = k - 1 (2(k - 1)
for an all-reduce), on IB if the group spans nodes, else on NVLink; the step takes as
long as its slowest group. Point-to-point traffic (an all-to-all's pieces, the leader's
messages) costs, per rank and link class, peers x alpha + max(bytes sent, bytes
received) / beta; the two classes run concurrently (a rank takes the slower), and the
step takes as long as its slowest rank. Steps run one after the other. Compute overlap,
congestion between nodes, SHARP/NVLS and protocol overheads are ignored: it says how
many bytes cross which link and how often, not what a profiler would show.

Also writes ``bench/results/plan_quality.txt`` (this report) and
``bench/results/plan_quality.png`` (peak bytes per rank, mimo_fx vs leader vs lower
bound, and modelled time, at the largest world size) unless ``--no-save``.

Run from the repository root::

    python bench/plan_quality.py           # 8, 64, 512 and 4096 ranks; writes results
    python bench/plan_quality.py --quick   # 8 and 64 ranks only, writes nothing
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

from common import collectives, replicas
from tabulate import tabulate

from mimo_fx import Grid, Layout, backward_plan, plan
from mimo_fx.explain import step_matrix
from mimo_fx.packed import PackedLayout
from mimo_fx.plan import Collective, Exchange, Plan
from mimo_fx.rows import RowRouting, plan_layouts, seed_bytes

WORLDS = (8, 64, 512, 4096)
QUICK_WORLDS = (8, 64)
S = H = 4096
ITEMSIZE = 2  # bf16
SAMPLE = S * H * ITEMSIZE  # bytes of one sample
GPUS_PER_NODE = 8
MIB = float(1 << 20)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class Link:
    name: str
    alpha: float  # seconds per message / ring round
    beta: float   # bytes per second per GPU


NVLINK = Link("NVLink", 3e-6, 300e9)
IB = Link("InfiniBand", 10e-6, 25e9)


def node(rank: int) -> int:
    return rank // GPUS_PER_NODE


def link_of(ranks) -> Link:
    return NVLINK if len({node(r) for r in ranks}) == 1 else IB


# -- the table of bridges -----------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    src: Layout
    dst: Layout
    sizes: dict[str, int]


def _sizes(src: Grid, dst: Grid) -> dict[str, int]:
    dps = [dict(zip(g.names, g.sizes))["dp"] for g in (src, dst)]
    return {"b": math.lcm(*dps), "s": S, "h": H}


def _case(src: Layout, dst: Layout) -> Case:
    return Case(src, dst, _sizes(src.grid, dst.grid))


def fan_in(n: int) -> Case:
    return _case(Layout(Grid(tp=2, dp=n // 2), "(dp b) s h"),
                 Layout(Grid(tp=4, dp=n // 4), "(dp b) s h"))


def fan_out(n: int) -> Case:
    return _case(Layout(Grid(tp=4, dp=n // 4), "(dp b) s h"),
                 Layout(Grid(tp=2, dp=n // 2), "(dp b) s h"))


def equal_cp(n: int) -> Case:
    return _case(Layout(Grid(tp=4, dp=n // 4), "(dp b) s h"),
                 Layout(Grid(tp=2, cp=2, dp=n // 4), "(dp b) (cp s) h", zigzag=("cp",)))


def fan_in_cp(n: int) -> Case:
    return _case(Layout(Grid(tp=2, dp=n // 2), "(dp b) s h"),
                 Layout(Grid(tp=2, cp=2, dp=n // 4), "(dp b) (cp s) h", zigzag=("cp",)))


def partial_fan_in(n: int) -> Case:
    return _case(Layout(Grid(tp=2, dp=n // 2), "(dp b) s h", partial=("tp",)),
                 Layout(Grid(tp=4, dp=n // 4), "(dp b) s h"))


def pipelined_tp4(n: int) -> Case:
    return _case(Layout(Grid(tp=2, dp=n // 4), "(dp b) s h"),
                 Layout(Grid(tp=4, dp=n // 8, offset=n // 2), "(dp b) s h"))


def pipelined_cp(n: int) -> Case:
    return _case(Layout(Grid(tp=2, dp=n // 4), "(dp b) s h"),
                 Layout(Grid(tp=2, cp=2, dp=n // 8, offset=n // 2), "(dp b) (cp s) h",
                        zigzag=("cp",)))


CASES: tuple[tuple[str, Callable[[int], Case]], ...] = (
    ("colocated fan-in TP2xDP(N/2) -> TP4xDP(N/4)", fan_in),
    ("colocated fan-out TP4xDP(N/4) -> TP2xDP(N/2)", fan_out),
    ("colocated equal DP TP4xDP(N/4) -> TP2xCP2xDP(N/4) zigzag", equal_cp),
    ("colocated fan-in TP2xDP(N/2) -> TP2xCP2xDP(N/4) zigzag", fan_in_cp),
    ("partial-TP input TP2xDP(N/2) -> TP4xDP(N/4)", partial_fan_in),
    ("pipelined TP2xDP(N/4) -> TP4xDP(N/8) on the other half", pipelined_tp4),
    ("pipelined TP2xDP(N/4) -> TP2xCP2xDP(N/8) zigzag, other half", pipelined_cp),
)


# -- the leader-based bridge, from its rules ------------------------------------------------
@dataclass
class Traffic:
    """Per-rank bytes of a scheme plus its phases' modelled times."""

    sent: dict[int, float]
    recv: dict[int, float]
    seconds: float

    @property
    def max_recv(self) -> float:
        return max(self.recv.values(), default=0.0)

    @property
    def max_sent(self) -> float:
        return max(self.sent.values(), default=0.0)

    @property
    def total(self) -> float:
        return sum(self.sent.values())


def _samples(i: int, parts: int, b: int) -> tuple[int, int]:
    return i * b // parts, (i + 1) * b // parts


def _add(traffic: dict[int, float], rank: int, n: float) -> None:
    traffic[rank] = traffic.get(rank, 0.0) + n


def _leader_messages(t: Traffic, frm: list[tuple[int, ...]], to: list[tuple[int, ...]],
                     b: int) -> None:
    """Each leader of ``frm`` sends each leader of ``to`` the samples both replicas cover
    (nothing when the two leaders are the same rank)."""
    pairs: dict[tuple[int, int], float] = defaultdict(float)
    for j, rep in enumerate(to):
        lo, hi = _samples(j, len(to), b)
        for i, src_rep in enumerate(frm):
            slo, shi = _samples(i, len(frm), b)
            overlap = max(0, min(hi, shi) - max(lo, slo))
            if overlap and src_rep[0] != rep[0]:
                pairs[src_rep[0], rep[0]] += overlap * SAMPLE
    for (s, d), n in pairs.items():
        _add(t.sent, s, n)
        _add(t.recv, d, n)
    t.seconds += p2p_seconds(pairs)


def _leader_broadcast(t: Traffic, reps: list[tuple[int, ...]], b: int) -> None:
    """Each leader broadcasts its replica's samples to its replica, as a pipelined chain."""
    slowest = 0.0
    for j, rep in enumerate(reps):
        lo, hi = _samples(j, len(reps), b)
        payload = (hi - lo) * SAMPLE
        for pos, r in enumerate(rep):
            if pos:
                _add(t.recv, r, payload)
            if pos < len(rep) - 1:
                _add(t.sent, r, payload)
        if len(rep) > 1:
            link = link_of(rep)
            slowest = max(slowest, (len(rep) - 1) * link.alpha + payload / link.beta)
    t.seconds += slowest


def _ring_all_reduce(t: Traffic, groups, nbytes: float) -> None:
    """Ring all-reduce of ``nbytes`` in each group: 2(k-1)/k of it in and out per rank."""
    slowest = 0.0
    for g in groups:
        k = len(g)
        share = 2 * (k - 1) / k * nbytes
        for r in g:
            _add(t.sent, r, share)
            _add(t.recv, r, share)
        slowest = max(slowest, 2 * (k - 1) * link_of(g).alpha + share / link_of(g).beta)
    t.seconds += slowest


def leader_bridge(case: Case) -> Traffic:
    """The pipelined bridge's scheme: src leaders -> dst leaders -> broadcast."""
    b = case.sizes["b"]
    t = Traffic({}, {}, 0.0)
    src_reps, dst_reps = replicas(case.src.grid), replicas(case.dst.grid)
    if case.src.partial:  # all-reduce over src TP to make the input TP-replicated
        _ring_all_reduce(t, src_reps, b // len(src_reps) * SAMPLE)
    _leader_messages(t, src_reps, dst_reps, b)
    _leader_broadcast(t, dst_reps, b)
    return t


def cp_allreduce_backward(case: Case) -> Traffic | None:
    """The seeds' CP backward: all-reduce the zero-padded replica gradient over CP; then
    colocated: narrow to the src batch (no traffic for fan-in or equal DP); pipelined: the
    leader path reversed (dst leaders -> src leaders -> broadcast over the src replica)."""
    grid = case.dst.grid
    if "cp" not in grid.names or grid.axis_size("cp") == 1:
        return None
    b = case.sizes["b"]
    t = Traffic({}, {}, 0.0)
    _ring_all_reduce(t, grid.groups("cp"), b // grid.axis_size("dp") * SAMPLE)
    if not set(case.src.grid.ranks) & set(grid.ranks):
        src_reps, dst_reps = replicas(case.src.grid), replicas(grid)
        _leader_messages(t, dst_reps, src_reps, b)
        _leader_broadcast(t, src_reps, b)
    return t


# -- the alpha-beta model ------------------------------------------------------------------
def p2p_seconds(pairs: dict[tuple[int, int], float]) -> float:
    """Point-to-point messages: per rank and link class, peers x alpha + bytes / beta; the
    classes overlap, the slowest rank sets the time."""
    bytes_: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    peers: dict[tuple[int, str], set[int]] = defaultdict(set)
    for (s, d), n in pairs.items():
        link = link_of((s, d))
        bytes_[s, link.name][0] += n
        bytes_[d, link.name][1] += n
        peers[s, link.name].add(d)
        peers[d, link.name].add(s)
    per_rank: dict[int, float] = defaultdict(float)
    for (rank, name), (out, into) in bytes_.items():
        link = NVLINK if name == NVLINK.name else IB
        t = len(peers[rank, name]) * link.alpha + max(out, into) / link.beta
        per_rank[rank] = max(per_rank[rank], t)
    return max(per_rank.values(), default=0.0)


def plan_seconds(p: Plan) -> float:
    """Modelled time of a mimo_fx plan: its steps one after the other."""
    total = 0.0
    for step in p.steps:
        pairs = step_matrix(p, step)
        if isinstance(step, Exchange):
            total += p2p_seconds(pairs)
            continue
        recv: dict[int, float] = defaultdict(float)
        for (_, d), n in pairs.items():
            recv[d] += n
        rounds = 2 if step.kind is Collective.ALL_REDUCE else 1
        total += max(rounds * (len(g) - 1) * link_of(g).alpha
                     + max(recv[r] for r in g) / link_of(g).beta for g in step.groups)
    return total


# -- image-token delivery -------------------------------------------------------------------
HIDDEN = 4096
ROW_BYTES = HIDDEN * ITEMSIZE  # one image embedding: hidden 4096, bf16
CPS = (2, 4, 8)
SAMPLES = 16  # per LLM DP replica
IMAGE_TOKENS = (256, 576, 1024)  # tokens per image
BATCH_SEED = 0
WHOLE_WORLD_UP_TO = 64  # larger worlds plan one LLM replica (replicas are identical)


@dataclass(frozen=True)
class Batch:
    """One LLM DP replica's samples: their token counts, and per image row (sample by
    sample, image by image) the position of the token it replaces in the unpadded packed
    sequence."""

    lengths: tuple[int, ...]
    positions: tuple[int, ...]
    image_tokens: tuple[int, ...]  # per sample

    @property
    def sample_rows(self) -> tuple[int, ...]:
        """Where each sample's image rows start, and the end of the last."""
        return (0, *accumulate(self.image_tokens))


def synthetic_batch(seed: int = BATCH_SEED) -> Batch:
    """SAMPLES samples of 64-2048 text tokens and 0-3 images of IMAGE_TOKENS tokens each,
    the images at random places in the text; fixed by ``seed``."""
    rng = random.Random(seed)
    lengths: list[int] = []
    positions: list[int] = []
    image_tokens: list[int] = []
    for _ in range(SAMPLES):
        images = [rng.choice(IMAGE_TOKENS) for _ in range(rng.randint(0, 3))]
        text = rng.randint(64, 2048)
        pos, prev = sum(lengths), 0
        for cut, n in zip(sorted(rng.randint(0, text) for _ in images), images):
            pos += cut - prev
            prev = cut
            positions.extend(range(pos, pos + n))
            pos += n
        lengths.append(text + sum(images))
        image_tokens.append(sum(images))
    return Batch(tuple(lengths), tuple(positions), tuple(image_tokens))


@dataclass(frozen=True)
class Delivery:
    """Who holds and who needs which image rows, as layouts: the encoder on DP over ranks
    0..N/2-1 (``(dp t) h``, ragged), the LLM as CP x DP (cp inner) on ranks N/2..N-1 (a
    ``PackedLayout`` of the batch in every replica, its image tokens selected); encoder
    rank d*cp + k encodes the k-th block of samples of LLM replica d, whose CP rank k
    needs the rows in its zigzag chunks."""

    world: int
    cp: int
    replicas: int  # LLM replicas planned
    rows: int      # image rows per replica
    src: Layout
    dst: PackedLayout
    counts: tuple[int, ...]  # image rows per encoder rank

    @property
    def src_ranks(self) -> range:
        return self.src.grid.ranks

    @property
    def dst_ranks(self) -> range:
        return self.dst.grid.ranks


def delivery(batch: Batch, world: int, cp: int, replicas: int) -> Delivery:
    """The layouts of the first ``replicas`` LLM replicas and their encoder ranks,
    replica d's rows numbered d*rows.. onwards."""
    rows, total = len(batch.positions), sum(batch.lengths)
    starts = batch.sample_rows
    counts = []
    for _ in range(replicas):
        for k in range(cp):
            lo, hi = _samples(k, cp, SAMPLES)
            counts.append(starts[hi] - starts[lo])
    src = Layout(Grid(dp=replicas * cp), "(dp t) h", ragged="dp")
    tokens = PackedLayout(Grid(cp=cp, dp=replicas, offset=world // 2), "t h",
                          [batch.lengths] * replicas)
    dst = tokens.select([d * total + p for d in range(replicas) for p in batch.positions])
    return Delivery(world, cp, replicas, rows, src, dst, tuple(counts))


def _row_pairs(p: RowRouting, direction: str) -> dict[tuple[int, int], float]:
    """Bytes each rank sends each other rank in one direction of a row plan."""
    return {pair: float(n * ROW_BYTES) for pair, n in p.pairs(direction).items()}


def row_plan_seconds(p: RowRouting) -> tuple[float, float]:
    """A row plan's modelled forward and backward: one all_to_all each."""
    return p2p_seconds(_row_pairs(p, "forward")), p2p_seconds(_row_pairs(p, "backward"))


def seed_seconds(dl: Delivery) -> tuple[float, float]:
    """The seed scheme's modelled forward and backward. Forward: encoder rank k of a
    replica sends its block to CP rank k (point-to-point), then a ring all-gather over CP
    gives every CP rank every block. Backward: a ring all-reduce of the whole replica's
    gradient over CP, then CP rank k returns block k's gradient to encoder rank k."""
    to_cp: dict[tuple[int, int], float] = {}
    gather = 0.0
    for d in range(dl.replicas):
        cp_ranks = tuple(range(dl.world // 2 + d * dl.cp, dl.world // 2 + (d + 1) * dl.cp))
        blocks = [dl.counts[d * dl.cp + k] for k in range(dl.cp)]
        for k, c in enumerate(cp_ranks):
            if blocks[k]:
                to_cp[d * dl.cp + k, c] = float(blocks[k] * ROW_BYTES)
        link = link_of(cp_ranks)
        gather = max(gather, (dl.cp - 1) * link.alpha
                     + (dl.rows - min(blocks)) * ROW_BYTES / link.beta)
    t = Traffic({}, {}, 0.0)
    groups = [tuple(range(dl.world // 2 + d * dl.cp, dl.world // 2 + (d + 1) * dl.cp))
              for d in range(dl.replicas)]
    _ring_all_reduce(t, groups, dl.rows * ROW_BYTES)
    back = {(c, e): n for (e, c), n in to_cp.items()}
    return p2p_seconds(to_cp) + gather, t.seconds + p2p_seconds(back)


@dataclass
class DeliveryRow:
    dl: Delivery
    plan: RowRouting

    def _cp_max(self, what: Callable[[int], int]) -> float:
        return float(max(what(r) for r in self.dl.dst_ranks) * ROW_BYTES)

    @property
    def fwd_recv(self) -> float:
        return self._cp_max(self.plan.received("forward").__getitem__)

    @property
    def bound(self) -> float:
        return self._cp_max(self.plan.needed_rows().__getitem__)

    @property
    def bwd_sent(self) -> float:
        return self._cp_max(self.plan.sent("backward").__getitem__)

    @property
    def seed(self) -> dict[str, float]:
        """The seed scheme's bytes per CP rank (its totals over a replica's CP ranks / cp)."""
        s = seed_bytes(self.dl.rows, range(self.dl.cp), ROW_BYTES)
        return {k: v / self.dl.cp for k, v in s.items()}

    def traffic_ratio(self, direction: str) -> float:
        """Seed bytes over mimo_fx bytes in ``direction``, summed over all ranks."""
        ours = sum(self.plan.sent(direction).values()) * ROW_BYTES
        seed = seed_bytes(self.dl.rows, range(self.dl.cp), ROW_BYTES)[direction]
        return seed * self.dl.replicas / ours if ours else math.inf

    @property
    def ok(self) -> bool:
        """Every rank receives its lower bound forward and sends it back, the encoder gets
        back what it sent, and the seed moves at least cp times as many bytes."""
        p = self.plan
        bound = p.needed_rows()
        return (p.received("forward") == bound
                and all(p.sent("backward")[r] == bound[r] for r in self.dl.dst_ranks)
                and all(p.received("backward")[r] == p.sent("forward")[r]
                        for r in self.dl.src_ranks)
                and all(self.traffic_ratio(d) >= self.dl.cp
                        for d in ("forward", "backward")))


def measure_delivery(batch: Batch, world: int, cp: int) -> DeliveryRow:
    replicas = world // 2 // cp if world <= WHOLE_WORLD_UP_TO else 1
    dl = delivery(batch, world, cp, replicas)
    # the row router's routing (both directions, in rows), whose forward plan the
    # planner's one entry point returns, as for every other table
    sizes = {"t": dl.counts, "h": HIDDEN}
    p = plan_layouts(dl.src, dl.dst, sizes, ITEMSIZE)
    assert p.row_bytes == ROW_BYTES
    assert plan(dl.src, dl.dst, sizes, ITEMSIZE).bytes_recv == {
        r: n * ROW_BYTES for r, n in p.received().items() if n}
    return DeliveryRow(dl, p)


def delivery_table(rows: list[DeliveryRow]) -> str:
    out = []
    for r in rows:
        fwd_s, bwd_s = row_plan_seconds(r.plan)
        seed_fwd_s, seed_bwd_s = seed_seconds(r.dl)
        seed = r.seed
        ratio = (f"{r.traffic_ratio('forward'):.2f} | {r.traffic_ratio('backward'):.2f}"
                 + ("" if r.ok else " CHECK"))
        peak = f"{seed['forward'] / r.fwd_recv:.2f} | {seed['backward'] / r.bwd_sent:.2f}"
        out.append([r.dl.world, r.dl.cp, r.dl.rows, _mib(r.fwd_recv), _mib(r.bound),
                    _mib(r.bwd_sent), _mib(seed["forward"]), _mib(seed["backward"]),
                    ratio, peak, _ms(fwd_s), _ms(bwd_s), _ms(seed_fwd_s),
                    _ms(seed_bwd_s), f"{(seed_fwd_s + seed_bwd_s) / (fwd_s + bwd_s):.2f}x",
                    "all" if r.dl.replicas * 2 * r.dl.cp == r.dl.world else "one replica"])
    return tabulate(out, disable_numparse=True, colalign=("right",) * 15 + ("left",),
                    headers=["N", "cp", "rows/replica", "fwd recv", "bound", "bwd sent",
                             "seed fwd", "seed bwd", "seed/mimo_fx total",
                             "seed/mimo_fx peak",
                             "fwd ms", "bwd ms", "seed fwd ms", "seed bwd ms", "speedup",
                             "planned"])


# -- measuring -------------------------------------------------------------------------------
@dataclass
class Row:
    case: str
    world: int
    fwd: Plan
    bwd: Plan | None
    leader: Traffic
    cp_bwd: Traffic | None
    fwd_s: float
    bwd_s: float | None

    @property
    def bound_ratio(self) -> float:
        bound = self.fwd.max_lower_bound
        return self.fwd.max_recv / bound if bound else (1.0 if not self.fwd.max_recv else
                                                         math.inf)

    @property
    def ok(self) -> bool:
        return self.fwd.max_recv == self.fwd.max_lower_bound


def measure(name: str, build: Callable[[int], Case], n: int) -> Row:
    case = build(n)
    fwd = plan(case.src, case.dst, case.sizes, ITEMSIZE)
    cp_bwd = cp_allreduce_backward(case)
    bwd = backward_plan(case.src, case.dst, case.sizes, ITEMSIZE) if cp_bwd else None
    return Row(name, n, fwd, bwd, leader_bridge(case), cp_bwd, plan_seconds(fwd),
               plan_seconds(bwd) if bwd else None)


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def sender_balance(p: Plan) -> str:
    """All-to-all steps: the busiest sender's bytes over an even split among the src ranks
    that hold data (1.00 = balanced); '-' without an all-to-all."""
    out = []
    holders = len(p.src.holders)
    for step in p.steps:
        if isinstance(step, Exchange):
            sent: dict[int, float] = defaultdict(float)
            for (s, _), n in step_matrix(p, step).items():
                sent[s] += n
            out.append(f"{max(sent.values()) / (sum(sent.values()) / holders):.2f}")
    return " ".join(out) or "-"


def bytes_table(rows: list[Row]) -> str:
    out = []
    for r in rows:
        f, lead = r.fwd, r.leader
        ratio = f"{r.bound_ratio:.2f}" + ("" if r.ok else " CHECK")
        peak = f"{lead.max_recv / f.max_recv:.2f}x" if f.max_recv else (
            "-" if not lead.max_recv else "inf")
        out.append([r.case, r.world, _mib(f.max_recv), _mib(f.max_sent), _mib(f.total_bytes),
                    collectives(f), ratio, sender_balance(f), _mib(lead.max_recv),
                    _mib(lead.max_sent), _mib(lead.total), peak])
    return tabulate(out, disable_numparse=True, colalign=("left",) + ("right",) * 4
                    + ("left",) + ("right",) * 6,
                    headers=["bridge", "N", "max recv", "max sent", "total", "collectives",
                             "recv/bound", "a2a sender balance", "leader recv", "leader sent",
                             "leader total", "leader/mimo_fx peak recv"])


def time_table(rows: list[Row]) -> str:
    out = []
    for r in rows:
        speedup = f"{r.leader.seconds / r.fwd_s:.2f}x" if r.fwd_s else "-"
        row = [r.case, r.world, _ms(r.fwd_s), _ms(r.leader.seconds), speedup]
        if r.bwd is not None and r.cp_bwd is not None:
            row += [_mib(r.bwd.max_recv), _mib(r.bwd.max_lower_bound),
                    _mib(r.cp_bwd.max_recv), _ms(r.bwd_s), _ms(r.cp_bwd.seconds),
                    f"{r.cp_bwd.seconds / r.bwd_s:.2f}x" if r.bwd_s else "-"]
        else:
            row += ["-"] * 6
        out.append(row)
    return tabulate(out, disable_numparse=True, colalign=("left",) + ("right",) * 10,
                    headers=["bridge", "N", "fwd mimo_fx ms", "fwd leader ms", "speedup",
                             "bwd recv", "bwd bound", "bwd all-reduce recv",
                             "bwd mimo_fx ms", "bwd all-reduce ms", "speedup"])


def chart(rows: list[Row], path: str) -> None:
    """Peak bytes per rank and modelled time at the largest world size, per bridge."""
    from matplotlib.figure import Figure

    world = max(r.world for r in rows)
    last = [r for r in rows if r.world == world]
    labels = [f"{i + 1}" for i in range(len(last))]
    fig = Figure(figsize=(13, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    x = range(len(last))
    width = 0.27
    colours = {"lower bound": "0.6", "mimo_fx": "C0", "leader-based": "C1"}
    series = [("lower bound", [r.fwd.max_lower_bound / MIB for r in last]),
              ("mimo_fx", [r.fwd.max_recv / MIB for r in last]),
              ("leader-based", [r.leader.max_recv / MIB for r in last])]
    for k, (name, values) in enumerate(series):
        left.bar([i + (k - 1) * width for i in x], values, width, label=name,
                 color=colours[name])
    left.set_xticks(list(x), labels)
    left.set_ylabel("peak MiB received per rank (forward)")
    left.set_xlabel("bridge (see legend below)")
    left.legend()
    left.set_title(f"forward, N = {world} ranks, s = h = {S}, bf16")
    for k, (name, values) in enumerate([("mimo_fx", [r.fwd_s * 1e3 for r in last]),
                                        ("leader-based", [r.leader.seconds * 1e3
                                                          for r in last])]):
        right.bar([i + (k - 0.5) * width for i in x], values, width, label=name,
                  color=colours[name])
    right.set_xticks(list(x), labels)
    right.set_ylabel("modelled forward time, ms")
    right.set_title("alpha-beta model: NVLink 300 GB/s, IB 25 GB/s per GPU, 8 GPUs/node")
    right.legend()
    legend = "\n".join(f"{i + 1}: {r.case}" for i, r in enumerate(last))
    fig.text(0.01, -0.02, legend, fontsize=8, va="top", family="monospace")
    fig.savefig(path, dpi=110, bbox_inches="tight")


def report(worlds: tuple[int, ...]) -> tuple[str, list[Row], list[DeliveryRow]]:
    rows = [measure(name, build, n) for name, build in CASES for n in worlds]
    batch = synthetic_batch()
    images = [measure_delivery(batch, n, cp) for n in worlds for cp in CPS if cp <= n // 2]
    buf = io.StringIO()
    print(f"plan quality: s = h = {S}, bf16, b = lcm(DP sizes); MiB per rank; worlds "
          f"{', '.join(map(str, worlds))}", file=buf)
    print("\nTable 1: forward bytes per rank, mimo_fx vs the lower bound and a leader-based "
          "bridge\n", file=buf)
    print(bytes_table(rows), file=buf)
    print(f"\nTable 2: alpha-beta model ({GPUS_PER_NODE} GPUs per node; NVLink alpha "
          f"{NVLINK.alpha * 1e6:.0f} µs, beta {NVLINK.beta / 1e9:.0f} GB/s; IB alpha "
          f"{IB.alpha * 1e6:.0f} µs, beta {IB.beta / 1e9:.0f} GB/s per GPU) and, for dst CP, "
          f"the backward: mimo_fx's adjoint plan vs all-reduce over CP of the zero-padded "
          f"gradient\n", file=buf)
    print(time_table(rows), file=buf)
    bad = [f"{r.case} N={r.world}" for r in rows if not r.ok]
    print(f"\nmax recv = lower bound on {len(rows) - len(bad)}/{len(rows)} rows"
          + (f"; CHECK: {'; '.join(bad)}" if bad else ""), file=buf)
    print(f"\nTable 3: image-token delivery, mimo_fx's row plan (a packed destination) vs the seed "
          f"scheme (all image rows to every CP rank, all-reduce over CP back); encoder DP on "
          f"N/2 ranks, LLM CP x DP on the other N/2; per replica {SAMPLES} samples with "
          f"{len(batch.positions)} image rows in {sum(batch.lengths)} tokens (seed "
          f"{BATCH_SEED}); rows of {ROW_BYTES} bytes; MiB per CP rank\n", file=buf)
    print(delivery_table(images), file=buf)
    bad = [f"N={r.dl.world} cp={r.dl.cp}" for r in images if not r.ok]
    print(f"\nfwd recv = bound, bwd sent = bound and seed/mimo_fx >= cp on "
          f"{len(images) - len(bad)}/{len(images)} rows"
          + (f"; CHECK: {'; '.join(bad)}" if bad else ""), file=buf)
    return buf.getvalue(), rows, images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"worlds {QUICK_WORLDS} only; writes no results")
    parser.add_argument("--no-save", action="store_true",
                        help="print only; do not write bench/results/plan_quality.*")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    text, rows, images = report(QUICK_WORLDS if args.quick else WORLDS)
    print(text, end="")
    print(f"(computed in {time.perf_counter() - start:.1f} s)")
    if not (args.quick or args.no_save):
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "plan_quality.txt"), "w") as f:
            f.write("# python bench/plan_quality.py (bytes are exact; times are the "
                    "alpha-beta model of the docstring, not measurements)\n")
            f.write(text)
        try:
            chart(rows, os.path.join(RESULTS, "plan_quality.png"))
        except ImportError:
            print("matplotlib is not installed (pip install matplotlib): no chart written",
                  file=sys.stderr)
        print(f"wrote {RESULTS}/plan_quality.txt and plan_quality.png")
    return 0 if all(r.ok for r in rows) and all(r.ok for r in images) else 1


if __name__ == "__main__":
    sys.exit(main())
