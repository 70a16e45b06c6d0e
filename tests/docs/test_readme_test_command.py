"""README's paragraph on ``bash scripts/test`` names its steps as the script runs them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _paragraph() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("The second is what CI runs")
    return text[start:text.index("\n\n", start)]


def _steps() -> list[str]:
    """The name of every ``step NAME …`` scripts/test runs, in the script's order."""
    script = (ROOT / "scripts/test").read_text()
    return re.findall(r'\bstep "([^"]+)"', script)


def test_every_step_is_named_in_order() -> None:
    """Each step's name appears, in backticks, after the one the script runs before it."""
    paragraph = _paragraph()
    steps = _steps()
    assert steps[:5] == [
        "collect core", "collect keep_last", "collect system", "collect stores", "collect django"
    ]
    assert "pytest core" in steps and "support matrix" in steps
    position = 0
    for name in steps:
        found = paragraph.find(f"`{name}`", position)
        assert found >= 0, f"README does not name the step {name!r} after the previous one"
        position = found + len(name)


def test_the_lanes_and_duration_are_stated() -> None:
    """Three lanes at once, the release check and matrix only with CI, and how long it takes."""
    paragraph = " ".join(_paragraph().split())
    script = (ROOT / "scripts/test").read_text()
    # two lanes run in the background beside the core session
    assert script.count("; lane ") == 2 and script.count('.out" 2>&1 &') == 2
    assert "three lanes at the same time" in paragraph
    assert re.search(r"with `CI` set, the `release check`", paragraph)
    assert re.search(r"about \d+\u2013\d+ minutes on 2 cores", paragraph)
