"""Collective kinds in one table: the places a new kind is added, and nothing else.

A new collective kind is added in exactly the four places of :data:`PLACES`:

1. ``mimo_fx/collective.py``: a member of ``Collective``, the kind's only spelling.
2. ``mimo_fx/steps.py``: its ``Step`` subclass. Setting ``kind`` registers it in
   ``STEPS``; it implements ``rank_groups``, ``restrict``, ``deliveries``, ``pairs`` and
   ``describe`` (``reduction_bound`` and ``summary`` have defaults). The planner's choice
   of when to emit it (one ``_Stage`` of ``plan._stages``, the groups it runs on beside
   it, which ``plan_groups`` and the plan's steps both read) is planning, which no table
   can supply.
3. ``compiled/lowering.py``: a function registered with ``@_lowers(Collective.X)``.
4. ``compiled/comm.py``: its ``OPS`` entry (``_comm_op``): the ordered custom op, how a
   comm's arguments become the op's, its fake, its plain tensor math over every member's
   input, and the names Flight Recorder gives it.

Everything else that handles a kind derives from those, and is checked here to cover
every kind: the plan's bytes and the explainer's matrix (``Step.traffic`` from
``pairs``), ``str(plan)`` and the explainer (``describe``, ``summary``), one rank's
part and the template symbolizer (``restrict``), the reference executor
(``deliveries``), the compiled executor (``comm.collective(op.kind, ...)``), the
functional, thread (``tests/threads.py``) and null (``bench/common.py``) comms (the
``OPS`` entry), the point-to-point channel (messages for the all-to-all and all-gather,
any other kind gathered and computed by its ``OPS`` math) and ``compiled/trace.py``
(``OPS[kind].recorded``).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from cases import CASES
from harness import mismatch, oracle_data
from threads import run_plan

from mimo_fx import Collective, MimoFxError, plan
from mimo_fx.compiled import comm, lowering
from mimo_fx.plan import STEPS, Exchange, Gather, Step, kind_of
from mimo_fx.reference import redistribute as reference_redistribute
from mimo_fx.reference import shard
from mimo_fx.reference.executor import ReferenceExecutor

ROOT = Path(__file__).resolve().parents[2]

# the four places a new kind is added: where, and whether the kind is there
PLACES = {
    "1. mimo_fx/collective.py: a Collective member":
        lambda kind: kind in Collective,
    "2. mimo_fx/steps.py: a Step subclass with kind = Collective.<KIND>":
        lambda kind: kind in STEPS,
    "3. compiled/lowering.py: a function registered with @_lowers(Collective.<KIND>)":
        lambda kind: kind in lowering._LOWER,
    "4. compiled/comm.py: an OPS entry made by _comm_op(Collective.<KIND>, ...)":
        lambda kind: kind in comm.OPS,
}


def missing_places(kind: Collective) -> list[str]:
    return [place for place, holds in PLACES.items() if not holds(kind)]


@pytest.mark.parametrize("kind", list(Collective), ids=lambda k: k.value)
def test_every_kind_is_in_every_place(kind: Collective):
    missing = missing_places(kind)
    assert not missing, f"collective {kind.value} is missing from: {'; '.join(missing)}"


def test_a_kind_missing_from_a_place_is_named(monkeypatch):
    monkeypatch.delitem(lowering._LOWER, Collective.ALL_REDUCE)
    assert missing_places(Collective.ALL_REDUCE) == [list(PLACES)[2]]
    assert missing_places(Collective.ALL_GATHER) == []


@pytest.mark.parametrize("kind", list(Collective), ids=lambda k: k.value)
def test_every_step_class_says_everything_its_kind_means(kind: Collective):
    """The reference executor (deliveries), the planner's cost (pairs), one rank's part
    (restrict) and printing (describe) ask the step class, so it must answer them all."""
    cls = STEPS[kind]
    assert cls.kind is kind and issubclass(cls, Step)
    assert not cls.__abstractmethods__, (
        f"{cls.__name__} ({kind.value}) must implement {sorted(cls.__abstractmethods__)}")


@pytest.mark.parametrize("kind", list(Collective), ids=lambda k: k.value)
def test_every_comm_op_is_one_consistent_entry(kind: Collective):
    """The op is ``mimo_fx::<kind>``, and the plain math the in-process comms run gives
    every member an output of the size the op's fake (what tracing sees) gives it."""
    entry = comm.OPS[kind]
    assert entry.kind is kind and entry.op.name() == f"mimo_fx::{kind.value}"
    ranks = (0, 1)
    flats = [torch.arange(4.0), torch.arange(4.0) + 10]
    ins = [(1, 3), (3, 1)] if kind is Collective.ALL_TO_ALL else [(), ()]
    outs = [tuple(s[i] for s in ins) for i in range(2)] if ins[0] else [(), ()]
    got = entry.compute(flats, outs, ins)
    for i, flat in enumerate(flats):
        assert got[i].shape == entry.output(flat, ranks, outs[i], ins[i]).shape


