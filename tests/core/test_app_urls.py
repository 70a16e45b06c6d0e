"""The broker and result backend as Celery reads them: the environment, failover lists."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.app_urls import broker_scheme, broker_urls, result_backend
from celery_dedup.lint import app_facts, task_facts
from celery_dedup.runtime import runtime_for
from celery_dedup.stores import derive_store_url
from tests.fixtures.redis import RedisServer

from .conftest import wait_until


@pytest.fixture
def bare_app(redis_server: RedisServer) -> Iterator[Celery]:
    """An app that names neither its broker nor its result backend in ``app.conf``."""
    redis_server.flush(3, 4)
    app = Celery("env-urls", set_as_current=False)
    app.conf.update(
        task_default_queue="q-env-urls",
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        result_expires=None,
    )
    yield app
    runtime_for(app).metrics.flush()
    app.close()


def _counting_task(app: Celery, runs: list[int], **options: Any) -> Any:
    lock = threading.Lock()

    @app.task(base=DedupTask, shared=False, unique_for=60, **options)
    def job(n: int) -> int:
        with lock:
            runs.append(n)
        return n

    return job


def test_environment_urls_deduplicate_with_a_real_worker(
    bare_app: Celery, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
    worker_for: Any,
) -> None:
    """``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` in the environment: the store is
    the result backend, a duplicate is refused and the body runs once.
    """
    monkeypatch.setenv("CELERY_BROKER_URL", redis_server.url(3))
    monkeypatch.setenv("CELERY_RESULT_BACKEND", redis_server.url(4))
    assert derive_store_url(bare_app) == redis_server.url(4)
    runs: list[int] = []
    job = _counting_task(bare_app, runs)
    first = job.delay(1)
    again = job.delay(1)
    assert (first.deduplicated, again.deduplicated) == (False, True)
    assert redis_server.client(4).keys("celery-dedup:*")  # the lock is in the result backend
    worker_for(bare_app, concurrency=2)
    assert first.get(timeout=30) == 1
    assert runs == [1]
    wait_until(lambda: not redis_server.client(4).keys("celery-dedup:*"))


@pytest.mark.parametrize("form", ["list", "semicolons"])
def test_failover_broker_list_gives_the_first_url(
    bare_app: Celery, redis_server: RedisServer, worker_for: Any, form: str
) -> None:
    """A failover list of brokers (a list, or ``;``-separated), no result backend: the
    store is the first broker; the worker runs a call once.
    """
    urls = [redis_server.url(3), "redis://127.0.0.1:1/0"]
    bare_app.conf.broker_url = urls if form == "list" else "; ".join(urls)
    assert broker_urls(bare_app.conf) == urls
    assert broker_scheme(bare_app.conf) == "redis"
    assert derive_store_url(bare_app) == redis_server.url(3)
    runs: list[int] = []
    job = _counting_task(bare_app, runs, ignore_result=True)
    first = job.delay(7)
    assert job.delay(7).deduplicated is True
    worker_for(bare_app, concurrency=2)
    wait_until(lambda: runs, 30)
    assert first.deduplicated is False
    wait_until(lambda: not redis_server.client(3).keys("celery-dedup:*"))
    assert runs == [7]


def test_lint_sees_the_environment_broker(
    bare_app: Celery, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Redis broker named only by ``CELERY_BROKER_URL``: its visibility_timeout (1 h)."""
    monkeypatch.setenv("CELERY_BROKER_URL", redis_server.url(3))
    monkeypatch.setenv("CELERY_RESULT_BACKEND", redis_server.url(4))
    job = _counting_task(bare_app, [], acks_late=True, time_limit=7200)
    facts = app_facts(bare_app)
    assert facts.visibility_timeout == 3600 and facts.store_url == redis_server.url(4)
    assert task_facts(job).acks_late is True


def test_settings_win_over_nothing_and_read_like_celery(
    bare_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No broker anywhere: no URL; the environment beats ``app.conf`` as in Celery."""
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    monkeypatch.delenv("CELERY_RESULT_BACKEND", raising=False)
    assert broker_urls(bare_app.conf) == [] and result_backend(bare_app.conf) == ""
    bare_app.conf.broker_url = "memory://"
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/0")
    assert broker_urls(bare_app.conf) == ["redis://127.0.0.1:1/0"]
    assert bare_app.conf.broker_url == "redis://127.0.0.1:1/0"
