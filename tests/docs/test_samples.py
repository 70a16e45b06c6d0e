"""Every code sample of the README and the docs runs, on real servers (``samples.py``).

Each page runs in its own process and working directory, with the page's
server addresses (``redis://localhost:6379/N``, ``10.0.0.7:11211``, …)
pointed at the test session's servers, so a sample that drifts from the
code fails here. ``docs/django.md`` needs Django's test database: it runs
in the Django session (``tests/django/test_docs_samples.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.samples import runnable, samples
from tests.fixtures._servers import free_port
from tests.fixtures.memcached import MemcachedServer
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.redis import RedisServer, redis_configured
from tests.fixtures.redis_cluster import RedisClusterServer

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
BROKER_DB, BACKEND_DB = 50, 51
DOCS_DATABASE = "celery_dedup_docs"

ALL_PAGES = sorted(
    str(page.relative_to(ROOT))
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                 *(ROOT / "docs").glob("stores/*.md")]
)

#: pages with no sample to run, and why.
WITHOUT_SAMPLES = {
    "docs/api.md": "the API reference: signatures, no code",
    "docs/benchmarks.md": "commands that run the benchmarks (minutes, on every server)",
    "docs/development.md": "the test command, release check and support matrix: run by CI itself",
    "docs/example.md": "runs the example project's demo, tested by tests/django/test_demo.py",
    "docs/features.md": "a comparison table: each row links to the page whose samples show it",
    "docs/guarantees.md": "commands that run tests/reliability itself",
}

#: pages whose samples need Django's test database.
DJANGO_PAGES = frozenset({"docs/django.md"})

#: the fixture pointing a page's other servers at the session's.
SERVERS = {
    "docs/cli.md": "docs_durable_redis",
    "docs/native.md": "docs_sqs",
    "docs/stores/index.md": "docs_postgres",
    "docs/stores/memcached.md": "docs_memcached",
    "docs/stores/redis-cluster.md": "docs_redis_cluster",
    "docs/stores/sql.md": "docs_postgres",
}

#: the apps (by their main name) a page shows failing ``celery dedup check`` on
#: purpose; every other app a page makes must pass it.
CHECK_FAILS_ON_PURPOSE: dict[str, list[str]] = {
    "docs/fallback.md": ["proj"],  # an rpc:// backend on purpose: no store can be derived
    "docs/lint.md": ["proj"],  # W101 on purpose: the page shows the lint at work
    "docs/stores/memcached.md": ["proj"],  # the several-servers form, which is W109
}

#: the marks of those fixtures' servers.
MARKS = {
    "docs_postgres": pytest.mark.postgres,
    "docs_memcached": pytest.mark.memcached,
    "docs_redis_cluster": pytest.mark.redis_cluster,
}

PAGES = [
    pytest.param(name, id=name, marks=[MARKS[SERVERS[name]]] if SERVERS.get(name) in MARKS else [])
    for name in ALL_PAGES
    if name not in WITHOUT_SAMPLES and name not in DJANGO_PAGES
]


@pytest.fixture(scope="module")
def snapshotting_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis as a default redis-server is: with RDB snapshots (the session's keeps none,
    which the settings lint rightly reports, W107, for ``unique_until="expiry"`` tasks).
    """
    with redis_configured(tmp_path_factory.mktemp("docs-rdb"), "--save", "3600 1") as server:
        yield server


@pytest.fixture
def redis_dbs(snapshotting_redis: RedisServer) -> Iterator[dict[str, str]]:
    """Two flushed databases standing in for the docs' ``localhost:6379/0`` and ``/1``."""
    redis_server = snapshotting_redis
    redis_server.flush(BROKER_DB, BACKEND_DB)
    yield {
        "redis://localhost:6379/0": redis_server.url(BROKER_DB),
        "redis://localhost:6379/1": redis_server.url(BACKEND_DB),
        "redis://localhost:6379": redis_server.url(BACKEND_DB).rsplit("/", 1)[0],
        "start_http_server(9808)": f"start_http_server({free_port()})",
    }
    redis_server.flush(BROKER_DB, BACKEND_DB)


