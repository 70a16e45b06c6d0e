"""The install lines and the supported ranges the docs state are the package's own."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/index.md")


def _setup() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _bounds(name: str) -> tuple[str, str]:
    """``(lowest, highest)`` minor of ``name`` from its ``>=X.Y,<A.B`` range in setup.cfg."""
    cfg = _setup()
    text = cfg["options"]["install_requires"] + cfg["options.extras_require"]["test"]
    spec = re.search(rf"^\s*{name}(?:\[[^]]*\])?\s*>=\s*([\d.]+)\s*,\s*<\s*([\d.]+)", text, re.M)
    assert spec, f"setup.cfg states no range for {name}"
    low, high = spec.group(1), spec.group(2)
    low = low.removesuffix(".0") if name == "redis" else low
    major, minor = (int(n) for n in [*high.split("."), "0"][:2])
    classifiers = cfg["metadata"]["classifiers"]
    if name == "django":
        found = re.findall(r"Framework :: Django :: (\d+\.\d+)", classifiers)
        return low, max(found, key=lambda v: tuple(map(int, v.split("."))))
    return low, (f"{major}.{minor - 1}" if minor else str(major - 1))


def supported_sentence() -> str:
    """The "Supported:" sentence setup.cfg implies."""
    classifiers = _setup()["metadata"]["classifiers"]
    pythons = re.findall(r"Programming Language :: Python :: (3\.\d+)$", classifiers, re.M)
    pythons.sort(key=lambda v: int(v.split(".")[1]))
    celery, kombu = _bounds("celery"), _bounds("kombu")
    assert celery == kombu, (celery, kombu)
    django, redis = _bounds("django"), _bounds("redis")
    return (f"Supported: Python {pythons[0]} to {pythons[-1]}, Celery and kombu {celery[0]} to "
            f"{celery[1]}, Django {django[0]} to {django[1]}, redis-py {redis[0]} to {redis[1]}.")


def test_pages_state_the_ranges_of_setup_cfg() -> None:
    """README and the docs landing page state the ranges setup.cfg installs, word for word."""
    sentence = supported_sentence()
    assert "Celery and kombu 5.3 to 5.7" in sentence and "redis-py 5 to 8" in sentence
    for page in PAGES:
        assert sentence in (ROOT / page).read_text(), page


def _install_block(page: str) -> str:
    text = (ROOT / page).read_text()
    match = re.search(r"```console\n(pip install '\./celery-dedup.*?)```", text, re.S)
    assert match, f"{page} has no install block"
    return match.group(1)


def test_install_blocks_are_one_text() -> None:
    """README and the landing page give the same install commands."""
    assert _install_block("README.md") == _install_block("docs/index.md")


def test_no_install_line_needs_a_release() -> None:
    """Until a release exists every ``pip install`` of celery-dedup names a checkout or a wheel.

    The one exception says "once it is published". Every extra named is one setup.cfg declares.
    """
    extras = set(_setup()["options.extras_require"])
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        for match in re.finditer(r"pip install[^`\n]*?celery-dedup[^`\n]*", text):
            line = match.group(0)
            before = text[max(0, match.start() - 40):match.start()]
            named = re.findall(r"celery-dedup\[([a-z,]+)\]", line)
            assert all(e in extras for n in named for e in n.split(",")), (page, line)
            from_checkout = "./celery-dedup" in line or "--find-links" in line
            assert from_checkout or "once it is" in before.lower(), (page.name, line)
