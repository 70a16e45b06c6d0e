"""``enqueue_many(per_item=True)``: each item deduplicated, the plain locks in one round trip."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_dedup import (
    BulkResult,
    DedupTask,
    DuplicateTaskError,
    InvalidOptionError,
    ItemStatus,
    RateLimited,
    enqueue_many,
)
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.redis import RedisStore
from celery_dedup.stores.sql import SQLStore
from tests.core.test_round_trips import app_on_store, counting_client, measure
from tests.fixtures._statements import Statements
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

#: 1,000 items over 900 keys: every tenth item repeats an earlier item's key
ITEMS = 1000
DISTINCT = 900


def item_key(i: int) -> int:
    """Item ``i``'s argument: items 0..899 are new, each later one repeats an earlier one."""
    return i if i < DISTINCT else (i * 7) % DISTINCT


def check_outcomes(outcomes: BulkResult, held: dict[int, str]) -> dict[int, str]:
    """Outcomes in input order: the first item of a key published (or a duplicate of the
    holder in ``held``), every later one a duplicate of it; returns key → the run's id."""
    assert isinstance(outcomes, BulkResult) and len(outcomes) == ITEMS
    owner: dict[int, str] = dict(held)
    first_seen: set[int] = set()
    for i, outcome in enumerate(outcomes):
        assert outcome.index == i
        n = item_key(i)
        if n in held or n in first_seen:
            assert outcome.status is ItemStatus.DUPLICATE, (i, outcome)
            assert outcome.result.deduplicated is True and outcome.result.id == owner[n]
        else:
            assert outcome.status is ItemStatus.PUBLISHED, (i, outcome)
            assert outcome.result.deduplicated is False
            owner[n] = outcome.result.id
        first_seen.add(n)
    assert len({outcome.result.id for outcome in outcomes}) == DISTINCT
    return owner


#: the two stores that keep the bulk round trip at one (a test's ``backend``)
BACKENDS = pytest.mark.parametrize("backend", [
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
])  # fmt: skip


def counted_job(
    app_factory: AppFactory,
    redis_server: RedisServer,
    request: pytest.FixtureRequest,
    backend: str,
    name: str,
    **conf: Any,
) -> tuple[Celery, Any, Any]:
    """An app on ``backend``'s store and its ``job(n)``, whose body appends ``n`` to the
    Redis list ``name``; returns the app, the task and that Redis client."""
    store_url = request.getfixturevalue("store_postgres").url if backend == "postgres" else None
    app = app_factory(name, dedup_store=store_url, **conf)
    runs = redis_server.client(5)
    runs.delete(name)

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(n: int) -> int:
        runs.rpush(name, n)
        return n

    return app, job, runs


