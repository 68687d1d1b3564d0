"""The prefill documentation runs: doctests of the explanation pages, the tutorial's code."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ["prefill-apportionment.md", "prefill-buckets-and-quota.md", "prefill-chunking.md"]


@pytest.mark.parametrize("page", PAGES)
def test_explanation_page_examples(page):
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    result = doctest.testfile(str(DOCS / page), module_relative=False, optionflags=flags)
    assert result.attempted > 0
    assert result.failed == 0


def test_tutorial_code_runs(capsys):
    text = (DOCS / "tutorial-prefill-router.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 4
    loop = blocks[1].strip().splitlines()
    assert len(loop) <= 30, f"the router loop has {len(loop)} lines"
    namespace: dict = {"__name__": "tutorial"}
    for block in blocks:
        exec(compile(block, "tutorial-prefill-router.md", "exec"), namespace)
    bal = namespace["bal"]
    bal._check()
    s = bal.statistics()
    assert s.routed > 300 and s.finished > 0.8 * s.routed
    assert s.routed == s.finished + s.queued + s.handed_back
    assert "routed" in capsys.readouterr().out
