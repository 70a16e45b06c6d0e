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


def _matrix_table() -> list[list[str]]:
    """The rows of docs/development.md's support-matrix table (cells, stripped)."""
    text = (ROOT / "docs/development.md").read_text()
    section = text[text.index("## Support matrix"):]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]


def test_matrix_table_states_the_bounds_of_setup_cfg() -> None:
    """docs/development.md's table pins exactly what setup.cfg's bounds say: the oldest
    session every lower bound, the newest every upper bound."""
    classifiers = _setup()["metadata"]["classifiers"]
    pythons = re.findall(r"Programming Language :: Python :: (3\.\d+)$", classifiers, re.M)
    pythons.sort(key=lambda v: int(v.split(".")[1]))
    bounds = {name: _bounds(name) for name in ("celery", "kombu", "django", "redis", "sqlalchemy")}
    bounds["redis"] = ("5.0", bounds["redis"][1])  # pinned as the minor 5.0
    names = ("celery", "kombu", "django", "redis", "sqlalchemy")
    expected = [
        ["oldest", pythons[0], *(f"{bounds[n][0]}.x" for n in names)],
        ["newest", pythons[-1], *(f"{bounds[n][1]}.x" for n in names)],
    ]
    assert _matrix_table() == expected


def test_noxfile_pins_the_table() -> None:
    """noxfile.py's sessions pin what the table says (it reads setup.cfg itself)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    assert spec and spec.loader
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    oldest, newest = _matrix_table()
    names = ("celery", "kombu", "django", "redis", "sqlalchemy")
    pins = {n: row[2 + i].removesuffix(".x") for i, n in enumerate(names) for row in [oldest]}
    highs = {n: row[2 + i].removesuffix(".x") for i, n in enumerate(names) for row in [newest]}
    order = noxfile.PINNED_OLDEST
    assert noxfile.lowest_minors() == [f"{n}=={pins[n]}.*" for n in order]
    assert noxfile.highest_minors() == [f"{n}=={highs[n]}.*" for n in order]
    assert noxfile.python_range() == (oldest[1], newest[1])
