"""Layout kinds: the places a new kind of layout touches, and nothing else.

A layout is given by boxes (:class:`~mimo_fx.layout.Layout`) or row by row (a packed
batch, :class:`~mimo_fx.packed.PackedLayout`). A new kind is written in its own module
and answers the row-side questions :class:`~mimo_fx.rows.BoxRows` lists; outside the
layout modules it touches exactly the places of :data:`PLACES`, each asking "is this
pair given row by row?" once:

1. ``mimo_fx/rows.py: row_side``: a layout's row side (the one test of a class).
2. ``mimo_fx/plan.py: _routed_rows``: the planner routes rows or cuts boxes.
3. ``compiled/row_sizing.py: sizing_for``: the compiled backend's sizing.
4. ``reference/oracle.py: _cut``: the oracle's cut (independent math, on purpose apart).

(The reference backend's sizes come from src's row side, :func:`reference.executor._sizes`,
which asks nothing.)

Found by ``bench/structure.py``'s count of row special cases (every ``isinstance`` on a
row kind, every ``is_row...`` predicate, every condition on a row flag), located by the
function that holds each.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PLACES = {
    ("mimo_fx/rows.py", "row_side"),
    ("mimo_fx/plan.py", "_routed_rows"),
    ("compiled/row_sizing.py", "sizing_for"),
    ("reference/oracle.py", "_cut"),
}


def _structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "bench" / "structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _function_at(tree: ast.AST, line: int) -> str:
    """The innermost function holding ``line`` (``<module>`` where none does)."""
    best, span = "<module>", None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end and (span is None or end - node.lineno < span):
                best, span = node.name, end - node.lineno
    return best


def places_asking_the_kind() -> dict[tuple[str, str], list[str]]:
    """(module, function) -> what each asks, for every row special case outside the
    layout modules."""
    structure = _structure()
    found: dict[tuple[str, str], list[str]] = {}
    for path in structure._files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in structure.LAYOUT_MODULES:
            continue
        cases = structure.row_cases(path)
        if not cases:
            continue
        tree = ast.parse(path.read_text())
        for line, what in cases:
            found.setdefault((rel, _function_at(tree, line)), []).append(f"{line}: {what}")
    return found


def test_a_new_layout_kind_touches_the_listed_places_only():
    found = places_asking_the_kind()
    extra = {place: found[place] for place in set(found) - PLACES}
    assert not extra, (f"a layout's kind is asked outside the listed places: {extra}; "
                       f"ask the layout's row side (mimo_fx.rows.row_side) instead, or "
                       f"list the new place here and in the module docstring")
    assert set(found) == PLACES, f"listed places that no longer ask: {PLACES - set(found)}"
    assert len(PLACES) <= 4
    # each place asks once
    assert all(len(asks) == 1 for asks in found.values()), found


def test_only_the_row_side_tests_a_layout_class():
    """Every other place asks what the layout's holdings are (its row dims), not its
    class."""
    classes = {place: asks for place, asks in places_asking_the_kind().items()
               if any("isinstance" in a or "issubclass" in a for a in asks)}
    assert set(classes) == {("mimo_fx/rows.py", "row_side")}, classes


def test_the_place_finder_locates_a_new_special_case(tmp_path):
    """The check can fail: a special case written in a new function is found there."""
    structure = _structure()
    code = tmp_path / "m.py"
    code.write_text("def f(a, b):\n    return 1\n\n"
                    "def g(lay):\n    if is_row_layout(lay):\n        return 2\n")
    tree = ast.parse(code.read_text())
    assert [(_function_at(tree, line), what) for line, what in structure.row_cases(code)] \
        == [("g", "is_row_layout(...)")]
