"""Flower's ``/api/task/async-apply`` goes through DedupTask.apply_async; send-task does not."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import states
from celery.contrib.testing.worker import start_worker

from celery_dedup import inspect_lock
from tests.apps.cli_app import SYNC, make_app
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


def test_send_task_copies_are_guarded_by_the_worker(
    flower_with_app: FlowerServer, redis_server: RedisServer
) -> None:
    """Flower's send-task bypasses apply_async: the worker guards the copies.

    A solo worker takes the messages in order: the ``delay`` holder runs and
    releases on success; the first send-task copy then finds the key free and
    runs, taking the guard's throttle lock for ``unique_for``; the second
    copy finds it held and is skipped (IGNORED): two identical send-task
    copies never both run.
    """
    app = make_app(redis_server.url(BROKER_DB), redis_server.url(BACKEND_DB))
    held = app.tasks[SYNC].delay(7)
    copies = [
        post(flower_with_app, "/api/task/send-task/demo.sync", {"args": [7]})["task-id"]
        for _ in range(2)
    ]
    assert len({held.id, *copies}) == 3
    assert redis_server.client(BROKER_DB).llen("celery") == 3
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        assert held.get(timeout=20) == 7
        deadline = time.monotonic() + 20
        while [app.AsyncResult(c).state for c in copies] != [states.SUCCESS, states.IGNORED]:
            assert time.monotonic() < deadline, [app.AsyncResult(c).state for c in copies]
            time.sleep(0.1)
    lock = inspect_lock(held.deduplication_key, app=app)
    assert lock is not None and lock.task_id == copies[0] and lock.policy == "expiry"
    app.close()
