"""compiled/inductor_order.py's patch of inductor's scheduler: installed on the torch this
runs on (CI runs the suite on every torch the project supports: 2.13.0 and 2.14.1), and
its re-filing of ordering edges on a graph written by hand."""

from __future__ import annotations

import importlib
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest


def test_the_scheduler_is_patched_once_mimo_fx_compiled_is_imported():
    import mimo_fx.compiled  # noqa: F401  (installs the patch)

    scheduler = importlib.import_module("torch._inductor.scheduler")
    init = scheduler.Scheduler.__init__
    assert getattr(init, "_mimo_fx", False), "inductor's Scheduler.__init__ is not patched"
    from mimo_fx.compiled import inductor_order

    inductor_order.install()  # idempotent: patched once, not wrapped again
    assert scheduler.Scheduler.__init__ is init
    assert not any(isinstance(f, inductor_order._OnImport) for f in sys.meta_path)


class _Buffer:
    def __init__(self, op: str) -> None:
        self.op = op

    def get_operation_name(self) -> str:
        return self.op


@pytest.mark.parametrize("edges, want", [
    # an edge filed under a buffer's name moves to its operation's, joining any there
    ({"buf1": {"op0"}}, {"op1": {"op0"}}),
    ({"buf2": {"op1"}, "op2": {"op0"}}, {"op2": {"op0", "op1"}}),
    # names that are not buffers, and a buffer named as its operation, stay
    ({"op3": {"op2"}, "other": {"x"}}, {"op3": {"op2"}, "other": {"x"}}),
])
def test_ordering_edges_are_filed_under_operation_names(edges, want):
    from mimo_fx.compiled.inductor_order import refile_effect_edges

    deps: defaultdict[str, set[str]] = defaultdict(set, {k: set(v) for k, v in edges.items()})
    graph = SimpleNamespace(additional_star_deps=deps, name_to_buffer={
        "buf1": _Buffer("op1"), "buf2": _Buffer("op2"), "op3": _Buffer("op3")})
    refile_effect_edges(graph)
    assert dict(deps) == want
    refile_effect_edges(SimpleNamespace())  # a graph without such edges: nothing to do
