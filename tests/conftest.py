"""Test configuration: every module in tests/fixtures is a fixture plugin."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = sorted(
    f"tests.fixtures.{path.stem}"
    for path in (Path(__file__).parent / "fixtures").glob("*.py")
    if not path.stem.startswith("_")
)
