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

ROOT = Path(__file__).resolve().parent.parent
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
    tests = [p for p in (ROOT / "tests").glob("test_*.py") if p.name != Path(__file__).name]
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


def test_the_readme_is_short_and_its_first_screen_shows_three_examples():
    assert len(README.read_text().splitlines()) <= 150
    first = [(end, block) for end, block in _blocks(README) if end <= FIRST_SCREEN]
    assert len(first) >= 3, f"python blocks ending in the first {FIRST_SCREEN} lines: {first}"
    kinds = ["doctest" if _is_doctest(b) else (_example_holding(b) or ["?"])[0]
             for _, b in first[:3]]
    assert kinds == ["doctest", "compiled_step.py", "packed_images.py"], kinds
