"""A ``__call__`` override without ``super()`` through both shims (issue 30).

celery-eternal's task class (a ``QueueOnce`` subclass) and projects that
put Flask's base-task pattern on ``Singleton`` override ``__call__`` to run
``self.run`` directly. The lock must still be claimed, released when the
run ends (not held for its whole timeout), and the body run once.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery

from celery_dedup.compat.celery_once import AlreadyQueued, QueueOnce
from celery_dedup.compat.celery_singleton import Singleton
from tests.compat.conftest import AppFactory, lock_of, wait_for, worker

pytestmark = pytest.mark.redis


class EternalOnce(QueueOnce):
    """celery-eternal's shape: ``__call__`` runs the body itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class BodylessSingleton(Singleton):
    """An override that runs the body itself, on the celery-singleton shim."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def _ran_once_and_released(app: Celery, task: Any, duplicate_is: Any) -> None:
    runs: list[int] = []
    gate = threading.Event()

    @app.task(base=task, shared=False)
    def job(x: int) -> int:
        runs.append(x)
        gate.wait(10)
        return x

    first = job.delay(1)
    duplicate_is(job)
    with worker(app):
        wait_for(lambda: runs)
        copy = app.send_task(job.name, args=[1])  # bypasses apply_async: the guard skips it
        wait_for(lambda: copy.state == "IGNORED")
        gate.set()
        assert first.get(timeout=10) == 1
        assert lock_of(app, first) is None  # released by the run, before its result
        assert runs == [1]
        assert job.delay(1).get(timeout=10) == 1
    assert runs == [1, 1]


def test_celery_once_subclass_with_its_own_call(make_app: AppFactory, lib_url: str) -> None:
    app = make_app(
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": lib_url}}
    )

    def duplicate_raises(job: Any) -> None:
        with pytest.raises(AlreadyQueued):
            job.delay(1)

    _ran_once_and_released(app, EternalOnce, duplicate_raises)


def test_celery_singleton_subclass_with_its_own_call(make_app: AppFactory, lib_url: str) -> None:
    app = make_app(singleton_backend_url=lib_url)

    def duplicate_shares(job: Any) -> None:
        assert job.delay(1).deduplicated is True

    _ran_once_and_released(app, BodylessSingleton, duplicate_shares)
