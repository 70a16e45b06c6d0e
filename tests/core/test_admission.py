"""The admission pipeline's invariants over every policy, limit, call path and id (issue 31).

A generated matrix, producer side, on Redis and PostgreSQL: a first call is
published; an identical call follows its ``on_duplicate``; a call of other
arguments under the same full rate key is refused (or, on a path the canvas
rules protect, published with a countdown); a call whose publish fails
leaves nothing behind. Every case counts the messages on the broker and
reads the store: no lock, window entry or revoked marker of a refused or
failed call, rate counts exact, no member lost, no worker-side publish raising.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery._state import _task_stack

from celery_dedup import DedupTask, DuplicateTaskError, RateLimited, inspect_lock
from celery_dedup.limits import rate_store_key
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import RateSupport, revoked_marker_key

from .conftest import AppFactory

POLICIES = ("existing", "raise", "replace", "keep_last", "cancel_running")
LIMITS = ("none", "rate", "rate_callable")
PATHS = ("delay", "signature", "group_member", "chord_member", "worker_side")
IDS = ("random", "deterministic", "caller")
_names = itertools.count()


def _user(user: str, n: int) -> str:
    return user


@pytest.fixture(params=["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_conf(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The lock store: the Redis result backend, or PostgreSQL."""
    if request.param == "redis":
        return {}
    case = request.getfixturevalue("store_postgres")
    return {"dedup_store": case.url}


def _app(app_factory: AppFactory, conf: dict[str, Any]) -> Celery:
    return app_factory(f"adm{next(_names)}", dedup_send_events=False, **conf)


def _task(app: Celery, policy: str, limit: str, ids: str) -> Any:
    options: dict[str, Any] = {"on_duplicate": policy, "unique_for": 600, "cancel_wait": 2}
    if limit != "none":
        options["rate_limit_per_key"] = "1/h"
        # (a staticmethod: the callable-key wrapping is fixed separately)
        options["rate_key"] = staticmethod(_user) if limit == "rate_callable" else "{user}"
    if ids == "deterministic":
        options["deterministic_id"] = True

    @app.task(base=DedupTask, shared=False, name=f"adm.job{next(_names)}", **options)
    def job(user: str, n: int) -> int:
        return n

    return job


class _InWorker:
    """Make ``app.current_worker_task`` answer a running parent task."""

    def __init__(self, app: Celery) -> None:
        @app.task(shared=False, name=f"adm.parent{next(_names)}")
        def parent() -> None:
            return None

        self.parent = parent

    def __enter__(self) -> None:
        self.parent.push_request(id="parent-id", called_directly=False)
        _task_stack.push(self.parent)

    def __exit__(self, *exc: object) -> None:
        _task_stack.pop()
        self.parent.pop_request()


def _call(app: Celery, job: Any, path: str, ids: str, n: int) -> Any:
    options: dict[str, Any] = {}
    if ids == "caller":
        options["task_id"] = f"caller-{job.name}-{n}"
    if path == "delay" and not options:
        return job.delay("u", n)
    if path == "signature":
        return job.s("u", n).set(**options).apply_async()
    if path == "group_member":
        return job.apply_async(("u", n), group_id=f"g-{job.name}", group_index=n, **options)
    if path == "chord_member":
        body = app.signature("adm.body")
        return job.apply_async(("u", n), chord=body, group_id=f"c-{job.name}", **options)
    if path == "worker_side":
        with _InWorker(app):
            return job.apply_async(("u", n), **options)
    return job.apply_async(("u", n), **options)


def _queued(app: Celery) -> int:
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        return int(client.llen(app.conf.task_default_queue))


def _window(app: Celery, job: Any) -> int:
    store = runtime_for(app).store
    assert isinstance(store, RateSupport)
    key = rate_store_key("celery-dedup", job.name, "u")
    return store.rate_window(key, 1, 3600).count


def _protected(path: str) -> bool:
    return path in ("group_member", "chord_member", "worker_side")


