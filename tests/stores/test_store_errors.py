"""Every store raises only celery-dedup's typed store errors, never a driver's exception.

Real servers in the failing states production meets (full under
``noeviction``, a read-only replica after a failover, ``MISCONF``, ``BUSY``,
ACL refusals, read-only PostgreSQL/MariaDB/SQLite, a role without rights, a
killed or full memcached): every ``LockStore`` and ``CounterSupport``
operation either still answers (reads a read-only server serves) or raises
the class the table in ``docs/stores/index.md`` gives, with a message naming
the store and the server's answer, and the driver's error as ``__cause__``.
"""

from __future__ import annotations

import errno
import re
import sqlite3
from collections.abc import Callable
from typing import Any

import psycopg
import pymysql
import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from pymemcache.exceptions import MemcacheError, MemcacheServerError
from sqlalchemy.exc import ProgrammingError, SQLAlchemyError

from celery_dedup.exceptions import (
    DedupKeyError,
    StoreContention,
    StoreError,
    StorePermissionDenied,
    StoreRefused,
    StoreUnavailable,
)
from celery_dedup.stores.base import Lock, store_errors
from celery_dedup.stores.db_codes import classify_driver_error
from celery_dedup.stores.django_cache import classify as classify_cache
from celery_dedup.stores.redis import classify as classify_redis
from tests.fixtures.failing_stores import HELD, META, OWNER, Broken

#: Every driver's root exception: nothing a store raises may be one.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    SQLAlchemyError,
    psycopg.Error,
    pymysql.err.Error,
    sqlite3.Error,
    MemcacheError,
)

#: The operations, in the order they run (the ones that may free ``HELD`` last).
OPERATIONS: dict[str, Callable[[Any], Any]] = {
    "get": lambda s: s.get(HELD),
    "scan": lambda s: list(s.scan("errors:")),
    "read_counts": lambda s: s.read_counts("errors"),
    "extend": lambda s: s.extend(HELD, OWNER, 300),
    "settle": lambda s: s.settle(HELD, OWNER, 300),
    "unrevoke": lambda s: s.unrevoke(HELD, OWNER),
    "acquire": lambda s: s.acquire("errors:free", "owner-b", 30, META),
    "take_over": lambda s: s.take_over(HELD, "owner-b", 30, META),
    "claim": lambda s: s.claim("errors:other", "owner-b", release=False, ttl=30, meta=META),
    "claim_owned": lambda s: s.claim(HELD, OWNER, release=False, ttl=30, meta=META),
    "revoke": lambda s: s.revoke(HELD, OWNER, 30),
    "add_counts": lambda s: s.add_counts("errors", {("tests.errors", "acquired"): 1}),
    "release": lambda s: s.release(HELD, OWNER),
}
ALL = frozenset(OPERATIONS)
READS = frozenset({"get", "scan", "read_counts"})
WRITES = ALL - READS

#: fixture -> (the class raised, the operations raising it; the others answer)
CASES = [
    pytest.param(
        "redis_full", StoreRefused,
        # DEL and PEXPIRE free or keep memory: a full Redis still releases.
        {"acquire", "take_over", "claim", "claim_owned", "revoke", "add_counts"},
        marks=pytest.mark.redis, id="redis-oom",
    ),
    pytest.param("redis_replica", StoreRefused, WRITES,
                 marks=pytest.mark.redis, id="redis-readonly"),
    pytest.param("redis_misconf", StoreRefused, WRITES,
                 marks=pytest.mark.redis, id="redis-misconf"),
    pytest.param("redis_busy", StoreRefused, ALL, marks=pytest.mark.redis, id="redis-busy"),
    pytest.param(
        "redis_noscript", StorePermissionDenied, ALL - {"unrevoke", "add_counts", "read_counts"},
        marks=pytest.mark.redis, id="redis-noperm",
    ),
    pytest.param("redis_noauth", StorePermissionDenied, ALL,
                 marks=pytest.mark.redis, id="redis-noauth"),
    pytest.param("postgres_read_only", StoreRefused, WRITES,
                 marks=pytest.mark.postgres, id="postgres-read-only"),
    pytest.param("postgres_no_rights", StorePermissionDenied, ALL,
                 marks=pytest.mark.postgres, id="postgres-no-rights"),
    pytest.param("mysql_read_only", StoreRefused, WRITES,
                 marks=pytest.mark.mysql, id="mariadb-read-only"),
    pytest.param("sqlite_read_only", StoreRefused, WRITES,
                 marks=pytest.mark.sqlite, id="sqlite-read-only"),
    pytest.param("memcached_killed", StoreUnavailable, ALL,
                 marks=pytest.mark.memcached, id="memcached-killed"),
    pytest.param(
        "memcached_full", StoreRefused,
        # Every owner-checked write (a delete too) is a cas that stores an item.
        WRITES - {"unrevoke"},
        marks=pytest.mark.memcached, id="memcached-oom",
    ),
]


