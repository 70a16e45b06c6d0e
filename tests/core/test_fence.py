"""A stale run's fenced write is refused, the newer run's lands (real worker; the fences
come from the Redis store, or from PostgreSQL's claim statements: ``store_conf``).

Two runs of one key are made to overlap: the first run's body waits while
its lock lapses (``unique_for`` shorter than the body), a second call of
the key is published and runs to its end, then the first body resumes.
Both write through a fenced helper: a Redis hash (``fenced_hset``) and a
PostgreSQL row (``fenced_update``). The newer run's write is what stays;
the older run's is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_dedup import (
    DedupTask,
    NoFenceError,
    current_fence,
    fenced_hset,
    fenced_update,
    inspect_lock,
)
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

EFFECTS_DB = 7


@pytest.fixture
def effects(redis_server: RedisServer) -> Iterator[Any]:
    """The side effects' Redis (not the store's database)."""
    redis_server.flush(EFFECTS_DB)
    client = redis_server.client(EFFECTS_DB)
    yield client
    client.close()


@pytest.fixture
def orders(postgres_server: PostgresServer) -> Iterator[tuple[sa.Engine, sa.Table]]:
    """A PostgreSQL table of orders, one row, never written yet."""
    engine = sa.create_engine(postgres_server.url())
    table = sa.Table(
        "fence_orders", sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("status", sa.String(20)),
        sa.Column("fence", sa.BigInteger, nullable=True),
    )  # fmt: skip
    table.drop(engine, checkfirst=True)
    table.create(engine)
    with engine.begin() as conn:
        conn.execute(table.insert().values(id=1, status="new", fence=None))
    yield engine, table
    table.drop(engine)
    engine.dispose()


def _overlap(
    app: Celery, worker_for: Callable[..., Any], write: Callable[[str, int], bool]
) -> dict[str, tuple[int, bool]]:
    """Run two overlapping runs of one key; what each saw: (fence, whether its write landed)."""
    resume = threading.Event()
    started: dict[str, int] = {}

    @app.task(base=DedupTask, unique_for=1, fence=True, unique_on=("order",), shared=False)
    def settle(order: int, who: str) -> tuple[int, bool]:
        fence = current_fence()
        started[who] = fence
        if who == "old":
            resume.wait(30)  # stalls past its lock's lifetime
        return fence, write(who, fence)

    worker_for(app, concurrency=2)
    old = settle.delay(1, "old")
    wait_until(lambda: "old" in started)
    key = old.deduplication_key
    wait_until(lambda: inspect_lock(key, app=app) is None, timeout=20)  # the lock lapsed
    new = settle.delay(1, "new")
    assert new.id != old.id  # the key was free: a second run was published
    outcome = {"new": tuple(new.get(timeout=20))}
    resume.set()
    outcome["old"] = tuple(old.get(timeout=20))
    return outcome  # type: ignore[return-value]


def test_a_stale_runs_redis_write_is_refused(
    app_factory: AppFactory,
    worker_for: Callable[..., Any],
    effects: Any,
    store_conf: dict[str, Any],
) -> None:
    """The newer run's hash stays; the older run's later write is refused (fenced_hset)."""
    app = app_factory("fence-redis", **store_conf)

    def write(who: str, fence: int) -> bool:
        return fenced_hset(effects, "doc:1", fence, {"body": who})

    outcome = _overlap(app, worker_for, write)
    (old_fence, old_landed), (new_fence, new_landed) = outcome["old"], outcome["new"]
    assert old_fence < new_fence
    assert new_landed is True and old_landed is False
    assert effects.hgetall("doc:1") == {b"body": b"new", b"fence": str(new_fence).encode()}


def test_a_stale_runs_sql_write_is_refused(
    app_factory: AppFactory,
    worker_for: Callable[..., Any],
    orders: tuple[sa.Engine, sa.Table],
    store_conf: dict[str, Any],
) -> None:
    """The newer run's row stays; the older run's later UPDATE matches no row (fenced_update)."""
    engine, table = orders
    app = app_factory("fence-sql", **store_conf)

    def write(who: str, fence: int) -> bool:
        with engine.begin() as conn:
            return fenced_update(conn, table, fence, {"id": 1}, {"status": f"paid-{who}"})

    outcome = _overlap(app, worker_for, write)
    (old_fence, old_landed), (new_fence, new_landed) = outcome["old"], outcome["new"]
    assert old_fence < new_fence and new_landed and not old_landed
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table.c.status, table.c.fence)).all()
    assert [tuple(row) for row in rows] == [("paid-new", new_fence)]


def test_a_run_without_fence_or_outside_a_task_has_none(
    app_factory: AppFactory, worker_for: Callable[..., Any], store_conf: dict[str, Any]
) -> None:
    """NoFenceError outside a task, in a task without fence=True, and for a call with no lock."""
    app = app_factory("fence-none", **store_conf)
    with pytest.raises(NoFenceError):
        current_fence()

    def fence_or_error() -> str:
        try:
            return str(current_fence())
        except NoFenceError as exc:
            return f"error: {exc}"

    @app.task(base=DedupTask, unique_for=60, shared=False)
    def unfenced() -> str:
        return fence_or_error()

    @app.task(base=DedupTask, unique_for=60, fence=True, shared=False)
    def fenced() -> str:
        return fence_or_error()

    worker_for(app)
    assert "does not set fence=True" in unfenced.delay().get(timeout=10)
    assert int(fenced.delay().get(timeout=10)) > 0
    no_lock = fenced.apply_async(unique_for=None).get(timeout=10)
    assert no_lock.startswith("error:") and "took no lock" in no_lock


def test_keep_last_runs_get_growing_fences(
    app_factory: AppFactory,
    worker_for: Callable[..., Any],
    runs: Any,
    store_conf: dict[str, Any],
) -> None:
    """keep_last (its start claim is claim_run, gated): each run of the key gets a fence
    from that claim, the later run a greater one; each body ran once."""
    app = app_factory("fence-keep-last", **store_conf)

    @app.task(base=DedupTask, unique_for=30, on_duplicate="keep_last", fence=True,
              unique_on=("order",), shared=False)
    def settle(order: int, n: int) -> int:
        runs.rpush("fence-settled", n)
        return current_fence()

    worker_for(app)
    first = settle.delay(1, 1).get(timeout=20)
    second = settle.delay(1, 2).get(timeout=20)
    assert 0 < first < second
    assert runs.lrange("fence-settled", 0, -1) == [b"1", b"2"]
