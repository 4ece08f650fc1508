"""The pipelines and packed-sequence documentation shows tested code: every python block
of the README's "Pipelines" and "Packed sequences" sections and of docs/pipelines.md is a
contiguous run of lines of a file under docs/examples/ (compared without indentation),
and those files are run against the undistributed model (or full-tensor math) by
tests/test_pipeline_schedules.py, tests/test_pipelining.py, tests/test_sync.py and
tests/test_index_bridge.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end != -1 else len(text)]


def _blocks() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    readme = _section(text, "\n## Pipelines") + _section(text, "\n## Packed sequences")
    docs = (ROOT / "docs" / "pipelines.md").read_text()
    return [(where, block) for where, text in (("README", readme), ("docs/pipelines.md", docs))
            for block in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def test_the_pipelines_docs_have_examples():
    where = [w for w, _ in _blocks()]
    assert where.count("README") >= 5 and where.count("docs/pipelines.md") >= 3


@pytest.mark.parametrize("where,block", _blocks(), ids=lambda v: v[:40] if isinstance(v, str)
                         else None)
def test_every_block_is_part_of_a_tested_example(where, block):
    files = {p.name: _lines(p.read_text()) for p in EXAMPLES}
    found = [name for name, lines in files.items() if _contains(lines, _lines(block))]
    assert found, f"a python block of {where} is in no file of docs/examples/:\n{block}"
