"""The codebase's shape: the project's modules import one another without a cycle
(function-level imports included): the core (mimo_fx/ but its facade) imports no backend
and no layer above it,
the backends import no facade, the facade imports the backends; and no library function
runs past 60 lines unless its docstring says why ("Long because")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"mimo_fx": ROOT / "mimo_fx", "mimo_fx.mimo": ROOT / "mimo",
            "mimo_fx.jobs": ROOT / "jobs", "mimo_fx.interop": ROOT / "interop",
            "mimo_fx.testing": ROOT / "testing",
            "mimo_fx.reference": ROOT / "reference", "mimo_fx.compiled": ROOT / "compiled"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.glob("*.py"):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # "from pkg import module" imports the module; "from module import name" the
            # module (or the package's __init__ when a name is not a module)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    modules = _modules()
    known = set(modules)
    # importing a submodule also runs its parents' __init__; that implicit edge is
    # Python's, so only what a module names counts
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# the facade: the package's entry points, which reach the backends on purpose
FACADE = ("mimo_fx", "mimo_fx.__main__", "mimo_fx.op", "mimo_fx.gpu_check")


def test_the_core_folder_imports_no_backend():
    """Every module of mimo_fx/ but the facade (the package itself, the CLI, the op, the
    GPU check) is the core: it imports no backend and no layer above it, as the folders
    say (the backends, the MIMO layer, interop, the jobs and the test utilities each have
    a folder of their own)."""
    modules = _modules()
    known = set(modules)
    upper = ("mimo_fx.compiled", "mimo_fx.reference", "mimo_fx.op", "mimo_fx.mimo", "mimo_fx.jobs",
             "mimo_fx.interop", "mimo_fx.testing")
    core = [name for name, path in modules.items()
            if path.parent == ROOT / "mimo_fx" and name not in FACADE]
    assert len(core) >= 15, core
    for name in core:
        above = {t for t in _imports(name, modules[name], known) if t.startswith(upper)}
        assert not above, f"{name} imports {above}"
    for package, folder in PACKAGES.items():  # (each layer above in its own folder)
        assert package == "mimo_fx" or folder.parent == ROOT, (package, folder)


def test_balanced_placement_never_communicates():
    """``assign`` and ``place`` are pure: every rank computes the same result from the same
    costs, so neither may reach for a collective."""
    for core in ("balance", "placement"):
        text = (ROOT / "mimo_fx" / f"{core}.py").read_text()
        assert "torch.distributed" not in text and "import dist" not in text, core


def test_no_long_function_without_a_reason():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60 and "Long because" not in (ast.get_docstring(node) or ""):
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_every_entry_point_the_readme_names_resolves():
    """Each ``mimo_fx.…`` name in the README's entry-point table, and each public
    spelling users have code on, is importable as written."""
    import pkgutil
    import re

    table = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("| ")]
    names = set(re.findall(r"`(mimo_fx(?:\.\w+)+)", "\n".join(table)))
    assert len(names) >= 10, sorted(names)  # the table was found
    names |= {"mimo_fx.Grid", "mimo_fx.Layout", "mimo_fx.redistribute",
              "mimo_fx.redistribute_dtensor", "mimo_fx.backward",
              "mimo_fx.compiled.Redistributor", "mimo_fx.compiled.Bridge",
              "mimo_fx.compiled.prepare"}
    missing = []
    for name in sorted(names):
        try:
            pkgutil.resolve_name(name)  # the longest importable module, then attributes
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"the README names entry points that do not resolve: {missing}"
    star: dict = {}
    exec("from mimo_fx import *", star)
    assert {"Grid", "Layout", "redistribute", "redistribute_dtensor", "backward"} <= set(star)


def test_results_and_docs_carry_no_local_paths():
    """What is published (results, docs, the README) names no machine's directories."""
    import re

    local = re.compile(r"(?<![\w.])/(?:work|tmp|home|root|Users|private|var/folders)/")
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "bench" / "results").glob("*"), *(ROOT / "bench").glob("*.md")]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
             for path in files if path.is_file()
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if local.search(line)]
    assert not found, "local paths in published files:\n" + "\n".join(found)


