"""Logging under ``celery_dedup`` (a DEBUG line per duplicate, keys as digests only), and
loud misconfiguration: errors that name the task, did-you-mean warnings, settings that
follow ``app.conf`` changes."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import pytest
from celery import Celery, states
from celery.contrib.testing.worker import start_worker

from celery_dedup import DedupTask, ImproperlyConfigured, InvalidOptionError
from celery_dedup.options import DedupConfigWarning
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


# -- loud misconfiguration ---------------------------------------------------------


def test_no_store_is_a_configuration_error_naming_the_task() -> None:
    """No derivable store and no explicit dedup_fallback: the first call raises, naming the task."""
    app = make_app("memory://", "rpc://")
    try:
        with pytest.raises(ImproperlyConfigured, match=f"cannot deduplicate {SYNC}: no lock"):
            app.tasks[SYNC].apply_async((1,), queue="no-store")
        with app.connection_for_write() as conn:
            assert conn.default_channel.queue_declare("no-store").message_count == 0
    finally:
        app.close()


def test_explicit_open_fallback_publishes_without_a_store(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``dedup_fallback='open'`` set on purpose publishes unlocked, with one warning."""
    app = make_app("memory://", "rpc://", dedup_fallback="open")
    try:
        with caplog.at_level(logging.DEBUG, logger="celery_dedup"):
            assert app.tasks[SYNC].delay(1).deduplicated is False
            assert app.tasks[SYNC].delay(1).deduplicated is False
    finally:
        app.close()
    logged = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and r.name == "celery_dedup"]
    assert len(logged) == 1 and "as dedup_fallback='open' asks" in logged[0]


def test_misspelt_names_warn_with_a_suggestion() -> None:
    """Misspelt task options, call options and settings warn once, with a "did you mean"."""
    app = make_app("memory://", None, "memory://misspelt", dedup_default_tll=5)
    try:
        with pytest.warns(DedupConfigWarning) as task_warnings:

            @app.task(base=DedupTask, shared=False, name="demo.typo", unique_untill="expiry")
            def typo(x: int) -> int:
                return x

            assert typo.name == "demo.typo"  # Celery creates the task class on first use

        assert "demo.typo: unknown task option 'unique_untill'" in str(task_warnings[0].message)
        assert "did you mean 'unique_until'?" in str(task_warnings[0].message)
        with pytest.warns(DedupConfigWarning) as call_warnings:
            typo.apply_async((1,), unqiue_for=60)
        messages = [str(w.message) for w in call_warnings]
        assert any("unknown setting 'dedup_default_tll'" in m and "'dedup_default_ttl'" in m
                   for m in messages)
        assert any("demo.typo: unknown call option 'unqiue_for'" in m and "'unique_for'" in m
                   for m in messages)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            typo.apply_async((2,), unqiue_for=60, queue="celery", priority=3)  # once per name
    finally:
        app.close()


def test_invalid_values_name_the_task() -> None:
    """A bad per-call value, or a bad setting met when the task first resolves, names the task."""
    app = make_app("memory://", None, "memory://invalid")
    try:
        with pytest.raises(InvalidOptionError, match=rf"^{SYNC}: unique_until='later'"):
            app.tasks[SYNC].apply_async((1,), unique_until="later")
        app.conf.dedup_default_unique_until = "sometimes"
        with pytest.raises(InvalidOptionError, match=rf"^{SYNC}: dedup_default_unique_until="):
            app.tasks[SYNC].delay(2)
    finally:
        app.close()


def test_settings_changed_after_first_use_take_effect() -> None:
    """``app.conf.dedup_*`` changed after the first call applies to the next call."""
    app = make_app("memory://", None, "memory://first")
    try:
        task = app.tasks[SYNC]
        first = task.delay(1)
        assert first.deduplication_key.startswith("celery-dedup:")
        assert runtime_for(app).settings.default_ttl == 3600
        app.conf.update(dedup_key_prefix="changed", dedup_store="memory://second",
                        dedup_default_ttl=7)
        second = task.delay(1)
        assert second.deduplicated is False  # a new prefix and a new store: a new lock
        assert second.deduplication_key.startswith("changed:")
        assert runtime_for(app).settings.default_ttl == 7
        assert runtime_for(app).store.name == "memory"  # type: ignore[union-attr]
        assert [lock.key for lock in runtime_for(app).store.scan("changed:")] == [  # type: ignore[union-attr]
            second.deduplication_key
        ]
    finally:
        app.close()


def test_task_default_queue_changed_after_first_use_routes_the_next_call() -> None:
    """``task_default_queue`` changed after the first call routes the next call, as it
    routes Celery's own publish (read on each one): another queue, another call."""
    app = make_app("memory://", None, "memory://first")
    try:
        task = app.tasks[SYNC]
        first = task.delay(1)
        app.conf.task_default_queue = "elsewhere"
        second = task.delay(1)
        assert second.deduplicated is False
        assert task.routed_queue({}, (1,), {}) == "elsewhere"
        assert first.deduplication_key != second.deduplication_key
        assert task.delay(1).deduplicated is True  # the new queue's lock holds
    finally:
        app.close()
