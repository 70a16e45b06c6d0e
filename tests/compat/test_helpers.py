"""celery-once's helpers stay importable, and ``once`` is read on every call."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery

from celery_dedup.compat.celery_once import AlreadyQueued, QueueOnce
from celery_dedup.compat.celery_once_helpers import (
    kwargs_to_list,
    now_unix,
    parse_redis_details,
    queue_once_key,
)
from tests.compat.conftest import AppFactory

pytestmark = pytest.mark.redis


@pytest.fixture
def once_app(make_app: AppFactory, lib_url: str) -> Celery:
    """An app configured for celery-once, its lock URL on db 26."""
    return make_app(ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": lib_url}})


def test_helpers_behave_as_celery_once_s() -> None:
    """``now_unix``, ``kwargs_to_list``, ``queue_once_key``, ``parse_redis_details``."""
    before = int(time.time())
    assert before <= now_unix() <= int(time.time())
    assert isinstance(now_unix(), int)
    assert kwargs_to_list({"b": 2, "a": 1}) == ["a-1", "b-2"]
    assert queue_once_key("tasks.add", {"b": 2, "a": 1}) == "qo_tasks.add_a-1_b-2"
    assert queue_once_key("tasks.add", {"b": 2, "a": 1}, restrict_to=["a"]) == "qo_tasks.add_a-1"
    assert parse_redis_details("redis://:pw@host:6380/3") == {
        "host": "host", "password": "pw", "port": 6380, "db": 3,
    }


def test_a_base_class_once_changed_in_place_takes_effect(once_app: Celery) -> None:
    """Mutating a shared base's ``once`` dict switches the next call to graceful."""

    class Base(QueueOnce):
        once = {"graceful": False}

    @once_app.task(base=Base, shared=False)
    def job(x: int) -> int:
        return x

    first = job.delay(1)
    with pytest.raises(AlreadyQueued):
        job.delay(1)
    Base.once["graceful"] = True
    again: Any = job.delay(1)
    assert again.deduplicated is True and again.id == first.id


def test_task_once_reassigned_at_run_time_takes_effect(once_app: Celery) -> None:
    """``task.once = {...}`` changes keys and timeout of the next call; explicit options win."""

    @once_app.task(base=QueueOnce, once={"graceful": True}, shared=False)
    def job(x: int, y: int) -> int:
        return x + y

    assert job.delay(1, 1).deduplicated is False
    assert job.delay(1, 2).deduplicated is False  # other arguments: other work
    job.once = {"graceful": True, "keys": ["x"], "timeout": 30}
    keyed = job.delay(5, 1)
    assert keyed.deduplicated is False
    assert job.delay(5, 2).deduplicated is True  # only x counts now
    ttl = job.dedup_config().unique_for
    assert ttl == 30

    @once_app.task(base=QueueOnce, once={"graceful": True}, unique_for=90, shared=False)
    def pinned(x: int) -> int:
        return x

    pinned.once = {"graceful": True, "timeout": 30}
    pinned.delay(1)
    assert pinned.dedup_config().unique_for == 90  # the explicit attribute wins
