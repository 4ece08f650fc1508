"""Structure counts of the library, read from its syntax trees (no import, no run).

    python bench/structure.py            # the counts, then each counted site

Two counts, each a property of the code's structure rather than of one spelling:

- **Module-level state**: names bound at a module's top level to a mutable container
  (``{}``, ``[]``, ``set()``, ``dict()``, ``list()``, ``deque``, ``Counter``,
  ``defaultdict``, ``OrderedDict``, ``WeakValueDictionary``, ``WeakKeyDictionary``,
  ``WeakSet``, or a dict/list/set comprehension), or to an instance of a class the
  module defines (an object that may hold state). Each is listed with its module, so a
  reader can tell the kind tables (filled at import, never changed) from the registries a
  bridge's state lives in.
- **Row special cases outside the layout modules**: every place outside
  ``mimo_fx/layout.py`` and ``mimo_fx/packed.py`` that asks which kind of layout, plan or
  sizing it holds: an ``isinstance``/``issubclass`` whose class names a row kind
  (``PackedLayout``, ``Selection``, ``RowRouting``, ``RowSizing``, ``RowRoute``,
  ``BoxRows``), a call of a predicate named ``is_row...``, and a read of a row-kind
  class (``RowRouting``, ``RowSizing``) or of a bridge's ``.rows`` or a sizing's
  ``.batched`` flag in a condition (``if``, ``while``, conditional expression,
  ``and``/``or``/``not`` operand).
- **Custom-op registration**: each ``torch.library.Library(...)`` fragment made, and each
  module that registers an op itself (calls ``torch.library``'s ``register_fake``,
  ``define``, ``impl``, ``custom_op`` or ``_register_effectful_op``, or a fragment's
  ``define``/``impl``): where the ``mimo_fx::`` ops and their side effects live.
- **Docstrings longer than their function**: functions and methods whose docstring has
  more lines than the rest of their body (each listed with its lines).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = [ROOT / "mimo_fx", ROOT / "compiled", ROOT / "reference"]
LAYOUT_MODULES = {"mimo_fx/layout.py", "mimo_fx/packed.py"}
CONTAINERS = {"dict", "list", "set", "deque", "Counter", "defaultdict", "OrderedDict",
              "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
ROW_KINDS = {"PackedLayout", "Selection", "RowRouting", "RowSizing", "RowRoute", "BoxRows"}


def _files() -> list[Path]:
    return sorted(p for folder in LIBRARY for p in folder.rglob("*.py")
                  if "testing" not in p.parts and "jobs" not in p.parts)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _name(node.value)
    return ""


def _mutable(value: ast.AST | None, classes: set[str]) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                          ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and _name(value.func) in CONTAINERS | classes


def module_state(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each module-level name bound to a mutable container (``__all__``
    and other dunders aside)."""
    out: list[tuple[int, str]] = []
    body = ast.parse(path.read_text()).body
    classes = {node.name for node in body if isinstance(node, ast.ClassDef)}
    for node in body:
        if isinstance(node, ast.Assign) and _mutable(node.value, classes):
            out += [(node.lineno, _name(t)) for t in node.targets if _name(t)]
        elif isinstance(node, ast.AnnAssign) and _mutable(node.value, classes) \
                and _name(node.target):
            out.append((node.lineno, _name(node.target)))
    return [(line, name) for line, name in out if not name.startswith("__")]


