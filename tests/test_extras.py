"""The ``dev`` extra (what the test command installs) holds every requirement of ``test``
(what the support matrix installs): a test dependency added to one only would pass in
one place and fail in the other."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _extra(name: str) -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    text = config["options.extras_require"][name]
    return {line.strip() for line in text.splitlines() if line.strip()}


def test_dev_installs_everything_the_test_extra_does() -> None:
    assert _extra("test") - _extra("dev") == set()
