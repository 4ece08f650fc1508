"""Every code example in the documentation runs in a test.

Each python block of README.md and docs/*.md is either a doctest (it starts with
``>>>``; pytest collects README.md and docs/*.md as doctest files, see pyproject.toml)
or a contiguous run of lines of a file under docs/examples/ (compared without
indentation); every file under docs/examples/ is named in a test file other than this
one, which runs it and checks its results. The README stays at most 150 lines, its
first screen holding a doctest and two tested examples. Nothing here spawns a process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
FIRST_SCREEN = 50  # lines


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _blocks(path: Path) -> list[tuple[int, str]]:
    """The python blocks of a page: the line each ends on, and its text."""
    text = path.read_text()
    return [(text[:m.end()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S)]


def _all_blocks() -> list[tuple[str, str]]:
    return [(path.relative_to(ROOT).as_posix(), block) for path in PAGES
            for _, block in _blocks(path)]


def _is_doctest(block: str) -> bool:
    return block.lstrip().startswith(">>>")


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def _example_holding(block: str) -> list[str]:
    lines = _lines(block)
    return [p.name for p in EXAMPLES if _contains(_lines(p.read_text()), lines)]


def _id(value) -> str | None:
    return value[:40] if isinstance(value, str) else None


@pytest.mark.parametrize("where,block", _all_blocks(), ids=_id)
def test_every_block_is_a_doctest_or_part_of_a_tested_example(where, block):
    if _is_doctest(block):
        # doctest reads the closing fence as expected output unless a blank line ends it
        assert block.endswith("\n\n"), f"a doctest block of {where} needs a blank line " \
                                       f"before its closing fence:\n{block}"
        return
    assert _example_holding(block), (f"a python block of {where} is neither a doctest nor "
                                     f"part of a file of docs/examples/:\n{block}")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_run_by_a_test(example):
    tests = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name != Path(__file__).name]
    assert any(example.name in p.read_text() for p in tests), \
        f"docs/examples/{example.name} is named in no test file"


def test_markdown_doctests_are_collected():
    """pytest's doctest collection covers README.md and docs/*.md (pyproject.toml)."""
    text = (ROOT / "pyproject.toml").read_text()
    testpaths = re.search(r"^testpaths\s*=\s*\[(.*?)\]", text, flags=re.M | re.S)
    addopts = re.search(r'^addopts\s*=\s*"(.*)"', text, flags=re.M)
    assert testpaths and {'"README.md"', '"docs"'} <= set(re.findall(r'"[^"]*"',
                                                                       testpaths.group(1)))
    assert addopts and "--doctest-glob=*.md" in addopts.group(1).split()


def test_every_page_has_a_tested_block_and_the_readme_links_it():
    readme = README.read_text()
    for page in PAGES[1:]:
        if page.name != "DESIGN.md":
            assert _blocks(page), f"{page.name} shows no tested python block"
        assert f"](docs/{page.name})" in readme, f"the README does not link docs/{page.name}"


def test_the_readme_is_short_installs_first_and_shows_two_whole_examples():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    blocks = _blocks(README)
    assert text.index("```bash\npip install torch==") < text.index("```python"), \
        "the README's install comes after its first example"
    kinds = ["doctest" if _is_doctest(b) else (_example_holding(b) or ["?"])[0]
             for _, b in blocks[:2]]
    assert kinds == ["doctest", "compiled_step.py"], kinds


def _code(block: str) -> str:
    """A block as python source (a doctest's prompts and outputs dropped)."""
    if not _is_doctest(block):
        return block
    return "\n".join(line.strip()[4:] for line in block.splitlines()
                     if line.strip().startswith((">>> ", "... ")))


def _undefined(source: str) -> set[str]:
    """Names ``source`` reads that it neither defines, imports nor takes from builtins."""
    import builtins
    import symtable

    top = symtable.symtable(source, "<block>", "exec")
    defined = {s.get_name() for s in top.get_symbols()
               if s.is_assigned() or s.is_imported() or s.is_namespace()}
    missing: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for sym in table.get_symbols():
            free = (sym.is_referenced() and not (sym.is_assigned() or sym.is_imported()
                                                 or sym.is_parameter() or sym.is_free()))
            if table is top or sym.is_global():
                free = free and sym.get_name() not in defined
            else:
                free = False
            if free and not hasattr(builtins, sym.get_name()):
                missing.add(sym.get_name())
    return missing


@pytest.mark.parametrize("end, block", _blocks(README), ids=lambda v: _id(v))
def test_every_readme_block_defines_or_imports_what_it_uses(end, block):
    missing = _undefined(_code(block))
    assert not missing, f"the README block ending at line {end} uses {sorted(missing)} " \
                        f"without defining or importing them"


def test_the_name_check_finds_an_undefined_name():
    assert _undefined("import torch\ndef f(x):\n    return torch.tanh(x @ w) + y\ny = 1\n") \
        == {"w"}
    assert _undefined(_code(">>> from a import b\n>>> b(c)\n")) == {"c"}
