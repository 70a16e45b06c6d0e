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
import sqlite3
from typing import Any

import psycopg
import pymysql
import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from pymemcache.exceptions import MemcacheServerError
from sqlalchemy.exc import ProgrammingError

from celery_dedup.exceptions import (
    DedupKeyError,
    StoreContention,
    StoreError,
    StorePermissionDenied,
    StoreRefused,
    StoreUnavailable,
)
from celery_dedup.stores.base import store_errors
from celery_dedup.stores.db_codes import classify_driver_error
from celery_dedup.stores.django_cache import classify as classify_cache
from celery_dedup.stores.redis import classify as classify_redis
from tests.fixtures.failing_stores import (
    ALL,
    DRIVER_ERRORS,
    HELD,
    WRITES,
    Broken,
    check_operations,
)

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
    pytest.param("postgres_unknown_role", StorePermissionDenied, ALL,
                 marks=pytest.mark.postgres, id="postgres-login-refused"),
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


@pytest.mark.parametrize(("fixture", "kind", "failing"), CASES)
def test_every_operation_raises_the_typed_error(
    fixture: str, kind: type[StoreError], failing: frozenset[str], request: pytest.FixtureRequest
) -> None:
    """Each operation raises exactly ``kind`` naming store and answer, or still answers."""
    check_operations(request.getfixturevalue(fixture), kind, failing)


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
        (psycopg.OperationalError(
            'connection failed: FATAL:  password authentication failed for user "app"'),
         StorePermissionDenied),
        (psycopg.OperationalError('connection failed: FATAL:  database "x" does not exist'),
         StoreRefused),
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


def _django_error(cls: type[Exception], cause: Exception | None) -> Exception:
    """A Django database error as Django raises it: the driver's error as its cause."""
    error = cls(str(cause) if cause is not None else "no cause")
    error.__cause__ = cause
    return error


def test_django_database_errors_by_the_drivers_code() -> None:
    """The Django DB store reads the driver's code under Django's wrapper, as the SQL store."""
    from django.db.utils import InterfaceError, OperationalError
    from django.db.utils import ProgrammingError as DjangoProgrammingError

    from celery_dedup.stores.django import _answer
    from celery_dedup.stores.django import classify as classify_django

    read_only = _django_error(
        OperationalError, psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT")
    )
    assert classify_django(read_only) is StoreRefused
    assert "(SQLSTATE 25006)" in _answer(read_only)
    denied = _django_error(
        DjangoProgrammingError, psycopg.errors.InsufficientPrivilege("permission denied")
    )
    assert classify_django(denied) is StorePermissionDenied
    assert "migrate celery_dedup" in _answer(denied)
    mysql = _django_error(OperationalError, pymysql.err.OperationalError(1290, "--read-only"))
    assert classify_django(mysql) is StoreRefused
    gone = _django_error(OperationalError, pymysql.err.OperationalError(2013, "Lost connection"))
    assert classify_django(gone) is StoreUnavailable
    missing = _django_error(OperationalError, None)
    missing.args = ("no such table: celery_dedup_lock",)
    assert classify_django(missing) is StoreRefused
    assert classify_django(_django_error(InterfaceError, None)) is StoreUnavailable
    assert classify_django(ValueError("ours")) is None
