"""Test configuration: every module in tests/fixtures is a fixture plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

# Fixture modules import each other; marking the package first lets pytest
# rewrite them whichever is imported first.
pytest.register_assert_rewrite("tests.fixtures")

pytest_plugins = sorted(
    f"tests.fixtures.{path.stem}"
    for path in (Path(__file__).parent / "fixtures").glob("*.py")
    if not path.stem.startswith("_")
)
