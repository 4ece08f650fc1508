"""Templates: one lowered program per rank serves every size of its regime.

A template is the plan pair at template sizes whose lowered programs hold polynomials
in the sizes (:mod:`mimo_fx.templates`, :mod:`mimo_fx.symbolic`). Here every rank's
template program runs in threads (collectives emulated, see ``threads.py``) at sizes
other than the template's -- several multiples of the granules for even dims, random
counts (zero-length shards included) for ragged dims -- both evaluated eagerly
(``lowering.at``) and evaluated by the executor on the fly (as under
``torch.compile``), and every output and input gradient must equal the oracle's
``shard(X, dst)`` / ``shard(G, src*)`` for *those* sizes, bitwise.
"""

from __future__ import annotations

import pytest
from cases import CASES, RAGGED, Case, case_ids, star
from harness import expected_input_grad, expected_output, mismatch, oracle_data
from hypothesis import given, settings
from hypothesis import strategies as st
from threads import run_programs

from mimo_fx import Grid, Layout
from mimo_fx.compiled import lowering
from mimo_fx.reference import shard
from mimo_fx.symbolic import Expr, Undecided, known_ge, smax
from mimo_fx.templates import Template

EVEN = [c for c in CASES if "uneven" not in c.tags]
COUNT_FREE = [c for c in RAGGED if c.count_free]


def _template(case: Case, free=None) -> Template | None:
    free = tuple(case.src.dims) if free is None else free
    return Template.build(case.src, case.dst, case.sizes, 8, (), free)


def _programs(t: Template, case: Case) -> tuple[dict, dict]:
    ranks = sorted(set(case.src.grid.ranks) | set(case.dst.grid.ranks))
    return ({r: lowering.lower(t.fwd, r, t.fwd_sym) for r in ranks},
            {r: lowering.lower(t.bwd, r, t.bwd_sym) for r in ranks})


def _check_at(case: Case, t: Template, programs, seed: int) -> list[str]:
    """Run the template's programs at ``case.sizes`` (both ways) against the oracle."""
    assert t.fits(case.sizes), (t.describe(), case.sizes)
    env = t.env(case.sizes)
    x, g = oracle_data(case, seed)
    want_y, want_g = expected_output(case, x), expected_input_grad(case, g)
    pieces, cots = shard(x, case.src, **case.counts), shard(g, star(case.dst), **case.counts)
    fwd, bwd = programs
    problems = []
    for how in ("evaluated", "on the fly", "straight"):
        if how == "evaluated":
            ys = run_programs({r: lowering.at(p, env) for r, p in fwd.items()}, pieces,
                              len(case.src.local_dims))
            gs = run_programs({r: lowering.at(p, env) for r, p in bwd.items()}, cots,
                              len(case.dst.local_dims))
        else:  # the template's numbers at env: by the executor, or by the function
            run = "straight" if how == "straight" else "interpreted"
            ys = run_programs(fwd, pieces, len(case.src.local_dims), env, how=run)
            gs = run_programs(bwd, cots, len(case.dst.local_dims), env, how=run)
        for r in ys:
            problems.append(mismatch(case, ys[r], want_y.get(r), f"{how} rank {r}: output"))
        for r, w in want_g.items():
            problems.append(mismatch(case, gs[r], w, f"{how} rank {r}: input gradient",
                                     exact=not case.src.partial))
    return [p for p in problems if p]


@pytest.mark.parametrize("case", EVEN, ids=case_ids(EVEN))
def test_even_template_serves_other_multiples_of_its_granules(case: Case):
    t = _template(case)
    assert t is not None, "an evenly cut case has a template"
    programs = _programs(t, case)
    for k, scale in enumerate((1, 2, 3)):
        sizes = {d: t.granules[d] * (scale + i) for i, d in enumerate(t.granules)}
        problems = _check_at(Case(case.name, case.src, case.dst, sizes), t, programs, k)
        assert not problems, (sizes, problems)


@pytest.mark.parametrize("case", EVEN[::3] + COUNT_FREE[::2],
                         ids=case_ids(EVEN[::3] + COUNT_FREE[::2]))
