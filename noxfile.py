"""The support matrix: the oldest and the newest supported combination.

``nox`` (from the ``dev`` extra) runs both sessions, each in a new virtualenv
with the ``test`` extra; ``scripts/test`` runs them when ``CI`` is set. The
full suite runs on the main combination in ``scripts/test``; here each
session runs a representative subset: the store contract on Redis, SQLite
and memory, SQLite's "database is locked" taken as contention, a real worker
on Redis, and the Django DB store (SQLite and PostgreSQL, through the
project's own queries).

- ``oldest``: the lowest Python of ``setup.cfg``'s classifiers (3.10) and
  the lowest minor of every range in ``setup.cfg`` for Celery, kombu,
  redis-py, Django and SQLAlchemy (its latest patch release:
  ``django>=4.2`` runs Django 4.2.x).
- ``newest``: the highest Python of the classifiers (3.13) and the highest
  minor inside every range (``celery<5.8`` runs 5.7.x, ``redis<9`` 8.x,
  Django its newest classifier, 5.2.x).

Every lower and every upper bound ``setup.cfg`` states is so one session's
pin; docs/development.md's table says which (a test holds them equal).

Interpreters are looked up on ``PATH`` (``python3.10``), then under pyenv's
versions directory; a missing one falls back to the interpreter running nox,
with a warning, so the matrix still runs, narrower.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
#: packages whose lowest (``oldest``) and highest (``newest``) supported minor are pinned
PINNED_OLDEST = ("celery", "kombu", "redis", "django", "sqlalchemy")

CORE = (
    "-p", "no:django",
    "-m", "not (postgres or mysql or memcached or redis_cluster or rabbitmq)",
    "tests/stores/test_conformance.py",
    # "database is locked" is contention, not an outage (Python 3.10 has no
    # sqlite_errorcode); the file's burst tests are left to the full suite.
    "tests/stores/test_sql_contention.py::test_wait_that_never_ends_raises_store_contention",
    "tests/stores/test_sql_contention.py::test_wait_that_ends_is_retried",
    "tests/test_smoke_redis.py",
    "tests/core/test_basic_worker.py",
)  # fmt: skip
DJANGO = (
    "-p", "django", "--ds=tests.django.settings",
    # The MariaDB classes and the run-record timing tests (seconds of TTLs
    # each) are left to the full suite: the matrix checks versions.
    "-k", "not (MariaDB or MySQLPath or test_run_)",
    "tests/django/test_django_store.py",
    "tests/django/test_store_race.py",
    "tests/django/test_store_transactions.py",
    "tests/django/test_store_connections.py",
)  # fmt: skip

nox.options.sessions = ["oldest", "newest"]
nox.options.reuse_existing_virtualenvs = False
nox.options.default_venv_backend = "venv"


def _works(python: str) -> str | None:
    """``python``'s version (major.minor) if it runs, else ``None``."""
    try:
        out = subprocess.run(
            [python, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (``"3.10"``) that runs, or ``None``."""
    on_path = shutil.which(f"python{version}")
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    installed = sorted(
        pyenv.glob(f"{version}.*"),
        key=lambda p: [int(n) for n in re.findall(r"\d+", p.name)],
        reverse=True,
    )
    candidates = [*([on_path] if on_path else []), *(str(p / "bin" / "python") for p in installed)]
    return next((c for c in candidates if _works(c) == version), None)


def pick(versions: tuple[str, ...], role: str) -> str:
    """The first of ``versions`` found here, else this interpreter (with a warning)."""
    for version in versions:
        found = find_python(version)
        if found:
            return found
    print(
        f"WARNING: no Python {' or '.join(versions)} found for the {role} session; "
        f"using {sys.executable} ({sys.version.split()[0]}): the matrix is narrower",
        file=sys.stderr,
    )
    return sys.executable


def ranges() -> dict[str, tuple[str, str]]:
    """``name → (lowest, highest)`` supported minor of PINNED, from setup.cfg.

    The lowest is the ``>=`` bound; the highest is the last minor below the
    ``<`` bound (``<5.8`` → ``5.7``, ``<9`` → ``8``), for Django the newest
    ``Framework :: Django ::`` classifier (``<6`` → ``5.2``).
    """
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    text = cfg["options"]["install_requires"] + cfg["options.extras_require"]["test"]
    found: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*([^#]*)", line)
        if not match:
            continue
        name, spec = match.group(1).lower(), match.group(2)
        bounds = re.search(r">=\s*(\d+)\.(\d+)\s*,\s*<\s*(\d+)(?:\.(\d+))?", spec)
        if name not in PINNED_OLDEST or not bounds:
            continue
        major, minor = int(bounds.group(3)), int(bounds.group(4) or 0)
        high = f"{major}.{minor - 1}" if minor else str(major - 1)
        if name == "django":
            versions = re.findall(r"Framework :: Django :: (\d+\.\d+)",
                                  cfg["metadata"]["classifiers"])
            high = max(versions, key=lambda v: tuple(map(int, v.split("."))))
        found[name] = (f"{bounds.group(1)}.{bounds.group(2)}", high)
    missing = set(PINNED_OLDEST) - set(found)
    if missing:
        raise RuntimeError(f"setup.cfg states no >=,< range for {sorted(missing)}")
    return {name: found[name] for name in PINNED_OLDEST}


def python_range() -> tuple[str, str]:
    """The lowest and the highest ``Programming Language :: Python :: 3.N`` classifier."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    found = re.findall(r"Programming Language :: Python :: (3\.\d+)$",
                       cfg["metadata"]["classifiers"], re.M)
    found.sort(key=lambda v: int(v.split(".")[1]))
    return found[0], found[-1]


def lowest_minors() -> list[str]:
    """``name==X.Y.*`` for each of PINNED_OLDEST: the lower bounds in setup.cfg."""
    return [f"{name}=={low}.*" for name, (low, _high) in ranges().items()]


def highest_minors() -> list[str]:
    """``name==X.Y.*`` for each of PINNED_OLDEST: the upper bounds in setup.cfg."""
    return [f"{name}=={high}.*" for name, (_low, high) in ranges().items()]


def run_subset(session: nox.Session) -> None:
    """Show the versions under test, then run both subsets; fail if either failed."""
    session.run(
        "python", "-c",
        "import sys, celery, kombu, redis, django, sqlalchemy; "
        "print('under test: Python', sys.version.split()[0], '| celery', celery.__version__, "
        "'| kombu', kombu.__version__, '| redis-py', redis.__version__, "
        "'| Django', django.__version__, '| SQLAlchemy', sqlalchemy.__version__)",
    )  # fmt: skip
    failures = []
    for name, args in (("core", CORE), ("django", DJANGO)):
        try:
            session.run("python", "-m", "pytest", "-q", *args, *session.posargs)
        except nox.command.CommandFailed:
            failures.append(name)
    if failures:
        session.error(f"the {' and '.join(failures)} subset failed")


@nox.session(python=pick((python_range()[0],), "oldest"))
def oldest(session: nox.Session) -> None:
    """Python 3.10 with the lowest minor of Celery, kombu, redis-py, Django, SQLAlchemy."""
    constraints = Path(session.create_tmp()) / "oldest.txt"
    constraints.write_text("\n".join(lowest_minors()) + "\n")
    session.log(f"pinned: {', '.join(lowest_minors())}")
    session.install("-c", str(constraints), ".[test]")
    run_subset(session)


@nox.session(python=pick((python_range()[1],), "newest"))
def newest(session: nox.Session) -> None:
    """The highest supported Python with the highest minor of every range."""
    constraints = Path(session.create_tmp()) / "newest.txt"
    constraints.write_text("\n".join(highest_minors()) + "\n")
    session.log(f"pinned: {', '.join(highest_minors())}")
    session.install("-c", str(constraints), ".[test]")
    run_subset(session)