@BACKENDS
def test_thousand_items_run_once_per_distinct_key(
    app_factory: AppFactory,
    worker_for: Any,
    redis_server: RedisServer,
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    """1,000 items, 10% repeating a key (and 10 keys held by earlier calls): a real worker
    runs each of the 900 distinct keys' bodies exactly once; the outcomes follow input
    order; afterwards the store holds no lock of the task."""
    app, job, runs = counted_job(app_factory, redis_server, request, backend, "bulk-runs")
    held = {n: job.delay(n).id for n in range(0, DISTINCT, 90)}  # 10 keys held already
    outcomes = enqueue_many([job.s(item_key(i)) for i in range(ITEMS)], per_item=True, app=app)
    owner = check_outcomes(outcomes, held)

    worker_for(app, concurrency=4)
    for outcome in outcomes.with_status("published"):
        outcome.result.get(timeout=120)
    for task_id in held.values():
        app.AsyncResult(task_id).get(timeout=120)
    done = sorted(int(n) for n in runs.lrange("bulk-runs", 0, -1))
    assert done == list(range(DISTINCT))  # each distinct key's body ran exactly once
    assert {n: app.AsyncResult(owner[n]).result for n in (0, 1, 899)} == {0: 0, 1: 1, 899: 899}
    store = runtime_for(app).store
    assert store is not None
    # unique_until="success": every run released its key (the last release may land
    # a moment after its result is stored).
    wait_until(lambda: not list(store.scan(f"celery-dedup:{job.name}:")), timeout=10)


@pytest.mark.redis
def test_per_item_costs_one_round_trip_on_redis(redis_server: RedisServer) -> None:
    """100 items over 90 keys, some held already: one EVALSHA for all of them; a second
    call of the same items (all held now) one more."""
    client = counting_client(redis_server, 9)
    client.flushdb()
    app = app_on_store("bulk-rt", RedisStore(client))

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def job(n: int) -> int:
        return n

    enqueue_many([job.s(-1), job.s(-2)], per_item=True, app=app)  # loads the script
    for n in range(5):
        job.delay(n)
    signatures = [job.s(n % 90) for n in range(100)]
    outcomes: list[BulkResult] = []
    assert measure(client, lambda: outcomes.append(
        enqueue_many(signatures, per_item=True, app=app)
    )) == 1  # fmt: skip
    statuses = [o.status.value for o in outcomes[0]]
    assert statuses.count("published") == 85 and statuses.count("duplicate") == 15
    assert measure(client, lambda: enqueue_many(signatures, per_item=True, app=app)) == 1
    client.close()
    app.close()


@pytest.mark.postgres
def test_per_item_costs_one_statement_on_postgres(store_postgres: StoreCase) -> None:
    """On PostgreSQL (autocommit: one statement is one round trip) 100 items over 90 keys,
    some held already, are one multi-row upsert."""
    store = store_postgres.store
    assert isinstance(store, SQLStore)
    app = app_on_store("bulk-pg", store)

    @app.task(base=DedupTask, shared=False, unique_for=30)
    def job(n: int) -> int:
        return n

    enqueue_many([job.s(-1), job.s(-2)], per_item=True, app=app)  # tables checked, reaped
    for n in range(5):
        job.delay(n)
    signatures = [job.s(n % 90) for n in range(100)]
    outcomes: list[BulkResult] = []
    try:
        with Statements(store.engine) as sql:
            assert sql.count(lambda: outcomes.append(
                enqueue_many(signatures, per_item=True, app=app)
            )) == 1, sql.sent  # fmt: skip
            assert sql.count(lambda: enqueue_many(signatures, per_item=True, app=app)) == 1
    finally:
        app.close()
    statuses = [o.status.value for o in outcomes[0]]
    assert statuses.count("published") == 85 and statuses.count("duplicate") == 15


@pytest.mark.redis
def test_failed_publish_gives_its_key_back(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer
) -> None:
    """An item whose publish fails is reported failed (its repeat too) and its key is
    free again; the other items are published and run once each."""
    app = app_factory("bulk-fail")
    runs = redis_server.client(5)
    runs.delete("bulk-fail")

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(n: int) -> int:
        runs.rpush("bulk-fail", n)
        return n

    broken = job.s(2).set(headers={"unserialisable": object()})
    outcomes = enqueue_many(
        [job.s(1), broken, job.s(3), job.s(2), job.s(1)], per_item=True, app=app
    )
    assert [o.status.value for o in outcomes] == [
        "published", "failed", "published", "failed", "duplicate",
    ]  # fmt: skip
    assert outcomes[1].error is not None and outcomes[3].error is outcomes[1].error
    assert outcomes[4].result.id == outcomes[0].result.id
    again = job.delay(2)  # its key is free again
    assert again.deduplicated is False
    worker_for(app)
    for result in (outcomes[0].result, outcomes[2].result, again):
        result.get(timeout=30)
    wait_until(lambda: runs.llen("bulk-fail") == 3, timeout=30)
    assert sorted(int(n) for n in runs.lrange("bulk-fail", 0, -1)) == [1, 2, 3]


@pytest.mark.redis
def test_items_needing_more_than_a_lock_take_the_single_call_path(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer
) -> None:
    """rate_limit_per_key and replace items are admitted as single calls (a rate refusal
    reported per item, a replace taking the key over); on_duplicate='raise' is reported
    refused; plain tasks are published; every admitted body runs once."""
    app = app_factory("bulk-mixed")
    runs = redis_server.client(5)
    runs.delete("bulk-mixed")

    @app.task(base=DedupTask, shared=False, unique_for=300, rate_limit_per_key="2/h",
              rate_key=lambda n: "all")  # fmt: skip
    def rated(n: int) -> int:
        runs.rpush("bulk-mixed", f"rated{n}")
        return n

    @app.task(base=DedupTask, shared=False, unique_for=300, on_duplicate="replace")
    def latest(n: int, version: int) -> int:
        runs.rpush("bulk-mixed", f"latest{n}v{version}")
        return n

    @app.task(base=DedupTask, shared=False, unique_for=300, on_duplicate="raise")
    def strict(n: int) -> int:
        runs.rpush("bulk-mixed", f"strict{n}")
        return n

    @app.task(shared=False)
    def plain(n: int) -> int:
        runs.rpush("bulk-mixed", f"plain{n}")
        return n

    strict.delay(1)
    latest.apply_async((1, 0), deduplication_key="latest-1")
    outcomes = enqueue_many([
        rated.s(1), rated.s(2), rated.s(3), rated.s(1),
        latest.s(1, 1).set(deduplication_key="latest-1"),
        strict.s(1), strict.s(2), plain.s(1),
    ], per_item=True, app=app)  # fmt: skip
    assert [o.status.value for o in outcomes] == [
        "published", "published", "refused", "duplicate",
        "published", "refused", "published", "published",
    ]  # fmt: skip
    assert isinstance(outcomes[2].error, RateLimited)
    assert isinstance(outcomes[5].error, DuplicateTaskError)
    assert outcomes[3].result.id == outcomes[0].result.id
    worker_for(app)
    for i in (0, 1, 4, 6, 7):
        outcomes[i].result.get(timeout=30)
    expected = ["latest1v1", "plain1", "rated1", "rated2", "strict1", "strict2"]
    wait_until(lambda: runs.llen("bulk-mixed") >= len(expected), timeout=30)
    assert sorted(r.decode() for r in runs.lrange("bulk-mixed", 0, -1)) == expected


@pytest.mark.redis
def test_bad_input_raises_before_anything_is_written(app_factory: AppFactory) -> None:
    """A batch key with per_item, or an item that is no signature, raises a typed error
    and leaves the store and the broker untouched."""
    app = app_factory("bulk-bad")

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(n: int) -> int:
        return n

    with pytest.raises(InvalidOptionError, match="deduplication_key"):
        enqueue_many([job.s(1)], per_item=True, deduplication_key="k", app=app)
    with pytest.raises(TypeError, match="item 1 is not a signature"):
        enqueue_many([job.s(1), (job, 2)], per_item=True, app=app)  # type: ignore[list-item]
    store = runtime_for(app).store
    assert store is not None and list(store.scan("celery-dedup:")) == []
    assert job.delay(1).deduplicated is False


@pytest.mark.redis
def test_batch_options_reach_dedup_items_only(app_factory: AppFactory) -> None:
    """unique_for/on_duplicate given to enqueue_many apply to DedupTask items that set none
    (an item's own .set() wins); a plain task and a task known only by name are published
    as Celery publishes them, without those options in their message properties."""
    from celery.signals import before_task_publish

    app = app_factory("bulk-given")

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(n: int) -> int:
        return n

    @app.task(shared=False)
    def plain(n: int) -> int:
        return n

    held = job.delay(1)
    seen: dict[str, dict[str, Any]] = {}

    def record(sender: Any = None, headers: Any = None, properties: Any = None, **_: Any) -> None:
        seen[str(sender)] = dict(properties or {})

    before_task_publish.connect(record, weak=False)
    try:
        outcomes = enqueue_many([
            job.s(1), job.s(1).set(on_duplicate="existing"), job.s(2), plain.s(3),
            app.signature("bulk.known.elsewhere", args=(4,)),
        ], per_item=True, on_duplicate="raise", unique_for=30, app=app)  # fmt: skip
    finally:
        before_task_publish.disconnect(record)
    assert [o.status.value for o in outcomes] == [
        "refused", "refused", "published", "published", "published",
    ]  # fmt: skip
    # (the second item repeats the first's key: it is refused as the first was)
    assert isinstance(outcomes[0].error, DuplicateTaskError)
    assert outcomes[0].error.existing_task_id == held.id
    lock = runtime_for(app).store.get(outcomes[2].result.deduplication_key)
    assert lock is not None and 25 < lock.ttl <= 30  # unique_for=30 applied
    for name in (plain.name, "bulk.known.elsewhere"):
        assert not {"unique_for", "on_duplicate"} & set(seen[name]), seen[name]


@pytest.mark.redis
def test_an_interrupt_gives_back_every_unpublished_key(app_factory: AppFactory) -> None:
    """An interrupt (a BaseException) in the third publish: the call raises it; the two
    items published keep their locks, the interrupted one and every later one are given
    back (nothing held for a message never sent)."""
    app = app_factory("bulk-interrupt")

    @app.task(base=DedupTask, shared=False, unique_for=300)
    def job(n: int) -> int:
        return n

    class Stop(BaseException):
        pass

    original = app.send_task
    sent: list[int] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if len(sent) == 2:
            raise Stop
        sent.append(1)
        return original(*args, **kwargs)

    app.send_task = interrupted  # type: ignore[method-assign]
    try:
        with pytest.raises(Stop):
            enqueue_many([job.s(n) for n in range(5)], per_item=True, app=app)
    finally:
        app.send_task = original  # type: ignore[method-assign]
    store = runtime_for(app).store
    assert store is not None
    keys = [job.dedup_key((n,), {}, job.dedup_config().default_call) for n in range(5)]
    assert [store.get(str(key)) is not None for key in keys] == [True, True, False, False, False]
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(app.conf.task_default_queue) == 2


@pytest.mark.redis
def test_a_subclass_with_its_own_apply_async_is_called(app_factory: AppFactory) -> None:
    """A DedupTask subclass overriding apply_async (as the compat shims do) gets every one
    of its items through that override; outcomes are still per item, in input order."""
    app = app_factory("bulk-override")
    seen: list[tuple[Any, ...]] = []

    class Audited(DedupTask):
        abstract = True

        def apply_async(self, args: Any = None, kwargs: Any = None, *a: Any, **kw: Any) -> Any:
            seen.append(tuple(args or ()))
            return super().apply_async(args, kwargs, *a, **kw)

    @app.task(base=Audited, shared=False, unique_for=300)
    def job(n: int) -> int:
        return n

    outcomes = enqueue_many([job.s(1), job.s(2), job.s(1)], per_item=True, app=app)
    assert [o.status.value for o in outcomes] == ["published", "published", "duplicate"]
    assert outcomes[2].result.id == outcomes[0].result.id
    assert seen == [(1,), (2,), (1,)]


@BACKENDS
def test_observing_items_are_published_anyway_and_counted(
    app_factory: AppFactory,
    worker_for: Any,
    redis_server: RedisServer,
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    """Under ``dedup_mode="observe"`` a bulk call publishes every item, a key repeated in
    the call or held by an earlier call included: each runs once, each would-be duplicate
    is counted once, and the holder keeps (then releases) its lock."""
    app, job, runs = counted_job(
        app_factory, redis_server, request, backend, "bulk-observed", dedup_mode="observe"
    )
    holder = job.delay(1)
    outcomes = enqueue_many([job.s(n) for n in (1, 2, 2, 3)], per_item=True, app=app)
    assert [o.status for o in outcomes] == [ItemStatus.PUBLISHED] * 4
    ids = [o.result.id for o in outcomes]
    assert len({holder.id, *ids}) == 5 and all(not o.result.deduplicated for o in outcomes)
    worker_for(app)
    assert [r.get(timeout=60) for r in (holder, *(o.result for o in outcomes))] == [1, 1, 2, 2, 3]
    assert sorted(int(n) for n in runs.lrange("bulk-observed", 0, -1)) == [1, 1, 2, 2, 3]
    assert runtime_for(app).metrics.read()[(job.name, "would_deduplicate")] == 2
    store = runtime_for(app).store
    assert store is not None
    wait_until(lambda: not list(store.scan(f"celery-dedup:{job.name}:")), timeout=10)