def test_a_rank_s_template_is_the_whole_template_s_part(case: Case):
    """What a bridge builds (its rank's parts of the template plans) lowers to the same
    program as the whole template, with the same granules on every rank."""
    whole = _template(case)
    assert whole is not None
    for rank in sorted(set(case.src.grid.ranks) | set(case.dst.grid.ranks)):
        mine = Template.build(case.src, case.dst, case.sizes, 8, (), tuple(case.src.dims),
                              rank=rank)
        assert mine is not None and mine.granules == whole.granules
        assert mine.variables == whole.variables
        for a, b, sa, sb in ((mine.fwd, whole.fwd, mine.fwd_sym, whole.fwd_sym),
                             (mine.bwd, whole.bwd, mine.bwd_sym, whole.bwd_sym)):
            assert lowering.lower(a, rank, sa) == lowering.lower(b, rank, sb)


@pytest.mark.parametrize("case", [c for c in CASES if "uneven" in c.tags],
                         ids=case_ids([c for c in CASES if "uneven" in c.tags]))
def test_uneven_cuts_give_no_template(case: Case):
    assert _template(case) is None


@pytest.mark.parametrize("case", [c for c in RAGGED if not c.count_free],
                         ids=case_ids([c for c in RAGGED if not c.count_free]))
def test_a_ragged_dim_an_even_layout_cuts_gives_no_template(case: Case):
    assert _template(case) is None
    assert _template(case, free=tuple(d for d in case.src.dims if d not in case.counts))


@st.composite
def _ragged_case(draw):
    case = draw(st.sampled_from(COUNT_FREE))
    counts = {d: tuple(draw(st.lists(st.integers(0, 4), min_size=len(c), max_size=len(c))))
              for d, c in case.counts.items()}
    scale = draw(st.integers(1, 3))
    return case, counts, scale


_PROGRAMS: dict[str, tuple] = {}


@settings(max_examples=40, deadline=None)
@given(_ragged_case(), st.integers(0, 100))
def test_ragged_template_serves_every_count(drawn, seed: int):
    case, counts, scale = drawn
    t = _template(case)
    assert t is not None
    if case.name not in _PROGRAMS:
        _PROGRAMS[case.name] = _programs(t, case)
    sizes = {**case.sizes, **counts,
             **{d: n * scale for d, n in t.granules.items()}}
    assert not _check_at(Case(case.name, case.src, case.dst, sizes), t,
                         _PROGRAMS[case.name], seed)


def test_fixed_dims_are_constants_and_only_free_ones_vary():
    src = Layout(Grid(tp=2, dp=4), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, dp=2), "(dp b) (cp s) h", zigzag="cp")
    t = Template.build(src, dst, {"b": 8, "s": 16, "h": 6}, 4, (), free=("s",))
    assert t.variables == (("u", "s"),) and t.granules == {"s": 4}
    assert not t.fits({"b": 8, "s": 18, "h": 6})
    program = lowering.lower(t.fwd, 0, t.fwd_sym)
    assert lowering.symbolic(program)
    assert not lowering.symbolic(lowering.at(program, t.env({"b": 8, "s": 40, "h": 6})))


def test_template_granules_follow_the_planner_s_own_cuts(two_rounds):
    """Disjoint grids with dst replicas, in two rounds: each replica takes a share of the
    dst piece's outermost dim that splits evenly (b: a share is then a contiguous run of
    the piece) and gathers the rest, so b's granule doubles and s's is zigzag CP's alone."""
    src = Layout(Grid(tp=2, dp=2), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, offset=4), "b (cp s) h", zigzag="cp")
    t = Template.build(src, dst, {"b": 4, "s": 16, "h": 64}, 4, (), free=("b", "s"))
    assert t.granules == {"b": 4, "s": 4}


