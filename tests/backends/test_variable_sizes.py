"""Sizes that change every step, learned by the ranks that do not know them, one graph.

On two spawned gloo worlds (every scenario in one of them, under a timeout; 8 ranks
where the layouts need them, 4 otherwise):

- (a) colocated fan-in to zigzag CP (TP2xDP4 -> TP2xCP2xDP2), no sizes given: every
  rank learns them by the exchange; 8 sequence lengths in one compiled loop;
- (b) disjoint grids (DP2 on ranks 0-1 to zigzag CP2 on ranks 2-3, 4 ranks), receivers
  pass ``None`` and no sizes, 9 lengths, compiled ``fullgraph=True`` after one eager
  warm-up call;
- (c) ragged token counts per DP replica (zero-length shards included), fan-in and
  disjoint;

each with every output and input gradient equal to the oracle's (bitwise) and the
number of Dynamo graphs asserted (at most 2: the first compile is static, the second
marks the sizes dynamic; ragged counts get one graph when the ragged dim is marked
unbacked). Also: the exchange (Flight Recorder counts it), uneven learned sizes are
exact, sizes given per call, sizes outside the template (4 ranks), the bounded program
cache, and docs/examples/variable_sizes.py (docs/sizes.md's example: 2 graphs, losses
against full-tensor math). The 4-rank world also runs (a) and (b) under inductor with
``loss.backward()``.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from mimo_fx import Collective, Grid, Layout
from mimo_fx.reference import shard

pytestmark = pytest.mark.slow  # spawned worlds, long: not in the fast subset (tests/README.md)

ENC = Grid(tp=2, dp=4)
LLM = Grid(tp=2, cp=2, dp=2)
LENGTHS = (8, 12, 16, 20, 24, 28, 32, 36)   # multiples of the zigzag granule 2*CP


def _backend(name: str):
    """``name`` as a torch.compile backend (Dynamo's own graph count is asserted)."""
    return name


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _loop(bridge, src, dst, backend, sizes_of, make, *, warm_up=False, unbacked=False,
          rank: int, compiled: bool = True) -> list[str]:
    """Steps of ``y = bridge(x * w)`` at each size from ``sizes_of`` (a list of dicts of
    global sizes), compiled; values and input gradients against the oracle."""
    import torch._dynamo as dynamo

    from mimo_fx.reference import shard

    dynamo.reset()

    def step(x, w):
        return bridge(None if x is None else x * w)

    fn = torch.compile(step, backend=backend, fullgraph=True) if compiled else step
    problems = []
    for i, sizes in enumerate(sizes_of):
        X, G, counts = make(sizes, i)
        x = shard(X, src, **counts).get(rank)
        if x is not None:
            x = x.clone().requires_grad_()
            if unbacked and i > 0:
                dynamo.decorators.mark_unbacked(x, 0)
        w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        y = (step if warm_up and i == 0 else fn)(x, w)
        dst_counts = counts if dst.ragged else {}
        want = shard(X, dst, **dst_counts).get(rank)
        if want is None:
            if y.numel():
                problems.append(f"{sizes}: rank {rank} holds no dst piece but got {y.shape}")
        elif not torch.equal(y.detach(), want):
            problems.append(f"{sizes}: rank {rank} output differs from the oracle")
        cot = shard(G, dst, **dst_counts).get(rank)
        loss = (y * cot).sum() if cot is not None else y.sum() * 0
        loss.backward()
        if x is not None and not torch.equal(x.grad, shard(G, src, **counts)[rank]):
            problems.append(f"{sizes}: rank {rank} input gradient differs from the oracle")
    return problems


def _dense(dims: str):
    def make(sizes, seed):
        gen = torch.Generator().manual_seed(seed)
        shape = [sizes[d] for d in dims]
        return (torch.randn(shape, generator=gen, dtype=torch.float64),
                torch.randn(shape, generator=gen, dtype=torch.float64), {})
    return make


def _ragged(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(sizes["t"])
    return (torch.randn(t, sizes["h"], generator=gen, dtype=torch.float64),
            torch.randn(t, sizes["h"], generator=gen, dtype=torch.float64),
            {"t": sizes["t"]})


def _scenario_a(rank: int, backend: str, lengths=LENGTHS) -> dict:
    from mimo_fx.compiled import Redistributor

    src = Layout(ENC, "(dp b) s h")
    dst = Layout(LLM, "(dp b) (cp s) h", zigzag="cp")
    bridge = Redistributor(src, dst, None, torch.float64)   # every size learned per call
    before = _graphs()
    problems = _loop(bridge, src, dst, _backend(backend),
                     [{"b": 8, "s": s, "h": 6} for s in lengths], _dense("bsh"), rank=rank)
    graphs = _graphs() - before
    bridge.destroy()
    return {"problems": problems, "graphs": graphs}


def _scenario_b(rank: int, backend: str, src_grid=None, dst_grid=None) -> dict:
    from mimo_fx.compiled import Redistributor

    src = Layout(src_grid or Grid(tp=2, dp=2), "(dp b) s h")
    dst = Layout(dst_grid or Grid(tp=2, cp=2, offset=4), "b (cp s) h", zigzag="cp")
    bridge = Redistributor(src, dst, {"h": 8}, torch.float64)   # b and s learned
    before = _graphs()
    problems = _loop(bridge, src, dst, _backend(backend),
                     [{"b": 4, "s": 8 * (i + 1), "h": 8} for i in range(9)], _dense("bsh"),
                     warm_up=True, rank=rank)
    graphs = _graphs() - before
    bridge.destroy()
    return {"problems": problems, "graphs": graphs}


def _scenario_c(rank: int, backend: str) -> dict:
    from mimo_fx.compiled import Redistributor

    out = {}
    rnd = random.Random(7)
    counts = [tuple(rnd.choice((0, 1, 2, 3, 5, 6)) for _ in range(4)) for _ in range(8)]
    counts[0] = (3, 0, 5, 2)
    cases = {
        "fan_in": (Layout(ENC, "(dp t) h", ragged="dp"), Layout(LLM, "(dp t) h", ragged="dp")),
        "fan_in_replicated": (Layout(ENC, "(dp t) h", ragged="dp"), Layout(LLM, "t (tp h)")),
        "disjoint": (Layout(Grid(dp=4), "(dp t) h", ragged="dp"),
                     Layout(Grid(tp=2, dp=2, offset=4), "(dp t) h", ragged="dp")),
    }
    for name, (src, dst) in cases.items():
        bridge = Redistributor(src, dst, {"h": 4}, torch.float64)
        before = _graphs()
        problems = _loop(bridge, src, dst, _backend(backend),
                         [{"t": c, "h": 4} for c in counts], _ragged, warm_up=True,
                         unbacked=True, rank=rank)
        out[name] = {"problems": problems, "graphs": _graphs() - before}
        bridge.destroy()
    return out


def _exchange_facts(rank: int) -> dict:
    """When the exchange runs, uneven learned sizes, per-call sizes, eager sizes outside
    the template, the bounded cache."""
    from mimo_fx.compiled import Redistributor, redistributor, trace
    from mimo_fx.reference import shard

    out: dict = {}
    src, dst = Layout(ENC, "(dp b) s h"), Layout(LLM, "(dp b) (cp s) h", zigzag="cp")
    # (frozen=False: no call meets to decide whether the source is frozen)
    bridge = Redistributor(src, dst, {"h": 6}, torch.float64, frozen=False)
    gen = torch.Generator().manual_seed(0)   # the same global tensor on every rank
    X = torch.randn(8, 16, 6, dtype=torch.float64, generator=gen)
    x = shard(X, src)[rank]
    start = trace.mark()
    y = bridge(x)                         # b, s learned: one exchange + the data
    learned = trace.since(start)
    start = trace.mark()
    y2 = bridge(x, b=8, s=16)              # every size given: checked by one exchange
    given = trace.since(start)
    out["one_exchange_per_call_learned_or_given"] = (
        [c.kind for c in learned] == [Collective.ALL_GATHER] * 2
        and [c.kind for c in given] == [Collective.ALL_GATHER] * 2
        and learned[0].ranks == tuple(range(8)) and torch.equal(y, y2)
        and torch.equal(y, shard(X, dst)[rank]))
    # uneven sizes (b=7 over dp 4 and 2, s=10 not a multiple of the zigzag granule 4 is
    # refused by zigzag itself, so s=12): learned exactly from every holder's shape
    X = torch.randn(7, 12, 6, dtype=torch.float64, generator=gen)
    y = bridge(shard(X, src)[rank])
    out["uneven_sizes_learned_exactly"] = torch.equal(y, shard(X, dst)[rank])
    # many sizes: the program cache keeps the most recent ones only
    for s in range(4, 4 * (redistributor.CACHED_SIZES + 10), 4):
        bridge(shard(torch.zeros(8, s, 6, dtype=torch.float64), src)[rank], b=8, s=s)
    out["cache_is_bounded"] = len(bridge.sizing._cache) == redistributor.CACHED_SIZES
    bridge.destroy()
    return out


def _outside_the_template(rank: int, enc: Grid, llm: Grid) -> dict:
    """Sizes given under torch.compile that no template serves: an uneven batch, and
    ragged counts cut by an even CP layout (planned per count pattern); each its own
    graph, values and gradients still the oracle's (``enc``: a dp grid of 4, ``llm`` one
    with cp 2 and dp 2)."""
    import torch._dynamo as dynamo

    from mimo_fx.compiled import Redistributor
    from mimo_fx.reference import shard

    out = {}
    src, dst = Layout(enc, "(dp b) s h"), Layout(llm, "(dp b) (cp s) h", zigzag="cp")
    bridge = Redistributor(src, dst, {"h": 6}, torch.float64)
    fn = torch.compile(lambda x, b, s: bridge(x, b=b, s=s), backend="aot_eager",
                       fullgraph=True)
    problems = []
    dynamo.reset()
    for b, s in ((8, 16), (7, 12), (8, 20)):   # b=7 over dp 4 and 2 is uneven
        X = torch.arange(b * s * 6, dtype=torch.float64).reshape(b, s, 6)
        y = fn(shard(X, src)[rank], b, s)
        if not torch.equal(y, shard(X, dst)[rank]):
            problems.append(f"b={b}, s={s}: output")
    out["uneven_given"] = problems
    bridge.destroy()
    src = Layout(enc, "(dp t) h", ragged="dp")
    dst = Layout(llm, "(cp t) h")
    bridge = Redistributor(src, dst, {"h": 2}, torch.float64)
    problems = []
    dynamo.reset()
    before = _graphs()
    fn = torch.compile(lambda x, t: bridge(x, t=t), backend="aot_eager", fullgraph=True)
    for counts in ((3, 0, 5, 2), (1, 1, 1, 1), (3, 0, 5, 2)):
        X = torch.arange(sum(counts) * 2, dtype=torch.float64).reshape(-1, 2)
        y = fn(shard(X, src, t=counts)[rank], counts)
        if not torch.equal(y, shard(X, dst)[rank]):
            problems.append(f"t={counts}: output")
    out["ragged_to_cp_given"] = problems
    out["ragged_to_cp_graphs"] = _graphs() - before
    bridge.destroy()
    return out


EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "variable_sizes.py"


def _example():
    spec = importlib.util.spec_from_file_location("variable_sizes", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example(rank: int, world: int) -> dict:
    """docs/examples/variable_sizes.py (docs/sizes.md's example) as written, under
    aot_eager (inductor is tested on 4 ranks below): its granules, graphs and losses."""
    import torch._dynamo as dynamo

    dynamo.reset()
    before = _graphs()
    granules, losses, grad = _example().train(rank, world, backend="aot_eager")
    return {"granules": granules, "graphs": _graphs() - before, "grad": grad,
            "losses": losses}


def _ragged_to_even(rank: int, backend: str) -> dict:
    """Counts learned under torch.compile, from a ragged encoder dim into an even CP cut
    (ranks 0-1 -> ranks 2-3, and into zigzag CP when the total allows; and into CP×TP
    on all four, its features cut too): no template
    serves them (the pieces are intersections of two sets of bounds), so the bridge
    routes them as rows; values and gradients the oracle's, at most two graphs."""
    import torch._dynamo as dynamo

    import mimo_fx
    from mimo_fx.compiled import Redistributor
    from mimo_fx.reference import shard

    out: dict = {}
    src = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    for name, dst in (("even", Layout(Grid(cp=2, offset=2), "(cp t) h")),
                      ("zigzag", Layout(Grid(cp=2, offset=2), "(cp t) h", zigzag="cp")),
                      # (features cut too, unevenly: h=3 over tp=2, on all 4 ranks)
                      ("cut_features", Layout(Grid(cp=2, tp=2), "(cp t) (tp h)"))):
        bridge = Redistributor(src, dst, {"h": 3}, torch.float64)
        dynamo.reset()
        before = _graphs()
        fn = torch.compile(lambda x, b=bridge: b(x), backend=backend, fullgraph=True)
        problems = []
        for k, counts in enumerate(((5, 3), (2, 10), (0, 8), (6, 6), (7, 1))):
            X = torch.arange(sum(counts) * 3, dtype=torch.float64).reshape(-1, 3) + k
            G = torch.randn(X.shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(k))
            x = shard(X, src, t=counts).get(rank)
            if x is not None:
                x = x.clone().requires_grad_()
                dynamo.decorators.mark_unbacked(x, 0)  # 0, 1, ... rows: one graph
            y = fn(x)
            if rank in dst.grid.ranks:
                if not torch.equal(y, shard(X, dst)[rank]):
                    problems.append(f"t={counts}: output")
                (y * shard(G, dst)[rank]).sum().backward()
            else:
                mimo_fx.backward()
            if x is not None and not torch.equal(x.grad, shard(G, src, t=counts)[rank]):
                problems.append(f"t={counts}: input gradient")
        out[name] = {"problems": problems, "graphs": _graphs() - before,
                     "rows": type(bridge.sizing).__name__}
        bridge.destroy()
    return out


def _world8(rank: int, world: int) -> dict:
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    return {"a": _scenario_a(rank, "aot_eager"), "c": _scenario_c(rank, "aot_eager"),
            "facts": _exchange_facts(rank), "example": _run_example(rank, world)}


def _world4(rank: int, world: int) -> dict:
    """The scenarios that need no 8 ranks, on 4 (each rank's compile costs a quarter of
    a core on 8, half of one on 4): (b) under aot_eager; sizes outside the template
    (the uneven batch still uneven over dp 4 and 2); (a) and (b) under inductor."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1
    return {"aot_eager": {"b": _scenario_b(rank, "aot_eager", Grid(dp=2), Grid(cp=2, offset=2)),
                          "outside": _outside_the_template(rank, Grid(dp=4),
                                                           Grid(cp=2, dp=2)),
                          "ragged_to_even": _ragged_to_even(rank, "aot_eager"),
                          "cut_unsized": _cut_features_unsized(rank)},
            "inductor": {**_inductor4(rank), "ragged_to_even": _ragged_to_even(rank, "inductor")}}


def _cut_features_unsized(rank: int) -> str:
    """Learned counts into a dst that cuts a feature the bridge was not built with the
    size of: what a traced call says."""
    from mimo_fx.compiled import Redistributor
    from mimo_fx.reference import shard

    src = Layout(Grid(dp=2), "(dp t) h", ragged="dp")
    bridge = Redistributor(src, Layout(Grid(cp=2, tp=2), "(cp t) (tp h)"), dtype=torch.float64,
                           frozen=True)
    x = shard(torch.randn(8, 4, dtype=torch.float64), src, t=(5, 3)).get(rank)
    try:
        torch.compile(bridge, backend="aot_eager", fullgraph=True)(x)
        return "returned"
    except Exception as err:  # (Dynamo's wrapper, around the bridge's MimoFxError)
        return str(err)
    finally:
        bridge.destroy()


def _inductor4(rank: int) -> dict:
    src_a = Grid(dp=4)
    out = {}
    from mimo_fx.compiled import Redistributor

    src = Layout(src_a, "(dp b) s h")
    dst = Layout(Grid(cp=2, dp=2), "(dp b) (cp s) h", zigzag="cp")
    bridge = Redistributor(src, dst, {"h": 4}, torch.float64)
    before = _graphs()
    problems = _loop(bridge, src, dst, "inductor",
                     [{"b": 4, "s": s, "h": 4} for s in (8, 12, 16, 20, 24, 28, 32, 36)],
                     _dense("bsh"), rank=rank)
    out["a"] = {"problems": problems, "graphs": _graphs() - before}
    bridge.destroy()
    out["b"] = _scenario_b(rank, "inductor", Grid(dp=2), Grid(cp=2, offset=2))
    return out


@pytest.fixture(scope="module")
def world8(worlds):
    return worlds.run(8, _world8, record=True, timeout=900)


@pytest.fixture(scope="module")
def world4(worlds):
    return worlds.run(4, _world4, timeout=900)


def _problems(results, key):
    return {r: res[key]["problems"] for r, res in enumerate(results) if res[key]["problems"]}


@pytest.mark.parametrize("scenario", ["a", "b"])
def test_aot_eager_loops_equal_the_oracle_in_at_most_two_graphs(world8, world4, scenario):
    results = world8 if scenario == "a" else [res["aot_eager"] for res in world4]
    assert not _problems(results, scenario)
    graphs = [res[scenario]["graphs"] for res in results]
    assert max(graphs) <= 2, graphs


@pytest.mark.parametrize("case", ["fan_in", "fan_in_replicated", "disjoint"])
def test_ragged_counts_per_replica_equal_the_oracle(world8, case):
    problems = {r: res["c"][case]["problems"] for r, res in enumerate(world8)
                if res["c"][case]["problems"]}
    assert not problems
    # the ragged dim marked unbacked: one graph per rank for every count pattern
    assert [res["c"][case]["graphs"] for res in world8] == [1] * 8


@pytest.mark.parametrize("fact", ["one_exchange_per_call_learned_or_given",
                                  "uneven_sizes_learned_exactly", "cache_is_bounded"])
def test_exchange_facts(world8, fact):
    assert all(res["facts"][fact] for res in world8), [res["facts"][fact] for res in world8]


def test_sizes_outside_the_template_compile_alone_and_stay_exact(world4):
    for res in (r["aot_eager"] for r in world4):
        assert res["outside"]["uneven_given"] == [] and res["outside"]["ragged_to_cp_given"] == []
        # (ragged counts into an even CP cut go as rows: one graph for both count
        # patterns, or two where Dynamo's first compile is static)
        assert res["outside"]["ragged_to_cp_graphs"] <= 2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_learned_counts_into_an_even_cp_cut_compile_exactly(world4, backend):
    """Before: "sizes learned under torch.compile must fit the bridge's template (none:
    its plan depends on the sizes); give the sizes in the call"."""
    for rank, res in enumerate(world4):
        for name, got in res[backend]["ragged_to_even"].items():
            assert got["problems"] == [] and got["rows"] == "RowSizing", (rank, name, got)
            assert got["graphs"] <= 2, (rank, name, got)


def test_learned_counts_into_cut_features_of_no_given_size_say_how(world4):
    for rank, res in enumerate(world4):
        said = res["aot_eager"]["cut_unsized"]
        assert "sizes learned under torch.compile must fit" in said, (rank, said)
        assert "build the bridge with the sizes of 'h'" in said, (rank, said)


def test_the_docs_example_runs_in_two_graphs_and_equals_full_tensor_math(world8):
    """docs/examples/variable_sizes.py: 4 lengths in 2 graphs on every rank, each rank's
    loss the mean square of its dst piece of ``tanh(X @ W)``."""
    example = _example()
    dst = Layout(LLM, "(dp b) (cp s) h", zigzag="cp")
    for rank, res in enumerate(world8):
        got = res["example"]
        assert (got["granules"], got["graphs"], got["grad"]) == ({"b": 4, "s": 4}, 2, True)
        for s, loss in zip(example.LENGTHS, got["losses"]):
            y = torch.tanh(example.batch(s) @ example.weight())
            torch.testing.assert_close(loss, (shard(y, dst)[rank] ** 2).mean())


@pytest.mark.parametrize("scenario", ["a", "b"])
def test_inductor_with_backward_equals_the_oracle_in_at_most_two_graphs(world4, scenario):
    results = [res["inductor"] for res in world4]
    assert not _problems(results, scenario)
    graphs = [res[scenario]["graphs"] for res in results]
    assert max(graphs) <= 2, graphs
