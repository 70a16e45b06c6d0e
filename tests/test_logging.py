"""Logging under ``celery_dedup``: a DEBUG line per duplicate, keys as digests only."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery, states
from celery.contrib.testing.worker import start_worker

from celery_dedup.runtime import runtime_for
from celery_dedup.worker import short
from tests.apps.cli_app import SYNC, make_app
from tests.fixtures._servers import free_port
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

BROKER_DB = 10
RAW_ARGUMENT = "raw-argument-7f3c"
CALLER_KEY = "caller-key-91ab"


@pytest.fixture
def app(redis_server: RedisServer, redis_url: str) -> Iterator[Celery]:
    """The demo app on a real Redis broker, backend and store, events on."""
    redis_server.client(BROKER_DB).flushdb()
    app = make_app(redis_server.url(BROKER_DB), redis_url, task_send_sent_event=True)
    yield app
    runtime_for(app).metrics.flush()
    app.close()


def secrets_in(records: list[logging.LogRecord]) -> list[str]:
    """Every logged text (message, arguments, traceback) that shows a raw argument or key."""
    found = []
    for record in records:
        texts = [record.getMessage(), repr(record.args), record.exc_text or ""]
        if record.exc_info:
            texts.append(logging.Formatter().formatException(record.exc_info))
        found += [text for text in texts if RAW_ARGUMENT in text or CALLER_KEY in text]
    return found


def test_one_debug_line_per_duplicate(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    """Each suppressed call logs exactly one DEBUG line naming the task and the key digest."""
    task = app.tasks[SYNC]
    with caplog.at_level(logging.DEBUG, logger="celery_dedup"):
        holder = task.delay(1, RAW_ARGUMENT)
        for _ in range(3):
            assert task.delay(1, RAW_ARGUMENT).id == holder.id
    lines = [r for r in caplog.records if "duplicate suppressed" in r.getMessage()]
    assert len(lines) == 3
    assert all(r.levelno == logging.DEBUG and r.name == "celery_dedup" for r in lines)
    assert all(SYNC in r.getMessage() for r in lines)
    assert all(short(holder.deduplication_key) in r.getMessage() for r in lines)


def test_fallback_logs_a_warning(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that falls back because the store is unreachable logs a WARNING under celery_dedup."""
    redis_server.client(BROKER_DB).flushdb()
    app = make_app(redis_server.url(BROKER_DB), None, f"redis://127.0.0.1:{free_port()}/0")
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_dedup"):
            app.tasks[SYNC].delay(2, RAW_ARGUMENT)
    finally:
        app.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].name == "celery_dedup"
    assert "unavailable" in warnings[0].getMessage()
    assert secrets_in(caplog.records) == []


def test_no_raw_argument_or_caller_key_is_logged(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing celery-dedup logs, producer or worker side, contains a raw argument or caller key."""
    task = app.tasks[SYNC]
    with caplog.at_level(logging.DEBUG, logger="celery_dedup"):
        keyed = task.apply_async((3, RAW_ARGUMENT), deduplication_key=CALLER_KEY)
        task.apply_async((3, RAW_ARGUMENT), deduplication_key=CALLER_KEY)
        by_args = task.apply_async((4, RAW_ARGUMENT), countdown=1)  # runs after the bypass
        task.delay(4, RAW_ARGUMENT)
        bypass = app.send_task(SYNC, args=(4, RAW_ARGUMENT))
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING",
                          shutdown_timeout=30):
            assert keyed.get(timeout=20) == 3 and by_args.get(timeout=20) == 4
            assert bypass.state == states.IGNORED  # it ran (and was skipped) before by_args
    messages = [r.getMessage() for r in caplog.records if r.name == "celery_dedup"]
    assert sum("duplicate suppressed" in m for m in messages) == 2
    assert any("released" in m for m in messages)
    assert any(f"skipping {SYNC}[{bypass.id}]" in m for m in messages)
    assert secrets_in(caplog.records) == []
