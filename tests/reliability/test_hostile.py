"""Hostile and odd input: forged headers, and arguments no key can be made of.

A message published around ``apply_async`` (``send_task``) with a forged
``celery_dedup`` header names a key but cannot own its lock: the owner token
is secret to the real publish. Odd arguments either raise a typed error
naming the argument and publish nothing, or behave exactly as plain Celery.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupKeyError
from celery_dedup.stores.redis import RedisStore

from .apps import WORK, work_task
from .conftest import Backends
from .probe import Producer, Recorder, poll
from .workers import WorkerPool

AppFactory = Callable[[dict[str, Any]], Celery]


@pytest.fixture
def store(backends: Backends) -> Iterator[RedisStore]:
    store = RedisStore(redis.Redis.from_url(backends.store))
    yield store
    store.close()


@pytest.mark.slow
@pytest.mark.redis
def test_forged_headers_cannot_release_extend_or_take_over(
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    producer_app: AppFactory,
    store: RedisStore,
) -> None:
    conf = backends.conf()
    workers.start(conf, concurrency=2)
    app = producer_app(conf)
    producer = Producer(recorder)
    # Queued for a few seconds: it holds the key, unstarted.
    holder = producer.call(work_task(app), (1, {}), countdown=4, unique_for=60)
    key = str(holder.deduplication_key)
    before = store.get(key)
    assert before is not None and producer.last is not None
    assert before.owner == producer.last.token
    forged_headers = [
        # the holder's own task id as owner, releasing at start, taking over
        {"key": key, "until": "start", "for": 60, "replace": True, "tok": None},
        # a guessed token, a tiny TTL to shorten the lock
        {"key": key, "until": "start", "for": 0.001, "replace": False, "tok": "0" * 32},
        # a long TTL to extend it
        {"key": key, "until": "expiry", "for": 3600, "replace": True, "tok": "f" * 32},
    ]
    forged = [
        app.send_task(
            WORK,
            args=(1, {}),
            task_id=holder.id if i == 0 else None,
            retries=1 if i == 0 else 0,
            headers={"celery_dedup": {"v": 1, **header}},
        ).id
        for i, header in enumerate(forged_headers)
    ]
    # While the holder waits for its countdown, the forged messages reach a worker.
    poll(lambda: len(recorder.events("prerun")) >= len(forged), 10, what="forged received")
    after = store.get(key)
    assert after is not None
    assert (after.owner, after.task_id, after.started) == (before.owner, holder.id, False)
    assert abs(after.expires_at - before.expires_at) < 0.5
    assert holder.get(timeout=30) == 1
    (end,) = recorder.events("end", token=before.owner)
    # A forged message may run once the key is free again (an unannounced
    # duplicate after the release), never while the holder held it.
    early = [
        e for e in recorder.events("start") if e.token != before.owner and e.t < end.t
    ]
    assert early == [], early
    assert [e.token for e in recorder.events("start", task_id=holder.id)][:1] == [before.owner]

def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


class Custom:
    """An object no serializer knows."""


ODD = {
    "nan": float("nan"),
    "infinity": float("inf"),
    "deep": nested(5000),
    "object": Custom(),
    "set": {1, 2},
    "bytes": b"\x00\xff",
    "surrogate": "\ud800x",
    "ten-megabytes": "x" * 10_000_000,
}


def outcome(call: Callable[[], Any]) -> type[BaseException] | None:
    try:
        call()
    except Exception as exc:
        return type(exc)
    return None


@pytest.mark.redis
@pytest.mark.parametrize("name", list(ODD))
def test_odd_arguments_raise_a_typed_error_or_behave_like_plain_celery(
    name: str, backends: Backends, producer_app: AppFactory, store: RedisStore
) -> None:
    app = producer_app(backends.conf())

    @app.task(name="rel.plain", shared=False)
    def plain(n: Any, plan: Any) -> None:
        return None

    value = ODD[name]
    broker = redis.Redis.from_url(backends.broker)
    plain_error = outcome(lambda: plain.apply_async((value, {})))
    queued = broker.llen("rel")
    try:
        work_task(app).apply_async((value, {}))
    except DedupKeyError as exc:
        assert exc.argument.startswith("n"), exc.argument
        assert broker.llen("rel") == queued, "published despite the error"
    except Exception as exc:
        assert type(exc) is plain_error, f"plain Celery raised {plain_error}, dedup {exc!r}"
        assert broker.llen("rel") == queued
    else:
        assert plain_error is None, f"plain Celery raised {plain_error}"
        assert broker.llen("rel") == queued + 1
    # Whatever happened, no lock is left without its message.
    locks = list(store.scan("celery-dedup:"))
    assert len(locks) == broker.llen("rel") - queued
    broker.close()
