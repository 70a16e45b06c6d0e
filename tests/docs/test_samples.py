"""Every code sample of the README and the docs runs, on a real Redis (``samples.py``).

Each page runs in its own process and working directory, with the page's
``redis://localhost:6379/N`` URLs pointed at the test session's Redis, so
a sample that drifts from the code fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.samples import samples
from tests.fixtures._servers import free_port
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
BROKER_DB, BACKEND_DB = 50, 51

#: pages whose samples do not run yet: fragments that assume an ``app`` (or
#: Django) defined elsewhere. A page leaves this list once its samples run
#: (a ``python title="path.py"`` block is written to a file instead of run).
NOT_RUNNABLE_YET = frozenset({
    "docs/django.md",  # "Publishing on commit" needs a Django project
    "docs/migrating.md",  # imports celery_once / celery_singleton
    "docs/stores/index.md",
    "docs/stores/memcached.md",
    "docs/stores/memory.md",
    "docs/stores/redis-cluster.md",
    "docs/stores/redis.md",
    "docs/stores/sql.md",
})

PAGES = [
    pytest.param(page, id=name, marks=[pytest.mark.xfail(reason="samples not runnable yet")]
                 if name in NOT_RUNNABLE_YET else [])
    for page in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                        *(ROOT / "docs").glob("stores/*.md")])
    for name in [str(page.relative_to(ROOT))]
]


@pytest.fixture
def redis_dbs(redis_server: RedisServer) -> Iterator[dict[str, str]]:
    """Two flushed databases standing in for the docs' ``localhost:6379/0`` and ``/1``."""
    redis_server.flush(BROKER_DB, BACKEND_DB)
    yield {
        "redis://localhost:6379/0": redis_server.url(BROKER_DB),
        "redis://localhost:6379/1": redis_server.url(BACKEND_DB),
        "redis://localhost:6379": redis_server.url(BACKEND_DB).rsplit("/", 1)[0],
        "start_http_server(9808)": f"start_http_server({free_port()})",
    }
    redis_server.flush(BROKER_DB, BACKEND_DB)


def _sqs(request: pytest.FixtureRequest) -> dict[str, str]:
    """``native.md`` talks to SQS: a moto server stands in for it."""
    server = request.getfixturevalue("sqs_server")
    return {
        'broker_url="sqs://"': f'broker_url="{server.broker_url}"',
        '{"region": "us-east-1"}': '{"region": "us-east-1", "is_secure": False}',
    }


@pytest.mark.parametrize("page", PAGES)
def test_page_samples_run(
    page: Path, redis_dbs: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The page's Python samples run in order; its ``celery … dedup`` output matches."""
    if not any(s.lang in ("python", "console") for s in samples(page.read_text())):
        pytest.skip("no Python or console sample")
    if page.name == "native.md":
        redis_dbs = {**redis_dbs, **_sqs(request)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.docs.samples", str(page), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DOCS_SUBSTITUTIONS": json.dumps(redis_dbs)},
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_samples_are_found_in_lists_and_admonitions() -> None:
    """Blocks nested in list items and admonitions are extracted, dedented."""
    text = (
        "1. Step:\n\n    ```python\n    x = 1\n    ```\n\n"
        "!!! note\n    ```console\n    $ ls\n    ```\n"
    )
    found = samples(text)
    assert [(s.lang, s.code) for s in found] == [("python", "x = 1\n"), ("console", "$ ls\n")]
