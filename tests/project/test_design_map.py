"""docs/DESIGN.md's module map and vocabulary say where the code is, and stay true.

The "## Layers" section holds a table with one row per module: its path (``compiled/lease.py``)
and what it holds, each name in backticks. A bare name is defined at the top level of that
module (a re-export does not count: the row says where the name lives); a dotted one resolves,
through a name of the module (``Bridge.send_forward``) or from the top (``mimo_fx.backward``).
Every module file of every package (``pyproject.toml``) has exactly one row, so adding a
module without mapping it fails here; ``__init__.py`` and ``__main__.py`` only when they define
something worth naming. Every code name the "## Vocabulary" section cites (CamelCase, or dotted
like ``compiled.prepare``) resolves under ``mimo_fx``.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
PYPROJECT = ROOT / "pyproject.toml"
OPTIONAL = ("__init__.py", "__main__.py")  # a row only when they define what is worth naming
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
CAMEL = re.compile(r"[A-Z]\w*[a-z]\w*")


def _section(title: str) -> str:
    text = DESIGN.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/DESIGN.md has no '## {title}' section"
    return match.group(1)


def _package_dirs() -> dict[str, str]:
    """Each package of pyproject.toml and its folder, relative to the repository."""
    text = PYPROJECT.read_text()
    listed = re.search(r"^packages\s*=\s*\[(.*?)\]", text, flags=re.M | re.S)
    table = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text,
                      flags=re.M | re.S)
    assert listed and table, "pyproject.toml lists no packages or no package-dir"
    given = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([\w./-]+)"', table.group(1), flags=re.M))

    def folder(package: str) -> str:
        if package in given:
            return given[package]
        parent, _, leaf = package.rpartition(".")
        return f"{folder(parent)}/{leaf}" if parent else package

    return {p: folder(p) for p in re.findall(r'"([\w.]+)"', listed.group(1))}


@cache
def _modules() -> dict[str, str]:
    """Every module file of the packages (a path relative to the repository) -> its name."""
    out = {}
    for package, folder in _package_dirs().items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[path.relative_to(ROOT).as_posix()] = name
    return out


@cache
def _rows() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The Layers table: each row's module path and the spans it cites in backticks."""
    rows = []
    for line in _section("Layers").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 2 or set(cells[0]) <= set("-: "):
            continue
        path = re.fullmatch(r"`([^`]+)`", cells[0])
        if path:  # the header row has none
            rows.append((path.group(1), tuple(re.findall(r"`([^`]+)`", cells[1]))))
    return tuple(rows)


def _defined(node_body: list[ast.stmt]) -> set[str]:
    """Names a module body defines (def, class, assignment), in its conditional blocks too."""
    names: set[str] = set()
    for node in node_body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                names |= _defined(block)
    return names


@cache
def _top_level(path: str) -> frozenset[str]:
    return frozenset(_defined(ast.parse((ROOT / path).read_text()).body))


def _defining(name: str) -> list[str]:
    return [path for path in _modules() if name in _top_level(path)]


def _resolves(dotted: str, module) -> bool:
    head, *rest = dotted.split(".")
    try:
        if hasattr(module, head) and head in _top_level(_path_of(module.__name__)):
            obj = getattr(module, head)
            for part in rest:
                obj = getattr(obj, part)
            return True
        pkgutil.resolve_name(dotted)
        return True
    except (ImportError, AttributeError, ValueError):
        return False


def _path_of(module_name: str) -> str:
    return next(path for path, name in _modules().items() if name == module_name)


def test_the_map_is_a_table_with_one_row_per_module():
    rows = _rows()
    assert len(rows) >= len(_package_dirs()), \
        "docs/DESIGN.md's Layers section has no table of modules (| `path` | holds |)"
    paths = [path for path, _ in rows]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    assert not twice, f"docs/DESIGN.md's Layers table has more than one row for {twice}: " \
                      f"merge them"


@pytest.mark.parametrize("path", [path for path, _ in _rows()])
def test_every_mapped_module_exists(path):
    assert path in _modules(), (
        f"docs/DESIGN.md's Layers table maps `{path}`, which is no module file of the "
        f"packages of pyproject.toml: fix its path or remove its row")
    importlib.import_module(_modules()[path])


@pytest.mark.parametrize("path,names", _rows(), ids=[path for path, _ in _rows()])
def test_every_name_is_where_the_map_says(path, names):
    if path not in _modules():
        pytest.skip(f"`{path}` is no module (test_every_mapped_module_exists)")
    module = importlib.import_module(_modules()[path])
    wrong = []
    for name in names:
        if name.isidentifier() and name not in _top_level(path):
            where = _defining(name)
            fix = f"move it to the row of {', '.join(where)}" if where else "fix or drop it"
            wrong.append(f"`{name}` is not defined at the top level of {path}: {fix}")
        elif DOTTED.fullmatch(name) and not _resolves(name, module):
            wrong.append(f"`{name}` does not resolve (from {path} or from the top): fix or "
                         f"drop it")
    assert not wrong, "docs/DESIGN.md's Layers table:\n" + "\n".join(wrong)


def test_every_module_has_a_row():
    mapped = {path for path, _ in _rows()}
    missing = [path for path in _modules()
               if path not in mapped and not path.endswith(OPTIONAL)]
    assert not missing, (f"docs/DESIGN.md's Layers table has no row for {missing}: add one "
                         f"per module, naming in backticks what it defines")


def _vocabulary_names() -> list[str]:
    spans = re.findall(r"`([^`]+)`", _section("Vocabulary"))
    return sorted({s for s in spans if CAMEL.fullmatch(s) or DOTTED.fullmatch(s)})


def test_the_vocabulary_cites_code_names():
    assert len(_vocabulary_names()) >= 5, _vocabulary_names()


@pytest.mark.parametrize("name", _vocabulary_names())
def test_every_code_name_of_the_vocabulary_resolves(name):
    import mimo_fx

    if DOTTED.fullmatch(name):
        full = name if name.startswith("mimo_fx.") else f"mimo_fx.{name}"
        try:
            pkgutil.resolve_name(full)
        except (ImportError, AttributeError) as err:
            pytest.fail(f"docs/DESIGN.md's Vocabulary cites `{name}`, but `{full}` does not "
                        f"resolve ({err}): fix the name")
        return
    if hasattr(mimo_fx, name):
        return
    mapped = [path for path, names in _rows() if name in names and path in _modules()]
    assert mapped, (f"docs/DESIGN.md's Vocabulary cites `{name}`, which `mimo_fx` does not "
                    f"export and no row of the Layers table names: add it to the row of "
                    f"the module that defines it ({_defining(name) or 'none does'})")
    for path in mapped:
        module = importlib.import_module(_modules()[path])
        assert hasattr(module, name), f"`{name}` cannot be imported from {_modules()[path]}"
