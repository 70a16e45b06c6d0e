"""``retry_window``: a window per outcome, with a real worker on Redis (issue 34, item 3).

A failed run keeps its key only for the cooldown; a success follows the
policy (``"expiry"``: held for the rest of ``unique_for``). Bodies count
their runs in a Redis list; the store is inspected for the lock's TTL.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_dedup import DedupTask, InvalidOptionError, OptionCombinationError, inspect_lock

from .conftest import AppFactory, wait_until


def test_a_failure_holds_the_key_only_for_the_cooldown(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, store_conf: dict[str, Any]
) -> None:
    app = app_factory("rw-fail", **store_conf)

    @app.task(base=DedupTask, shared=False, unique_for=600, retry_window=5)
    def job(x: int) -> None:
        runs.rpush("rw-fail", x)
        raise ValueError("boom")

    first = job.delay(1)
    worker_for(app)
    with pytest.raises(ValueError, match="boom"):
        first.get(timeout=20)
    lock = inspect_lock(first.deduplication_key, app=app)
    if lock is not None:  # (gone already only if the cooldown passed meanwhile)
        assert lock.task_id == first.id and lock.ttl <= 5
        # Within the cooldown a call is a duplicate of the failed run.
        assert job.delay(1).id == first.id
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is None, timeout=30)
    second = job.delay(1)
    assert second.deduplicated is False and second.id != first.id
    with pytest.raises(ValueError, match="boom"):
        second.get(timeout=20)
    assert runs.lrange("rw-fail", 0, -1) == [b"1", b"1"]


def test_without_a_window_a_failure_holds_the_key_for_unique_for(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    app = app_factory("rw-none")

    @app.task(base=DedupTask, shared=False, unique_for=600)
    def job(x: int) -> None:
        runs.rpush("rw-none", x)
        raise ValueError("boom")

    first = job.delay(1)
    worker_for(app)
    with pytest.raises(ValueError):
        first.get(timeout=20)
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.ttl > 500
    assert job.delay(1).id == first.id
    assert runs.lrange("rw-none", 0, -1) == [b"1"]


def test_a_success_under_expiry_holds_the_key_for_unique_for(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    """asynq#629: a failed task should not block for the whole window, a successful one should."""
    app = app_factory("rw-ok")

    @app.task(base=DedupTask, shared=False, unique_for=600, unique_until="expiry",
              retry_window=5)
    def job(x: int) -> int:
        runs.rpush("rw-ok", x)
        return x

    first = job.delay(1)
    worker_for(app)
    assert first.get(timeout=20) == 1
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.ttl > 500
    assert job.delay(1).id == first.id
    assert runs.lrange("rw-ok", 0, -1) == [b"1"]