@pytest.fixture
def docs_durable_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The page's store Redis as a default redis-server is: with RDB snapshots.

    The session's server keeps no snapshots, which the settings lint
    reports (W107) for the page's ``unique_until="expiry"`` task.
    """
    with redis_configured(tmp_path_factory.mktemp("docs-rdb"), "--save", "3600 1") as server:
        yield {"redis://localhost:6379/1": server.url(1)}


@pytest.fixture
def docs_sqs(request: pytest.FixtureRequest) -> dict[str, str]:
    """``native.md`` talks to SQS: a moto server stands in for it."""
    server = request.getfixturevalue("sqs_server")
    return {
        'broker_url="sqs://"': f'broker_url="{server.broker_url}"',
        '{"region": "us-east-1"}': '{"region": "us-east-1", "is_secure": False}',
    }


@pytest.fixture
def docs_postgres(postgres_server: PostgresServer) -> Iterator[dict[str, str]]:
    """The pages' PostgreSQL URLs, on a database of their own, dropped afterwards."""
    with postgres_server.connect() as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DOCS_DATABASE}")
        conn.execute(f"CREATE DATABASE {DOCS_DATABASE}")
    url = "db+" + postgres_server.url().rsplit("/", 1)[0] + "/" + DOCS_DATABASE
    yield {
        "db+postgresql+psycopg://app@db.internal/app": url,
        "db+postgresql+psycopg://app@db/app": url,
    }
    with postgres_server.connect() as conn:
        conn.execute(f"DROP DATABASE {DOCS_DATABASE} WITH (FORCE)")


@pytest.fixture
def docs_memcached(
    memcached_pair: tuple[MemcachedServer, MemcachedServer],
) -> dict[str, str]:
    """The page's two memcached servers, two fresh ones."""
    first, second = memcached_pair
    return {"10.0.0.7:11211": f"127.0.0.1:{first.port}",
            "10.0.0.8:11211": f"127.0.0.1:{second.port}"}


@pytest.fixture
def docs_redis_cluster(redis_cluster: RedisClusterServer) -> Iterator[dict[str, str]]:
    """The page's cluster node; the test cluster has no password."""
    redis_cluster.flush()
    yield {"10.0.0.5:7000": f"127.0.0.1:{redis_cluster.ports[0]}",
           '{"password": "…"}': '{"password": None}'}
    redis_cluster.flush()


@pytest.mark.parametrize("name", PAGES)
def test_page_samples_run(
    name: str, redis_dbs: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The page's Python samples run in order; its ``celery … dedup`` output matches;
    every app it makes passes ``celery dedup check``."""
    substitutions = dict(redis_dbs)
    if name in SERVERS:
        substitutions.update(request.getfixturevalue(SERVERS[name]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.docs.samples", str(ROOT / name), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT),
             "DOCS_SUBSTITUTIONS": json.dumps(substitutions),
             "DOCS_CHECK_APPS": json.dumps(CHECK_FAILS_ON_PURPOSE.get(name, []))},
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_pages_without_samples_are_the_listed_ones() -> None:
    """Every page has a sample to run, except the listed ones (each with its reason)."""
    assert {name for name in ALL_PAGES if not runnable(ROOT / name)} == set(WITHOUT_SAMPLES)


def test_lists_name_pages_with_samples() -> None:
    """``SERVERS`` and ``DJANGO_PAGES`` name existing pages that have samples."""
    with_samples = set(ALL_PAGES) - set(WITHOUT_SAMPLES)
    assert not (set(SERVERS) | DJANGO_PAGES) - with_samples


def test_samples_are_found_in_lists_and_admonitions() -> None:
    """Blocks nested in list items and admonitions are extracted, dedented."""
    text = (
        "1. Step:\n\n    ```python\n    x = 1\n    ```\n\n"
        "!!! note\n    ```console\n    $ ls\n    ```\n"
    )
    found = samples(text)
    assert [(s.lang, s.code) for s in found] == [("python", "x = 1\n"), ("console", "$ ls\n")]