def _first_case(kind: Collective):
    """The first case of the shared table that plans a ``kind`` step (dst not partial,
    so the oracle says every output)."""
    return next((c for c in CASES if not c.dst.partial
                 and any(s.kind is kind for s in plan(c.src, c.dst, c.sizes).steps)), None)


@pytest.mark.parametrize("kind", list(Collective), ids=lambda k: k.value)
def test_every_kind_runs_in_the_reference_and_the_thread_comm(kind: Collective):
    """A case of the shared table plans each kind (so the reference and compiled tests
    run it), and its first such case matches the oracle through the reference executor
    and through every rank's lowered program in threads."""
    case = _first_case(kind)
    assert case is not None, (f"no case in tests/cases.py plans a {kind.value} step: add "
                              f"one, so the backends' tests run it")
    x, _ = oracle_data(case, 3)
    pieces = shard(x, case.src, **case.counts)
    p = plan(case.src, case.dst, case.sizes, torch.float64)
    threaded = run_plan(p, pieces, len(case.src.local_dims))
    ref = reference_redistribute(pieces, case.src, case.dst, **case.sizes)
    x_dst = x.permute([case.src.dims.index(d) for d in case.dst.dims])
    want = shard(x_dst, case.dst, **case.counts)
    for rank, y in want.items():
        assert not mismatch(case, ref[rank], y, f"{kind.value}: reference rank {rank}")
        assert not mismatch(case, threaded[rank], y, f"{kind.value}: threads rank {rank}")


# -- an unknown step is an error naming its class, never another kind ---------------------
@dataclasses.dataclass(frozen=True)
class Stranger:
    groups: tuple = ((0, 1),)


class Tweaked(Gather):
    """A subclass of a step class: not a registered step, though it inherits a kind."""


def _some_plan():
    case = _first_case(Collective.ALL_GATHER)
    return plan(case.src, case.dst, case.sizes)


@pytest.mark.parametrize("step", [Stranger(), Tweaked(((0, 1),), (((),), ((),)))],
                         ids=["stranger", "gather_subclass"])
def test_an_unknown_step_is_an_error_naming_its_class(step):
    name = type(step).__qualname__
    with pytest.raises(MimoFxError, match=f"{name} is not a plan step"):
        kind_of(step)
    p = _some_plan()
    with pytest.raises(MimoFxError, match=name):  # so never printed, costed or lowered
        dataclasses.replace(p, steps=(step,))
    with pytest.raises(MimoFxError, match=name):
        lowering._lower_step(step, 0, lowering._Resolver())
    with pytest.raises(MimoFxError, match=name):
        ReferenceExecutor._apply(step, {})


def test_a_kind_has_one_step_class():
    with pytest.raises(TypeError, match="already Exchange's"):
        class Another(Step):
            kind = Collective.ALL_TO_ALL
    assert STEPS[Collective.ALL_TO_ALL] is Exchange


# -- one spelling ---------------------------------------------------------------------------
def test_no_library_module_spells_a_kind_as_a_string():
    """A kind is a Collective everywhere: its value appears as a string literal in
    mimo_fx/collective.py only (``Collective.X.value`` where a name is needed)."""
    names = {kind.value for kind in Collective}
    found = []
    for folder in ("mimo_fx", "compiled", "reference", "mimo", "interop", "jobs", "testing"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "mimo_fx" / "collective.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, found
