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
- **Module-level state that only grows**: of those, each container that code adds to
  and nothing takes from: a plain one its module's functions fill, or an attribute
  that the methods of a module-level object's class fill and never empty or replace
  (weak containers aside: what they hold lives elsewhere; tables a decorator or an
  ``__init_subclass__`` fills at import aside).
- **Custom-op registration**: each ``torch.library.Library(...)`` fragment made, and each
  module that registers an op itself (calls ``torch.library``'s ``register_fake``,
  ``define``, ``impl``, ``custom_op`` or ``_register_effectful_op``, or a fragment's
  ``define``/``impl``): where the ``mimo_fx::`` ops and their side effects live.
- **Cut rules compared with a string**: each comparison of a ``rule`` with a string
  constant (a tiling asking which cut it has, where the cut's type should answer).
- **Docstrings longer than their function**: functions and methods whose docstring has
  more lines than the rest of their body (each listed with its lines).
- **Identities parsed back**: each call of ``split``/``rsplit``/``partition``/``rpartition``
  whose separator is ``"|"``: a string that joined a bridge's name with other fields (a
  collective's site, an op's argument) read back into them.
- **The bridge handle**: the lines of class ``Redistributor``, the attributes its
  methods set (``self.x = ...``, by name) and its methods; and every object made to
  share another's state (an assignment to an ``__dict__``: a twin handle).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = [ROOT / "mimo_fx", ROOT / "compiled", ROOT / "reference", ROOT / "mimo",
           ROOT / "interop"]  # (jobs and test utilities aside)
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


