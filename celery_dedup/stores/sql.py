"""SQL lock store (SQLAlchemy Core): PostgreSQL, MySQL/MariaDB and SQLite.

A lock is a row of ``celery_dedup_lock`` keyed on the lock key. Times are
epoch seconds read from the database's clock inside each statement, so
producers and workers with skewed clocks agree on expiry. Every operation
runs on an autocommit connection, so a single-statement operation is one
round trip: no ``BEGIN``/``COMMIT`` around it.

``acquire`` is one upsert that inserts the row, or takes over an expired
one, and returns the holder:

- PostgreSQL: ``INSERT … ON CONFLICT (key) DO UPDATE … WHERE <expired>
  RETURNING`` in a CTE, with the live holder read by the same statement.
- MariaDB ≥ 10.5: ``INSERT … ON DUPLICATE KEY UPDATE col = IF(<expired>, new,
  old) … RETURNING``.
- MySQL: the same upsert, then a read of the row (two round trips).
- SQLite ≥ 3.35: ``INSERT … ON CONFLICT DO UPDATE … WHERE <expired>
  RETURNING``, plus a read of the holder when the key is held (in process:
  no round trip).

Expired rows are never reported and are taken over in place; a ``DELETE`` of
expired rows runs at most once per ``reap_interval`` seconds per process,
after an acquire. ``docs/stores/sql.md`` shows the exact SQL per dialect.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from kombu.utils.url import maybe_sanitize_url
from sqlalchemy import (
    create_engine,
    event,
    inspect,
)
from sqlalchemy.engine import Connection, Engine, Row, make_url
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.exc import (
    DatabaseError,
    NoSuchModuleError,
    OperationalError,
)

from ..exceptions import ImproperlyConfigured
from .base import Lock, LockMeta, unavailable_on
from .sql_dialects import (
    _MYSQL_DEADLOCK,
    _RACE_RETRIES,
    COUNTER_TABLE,
    E_KEY_TOO_LONG,
    E_NO_DIALECT,
    KEY_LENGTH,
    LOCK_TABLE,
    UNREACHABLE,
    T,
    _Dialect,
    _fetch_all,
    _like_prefix,
    _missing_driver,
    _pick_dialect,
    _set_utc,
    counter_table,
    lock_table,
    metadata,
)

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "COUNTER_TABLE",
    "LOCK_TABLE",
    "SQLStore",
    "counter_table",
    "lock_table",
    "metadata",
]

logger = logging.getLogger("celery_dedup")

_STORES: weakref.WeakSet[SQLStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The parent's pooled connections share sockets with the parent: drop
    # them without closing (close=False), as celery's DatabaseBackend does.
    for store in list(_STORES):
        store.engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SQLStore:
    """Owner-checked TTL locks in a SQL table (SQLAlchemy Core).

    Tables are created on first use. The engine is this store's own (never
    the result backend's), runs in autocommit mode and is replaced in a
    forked child. ``reap_interval`` is the least number of seconds between
    two deletes of expired rows by this process (``0`` never reaps).
    """

    name = "sql"

    def __init__(
        self,
        url: str,
        *,
        engine_options: Mapping[str, Any] | None = None,
        reap_interval: float = 60.0,
    ) -> None:
        self.url = url
        self.label = f"sql ({maybe_sanitize_url(url)})"
        self.reap_interval = reap_interval
        options = dict(engine_options or {})
        try:
            backend = make_url(url).get_dialect()
        except NoSuchModuleError as exc:
            raise ImproperlyConfigured(
                E_NO_DIALECT.format(url=maybe_sanitize_url(url), error=exc)
            ) from exc
        # Every operation is one statement or an explicit transaction, so the
        # driver must not wrap statements in BEGIN/COMMIT round trips.
        options["isolation_level"] = "AUTOCOMMIT"
        if backend.detect_autocommit_setting is not DefaultDialect.detect_autocommit_setting:
            options.setdefault("skip_autocommit_rollback", True)
        try:
            self.engine: Engine = create_engine(url, **options)
        except ImportError as exc:
            raise ImproperlyConfigured(
                _missing_driver(url, backend.name, backend.driver, exc)
            ) from exc
        if self.engine.dialect.name in ("mysql", "mariadb"):
            event.listen(self.engine, "connect", _set_utc)
        self._dialect: _Dialect | None = None
        self._ready_lock = threading.Lock()
        self._next_reap = time.monotonic() + reap_interval
        _STORES.add(self)

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> SQLStore:
        """Build the store for a SQLAlchemy URL (the part after ``db+``).

        ``options`` are ``create_engine`` keyword arguments (``connect_args``,
        ``pool_pre_ping``, ``pool_size``…) plus ``reap_interval``. When ``url``
        is ``app``'s result backend, ``database_engine_options`` apply first,
        as for Celery's DatabaseBackend.
        """
        engine_options: dict[str, Any] = {}
        if app is not None and app.conf.get("result_backend") == f"db+{url}":
            engine_options.update(app.conf.get("database_engine_options") or {})
        engine_options.update(options or {})
        reap_interval = float(engine_options.pop("reap_interval", 60.0))
        return cls(url, engine_options=engine_options, reap_interval=reap_interval)

    # -- plumbing ----------------------------------------------------------

    def _describe(self) -> str:
        return self.label

    def create_tables(self) -> None:
        """Create the tables if they are missing (done once on first use)."""
        with unavailable_on(UNREACHABLE, self.name, self._describe):
            self._ready()

    def _ready(self) -> _Dialect:
        if self._dialect is not None:
            return self._dialect
        with self._ready_lock:
            if self._dialect is None:
                with self.engine.connect():
                    pass  # the first connect reads the server version
                dialect = _pick_dialect(self.engine)
                self._create_tables()
                self._dialect = dialect
        return self._dialect

    def _create_tables(self) -> None:
        # Processes starting together race between the check and the CREATE;
        # the loser's CREATE fails, and a later check finds the tables.
        for attempt in range(10):
            try:
                metadata.create_all(self.engine, checkfirst=True)
                return
            except DatabaseError:
                if {LOCK_TABLE, COUNTER_TABLE} <= set(inspect(self.engine).get_table_names()):
                    return
                if attempt == 9:
                    raise
                time.sleep(0.05 * (attempt + 1))

    def _run(self, operation: Callable[[_Dialect, Connection], T]) -> T:
        with unavailable_on(UNREACHABLE, self.name, self._describe):
            dialect = self._ready()
            for attempt in range(_RACE_RETRIES):
                try:
                    with self.engine.connect() as conn:
                        return operation(dialect, conn)
                except OperationalError as exc:
                    # InnoDB breaks a deadlock by failing one transaction; it
                    # is safe to run again.
                    code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
                    if code != _MYSQL_DEADLOCK or attempt == _RACE_RETRIES - 1:
                        raise
            raise AssertionError("unreachable")  # pragma: no cover

    def _params(self, key: str, owner: str, ttl: float, meta: LockMeta) -> dict[str, Any]:
        if len(key) > KEY_LENGTH:
            raise ValueError(E_KEY_TOO_LONG.format(length=len(key), limit=KEY_LENGTH))
        return {
            "b_key": key,
            "b_owner": owner,
            "b_task_name": meta.get("task_name", "")[:255],
            "b_policy": meta.get("policy", "")[:32],
            "b_token": secrets.token_hex(16),
            "b_ttl": float(ttl),
        }

    @staticmethod
    def _lock(key: str, row: Row[Any]) -> Lock:
        # Times come from the database clock; report them on ours, as offsets
        # from the database's "now" of the same statement.
        now = time.time()
        db_now = float(row.now)
        return Lock(
            key=key,
            owner=row.owner,
            task_name=row.task_name,
            acquired_at=now - (db_now - float(row.acquired_at)),
            expires_at=now + (float(row.expires_at) - db_now),
            policy=row.policy,
        )

    # -- LockStore ---------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock if free or expired, else return the holder (one upsert)."""
        params = self._params(key, owner, ttl, meta)
        row = self._run(lambda d, conn: d.acquire(conn, params))
        self._maybe_reap()
        return None if row is None else self._lock(key, row)

    def release(self, key: str, owner: str) -> bool:
        """Delete the row if ``owner`` holds it and it is live (one DELETE)."""
        params = {"b_key": key, "b_owner": owner}
        return self._run(lambda d, conn: conn.execute(d.release, params).rowcount > 0)

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Set the expiry to now + ``ttl`` if ``owner`` holds the live lock (one UPDATE)."""
        params = {"b_key": key, "b_owner": owner, "b_ttl": float(ttl)}
        return self._run(lambda d, conn: conn.execute(d.extend, params).rowcount > 0)

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder; return the previous live holder.

        One statement on PostgreSQL; a short transaction (read with the row
        locked, then write) on MySQL/MariaDB and SQLite.
        """
        params = self._params(key, owner, ttl, meta)
        row = self._run(lambda d, conn: d.take_over(conn, params))
        if row is None or float(row.expires_at) <= float(row.now):
            return None
        return self._lock(key, row)

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key`` (one SELECT)."""
        row = self._run(lambda d, conn: conn.execute(d.get, {"b_key": key}).first())
        return None if row is None else self._lock(key, row)

    def scan(self, prefix: str, *, batch: int = 500) -> Iterator[Lock]:
        """Every live lock whose key starts with ``prefix``, in key order.

        Reads ``batch`` rows per SELECT (keyset pagination), so no connection
        is held while the caller iterates.
        """
        after = ""
        while True:
            params = {"b_pattern": _like_prefix(prefix), "b_after": after, "b_limit": batch}
            rows = self._run(partial(_fetch_all, "scan", params))
            for row in rows:
                yield self._lock(row.key, row)
            if len(rows) < batch:
                return
            after = rows[-1].key

    # -- CounterSupport ----------------------------------------------------

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add ``counts`` in one multi-row upsert."""
        # Sorted, so concurrent upserts lock rows in one order and cannot deadlock.
        rows = [
            {"prefix": prefix, "task_name": task_name[:255], "event": event, "count": n}
            for (task_name, event), n in sorted(counts.items())
            if n
        ]
        if rows:
            self._run(lambda d, conn: conn.execute(d.add_counts(rows)))

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix`` (one SELECT)."""
        rows = self._run(partial(_fetch_all, "read_counts", {"b_prefix": prefix}))
        return {(row.task_name, row.event): int(row.total) for row in rows}

    # -- housekeeping ------------------------------------------------------

    def purge_expired(self) -> int:
        """Delete every expired row now; returns how many were deleted."""
        return self._run(lambda d, conn: conn.execute(d.reap).rowcount)

    def _maybe_reap(self) -> None:
        if not self.reap_interval or time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + self.reap_interval
        try:
            deleted = self.purge_expired()
        except Exception as exc:  # housekeeping must never fail an acquire
            logger.debug("celery-dedup: reaping expired SQL locks failed: %s", exc)
        else:
            logger.debug("celery-dedup: reaped %d expired SQL locks", deleted)

    def close(self) -> None:
        """Close every pooled connection (a later call reconnects)."""
        self.engine.dispose()

    def __repr__(self) -> str:
        return f"<SQLStore {self.label}>"
