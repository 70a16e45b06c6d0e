"""on_key_reuse: a caller's deduplication_key held by a publish with different arguments.

Real Redis broker and a real worker; the lock store is Redis (derived from
the result backend) or PostgreSQL. Executions are counted in the task body
and messages in the broker queue.
"""

from __future__ import annotations

import pickle
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dedup import (
    DedupTask,
    DuplicateTaskError,
    InvalidOptionError,
    KeyReuseError,
    KeyReuseWarning,
    inspect_lock,
    key_reused,
)
from celery_dedup.runtime import runtime_for
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

STORES = ["redis", "postgres"]


class Recorder:
    """An app with one keyed task that records the arguments of every run."""

    def __init__(self, app: Celery, redis_server: RedisServer, **task_options: Any) -> None:
        self.app = app
        self.queue = str(app.conf.task_default_queue)
        self.broker = redis_server.client(3)
        self.runs: list[tuple[int, str]] = []
        lock = threading.Lock()
        runs = self.runs

        @app.task(base=DedupTask, shared=False, unique_for=60, **task_options)
        def charge(account: int, amount: str = "1.00") -> str:
            with lock:
                runs.append((account, amount))
            return amount

        self.task = charge

    def queued(self) -> int:
        """Messages waiting in the broker queue."""
        return int(self.broker.llen(self.queue))


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """``None``: the Redis store derived from the result backend; else a PostgreSQL store."""
    if request.param == "redis":
        yield None
    else:
        case: StoreCase = request.getfixturevalue("store_postgres")
        yield case.url


def _recorder(
    app_factory: AppFactory,
    redis_server: RedisServer,
    store_url: str | None,
    name: str,
    setting: str | None = None,
    **task_options: Any,
) -> Recorder:
    conf: dict[str, Any] = {"dedup_fallback": "closed"}
    if store_url is not None:
        conf["dedup_store"] = store_url
    if setting is not None:
        conf["dedup_on_key_reuse"] = setting
    return Recorder(app_factory(name, **conf), redis_server, **task_options)


def test_different_arguments_raise_and_publish_nothing(
    app_factory: AppFactory, redis_server: RedisServer, worker_for: Any, store_url: str | None
) -> None:
    """Same key, other arguments: KeyReuseError before publishing; only the first call runs."""
    rec = _recorder(app_factory, redis_server, store_url, "kr-raise", on_key_reuse="raise")
    signalled: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        signalled.append(kwargs)

    key_reused.connect(receiver, weak=False)
    try:
        first = rec.task.apply_async((7, "10.00"), deduplication_key="order-1")
        assert first.deduplicated is False
        with pytest.raises(KeyReuseError) as raised:
            rec.task.apply_async((7, "99.00"), deduplication_key="order-1")
    finally:
        key_reused.disconnect(receiver)
    error = raised.value
    assert isinstance(error, DuplicateTaskError)
    assert error.existing_task_id == first.id
    assert first.id not in str(error) and "99.00" not in str(error)
    assert signalled == [
        {"signal": key_reused, "key": first.deduplication_key,
         "existing_task_id": first.id, "action": "raise"}
    ]
    assert rec.queued() == 1
    lock = inspect_lock(first.deduplication_key, app=rec.app)
    assert lock is not None and lock.task_id == first.id
    worker_for(rec.app)
    assert first.get(timeout=30) == "10.00"
    wait_until(lambda: inspect_lock(first.deduplication_key, app=rec.app) is None, timeout=30)
    assert rec.runs == [(7, "10.00")]
    assert runtime_for(rec.app).metrics.read()[(rec.task.name, "key_reused")] == 1


