"""celery-singleton's documented behaviour through the shim: its README and its own tests, ported.

Each test names the README section or the celery-singleton test it stands
for. Real Redis and a real worker; ``singleton_backend_url`` is db 26.
"""

from __future__ import annotations

import json
import logging
import socket
import uuid
from typing import Any

import pytest
from celery import Celery
from kombu.exceptions import OperationalError

from celery_dedup import DuplicateTaskError as CoreDuplicateTaskError
from celery_dedup import ImproperlyConfigured, InvalidOptionError
from celery_dedup.compat.celery_singleton import (
    CelerySingletonException,
    DuplicateTaskError,
    Singleton,
    clear_locks,
)
from tests.compat.conftest import LIB_DB, AppFactory, lifetime, lock_of, wait_for, worker
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis


class ExpectedTaskFail(Exception):
    """Raised by the failing task."""


class UUIDEncoder(json.JSONEncoder):
    """A ``singleton_json_encoder_class``: UUIDs as their string."""

    def default(self, o: Any) -> Any:
        if isinstance(o, uuid.UUID):
            return str(o)
        return super().default(o)


@pytest.fixture
def app(make_app: AppFactory, lib_url: str) -> Celery:
    """An app with celery-singleton's settings as its tests use them."""
    return make_app(singleton_backend_url=lib_url, singleton_key_prefix="lock_prefix:")


# -- README ------------------------------------------------------------------------


def test_duplicates_share_the_result_until_the_task_ran(
    app: Celery, redis_server: RedisServer
) -> None:
    """README quick start and "How does it work?"; test__queue_duplicate_after_success."""

    @app.task(base=Singleton, shared=False)
    def do_stuff(*args: Any, **kwargs: Any) -> str:
        return "I just woke up"

    async_result = do_stuff.delay(1, 2, 3, a="b")
    async_result2 = do_stuff.delay(1, 2, 3, a="b")
    assert async_result == async_result2
    assert async_result2.deduplicated is True
    c = do_stuff.delay(4, 5, 6)
    assert c != async_result
    assert len(redis_server.client(LIB_DB).keys("lock_prefix:*do_stuff*")) == 2

    with worker(app):
        assert async_result.get(timeout=10) == "I just woke up"
        wait_for(lambda: lock_of(app, async_result) is None)
    d = do_stuff.delay(1, 2, 3, a="b")
    assert d != async_result and d.deduplicated is False