def _cases() -> Iterator[Any]:
    for policy, limit, path, ids in itertools.product(POLICIES, LIMITS, PATHS, IDS):
        yield pytest.param(policy, limit, path, ids, id=f"{policy}-{limit}-{path}-{ids}")


@pytest.mark.parametrize(("policy", "limit", "path", "ids"), list(_cases()))
def test_refused_call_leaves_nothing_and_loses_nothing(
    app_factory: AppFactory, store_conf: dict[str, Any], policy: str, limit: str, path: str,
    ids: str,
) -> None:
    """A call refused by its rate leaves no lock, window entry or revoked marker; a protected
    path is published (delayed) instead of refused or raising; counts are exact."""
    app = _app(app_factory, store_conf)
    job = _task(app, policy, limit, ids)
    first = _call(app, job, path, ids, 1)
    assert first.deduplicated is False
    first_lock = inspect_lock(first.deduplication_key, app=app)
    published = 1
    assert _queued(app) == published

    try:
        other = _call(app, job, path, ids, 2)
    except RateLimited as exc:
        assert limit != "none" and not _protected(path)
        assert 0 < exc.retry_after <= 3600
        # Nothing left behind: no lock for the refused call, the first keeps its own.
        refused_key = job.dedup_key(("u", 2), {}, job.dedup_config().default_call)
        assert inspect_lock(refused_key, app=app) is None
        after = inspect_lock(first.deduplication_key, app=app)
        assert after is not None and first_lock is not None and after.owner == first_lock.owner
        store = runtime_for(app).store
        assert store is not None
        assert store.get(revoked_marker_key(first.deduplication_key, first_lock.owner)) is None
    else:
        assert other.deduplicated is False  # a different call is never answered with a handle
        published += 1
    assert _queued(app) == published
    if limit != "none":
        assert _window(app, job) == published  # exact: one entry per message


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit", LIMITS)
def test_duplicate_follows_on_duplicate_not_the_rate(
    app_factory: AppFactory, store_conf: dict[str, Any], policy: str, limit: str
) -> None:
    """An identical call is answered per ``on_duplicate`` even when its rate window is full;
    a take-over refused by the rate leaves the holder holding, unrevoked."""
    app = _app(app_factory, store_conf)
    job = _task(app, policy, limit, "random")
    first = job.delay("u", 1)
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None
    if policy == "existing":
        again = job.delay("u", 1)
        assert again.deduplicated is True and again.id == first.id
    elif policy == "raise":
        with pytest.raises(DuplicateTaskError):
            job.delay("u", 1)
    elif limit != "none":
        with pytest.raises(RateLimited):
            job.delay("u", 1)
        after = inspect_lock(first.deduplication_key, app=app)
        assert after is not None and after.owner == lock.owner
        store = runtime_for(app).store
        assert store is not None
        assert store.get(revoked_marker_key(first.deduplication_key, lock.owner)) is None
    else:
        again = job.delay("u", 1)
        assert again.deduplicated is False and again.id != first.id
    expected = 2 if policy in ("replace", "keep_last", "cancel_running") and limit == "none" else 1
    assert _queued(app) == expected
    if limit != "none":
        assert _window(app, job) == 1


@pytest.mark.parametrize("limit", LIMITS)
def test_failed_publish_leaves_nothing(
    app_factory: AppFactory, store_conf: dict[str, Any], limit: str
) -> None:
    """A publish that raises gives back its lock and its window entry: the next call publishes."""
    app = _app(app_factory, store_conf)
    job = _task(app, "existing", limit, "random")

    class Boom(Exception):
        pass

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise Boom("broker down")

    original = job.app.send_task
    job.app.send_task = broken
    try:
        with pytest.raises(Boom):
            job.delay("u", 1)
    finally:
        job.app.send_task = original
    key = job.dedup_key(("u", 1), {}, job.dedup_config().default_call)
    assert inspect_lock(key, app=app) is None
    if limit != "none":
        assert _window(app, job) == 0
    result = job.delay("u", 1)
    assert result.deduplicated is False and _queued(app) == 1
