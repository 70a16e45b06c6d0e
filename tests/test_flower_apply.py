"""Flower's ``/api/task/async-apply`` goes through DedupTask.apply_async."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures._servers import free_port, running
from tests.fixtures.flower import FlowerServer, flower_env
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[1]
BROKER_DB, BACKEND_DB = 16, 17


@pytest.fixture
def flower_with_app(redis_server: RedisServer, tmp_path: Path) -> Iterator[FlowerServer]:
    """``celery -A tests.apps.cli_app flower``: a Flower that has the DedupTask registered."""
    redis_server.flush(BROKER_DB, BACKEND_DB)
    port = free_port()
    env = {
        **flower_env(),
        "PYTHONPATH": str(ROOT),
        "DEDUP_TEST_BROKER": redis_server.url(BROKER_DB),
        "DEDUP_TEST_BACKEND": redis_server.url(BACKEND_DB),
    }
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.apps.cli_app",
        "flower",
        f"--port={port}",
        "--address=127.0.0.1",
    ]
    server = FlowerServer(
        port=port, broker_url=env["DEDUP_TEST_BROKER"], log=tmp_path / "flower.log"
    )
    with running(argv, port, log=server.log, env=env):
        yield server


def post(flower: FlowerServer, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        flower.url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict[str, object] = json.loads(response.read())
    return answer


def test_async_apply_is_deduplicated(
    flower_with_app: FlowerServer, redis_server: RedisServer
) -> None:
    """Two identical async-apply calls publish one message; both answer the holder's id."""
    first = post(flower_with_app, "/api/task/async-apply/demo.sync", {"args": [5]})
    second = post(flower_with_app, "/api/task/async-apply/demo.sync", {"args": [5]})
    other = post(flower_with_app, "/api/task/async-apply/demo.sync", {"args": [6]})
    assert first["task-id"] == second["task-id"]
    assert other["task-id"] != first["task-id"]
    assert redis_server.client(BROKER_DB).llen("celery") == 2