def test_the_structure_counter_counts_what_it_says(tmp_path):
    """bench/structure.py's counts, on code written to hold a known number of each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("structure", ROOT / "bench" / "structure.py")
    assert spec and spec.loader
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    code = tmp_path / "m.py"
    code.write_text(
        "import weakref\n__all__ = ['f']\n_A: dict = {}\n_B = weakref.WeakValueDictionary()\n"
        "N = 3\nKINDS = (1, 2)\n"
        "def f(x, bridge):\n"
        "    if isinstance(x, (int, PackedLayout)):\n"
        "        return 1\n"
        "    y = 2 if bridge.rows else 3\n"
        "    return is_row_layout(x) or isinstance(x, str)\n")
    assert [name for _, name in structure.module_state(code)] == ["_A", "_B"]
    assert [what for _, what in structure.row_cases(code)] == [
        "isinstance(..., PackedLayout)", "condition on rows", "is_row_layout(...)"]
    ops = tmp_path / "ops.py"
    ops.write_text(
        "import torch\n_L = torch.library.Library('x', 'FRAGMENT')\n"
        "def f():\n    'One line.'\n    return 1\n"
        "_L.define('f() -> ()')\n_L.impl('f', f, 'CPU')\nother.define('g')\n"
        "torch.library.register_fake('x::f', f, lib=_L)\ntorch.library.get_ctx()\n")
    assert structure.op_registrations(ops) == ([2], [6, 7, 9])
    assert structure.long_docstrings(ops) == []  # (as long as its body: not counted)
    ops.write_text("def g(x):\n    '''One\n    two\n    three.'''\n    y = x\n    return y\n")
    assert structure.long_docstrings(ops) == [(1, "g", 3, 2)]
    ops.write_text("def h(site, t):\n    a = site.rsplit('|', 3)\n    b = t.split(',')\n"
                   "    return a, b, site.rpartition('|')\n")
    assert structure.parsed_identities(ops) == [2, 4]
    state = tmp_path / "state.py"
    state.write_text(
        "_A = {}\n_B = {}\n_C = []\n"
        "def put(k):\n    _A[k] = 1\n    _B.setdefault(k, 2)\n    _C.append(k)\n"
        "def take(k):\n    _B.pop(k)\n"
        "class Ring:\n    def __init__(self):\n        self.slots = [None] * 4\n"
        "        self.seen: dict = {}\n        self.log = []\n"
        "    def put(self, k):\n        self.slots[0], self.seen[k] = k, 0\n"
        "        self.log.append(k)\n    def drop(self, k):\n        del self.seen[k]\n"
        "_R = Ring()\n")
    assert [name for _, name in structure.unbounded_state(state)] == ["_A", "_C", "_R.log"]
    rules = tmp_path / "rules.py"
    rules.write_text("def f(t, rule):\n    if t.rule == 'zigzag' or rule != \"chunk\":\n"
                     "        return 1\n    return t.rule.monotone and t.split == 'chunk'\n")
    assert structure.rule_branches(rules) == [2, 2]
    handle = tmp_path / "handle.py"
    handle.write_text("class Redistributor:\n    def __init__(self, a):\n"
                      "        self.a, self.b = a, 1\n        self.a = 2\n"
                      "    def f(self):\n        other.c = self.d\n"
                      "        twin = object.__new__(Redistributor)\n"
                      "        twin.__dict__ = self.__dict__\n")
    assert structure.class_size(handle, "Redistributor") == (8, 2, 2)
    assert structure.class_size(handle, "Bridge") is None
    assert structure.shared_states(handle) == [8]


def test_tests_readme_names_every_module_with_slow_tests():
    """tests/README.md's fast-subset section lists every test module that marks a test
    (or itself) slow, and every helper module of tests/ (what a reader looks for)."""
    import re

    text = (ROOT / "tests" / "README.md").read_text()
    section = text.split("## The fast subset", 1)[1].split("\n## ", 1)[0]
    marked = re.compile(r"^\s*@pytest\.mark\.slow|^pytestmark = .*pytest\.mark\.slow", re.M)
    slow = sorted(p.name for p in (ROOT / "tests").rglob("test_*.py")
                  if marked.search(p.read_text()))
    assert [name for name in slow if f"`{name}`" not in section] == []
    helpers = sorted(p.name for p in (ROOT / "tests").glob("*.py")
                     if not p.name.startswith(("test_", "conftest")))
    assert [name for name in helpers if f"`{name}`" not in text] == []
