"""How good mimo_fx's plans are: bytes per rank against the lower bound, a leader-based
bridge and an all-reduce-over-CP backward, and what the difference costs on a cluster.

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
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from common import collectives, replicas
from tabulate import tabulate

from mimo_fx import Grid, Layout, backward_plan, plan
from mimo_fx.explain import step_matrix
from mimo_fx.plan import Collective, Exchange, Plan

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


def report(worlds: tuple[int, ...]) -> tuple[str, list[Row]]:
    rows = [measure(name, build, n) for name, build in CASES for n in worlds]
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
    return buf.getvalue(), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"worlds {QUICK_WORLDS} only; writes no results")
    parser.add_argument("--no-save", action="store_true",
                        help="print only; do not write bench/results/plan_quality.*")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    text, rows = report(QUICK_WORLDS if args.quick else WORLDS)
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
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