def _conditions(tree: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            out.append(node.test)
        elif isinstance(node, ast.BoolOp):
            out += node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append(node.operand)
        elif isinstance(node, ast.comprehension):
            out += node.ifs
    return out


def row_cases(path: Path) -> list[tuple[int, str]]:
    """(line, what) of each place that asks which kind of layout, plan or sizing it has."""
    tree = ast.parse(path.read_text())
    found: dict[tuple[int, int], str] = {}
    inside: set[int] = set()  # nodes of a counted call (not counted again as a condition)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = _name(node.func)
            if fn in ("isinstance", "issubclass") and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) \
                    else [node.args[1]]
                named = sorted({_name(k) for k in kinds} & ROW_KINDS)
                if named:
                    found[node.lineno, node.col_offset] = f"{fn}(..., {', '.join(named)})"
                    inside |= {id(n) for n in ast.walk(node)}
            elif fn.startswith("is_row"):
                found[node.lineno, node.col_offset] = f"{fn}(...)"
                inside |= {id(n) for n in ast.walk(node)}
    for test in _conditions(tree):
        for node in ast.walk(test):
            if id(node) in inside or not isinstance(node, (ast.Name, ast.Attribute)):
                continue
            name = _name(node)
            if name in ("RowRouting", "RowSizing") or (isinstance(node, ast.Attribute)
                                                    and name in ("rows", "batched")):
                found.setdefault((node.lineno, node.col_offset), f"condition on {name}")
    return sorted((line, what) for (line, _), what in found.items())


REGISTERS = {"register_fake", "define", "impl", "custom_op", "_register_effectful_op"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def op_registrations(path: Path) -> tuple[list[int], list[int]]:
    """(lines of each ``Library(...)`` made, lines of each op registered here)."""
    tree = ast.parse(path.read_text())
    fragments = {_name(t) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Call) and _name(node.value.func) == "Library"
                 for t in node.targets}
    made, registered = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        if _name(node.func) == "Library" and "library" in dotted:
            made.append(node.lineno)
        elif _name(node.func) in REGISTERS and (
                dotted.startswith("torch.library.") or dotted.rsplit(".", 1)[0] in fragments
                or _name(node.func) == "_register_effectful_op"):
            registered.append(node.lineno)
    return made, registered


def long_docstrings(path: Path) -> list[tuple[int, str, int, int]]:
    """(line, name, docstring lines, body lines) of each function whose docstring has
    more lines than the statements after it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is None or len(node.body) < 2:
            continue
        first = node.body[0]
        doc_lines = (first.end_lineno or first.lineno) - first.lineno + 1
        rest = node.body[1:]
        body_lines = (rest[-1].end_lineno or rest[-1].lineno) - rest[0].lineno + 1
        if doc_lines > body_lines:
            out.append((node.lineno, node.name, doc_lines, body_lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="the counts only")
    args = parser.parse_args(argv)
    state, rows, made, registering, docs = [], [], [], {}, []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        state += [(rel, line, name) for line, name in module_state(path)]
        fragments, registered = op_registrations(path)
        made += [(rel, line) for line in fragments]
        if registered:
            registering[rel] = registered
        docs += [(rel, *found) for found in long_docstrings(path)]
        if rel not in LAYOUT_MODULES:
            rows += [(rel, line, what) for line, what in row_cases(path)]
    print(f"module-level mutable state: {len(state)} names in "
          f"{len({s[0] for s in state})} modules")
    print(f"row special cases outside {', '.join(sorted(LAYOUT_MODULES))}: {len(rows)} in "
          f"{len({r[0] for r in rows})} modules")
    print(f"torch.library fragments: {len(made)}; modules registering mimo_fx:: ops: "
          f"{len(registering)}")
    print(f"functions whose docstring is longer than their body: {len(docs)}")
    if not args.quiet:
        print("\ntorch.library fragments and registrations:")
        for rel, line in made:
            print(f"  {rel}:{line}  Library(...)")
        for rel, lines in registering.items():
            print(f"  {rel}: registers at lines {', '.join(map(str, lines))}")
        print("\nfunctions whose docstring is longer than their body:")
        for rel, line, name, doc, body in docs:
            print(f"  {rel}:{line}  {name}: {doc} docstring lines, {body} of body")
        print("\nmodule-level mutable state:")
        for rel, line, name in state:
            print(f"  {rel}:{line}  {name}")
        print("\nrow special cases:")
        for rel, line, what in rows:
            print(f"  {rel}:{line}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
