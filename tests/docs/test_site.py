"""The docs site builds strictly with MkDocs Material, and renders every sample as code.

``mkdocs build --strict`` alone passes on a page whose fences nested in a
list item render as inline text; so the landing page's HTML is checked for a
``<pre><code>`` block per fenced sample, and every page for literal fences.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.samples import samples

ROOT = Path(__file__).resolve().parents[2]
PRE = re.compile(r"<pre[^>]*>(?P<body>.*?)</pre>", re.S)
TAG = re.compile(r"<[^>]+>")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The site built with ``mkdocs build --strict`` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    yield out


def _code_blocks(page: str) -> list[str]:
    """The text of every ``<pre>`` block holding a ``<code>``, tags stripped."""
    return [
        html.unescape(TAG.sub("", match["body"]))
        for match in PRE.finditer(page)
        if "<code" in match["body"]
    ]


def test_landing_page_renders_every_sample_as_code(site: Path) -> None:
    """Each fenced sample of ``docs/index.md`` is a ``<pre><code>`` block, nested ones too."""
    fenced = samples((ROOT / "docs" / "index.md").read_text())
    blocks = _code_blocks((site / "index.html").read_text())
    assert len(blocks) == len(fenced)
    for sample, block in zip(fenced, blocks, strict=True):
        lines = [line.strip() for line in sample.code.splitlines() if line.strip()]
        assert all(line in block for line in lines), (sample.line, block)


def test_no_page_shows_a_literal_fence(site: Path) -> None:
    """No rendered page has a ``` left in its text (a fence Markdown did not parse)."""
    for page in site.glob("**/index.html"):
        text = html.unescape(TAG.sub("", page.read_text()))
        assert "```" not in text, page.relative_to(site)


def test_api_reference_and_no_script(site: Path) -> None:
    """The API page is generated from docstrings; the screenshot scripts are not published."""
    api = (site / "api" / "index.html").read_text()
    assert "Take the call's lock, then publish" in api  # DedupTask.apply_async's docstring
    assert "RevokeOutcome" in api and "memory_store" in api
    assert not list(site.glob("img/*.py"))
    assert (site / "img" / "flower-task.png").exists()