def _check_answer(name: str, result: Any) -> None:
    """An operation the broken server still serves answers as on a healthy one."""
    if name == "get":
        assert isinstance(result, Lock) and result.owner == OWNER
    elif name == "scan":
        assert [lock.key for lock in result] == [HELD]
    elif name == "read_counts":
        assert isinstance(result, dict)
    elif name in ("extend", "settle", "release"):
        assert result is True
    else:
        assert name in ("unrevoke", "add_counts") and result is None


@pytest.mark.parametrize(("fixture", "kind", "failing"), CASES)
def test_every_operation_raises_the_typed_error(
    fixture: str, kind: type[StoreError], failing: frozenset[str], request: pytest.FixtureRequest
) -> None:
    """Each operation raises exactly ``kind`` naming store and answer, or still answers."""
    broken: Broken = request.getfixturevalue(fixture)
    seen: dict[str, str] = {}
    for name, operation in OPERATIONS.items():
        try:
            result = operation(broken.store)
        except Exception as exc:
            seen[name] = type(exc).__name__
            assert name in failing, f"{name} raised {exc!r}"
            assert type(exc) is kind, f"{name} raised {exc!r}"
            assert not isinstance(exc, DRIVER_ERRORS)
            # the driver's error, or the socket's (an OSError) under it
            cause = exc.__cause__
            assert isinstance(cause, (*DRIVER_ERRORS, OSError)), f"{name}: {cause!r}"
            assert exc.store == broken.store.name
            assert broken.label in str(exc), f"{name}: {exc}"
            assert re.search(broken.answer, str(exc)), f"{name}: {exc}"
        else:
            assert name not in failing, f"{name} answered {result!r}"
            _check_answer(name, result)
    assert set(seen) == failing


# -- the classification, driver by driver (supplements: codes no fixture can produce) ----


@pytest.mark.parametrize(
    ("orig", "kind"),
    [
        (pymysql.err.OperationalError(1290, "running with the --read-only option"), StoreRefused),
        (pymysql.err.OperationalError(1836, "Running in read-only mode"), StoreRefused),
        (pymysql.err.OperationalError(1142, "INSERT command denied"), StorePermissionDenied),
        (pymysql.err.OperationalError(1044, "Access denied for user"), StorePermissionDenied),
        (pymysql.err.OperationalError(1045, "Access denied (using password)"),
         StorePermissionDenied),
        (pymysql.err.OperationalError(1114, "The table is full"), StoreRefused),
        (pymysql.err.OperationalError(2003, "Can't connect"), StoreUnavailable),
        (pymysql.err.OperationalError(1213, "Deadlock found"), StoreContention),
        (psycopg.errors.DiskFull("could not extend file"), StoreRefused),
        (psycopg.errors.ReadOnlySqlTransaction("read-only transaction"), StoreRefused),
        (psycopg.errors.InsufficientPrivilege("permission denied"), StorePermissionDenied),
        (psycopg.errors.InvalidPassword("password authentication failed"),
         StorePermissionDenied),
        (psycopg.errors.AdminShutdown("terminating connection"), StoreUnavailable),
        (psycopg.errors.TooManyConnections("too many clients"), StoreUnavailable),
        (psycopg.errors.UndefinedTable("relation does not exist"), StoreRefused),
        (psycopg.OperationalError("connection refused"), None),
    ],
)
def test_database_codes(orig: Exception, kind: type[StoreError] | None) -> None:
    """Server error codes name the class, whatever SQLAlchemy class wraps them."""
    assert classify_driver_error(orig) is kind