def test_template_granules_of_one_round_are_the_layouts_own():
    """The same bridge in one round (its exchange is small): no share is cut, so b's
    granule is the src DP's alone."""
    src = Layout(Grid(tp=2, dp=2), "(dp b) s h")
    dst = Layout(Grid(tp=2, cp=2, offset=4), "b (cp s) h", zigzag="cp")
    t = Template.build(src, dst, {"b": 4, "s": 16, "h": 64}, 4, (), free=("b", "s"))
    assert t.granules == {"b": 2, "s": 4}


def test_polynomials_decide_only_what_holds_for_every_size():
    u = Expr.var(("u", "s"), 4)
    c0, c1 = Expr.var(("c", "t", 0), 2), Expr.var(("c", "t", 1), 3)
    assert known_ge(3 * u, 2 * u) and not known_ge(2 * u, 3 * u)
    assert known_ge(c0 + c1, c0) and not known_ge(c0, 1)  # a count may be 0
    assert c0 < c0 + c1 and smax(c0, c0 + c1) == c0 + c1    # positions that may coincide
    with pytest.raises(Undecided):
        smax(c0, c1)                                         # no order for every count
    with pytest.raises(TypeError, match="no truth value"):
        bool(u)
    assert (u - u) == 0 and isinstance(u - u, int)
    assert (2 * u * c0).eval({("u", "s"): 5, ("c", "t", 0): 7}) == 70


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-5, 5), st.integers(0, 2), st.integers(0, 2)),
                min_size=1, max_size=4),
       st.integers(0, 9), st.integers(0, 9), st.integers(0, 9))
def test_a_primed_polynomial_has_the_value_of_its_terms(terms, u, c0, c1):
    """Expr.prime compiles a polynomial into one Python expression (what a traced call
    evaluates): its value is the sum of coef * u**i * c0**j (* c1) written out here."""
    vu, v0, v1 = Expr.var(("u", "s"), 4), Expr.var(("c", "t", 0), 2), Expr.var(("c", "t", 1), 3)
    env = {("u", "s"): u, ("c", "t", 0): c0, ("c", "t", 1): c1}
    poly, want = vu - vu, 0
    for coef, i, j in terms:
        term = coef * v1
        for factor in [vu] * i + [v0] * j:
            term = term * factor
        poly = poly + term
        want += coef * u ** i * c0 ** j * c1
    if not isinstance(poly, Expr):
        return  # (the terms cancelled: a plain int, nothing to prime)
    before = poly.eval(env)
    poly.prime()
    assert poly.eval(env) == before == want


@pytest.mark.parametrize("rank", [0, 1, 4, 7])
def test_a_free_size_bridges_large_calls_are_planned_at_their_sizes(rank):
    """A TP-replicated source behind a fan-out: the template (small sizes, one round)
    sends each TP rank its gradient; at 16 MiB the plan sends it once across and
    all-gathers it over TP, and an eager call of the free-size bridge runs that plan
    (the groups it needs were made with the bridge's)."""
    import torch

    from mimo_fx.compiled.sizing import Sizing, _size_key

    src = Layout(Grid(tp=2, dp=2), "(dp b) s h")
    dst = Layout(Grid(dp=4, offset=4), "(dp b) s h")
    free = Sizing(src, dst, None, torch.float32, (), rank, "test")
    assert {(0, 1), (2, 3)} <= set(free.groups["backward"])
    for s, rounds in ((8, ["all_to_all"]), (2048, ["all_to_all", "all_gather"])):
        full = {"b": 8, "s": s, "h": 256}
        fixed = Sizing(src, dst, full, torch.float32, (), rank, "test")
        fwd, bwd = free.programs_at(_size_key(full))
        assert [o.kind.value for o in bwd.ops] == rounds[:len(bwd.ops)]
        assert [(o.kind, o.ranks) for o in bwd.ops] == \
               [(o.kind, o.ranks) for o in fixed.bwd_program.ops]
        assert [(o.kind, o.ranks) for o in fwd.ops] == \
               [(o.kind, o.ranks) for o in fixed.fwd_program.ops]
        if rank >= 4:  # a receiver's gradient: to both TP ranks, then to one
            assert len(bwd.ops[0].pack) == (2 if s == 8 else 1), (s, bwd.ops[0].pack)