def test_a_success_under_success_releases_as_always(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    app = app_factory("rw-success")

    @app.task(base=DedupTask, shared=False, unique_for=600, retry_window=5)
    def job(x: int) -> int:
        runs.rpush("rw-success", x)
        return x

    first = job.delay(1)
    worker_for(app)
    assert first.get(timeout=20) == 1
    assert inspect_lock(first.deduplication_key, app=app) is None
    assert job.delay(1).get(timeout=20) == 1
    assert runs.lrange("rw-success", 0, -1) == [b"1", b"1"]


def test_a_retry_is_not_a_failure(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    """A body that retries, then succeeds, is held as a success (not for the cooldown)."""
    app = app_factory("rw-retry")

    @app.task(base=DedupTask, shared=False, bind=True, unique_for=600, unique_until="expiry",
              retry_window=5, max_retries=3)
    def job(self: Any, x: int) -> int:
        attempt = runs.rpush("rw-retry", x)
        if attempt < 3:
            raise self.retry(countdown=0.1)
        return x

    first = job.delay(1)
    worker_for(app)
    assert first.get(timeout=30) == 1
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.ttl > 500
    assert job.delay(1).id == first.id
    assert runs.lrange("rw-retry", 0, -1) == [b"1", b"1", b"1"]


def test_an_eager_failure_gets_the_cooldown(app_factory: AppFactory, runs: redis.Redis) -> None:
    app = app_factory("rw-eager", task_always_eager=True)

    @app.task(base=DedupTask, shared=False, unique_for=600, retry_window=5)
    def job(x: int) -> None:
        runs.rpush("rw-eager", x)
        raise ValueError("boom")

    first = job.delay(1)
    assert first.failed()
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is None or lock.ttl <= 5
    assert runs.lrange("rw-eager", 0, -1) == [b"1"]


@pytest.mark.parametrize("policy", ["start", "finish"])
def test_a_policy_that_frees_a_failure_refuses_the_window(
    app_factory: AppFactory, policy: str
) -> None:
    app = app_factory("rw-combo")
    with pytest.raises(OptionCombinationError) as info:

        @app.task(base=DedupTask, shared=False, name=f"rw.{policy}", unique_until=policy,
                  retry_window=5)
        def job(x: int) -> None:
            return None

        job.name  # noqa: B018 - tasks are created lazily; touching one evaluates it

    exc = info.value
    assert (exc.option, exc.value, exc.requires, exc.task_name) == (
        "retry_window", 5, "unique_until", f"rw.{policy}"
    )
    assert "'success' or 'expiry'" in str(exc) and repr(policy) in str(exc)

    @app.task(base=DedupTask, shared=False, name=f"rw.call.{policy}")
    def plain(x: int) -> None:
        return None

    with pytest.raises(OptionCombinationError):
        plain.apply_async((1,), unique_until=policy, retry_window=5)
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(app.conf.task_default_queue) == 0


def test_a_window_not_shorter_than_unique_for_is_refused(app_factory: AppFactory) -> None:
    app = app_factory("rw-long")

    @app.task(base=DedupTask, shared=False, name="rw.long", unique_for=60, retry_window=60)
    def job(x: int) -> None:
        return None

    with pytest.raises(InvalidOptionError, match=r"rw\.long: .*retry_window.*unique_for \(60\)"):
        job.delay(1)

    @app.task(base=DedupTask, shared=False, name="rw.short", unique_for=60)
    def other(x: int) -> None:
        return None

    with pytest.raises(InvalidOptionError, match="retry_window"):
        other.apply_async((1,), retry_window=90)
    assert other.apply_async((1,), retry_window=30).deduplicated is False


    @app.task(base=DedupTask, shared=False, name="rw.window", unique_for=60, retry_window=30)
    def windowed(x: int) -> None:
        return None

    # A call's own shorter unique_for ends a failure's hold sooner anyway: no cooldown, no error.
    short = windowed.apply_async((1,), unique_for=20)
    assert short.deduplicated is False
    lock = inspect_lock(short.deduplication_key, app=app)
    assert lock is not None and lock.ttl <= 20


def test_the_app_setting_applies_where_it_shortens(app_factory: AppFactory) -> None:
    app = app_factory("rw-setting", dedup_retry_window=30)

    @app.task(base=DedupTask, shared=False, name="rw.set.long", unique_for=600)
    def long(x: int) -> None:
        return None

    @app.task(base=DedupTask, shared=False, name="rw.set.short", unique_for=10)
    def short(x: int) -> None:
        return None

    @app.task(base=DedupTask, shared=False, name="rw.set.finish", unique_until="finish")
    def finish(x: int) -> None:
        return None

    assert long.dedup_config().retry_window == 30
    assert short.dedup_config().retry_window is None
    assert finish.dedup_config().retry_window is None


def test_first_use_checks_the_app_default_policy(app_factory: AppFactory) -> None:
    """``unique_until`` left to ``dedup_default_unique_until="finish"``: refused at the first
    call, before anything is published."""
    app = app_factory("rw-default", dedup_default_unique_until="finish")

    @app.task(base=DedupTask, shared=False, name="rw.default", unique_for=60, retry_window=5)
    def job(x: int) -> None:
        return None

    with pytest.raises(OptionCombinationError, match="unique_until is 'finish'"):
        job.delay(1)
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(app.conf.task_default_queue) == 0
