"""A project's own test suite, run as the project runs it, on PostgreSQL and MariaDB.

The sample project in ``tests/django/sample`` has two Celery apps and
deduplicated tasks; its tests (``manage.py test`` with ``TestCase`` and
``TransactionTestCase``, and pytest-django with ``db`` and
``transactional_db``) check that each test starts with no lock left by
another, that emptying the lock table inside a test never hangs, and that
``override_settings`` reaches both apps. Here each suite runs in a fresh
process and must pass, exit 0, and leave its test database dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SAMPLE = Path(__file__).resolve().parent / "sample"
ROOT = SAMPLE.parents[2]


def _environment(vendor: str, port: int, name: str, *, pool: bool = False) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SAMPLE), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "sample.settings",
        "SAMPLE_DB_VENDOR": vendor,
        "SAMPLE_DB_PORT": str(port),
        "SAMPLE_DB_NAME": name,
    }
    env.pop("SAMPLE_DB_POOL", None)
    if pool:
        env["SAMPLE_DB_POOL"] = "1"
    return env


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], cwd=SAMPLE, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )


def _pg_databases(server: Any) -> set[str]:
    with server.connect() as conn:
        return {row[0] for row in conn.execute("SELECT datname FROM pg_database")}


def _maria_databases(server: Any) -> set[str]:
    conn = server.connect()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SHOW DATABASES")
            return {row[0] for row in cursor.fetchall()}
    finally:
        conn.close()


@pytest.mark.parametrize("pool", [False, True], ids=["plain", "pooled"])
def test_manage_py_test_on_postgres(postgres_server: Any, pool: bool) -> None:
    """``manage.py test`` passes and drops its test database (plain and pooled)."""
    name = f"sample_pg_{'pool' if pool else 'plain'}"
    result = _run(
        ["manage.py", "test", "sample", "--noinput", "-v", "2"],
        _environment("postgresql", postgres_server.port, name, pool=pool),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Ran 8 tests" in output and "\nOK" in output, output
    assert "being accessed by other users" not in output
    assert f"test_{name}" not in _pg_databases(postgres_server)


def test_manage_py_test_on_mariadb(mysql_server: Any) -> None:
    """``manage.py test`` passes on MariaDB and drops its test database."""
    result = _run(
        ["manage.py", "test", "sample", "--noinput", "-v", "2"],
        _environment("mysql", mysql_server.port, "sample_maria"),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Ran 8 tests" in output and "\nOK" in output, output
    assert "test_sample_maria" not in _maria_databases(mysql_server)


@pytest.mark.parametrize("vendor", ["postgresql", "mysql"])
def test_pytest_django_suite(request: pytest.FixtureRequest, vendor: str) -> None:
    """pytest-django's ``db`` and ``transactional_db`` tests pass; the test database is dropped."""
    fixture = "postgres_server" if vendor == "postgresql" else "mysql_server"
    server = request.getfixturevalue(fixture)
    name = f"sample_pytest_{vendor}"
    result = _run(
        ["-m", "pytest", "-c", "pytest.ini", "-q", "sample/suite_pytest.py"],
        _environment(vendor, server.port, name),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "6 passed" in output, output
    databases = _pg_databases(server) if vendor == "postgresql" else _maria_databases(server)
    assert f"test_{name}" not in databases


def test_pooled_postgres_under_threads_and_a_worker(postgres_server: Any) -> None:
    """Pool of 4: 16 request threads and a worker; every call answers, nothing is kept.

    Each key runs exactly once; the database never sees more than the project's
    pool plus the store's own (4 + 4) plus the worker's, and every pooled
    connection is back in the pool at the end.
    """
    name = "sample_pooled_load"
    with postgres_server.connect() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")
    env = _environment("postgresql", postgres_server.port, name, pool=True)
    migrate = _run(["manage.py", "migrate", "-v", "0"], env)
    assert migrate.returncode == 0, migrate.stderr
    result = _run(["pooled_load.py"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == []
    assert report["executed"] == {f"key-{i}": 1 for i in range(8)}
    assert 0 < report["peak"] <= 8
    assert report["pool_available"] == report["pool_size"]