GROWS = {"append", "appendleft", "add", "extend", "insert", "setdefault", "update"}
SHRINKS = {"pop", "popitem", "popleft", "clear", "remove", "discard"}
WEAK = {"WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}


def _grows_and_shrinks(nodes, owner, items: bool = True) -> tuple[bool, bool]:
    """Whether code in ``nodes`` adds to / takes from the container ``owner(node)`` names
    (a call of its growing or shrinking methods, an item assigned -- where ``items`` --
    or deleted)."""
    grows = shrinks = False
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) \
                    and owner(sub.func.value):
                grows |= sub.func.attr in GROWS
                shrinks |= sub.func.attr in SHRINKS
            elif isinstance(sub, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = sub.targets if isinstance(sub, (ast.Assign, ast.Delete)) \
                    else [sub.target]
                flat = [e for t in targets for e in (
                    t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
                for t in flat:
                    if isinstance(t, ast.Subscript) and owner(t.value):
                        grows |= items and not isinstance(sub, ast.Delete)
                        shrinks |= isinstance(sub, ast.Delete)
    return grows, shrinks


def unbounded_state(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each module-level container that code adds to and nothing takes
    from (nor replaces, for an object's attribute): a plain container its module's
    functions fill, or an instance of a class of the module, one of whose attributes
    its methods fill. Weak containers are bounded by what lives elsewhere."""
    body = ast.parse(path.read_text()).body
    classes = {node.name: node for node in body if isinstance(node, ast.ClassDef)}
    # (a decorator's or a class's __init_subclass__ fills a table at import: bounded)
    decorators = {_name(d.func if isinstance(d, ast.Call) else d) for node in body
                  for d in getattr(node, "decorator_list", ())}
    functions = [node for node in body if isinstance(node, ast.FunctionDef)
                 and node.name not in decorators]
    functions += [m for node in body if isinstance(node, ast.ClassDef) for m in node.body
                  if isinstance(m, ast.FunctionDef) and m.name != "__init_subclass__"]
    out = []
    for line, name in module_state(path):
        value = next(n.value for n in body if isinstance(n, (ast.Assign, ast.AnnAssign))
                     and n.lineno == line)
        kind = _name(value.func) if isinstance(value, ast.Call) else ""
        if kind in WEAK:
            continue
        if kind in classes:
            methods = [m for m in classes[kind].body if isinstance(m, ast.FunctionDef)]
            later = [m for m in methods if m.name != "__init__"]
            attrs = {t.attr: sub.value for m in methods for sub in ast.walk(m)
                     if isinstance(sub, (ast.Assign, ast.AnnAssign))
                     for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                     if isinstance(t, ast.Attribute) and _name(t.value) == "self"}
            for attr in sorted(attrs):
                def of(node, attr=attr):
                    return isinstance(node, ast.Attribute) and node.attr == attr and \
                        _name(node.value) == "self"
                # (an item of a list set: no growth -- a list made as [..] or [..] * n)
                listed = isinstance(attrs[attr], (ast.List, ast.ListComp)) or (
                    isinstance(attrs[attr], ast.BinOp) and isinstance(attrs[attr].left, ast.List))
                grows, shrinks = _grows_and_shrinks(later, of, items=not listed)
                replaced = any(isinstance(sub, ast.Assign) and any(of(t) for t in sub.targets)
                               for m in later for sub in ast.walk(m))
                if grows and not (shrinks or replaced):
                    out.append((line, f"{name}.{attr}"))
            continue
        grows, shrinks = _grows_and_shrinks(
            functions, lambda node, name=name: isinstance(node, ast.Name) and node.id == name)
        if grows and not shrinks:
            out.append((line, name))
    return out


def rule_branches(path: Path) -> list[int]:
    """Lines of each comparison of a ``rule`` (an attribute or name) with a string: a
    cut rule asked for by its spelling rather than answered by its type."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_name(x) == "rule" for x in sides) and any(
                    isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides):
                out.append(node.lineno)
    return out


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


def parsed_identities(path: Path) -> list[int]:
    """Lines splitting a string at ``"|"`` (an identity joined into a string, read back)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("split", "rsplit", "partition", "rpartition")
            and node.args and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "|"]


def class_size(path: Path, name: str) -> tuple[int, int, int] | None:
    """(lines, attributes its methods set, methods) of class ``name`` in ``path``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            methods = [m for m in node.body
                       if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attributes = {t.attr for m in methods for t in ast.walk(m)
                          if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                          and isinstance(t.value, ast.Name) and t.value.id == "self"}
            return (node.end_lineno or node.lineno) - node.lineno + 1, len(attributes), \
                len(methods)
    return None


def shared_states(path: Path) -> list[int]:
    """Lines assigning an object's ``__dict__`` (an object sharing another's state)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "__dict__" for t in node.targets)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quiet", action="store_true", help="the counts only")
    args = parser.parse_args(argv)
    state, rows, made, registering, docs, growing, rules = [], [], [], {}, [], [], []
    handle, twins, parsed = None, [], []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        state += [(rel, line, name) for line, name in module_state(path)]
        growing += [(rel, line, name) for line, name in unbounded_state(path)]
        fragments, registered = op_registrations(path)
        made += [(rel, line) for line in fragments]
        if registered:
            registering[rel] = registered
        docs += [(rel, *found) for found in long_docstrings(path)]
        rules += [(rel, line) for line in rule_branches(path)]
        handle = handle or class_size(path, "Redistributor")
        twins += [(rel, line) for line in shared_states(path)]
        parsed += [(rel, line) for line in parsed_identities(path)]
        if rel not in LAYOUT_MODULES:
            rows += [(rel, line, what) for line, what in row_cases(path)]
    print(f"module-level mutable state: {len(state)} names in "
          f"{len({s[0] for s in state})} modules")
    print(f"row special cases outside {', '.join(sorted(LAYOUT_MODULES))}: {len(rows)} in "
          f"{len({r[0] for r in rows})} modules")
    print(f"module-level state that only grows: "
          f"{len({(rel, name.split('.')[0]) for rel, _, name in growing})} names")
    print(f"torch.library fragments: {len(made)}; modules registering mimo_fx:: ops: "
          f"{len(registering)}")
    print(f"cut rules compared with a string: {len(rules)}")
    print(f"functions whose docstring is longer than their body: {len(docs)}")
    lines, attributes, methods = handle or (0, 0, 0)
    print(f"Redistributor: {lines} lines, {attributes} attributes, {methods} methods; "
          f"objects sharing another's state: {len(twins)}")
    print(f"identities parsed back from a string (split at '|'): {len(parsed)}")
    if not args.quiet:
        print("\nmodule-level state that only grows (filled, never emptied):")
        for rel, line, name in growing:
            print(f"  {rel}:{line}  {name}")
        print("\ntorch.library fragments and registrations:")
        for rel, line in made:
            print(f"  {rel}:{line}  Library(...)")
        for rel, lines in registering.items():
            print(f"  {rel}: registers at lines {', '.join(map(str, lines))}")
        print("\ncut rules compared with a string:")
        for rel, line in rules:
            print(f"  {rel}:{line}")
        print("\nidentities parsed back from a string:")
        for rel, line in parsed:
            print(f"  {rel}:{line}")
        print("\nobjects sharing another's state:")
        for rel, line in twins:
            print(f"  {rel}:{line}  __dict__ = ...")
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