def test_sqlite_codes(tmp_path: Any) -> None:
    """SQLite's result codes: read-only is refused, an unreachable file unavailable."""
    path = tmp_path / "x.sqlite3"
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.commit()
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.Error) as info:
        conn.execute("INSERT INTO t VALUES (1)")
    assert classify_driver_error(info.value) is StoreRefused
    with pytest.raises(sqlite3.Error) as missing:
        sqlite3.connect(tmp_path / "no" / "such" / "dir.sqlite3")
    assert classify_driver_error(missing.value) is StoreUnavailable


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (redis.exceptions.ReadOnlyError("You can't write", status_code="READONLY"), StoreRefused),
        (redis.exceptions.ResponseError("MISCONF Redis is configured to save"), StoreRefused),
        (redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas"), StoreRefused),
        (redis.exceptions.BusyLoadingError("Redis is loading", status_code="LOADING"),
         StoreUnavailable),
        (redis.exceptions.MasterDownError("Link with MASTER is down", status_code="MASTERDOWN"),
         StoreUnavailable),
        (redis.exceptions.TryAgainError("Multiple keys request"), StoreUnavailable),
        (redis.exceptions.AuthenticationError("invalid password", status_code="WRONGPASS"),
         StorePermissionDenied),
        (redis.exceptions.ConnectionError("Connection refused"), StoreUnavailable),
        (redis.exceptions.DataError("Invalid input"), StoreRefused),
        (ValueError("ours"), None),
    ],
)
def test_redis_answers(exc: Exception, kind: type[StoreError] | None) -> None:
    """Redis answers the fixtures cannot produce map as the table says."""
    assert classify_redis(exc) is kind


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), StoreRefused),
        (OSError(errno.EROFS, "Read-only file system"), StoreRefused),
        (PermissionError(errno.EACCES, "Permission denied"), StorePermissionDenied),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), StoreUnavailable),
        (redis.exceptions.ReadOnlyError("You can't write", status_code="READONLY"), StoreRefused),
        (MemcacheServerError(b"out of memory storing object"), StoreRefused),
        (RuntimeError("some backend's own error"), StoreRefused),
        (TypeError("a bug of ours"), None),
        (SoftTimeLimitExceeded(), None),
    ],
)
def test_any_django_cache_backend(exc: Exception, kind: type[StoreError] | None) -> None:
    """A Django cache of any backend: known drivers by their answers, the rest refused."""
    assert classify_cache(exc) is kind


def test_wrapped_errors_are_judged_by_their_cause() -> None:
    """A backend wrapping a driver error (django-redis's ConnectionInterrupted) is its cause."""

    class ConnectionInterrupted(Exception):
        pass

    wrapper = ConnectionInterrupted("interrupted")
    wrapper.__cause__ = redis.exceptions.ConnectionError("gone")
    assert classify_cache(wrapper) is StoreUnavailable


def test_the_boundary_passes_our_errors_and_bugs() -> None:
    """Our own errors, bad arguments and time limits cross unchanged; driver errors never."""

    def classify(exc: BaseException) -> type[StoreError] | None:
        return StoreRefused if isinstance(exc, ProgrammingError) else None

    for error in (DedupKeyError("bad", "x"), TypeError("bad"), SoftTimeLimitExceeded()):
        with pytest.raises(type(error)) as info, store_errors(classify, "sql", lambda: "sql (x)"):
            raise error
        assert info.value is error
    refused = pytest.raises(StoreRefused, match=r"lock store sql \(x\) refused the operation")
    with refused, store_errors(classify, "sql", lambda: "sql (x)"):
        raise ProgrammingError("SELECT", {}, Exception("no"))
    contention = StoreContention("contended", store="sql")
    with pytest.raises(StoreContention) as kept, store_errors(classify, "sql"):
        raise contention
    assert kept.value is contention


def test_typed_errors_are_no_driver_errors() -> None:
    """No class of the taxonomy subclasses a driver's exception (callers catch them apart)."""
    for kind in (StoreError, StoreUnavailable, StoreContention, StoreRefused,
                 StorePermissionDenied):
        assert not issubclass(kind, DRIVER_ERRORS)
    assert issubclass(StorePermissionDenied, PermissionError)
    assert issubclass(StoreUnavailable, ConnectionError)


def test_sql_messages_never_show_the_statement(sqlite_read_only: Broken) -> None:
    """The message is the server's answer: never the SQL or its parameters (owner tokens)."""
    with pytest.raises(StoreRefused) as info:
        sqlite_read_only.store.release(HELD, "secret-owner-token")
    assert "secret-owner-token" not in str(info.value)
    assert "DELETE" not in str(info.value)
