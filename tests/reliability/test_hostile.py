"""Hostile and odd input: forged and malformed headers, and arguments no key can be made of.

A message published around ``apply_async`` (``send_task``) with a forged
``celery_dedup`` header names a key but cannot own its lock: the owner token
is secret to the real publish. Odd arguments either raise a typed error
naming the argument and publish nothing, or behave exactly as plain Celery.
No header, whatever it holds, stops a worker: one that cannot be decoded is
logged once and the message is handled as one without a header.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_dedup import DedupKeyError, MalformedHeader, UniqueUntil, backoff, runs
from celery_dedup.header import HEADER, LockHeader
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


#: Any JSON value (what a hostile producer can put in a header).
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
#: Headers shaped like ours, each field right, wrong, missing or huge.
FIELDS = {
    "v": st.sampled_from([1, 0, 2, "1", 1.0, True, None]) | JSON,
    "key": st.text(min_size=1, max_size=30) | st.just("k" * 1_000_000) | JSON,
    "until": st.sampled_from([u.value for u in UniqueUntil]) | JSON,
    "for": st.floats() | st.integers(-10, 10**12) | JSON,
    "replace": st.booleans() | JSON,
    "tok": st.text(min_size=1, max_size=30) | st.just("t" * 100_000) | JSON,
    "last": st.booleans() | JSON,
}
HEADERS = JSON | st.fixed_dictionaries({}, optional=FIELDS)
#: celery-dedup's other message fields, hostile too.
EXTRAS = st.fixed_dictionaries(
    {},
    optional={
        runs.DELIVERY_FIELD: JSON | st.just("d" * 100_000),
        runs.INHERITED_FIELD: JSON,
        backoff.FIELD: JSON | st.just("0.0/" + "9" * 50),
    },
)


def malformed(header: Any) -> bool:
    """Whether the worker must treat ``header`` as malformed (logged, then guarded)."""
    if header is None:
        return False
    try:
        LockHeader.decode(header)
    except MalformedHeader:
        return True
    return False


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(900)
def test_no_header_stops_a_worker_and_every_well_formed_message_after_it_runs(
    backends: Backends,
    recorder: Recorder,
    workers: WorkerPool,
    producer_app: AppFactory,
) -> None:
    """Generated headers reach a real prefork worker; it stays up, and a malformed
    header is logged once and handled as a message without one (its guard runs it once).
    """
    conf = backends.conf()
    (worker,) = workers.start(conf, concurrency=2)
    app = producer_app(conf)
    task = work_task(app)
    numbers = itertools.count(1_000)
    hostile: list[tuple[str, int, bool]] = []

    @settings(
        max_examples=int(os.environ.get("DEDUP_HOSTILE_EXAMPLES", "30")),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(header=HEADERS, extras=EXTRAS)
    @example(header={"v": 1, "key": "k", "until": "bogus", "for": 10}, extras={})
    @example(header="bogus", extras={})
    @example(header={"v": 1, "key": "k", "until": "success", "for": 10}, extras={})
    def feed(header: Any, extras: dict[str, Any]) -> None:
        n = next(numbers)
        sent = app.send_task(WORK, args=(n, {}), headers={HEADER: header, **extras})
        hostile.append((sent.id, n, malformed(header)))
        well_formed = task.apply_async((-n, {}))
        assert well_formed.get(timeout=30) == -n, worker.tail()
        assert worker.proc is not None and worker.proc.poll() is None, worker.tail()

    feed()
    log = worker.log.read_text(errors="replace")
    assert "Unrecoverable error" not in log
    assert any(bad for _, _, bad in hostile)
    for task_id, n, bad in hostile:
        result = AsyncResult(task_id, app=app)
        poll(lambda r=result: r.state in ("SUCCESS", "IGNORED"), 30, what=f"{task_id} final")
        if bad:
            # Handled as a message without a header: its guard (a key of its own) ran it once.
            assert result.get(timeout=5) == n
            assert len(recorder.events("start", task_id=task_id)) == 1
            assert log.count(f"[{task_id}] carries a malformed header") == 1, task_id

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
