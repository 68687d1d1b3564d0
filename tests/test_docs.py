"""Every ```python block in README.md and docs/*.md runs.

Blocks of one page run in order in one namespace, from the repository root, so a page can build
an example step by step. Blocks written as doctests (``>>>`` prompts) are checked as doctests, so
the output they show is the output the code prints. Figures in the examples are computed, never
typed by hand.
"""

from __future__ import annotations

import doctest
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.mark.parametrize(
    "page", [p for p in PAGES if _blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_python_blocks_run(page, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    blocks = _blocks(page)
    if any(line.lstrip().startswith(">>>") for code in blocks for line in code.splitlines()):
        flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
        result = doctest.testfile(str(page), module_relative=False, optionflags=flags)
        assert result.failed == 0, f"{result.failed} doctest example(s) failed in {page.name}"
        blocks = [b for b in blocks if ">>>" not in b]
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the failure message is the point
            pytest.fail(f"{page.relative_to(ROOT)} block {i} raised {type(exc).__name__}: {exc}")


def test_readme_opens_with_the_two_quickstart_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in quick.strip().splitlines() if line.strip()]
    assert len(commands) == 2
    assert "pip install" in commands[0] and "lbkit" in commands[0]
    assert "pip install" in commands[1] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, ".ci/run must run the README's test command verbatim"


def test_reference_page_is_generated_from_the_docstrings():
    run = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "make_reference.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@functools.cache
def _make_performance():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_performance", ROOT / "benchmarks" / "make_performance.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_tables_match_the_committed_results(page):
    """Tables that a page quotes from ``benchmarks/results`` are the generator's, not typed."""
    mp = _make_performance()
    text = page.read_text()
    assert mp.splice(text) == text, (
        f"{page.name}: quoted tables differ from benchmarks/results; run "
        "`python benchmarks/make_performance.py --render-only`"
    )


def test_quoted_table_rebuilds_rows_and_filters(tmp_path):
    mp = _make_performance()
    (tmp_path / "r.json").write_text(
        '{"tables": [{"title": "T", "columns": ["policy", "x"],'
        ' "rows": [["a", 1.23456789], ["b", 20000], ["c", null]]}]}'
    )
    stale = "before\n<!-- table: r.json | T | policy: a, b -->\n| old |\n<!-- end table -->\nafter"
    assert mp.splice(stale, tmp_path) == (
        "before\n<!-- table: r.json | T | policy: a, b -->\n| policy | x |\n|---|---:|\n"
        "| a | 1.2346 |\n| b | 20,000 |\n<!-- end table -->\nafter"
    )
    with pytest.raises(KeyError, match="no table titled 'U'"):
        mp.splice("<!-- table: r.json | U -->\n<!-- end table -->", tmp_path)