def test_same_arguments_are_the_usual_duplicate(
    app_factory: AppFactory, redis_server: RedisServer, worker_for: Any, store_url: str | None
) -> None:
    """Same key and the same delivered arguments (however passed): a duplicate, no error."""
    rec = _recorder(app_factory, redis_server, store_url, "kr-same", on_key_reuse="raise")
    first = rec.task.apply_async((7, "10.00"), deduplication_key="order-2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = rec.task.apply_async((7,), {"amount": "10.00"}, deduplication_key="order-2")
        positional = rec.task.apply_async([7, "10.00"], deduplication_key="order-2")
    assert again.deduplicated is True and again.id == first.id
    assert positional.deduplicated is True and positional.id == first.id
    assert rec.queued() == 1
    worker_for(rec.app)
    assert again.get(timeout=30) == "10.00"
    wait_until(lambda: inspect_lock(first.deduplication_key, app=rec.app) is None, timeout=30)
    assert rec.runs == [(7, "10.00")]


def test_warn_mode_warns_and_returns_the_holders_handle(
    app_factory: AppFactory, redis_server: RedisServer, worker_for: Any, store_url: str | None
) -> None:
    """The default, 'warn': a KeyReuseWarning naming the caller's line; the holder's result."""
    rec = _recorder(app_factory, redis_server, store_url, "kr-warn")
    first = rec.task.apply_async((8, "10.00"), deduplication_key="order-3")
    with pytest.warns(KeyReuseWarning) as caught:
        reused = rec.task.apply_async((8, "11.00"), deduplication_key="order-3")
    assert [w.filename for w in caught] == [__file__]
    assert first.id not in str(caught[0].message)
    assert reused.deduplicated is True and reused.id == first.id
    assert rec.queued() == 1
    worker_for(rec.app)
    assert reused.get(timeout=30) == "10.00"
    wait_until(lambda: inspect_lock(first.deduplication_key, app=rec.app) is None, timeout=30)
    assert rec.runs == [(8, "10.00")]


def test_ignore_mode_is_the_old_behaviour(
    app_factory: AppFactory, redis_server: RedisServer, worker_for: Any, store_url: str | None
) -> None:
    """'ignore' (here from the setting): no warning, the holder's handle, one run."""
    rec = _recorder(app_factory, redis_server, store_url, "kr-ignore", setting="ignore")
    first = rec.task.apply_async((9, "10.00"), deduplication_key="order-4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reused = rec.task.apply_async((9, "12.00"), deduplication_key="order-4")
    assert reused.deduplicated is True and reused.id == first.id
    assert rec.queued() == 1
    worker_for(rec.app)
    assert reused.get(timeout=30) == "10.00"
    wait_until(lambda: inspect_lock(first.deduplication_key, app=rec.app) is None, timeout=30)
    assert rec.runs == [(9, "10.00")]


def test_per_call_option_overrides_task_and_setting(
    app_factory: AppFactory, redis_server: RedisServer
) -> None:
    """The call's on_key_reuse wins over the task's, which wins over the setting.

    Only a fingerprinted holder can be judged: an 'ignore' call computes none.
    """
    rec = _recorder(
        app_factory, redis_server, None, "kr-layers", setting="raise", on_key_reuse="ignore"
    )
    unjudged = rec.task.apply_async((2, "1"), deduplication_key="unfingerprinted")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other = rec.task.apply_async(
            (2, "2"), deduplication_key="unfingerprinted", on_key_reuse="raise"
        )
    assert other.id == unjudged.id
    first = rec.task.apply_async((1, "1"), deduplication_key="k", on_key_reuse="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rec.task.apply_async((1, "2"), deduplication_key="k").id == first.id
    with pytest.raises(KeyReuseError):
        rec.task.apply_async((1, "3"), deduplication_key="k", on_key_reuse="raise")
    with pytest.warns(KeyReuseWarning):
        rec.task.apply_async((1, "4"), deduplication_key="k", on_key_reuse="warn")
    assert rec.queued() == 2


def test_keys_from_the_task_callable_do_not_count(
    app_factory: AppFactory, redis_server: RedisServer
) -> None:
    """A key the task derives from its arguments coalesces different arguments on purpose."""
    rec = _recorder(
        app_factory, redis_server, None, "kr-callable",
        on_key_reuse="raise", deduplication_key=lambda account, amount="1.00": f"acct-{account}",
    )
    first = rec.task.delay(5, "1.00")
    assert rec.task.delay(5, "2.00").id == first.id
    assert rec.queued() == 1


def test_the_owner_secret_is_not_handed_out(
    app_factory: AppFactory, redis_server: RedisServer
) -> None:
    """A duplicate caller sees the holder without its owner token, fingerprint or not."""
    rec = _recorder(app_factory, redis_server, None, "kr-secret")
    rec.task.apply_async((1, "1"), deduplication_key="k")
    duplicate = rec.task.apply_async((1, "1"), deduplication_key="k")
    assert duplicate.lock is not None and duplicate.lock.owner == ""


def test_invalid_values_are_refused(app_factory: AppFactory, redis_server: RedisServer) -> None:
    """A bad value, per call, on the task or in the setting, names the option and the choices."""
    rec = _recorder(app_factory, redis_server, None, "kr-invalid")
    with pytest.raises(InvalidOptionError, match=r"on_key_reuse='loud'.*'raise', 'warn', 'ignore'"):
        rec.task.apply_async((1,), deduplication_key="k", on_key_reuse="loud")
    with pytest.raises(InvalidOptionError, match=r"charge: on_key_reuse=True is not valid"):
        _ = Recorder(app_factory("kr-invalid2"), redis_server, on_key_reuse=True).task.name
    bad = Recorder(app_factory("kr-invalid3", dedup_on_key_reuse="always"), redis_server)
    with pytest.raises(InvalidOptionError, match="dedup_on_key_reuse='always'"):
        bad.task.apply_async((1,), deduplication_key="k")
    bad.app.conf.dedup_on_key_reuse = "warn"  # the fixture's teardown reads the settings
    assert rec.queued() == 0


def test_key_reuse_error_round_trips() -> None:
    """Pickle and Celery's JSON backend rebuild it from ``args``, message and fields intact."""
    error = KeyReuseError("t", "celery-dedup:t:abc", "holder-id", 12.0)
    for copy in (pickle.loads(pickle.dumps(error)), type(error)(*error.args)):
        assert isinstance(copy, KeyReuseError)
        assert str(copy) == str(error) and copy.existing_task_id == "holder-id"
    assert "holder-id" not in str(error)


def test_only_our_fingerprinted_tokens_are_read() -> None:
    """Plain tokens and task ids used as owners (0.1.0 locks, custom ids) carry no fingerprint."""
    from celery_dedup import key_reuse
    from celery_dedup.identity import digest

    fingerprint = digest("x")
    assert key_reuse.fingerprint_of(key_reuse.token(fingerprint)) == fingerprint
    assert key_reuse.fingerprint_of(key_reuse.token(None)) is None
    for owner in ("my.custom.task-id", "a" * 22 + "." + "Z" * 32, "a" * 21 + "." + fingerprint):
        assert key_reuse.fingerprint_of(owner) is None


def test_raise_is_not_softened_inside_a_worker(
    app_factory: AppFactory, redis_server: RedisServer, worker_for: Any
) -> None:
    """A task reusing a key for other arguments fails with KeyReuseError (on_duplicate='raise'
    would have returned the holder there): the reuse surfaces, the child runs once."""
    rec = _recorder(
        app_factory, redis_server, None, "kr-worker", on_key_reuse="raise", unique_until="expiry"
    )
    child = rec.task

    @rec.app.task(shared=False)
    def parent() -> str:
        child.apply_async((3, "2.00"), deduplication_key="order-9")
        return "published"

    holder = child.apply_async((3, "1.00"), deduplication_key="order-9")
    worker_for(rec.app)
    with pytest.raises(KeyReuseError):
        parent.delay().get(timeout=30)
    assert holder.get(timeout=30) == "1.00"
    assert rec.runs == [(3, "1.00")]