def test_same_and_different_arguments(app: Celery) -> None:
    """test__queue_duplicates__same_id, test__queue_multiple_uniques__different_ids."""

    @app.task(base=Singleton, shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    tasks = [simple_task.apply_async(args=[1, 2, 3]) for _ in range(10)]
    assert set(tasks) == {tasks[0]}
    uniques = [simple_task.apply_async(args=[i, i + 1, i + 2]) for i in range(5)]
    assert len(set(uniques)) == len(uniques)


def test_a_failure_releases_the_lock(app: Celery) -> None:
    """test__queue_duplicate_after_error__different_ids."""

    @app.task(base=Singleton, shared=False)
    def fails(*args: Any) -> None:
        raise ExpectedTaskFail()

    task1 = fails.apply_async(args=[1, 2, 3])
    with worker(app):
        with pytest.raises(ExpectedTaskFail):
            task1.get(timeout=10)
        wait_for(lambda: lock_of(app, task1) is None)
    assert fails.apply_async(args=[1, 2, 3]) != task1


def test_raise_on_duplicate_from_the_task_and_the_app(make_app: AppFactory) -> None:
    """README raise_on_duplicate; test__raise_on_duplicate__*, TestRaiseOnDuplicateConfig."""
    app = make_app(singleton_raise_on_duplicate=True)
    default = make_app()

    @app.task(base=Singleton, raise_on_duplicate=True, shared=False)
    def do_something(username: str) -> None:
        return None

    @app.task(base=Singleton, shared=False)
    def from_settings(username: str) -> None:
        return None

    @app.task(base=Singleton, raise_on_duplicate=False, shared=False)
    def overridden(username: str) -> None:
        return None

    @default.task(base=Singleton, shared=False)
    def mytask(username: str) -> None:
        return None

    task1 = do_something.delay("bob")
    with pytest.raises(DuplicateTaskError) as raised:
        do_something.delay("bob")
    assert raised.value.task_id == task1.task_id
    assert isinstance(raised.value, CelerySingletonException)
    assert isinstance(raised.value, CoreDuplicateTaskError)

    from_settings.delay("bob")
    with pytest.raises(DuplicateTaskError):
        from_settings.delay("bob")

    first = overridden.delay("bob")
    assert overridden.delay("bob") == first
    first = mytask.delay("bob")
    assert mytask.delay("bob") == first


def test_unique_on(app: Celery) -> None:
    """README unique_on; TestUniqueOn (positional, keyword and string unique_on)."""

    @app.task(base=Singleton, unique_on=["username"], shared=False)
    def do_something(username: str, otherarg: int | None = None) -> None:
        return None

    @app.task(base=Singleton, unique_on=["a", "c"], shared=False)
    def unique_on_args_task(a: int, b: int, c: int, d: int = 4) -> int:
        return a * b * c * d

    @app.task(base=Singleton, unique_on=["b", "d"], shared=False)
    def unique_on_kwargs_task(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
        return a * b * c * d

    @app.task(base=Singleton, unique_on="c", shared=False)
    def unique_on_string_task(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
        return a * b * c * d

    task1 = do_something.delay(username="bob", otherarg=99)
    assert do_something.delay(username="bob", otherarg=100) == task1
    assert do_something.delay(username="alice", otherarg=99) != task1

    first = unique_on_args_task.delay(2, 3, 4, 5)
    assert unique_on_args_task.delay(2, 9, 4, 9) == first
    assert unique_on_args_task.delay(2, 3, 5, 5) != first
    first = unique_on_kwargs_task.delay(2, b=3, c=4, d=5)
    assert unique_on_kwargs_task.delay(9, b=3, c=9, d=5) == first
    first = unique_on_string_task.delay(2, b=3, c=4, d=5)
    assert unique_on_string_task.delay(1, c=4) == first
    assert unique_on_string_task.delay(2, b=3, c=5, d=5) != first


@pytest.mark.parametrize(("version", "task_name_only"), [("0.3.1", False), ("master", True)])
def test_empty_unique_on_follows_the_declared_version(
    make_app: AppFactory, version: str, task_name_only: bool
) -> None:
    """test__unique_on_empty__lock_on_task_name_only (master); 0.3.1 keys every argument."""
    app = make_app(singleton_version=version)

    @app.task(base=Singleton, unique_on=[], shared=False)
    def unique_on_empty_task(a: int, b: int = 2, c: int = 3, d: int = 4) -> int:
        return a * b * c * d

    first = unique_on_empty_task.delay(2, b=3, c=4, d=5)
    assert (unique_on_empty_task.delay(7) == first) is task_name_only
    assert unique_on_empty_task.delay(2, b=3, c=4, d=5) == first


def test_an_unknown_version_is_refused(make_app: AppFactory) -> None:
    """singleton_version names a celery-singleton whose behaviour the shim knows."""
    app = make_app(singleton_version="0.4")

    @app.task(base=Singleton, shared=False)
    def example() -> None:
        return None

    with pytest.raises(InvalidOptionError, match="singleton_version"):
        example.delay()


def test_lock_expiry(make_app: AppFactory) -> None:
    """README lock_expiry; TestLockExpiry; singleton_lock_expiry; a TTL always applies."""
    app = make_app(singleton_lock_expiry=20)

    @app.task(base=Singleton, lock_expiry=1, shared=False)
    def runs_briefly() -> None:
        return None

    @app.task(base=Singleton, lock_expiry=60, shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    @app.task(base=Singleton, shared=False)
    def from_settings() -> None:
        return None

    assert lifetime(lock_of(app, simple_task.delay(1, 2, 3))) == pytest.approx(60, abs=1)
    assert lifetime(lock_of(app, from_settings.delay())) == pytest.approx(20, abs=1)
    other = make_app(dedup_default_ttl=900)

    @other.task(base=Singleton, shared=False)
    def no_expiry() -> None:
        return None

    assert lifetime(lock_of(other, no_expiry.delay())) == pytest.approx(900, abs=1)

    task1 = runs_briefly.delay()
    assert runs_briefly.delay() == task1
    wait_for(lambda: lock_of(app, task1) is None)
    assert runs_briefly.delay() != task1


def test_clear_locks_and_release_lock(app: Celery, redis_server: RedisServer) -> None:
    """README "Handling deadlocks"; TestClearLocks; release_lock for one set of arguments."""

    @app.task(base=Singleton, shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    results = [simple_task.apply_async(args=[i]) for i in range(5)]
    assert results[0].deduplication_key.startswith("lock_prefix::")
    simple_task.release_lock(task_args=[4])
    assert lock_of(app, results[4]) is None
    assert clear_locks(app) == 4
    assert not redis_server.client(LIB_DB).keys("lock_prefix:*")
    assert simple_task.apply_async(args=[0]) != results[0]


# -- celery-singleton's methods and override points ------------------------------


def test_generate_lock_and_existing_task_id(app: Celery) -> None:
    """test__get_existing_task_id: aquire_lock, get_existing_task_id, unlock."""

    @app.task(base=Singleton, shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    lock = simple_task.generate_lock(simple_task.name, task_args=[1, 2, 3])
    assert simple_task.aquire_lock(lock, "test_task_id") is True
    assert simple_task.aquire_lock(lock, "other_task_id") is False
    assert simple_task.get_existing_task_id(lock) == "test_task_id"
    assert simple_task.apply_async(args=[1, 2, 3]).id == "test_task_id"
    simple_task.unlock(lock)
    assert simple_task.get_existing_task_id(lock) is None
    result = simple_task.apply_async(args=[1, 2, 3])
    assert result.deduplication_key == lock
    assert simple_task.get_existing_task_id(lock) == result.id


def test_a_failed_publish_clears_the_lock_and_raises(
    make_app: AppFactory, lib_url: str
) -> None:
    """test__apply_async_fails__lock_cleared and __exception_reraised, on a broker that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    app = make_app(
        broker_url=f"redis://127.0.0.1:{closed_port}/0", singleton_backend_url=lib_url
    )

    @app.task(base=Singleton, shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    lock = simple_task.generate_lock(simple_task.name, task_args=[1, 2, 3])
    with pytest.raises(OperationalError):
        simple_task.apply_async(args=[1, 2, 3], retry=False)
    assert simple_task.get_existing_task_id(lock) is None


def test_generate_lock_override_decides_the_lock(app: Celery) -> None:
    """An overridden generate_lock is the lock, for every call and for release_lock."""

    class PerUser(Singleton):
        def generate_lock(
            self, task_name: str, task_args: Any = None, task_kwargs: Any = None
        ) -> str:
            user = (task_kwargs or {}).get("user") or (task_args or [None])[0]
            return f"user-lock-{user}"

    @app.task(base=PerUser, shared=False)
    def export(user: str, fmt: str = "csv") -> str:
        return user

    @app.task(base=PerUser, shared=False)
    def delete(user: str) -> str:
        return user

    first = export.delay("bob")
    assert export.delay("bob", fmt="pdf") == first
    assert delete.delay(user="bob") == first
    assert export.delay("alice") != first
    assert export.get_existing_task_id("user-lock-bob") == first.id

    export.release_lock(task_args=["bob"])
    assert export.get_existing_task_id("user-lock-bob") is None
    second = delete.delay("bob")
    with worker(app):
        assert second.get(timeout=10) == "bob"
        wait_for(lambda: export.get_existing_task_id("user-lock-bob") is None)


def test_on_duplicate_override_is_called(make_app: AppFactory, lib_url: str) -> None:
    """A subclass's on_duplicate(existing_task_id) decides what a duplicate returns."""
    seen: list[str] = []

    class Reported(Singleton):
        def on_duplicate(self, existing_task_id: str) -> Any:  # type: ignore[override]
            seen.append(existing_task_id)
            return super().on_duplicate(existing_task_id)

    class Quiet(Singleton):
        def on_duplicate(self, existing_task_id: str) -> Any:  # type: ignore[override]
            return None

    app = make_app(singleton_backend_url=lib_url)

    @app.task(base=Reported, shared=False)
    def reported(n: int) -> int:
        return n

    @app.task(base=Reported, raise_on_duplicate=True, shared=False)
    def strict(n: int) -> int:
        return n

    @app.task(base=Quiet, raise_on_duplicate=True, shared=False)
    def quiet(n: int) -> int:
        return n

    first = reported.delay(1)
    duplicate = reported.delay(1)
    assert duplicate == first and seen == [first.id]
    held = strict.delay(1)
    with pytest.raises(DuplicateTaskError) as raised:
        strict.delay(1)
    assert raised.value.task_id == held.id and seen[-1] == held.id
    quiet.delay(1)
    assert quiet.delay(1) is None

    with pytest.raises(InvalidOptionError, match="hook"):

        class Misread(Singleton):
            on_duplicate = "raise"  # type: ignore[assignment]  # the mistake tested


def test_json_encoder_class_encodes_the_key_arguments(
    make_app: AppFactory, lib_url: str
) -> None:
    """singleton_json_encoder_class (master): arguments encoding alike are one call."""
    value = uuid.uuid4()
    for encoder in (UUIDEncoder, f"{__name__}.UUIDEncoder"):
        app = make_app(singleton_backend_url=lib_url, singleton_json_encoder_class=encoder)

        @app.task(base=Singleton, shared=False)
        def by_id(item: Any) -> str:
            return str(item)

        first = by_id.delay(value)
        assert by_id.delay(str(value)) == first
        by_id.release_lock(task_args=[str(value)])
        assert lock_of(app, first) is None


def test_a_chain_whose_first_step_is_held_raises(app: Celery) -> None:
    """test__chain_multiple_uniques__different_ids: chains run; a held first step is refused."""

    @app.task(base=Singleton, shared=False)
    def simple_task(*args: Any) -> Any:
        return args

    async_result = (simple_task.si(1) | simple_task.s(2)).delay()
    with pytest.raises(DuplicateTaskError):
        (simple_task.si(1) | simple_task.s(3)).delay()
    first_step = simple_task.generate_lock(simple_task.name, [1])
    with worker(app):
        assert async_result.get(timeout=10) == [[1], 2]
        wait_for(lambda: simple_task.get_existing_task_id(first_step) is None)
        async_result2 = (simple_task.si(1) | simple_task.s(3)).delay()
        assert async_result2.get(timeout=10) == [[1], 3]


def test_duplicate_task_error_as_celery_singleton_builds_it() -> None:
    """DuplicateTaskError(message, task_id) and CelerySingletonException, as in celery-singleton."""
    exc = DuplicateTaskError("Attempted to queue a duplicate of task ID 42", "42")
    assert str(exc) == "Attempted to queue a duplicate of task ID 42"
    assert exc.task_id == "42" == exc.existing_task_id
    assert isinstance(exc, CelerySingletonException)
    assert issubclass(CelerySingletonException, Exception)


# -- backends and settings ---------------------------------------------------------


def test_backend_url_falls_back_to_the_result_backend_then_the_broker(
    make_app: AppFactory, redis_server: RedisServer
) -> None:
    """TestBackendUrl: singleton_backend_url, else the result backend, else the broker."""
    broker_only = make_app(result_backend=None)

    @broker_only.task(base=Singleton, shared=False)
    def example() -> None:
        return None

    result = example.delay()
    assert redis_server.client(24).exists(result.deduplication_key)


def test_no_usable_store_fails_loudly(make_app: AppFactory) -> None:
    """With no Redis anywhere and no singleton_backend_url, a call raises instead of publishing."""
    app = make_app(broker_url="memory://", result_backend=None)

    @app.task(base=Singleton, shared=False)
    def example() -> None:
        return None

    with pytest.raises(ImproperlyConfigured, match="singleton_backend_url"):
        example.delay()


def test_backend_settings_without_equivalent_warn(
    make_app: AppFactory, lib_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """TestBackend: a custom singleton_backend_class or backend kwargs are named in a warning."""
    default = make_app(
        singleton_backend_class="celery_singleton.backends.redis.RedisBackend",
        singleton_backend_url=lib_url,
    )
    custom = make_app(
        singleton_backend_class="singleton_backends.fake.FakeBackend",
        singleton_backend_kwargs={"timeout": 3},
        singleton_backend_url=lib_url,
    )
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        for app in (default, custom):

            @app.task(base=Singleton, shared=False)
            def example() -> None:
                return None

            example.delay()
    warnings = [r.getMessage() for r in caplog.records if r.name == "celery_dedup"]
    assert warnings == [
        "celery-dedup: singleton_backend_class='singleton_backends.fake.FakeBackend' has no "
        f"celery-dedup equivalent; using {lib_url} instead",
        "celery-dedup: singleton_backend_kwargs is ignored; set dedup_store_options instead",
    ]
