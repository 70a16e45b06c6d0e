"""SQL lock store (SQLAlchemy Core): PostgreSQL, MySQL/MariaDB and SQLite.

A lock is a row of ``celery_dedup_sql_lock`` keyed on the lock key; a
revoked owner token is a row of ``celery_dedup_sql_revoked``; a key's
fencing-token counter (PostgreSQL) a row of ``celery_dedup_sql_fence``. Times are
epoch seconds read from the database's clock inside each statement, so
producers and workers with skewed clocks agree on expiry. Every operation
runs on an autocommit connection, so a single-statement operation is one
round trip: no ``BEGIN``/``COMMIT`` around it.

Statements are rendered once per store for its engine. While nothing
observes the engine's statements (no cursor or error event listener, no
SQL logging), they run on the pooled DBAPI connection itself, skipping
SQLAlchemy's per-statement execution and result machinery, which costs as
much as the database's answer; otherwise through ``exec_driver_sql``, so
listeners and logs see every statement. Both send the same SQL.

- PostgreSQL: every operation is one statement (data-modifying CTEs).
- SQLite ≥ 3.35 and MySQL/MariaDB: acquire is one upsert (MySQL: plus a
  read), the worker's start check is one ``UPDATE``/``DELETE`` when the
  holder starts; take-over, revoke and the other start checks are short
  transactions that lock the key's row first.

Deadlocks, lock-wait timeouts and serialization failures are retried with
jittered backoff and never become ``StoreUnavailable``; expired rows are
deleted at most once per ``reap_interval`` seconds per process, after an
acquire. ``docs/stores/sql.md`` shows the exact SQL per dialect.
"""

from __future__ import annotations

import base64
import logging
import os
import random
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from kombu.utils.url import maybe_sanitize_url
from sqlalchemy import (
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.exc import (
    ArgumentError,
    DatabaseError,
    DBAPIError,
    NoSuchModuleError,
    SQLAlchemyError,
)

from ..app_urls import result_backend
from ..exceptions import (
    FencingNotSupported,
    ImproperlyConfigured,
    StoreContention,
    StoreError,
    StoreRefused,
    StoreUnavailable,
)
from .base import (
    DONE_POLICY,
    OUTCOME_FIELD,
    RUNNING_POLICY,
    AcquireItem,
    Claim,
    Lock,
    LockMeta,
    RevokeOutcome,
    RunOutcome,
    RunRef,
    revoked_marker_key,
    server_answer,
    store_errors,
)
from .db_codes import classify_driver_error, driver_answer
from .sql_dialects import (
    COUNTER_TABLE,
    E_CONTENTION,
    E_KEY_TOO_LONG,
    E_NO_DIALECT,
    FENCE_TABLE,
    GATE_WAIT_TABLE,
    KEY_LENGTH,
    LOCK_TABLE,
    REVOKED_TABLE,
    UNREACHABLE,
    T,
    _Dialect,
    _fetch_all,
    _like_prefix,
    _missing_driver,
    _pick_dialect,
    _Postgres,
    _Result,
    _Runner,
    _set_session,
    _Statement,
    _Transactional,
    counter_table,
    fence_table,
    is_contention,
    lock_table,
    metadata,
    revoked_table,
)
from .sql_limits import SQLLimits

_PG_NOW = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"

# GateHandoff.wait_at_gate on PostgreSQL: the follow-up's message, listed while
# another copy holds the gate (read FOR SHARE: an end opening the gate waits
# for this statement, or this statement finds the gate gone and lists nothing).
WAIT_AT_GATE = text(f"""
INSERT INTO {GATE_WAIT_TABLE} AS w (key, payload, expires_at)
SELECT g.key, :payload, {_PG_NOW} + :life FROM (
  SELECT key FROM {LOCK_TABLE}
  WHERE key = :gate AND owner <> :run AND policy = :running AND expires_at > {_PG_NOW}
  FOR SHARE
) AS g
ON CONFLICT (key) DO UPDATE SET payload = excluded.payload, expires_at = excluded.expires_at
RETURNING w.key
""")

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "COUNTER_TABLE",
    "FENCE_TABLE",
    "LOCK_TABLE",
    "REVOKED_TABLE",
    "SQLStore",
    "counter_table",
    "fence_table",
    "lock_table",
    "metadata",
    "revoked_table",
]

logger = logging.getLogger("celery_dedup")

#: Seconds a PostgreSQL connection attempt may take (libpq's
#: ``connect_timeout``), unless the URL or ``connect_args`` set one: a port
#: that does not speak PostgreSQL then fails fast instead of hanging.
CONNECT_TIMEOUT = 10
#: MySQL/MariaDB drivers' connect and socket read/write timeouts (seconds),
#: unless the URL or ``connect_args`` set them: a hung server fails a call in
#: seconds. The store's statements and transactions are short; a row lock held
#: elsewhere for longer than the read timeout fails the call (fallback).
MYSQL_TIMEOUTS: Mapping[str, int] = {"connect_timeout": 5, "read_timeout": 10, "write_timeout": 10}
#: A lost race (deadlock, lock wait, serialization failure) is run again up
#: to this many tries in all, within this many seconds, sleeping a jittered
#: backoff that doubles from the base up to the cap between tries.
CONTENTION_TRIES = 12
CONTENTION_BUDGET = 10.0
_BACKOFF_BASE = 0.005
_BACKOFF_CAP = 0.25

_STORES: weakref.WeakSet[SQLStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The parent's pooled connections share sockets with the parent: drop
    # them without closing (close=False), as celery's DatabaseBackend does.
    for store in list(_STORES):
        store.engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _observed(engine: Engine) -> bool:
    """Whether anything watches ``engine``'s statements: a listener or SQL logging."""
    events = engine.dispatch
    driver = engine.dialect.dispatch
    return bool(
        events.before_cursor_execute
        or events.after_cursor_execute
        or driver.do_execute
        or driver.do_execute_no_params
        or driver.handle_error
        or engine.logger.isEnabledFor(logging.INFO)
    )


class _EngineRunner:
    """Runs rendered statements through SQLAlchemy (``exec_driver_sql``).

    Taken while something observes the engine, so its listeners, error
    handlers and SQL log see every statement.
    """

    __slots__ = ("connection",)

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def __call__(self, statement: _Statement, params: Mapping[str, Any]) -> _Result:
        result = self.connection.exec_driver_sql(statement.sql, statement.parameters(params))
        if statement.row is None:
            return _Result([], result.rowcount)
        rows = [statement.row._make(row) for row in result]
        return _Result(rows, len(rows))

    def sql(self, text: str) -> None:
        self.connection.exec_driver_sql(text)


class _DriverRunner:
    """Runs rendered statements on the pooled DBAPI connection itself.

    SQLAlchemy's execution and result machinery per statement costs about as
    much as the database's answer; this skips it, and does what it would do
    on errors: a driver error becomes SQLAlchemy's (``OperationalError``…),
    a dropped connection is invalidated with the rest of the pool (the next
    call reconnects), and a connection interrupted mid-statement (a time
    limit, ``KeyboardInterrupt``) never goes back to the pool.
    """

    __slots__ = ("_dbapi", "_error", "connection")

    def __init__(self, connection: Connection, error: type[Exception]) -> None:
        self.connection = connection
        dbapi = connection.connection.dbapi_connection
        assert dbapi is not None  # checked out and valid
        self._dbapi = dbapi
        self._error = error

    def __call__(self, statement: _Statement, params: Mapping[str, Any]) -> _Result:
        return self._execute(statement.sql, statement.parameters(params), statement.row)

    def sql(self, text: str) -> None:
        self._execute(text, None, None)

    def _execute(self, sql: str, parameters: Any, row: type[Any] | None) -> _Result:
        cursor = None
        try:
            cursor = self._dbapi.cursor()
            if parameters is None:
                cursor.execute(sql)
            else:
                cursor.execute(sql, parameters)
            if row is None:
                result = _Result([], cursor.rowcount)
            else:
                rows = [row._make(values) for values in cursor.fetchall()]
                result = _Result(rows, len(rows))
            cursor.close()
            return result
        except self._error as exc:
            raise self._translate(exc, sql, parameters, cursor) from exc
        except BaseException as exc:
            self.connection.invalidate(exc)
            raise

    def _translate(self, exc: Exception, sql: str, parameters: Any, cursor: Any) -> BaseException:
        engine = self.connection.engine
        dialect = engine.dialect
        disconnect = dialect.is_disconnect(cast(Any, exc), self.connection.connection, cursor)
        if cursor is not None:
            with suppress(Exception):
                cursor.close()
        if disconnect and not self.connection.invalidated:
            # As SQLAlchemy does: the other pooled connections most likely
            # lost the same server, so they go too.
            self.connection.invalidate(exc)
            engine.dispose()
        return DBAPIError.instance(
            sql,
            parameters,
            exc,
            self._error,
            hide_parameters=engine.hide_parameters,
            connection_invalidated=disconnect,
            dialect=dialect,
        )


class SQLStore(SQLLimits):
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
            parsed = make_url(url)
            backend = parsed.get_dialect()
        except (ArgumentError, NoSuchModuleError) as exc:
            raise ImproperlyConfigured(
                E_NO_DIALECT.format(url=maybe_sanitize_url(url), error=exc)
            ) from exc
        #: PostgreSQL keeps run gates in its run-record statements (``RunRecords``)
        self.run_gates = backend.name == "postgresql"
        #: PostgreSQL issues fencing tokens in its claim statements (``FencedClaims``)
        self.fences = backend.name == "postgresql"
        if backend.driver in ("psycopg", "psycopg2") and "connect_timeout" not in parsed.query:
            options["connect_args"] = {
                "connect_timeout": CONNECT_TIMEOUT, **(options.get("connect_args") or {})
            }
        if backend.driver in ("pymysql", "mysqldb"):
            given = {**parsed.query, **(options.get("connect_args") or {})}
            options["connect_args"] = {
                **{k: v for k, v in MYSQL_TIMEOUTS.items() if k not in given},
                **(options.get("connect_args") or {}),
            }
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
            event.listen(self.engine, "connect", _set_session)
        self._dbapi_error: type[Exception] = self.engine.dialect.loaded_dbapi.Error
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
        if app is not None and result_backend(app.conf) == f"db+{url}":
            engine_options.update(app.conf.get("database_engine_options") or {})
        engine_options.update(options or {})
        reap_interval = float(engine_options.pop("reap_interval", 60.0))
        return cls(url, engine_options=engine_options, reap_interval=reap_interval)

    # -- plumbing ----------------------------------------------------------

    def _describe(self) -> str:
        return self.label

    def create_tables(self) -> None:
        """Create the tables if they are missing (done once on first use)."""
        with self._errors():
            self._ready()

    def classify(self, exc: BaseException) -> type[StoreError] | None:
        """What a driver or SQLAlchemy error means (``db_codes`` for the server's code).

        A dropped connection, or a driver error raised before the server
        answered (``OperationalError``, ``InterfaceError``, a pool timeout),
        is ``StoreUnavailable``; any other database error ``StoreRefused``.
        """
        if isinstance(exc, DBAPIError):
            if exc.connection_invalidated:
                return StoreUnavailable
            kind = classify_driver_error(exc.orig)
            if kind is not None:
                return kind
        elif isinstance(exc, self._dbapi_error):
            kind = classify_driver_error(exc)
            if kind is not None:
                return kind
        if isinstance(exc, UNREACHABLE):
            return StoreUnavailable
        if isinstance(exc, (SQLAlchemyError, self._dbapi_error, OSError)):
            return StoreRefused
        return None

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The one boundary every driver error crosses into a ``StoreError``."""
        with store_errors(self.classify, self.name, self._describe, _answer):
            yield

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
                if set(metadata.tables) <= set(inspect(self.engine).get_table_names()):
                    return
                if attempt == 9:
                    raise
                time.sleep(0.05 * (attempt + 1))

    def _run(self, operation: Callable[[_Dialect, _Runner], T], key: str = "") -> T:
        """Run ``operation`` on a pooled connection; run it again after a lost race."""
        with self._errors():
            dialect = self._dialect or self._ready()
            deadline = time.monotonic() + CONTENTION_BUDGET
            tries = 0
            while True:
                tries += 1
                try:
                    with self.engine.connect() as conn:
                        return operation(dialect, self._runner(conn))
                except DBAPIError as exc:
                    # The database broke a deadlock or a wait by failing us;
                    # nothing was written, so it is safe to run again.
                    if not is_contention(exc):
                        raise
                    if tries >= CONTENTION_TRIES or time.monotonic() >= deadline:
                        message = E_CONTENTION.format(key=key, tries=tries)
                        raise StoreContention(f"{message}: {exc.orig}", store=self.name) from exc
                    logger.debug(
                        "celery-dedup: %s lost a race on %r (%s); trying again",
                        self.label, key, exc.orig,
                    )
                time.sleep(_backoff(tries))

    def _runner(self, conn: Connection) -> _Runner:
        if _observed(self.engine):
            return _EngineRunner(conn)
        return _DriverRunner(conn, self._dbapi_error)

    def _params(self, key: str, owner: str, ttl: float, meta: LockMeta) -> dict[str, Any]:
        if len(key) > KEY_LENGTH:
            raise ValueError(E_KEY_TOO_LONG.format(length=len(key), limit=KEY_LENGTH))
        return {
            "b_key": key,
            "b_owner": owner,
            "b_task_id": meta.get("task_id", "")[:255],
            "b_task_name": meta.get("task_name", "")[:255],
            "b_policy": meta.get("policy", "")[:32],
            "b_started": meta.get("started") == "1",
            "b_token": secrets.token_hex(16),
            "b_ttl": float(ttl),
        }

    @staticmethod
    def _lock(key: str, row: Any) -> Lock:
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
            # A lock taken without a task id reports its owner (see LockMeta).
            task_id=row.task_id or row.owner,
            started=bool(row.started),
        )

    # -- LockStore ---------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock if free or expired, else return the holder (one upsert)."""
        params = self._params(key, owner, ttl, meta)
        row = self._run(lambda d, run: d.acquire(run, params), key)
        self._maybe_reap()
        return None if row is None else self._lock(key, row)

    def acquire_many(self, items: Sequence[AcquireItem]) -> list[Lock | None]:
        """``acquire`` for every item: one statement on PostgreSQL (eight arrays,
        one upsert), one per item on one connection elsewhere."""
        params = [self._params(key, owner, ttl, meta) for key, owner, ttl, meta in items]
        first = items[0][0] if items else ""
        rows = self._run(lambda d, run: d.acquire_many(run, params), first)
        self._maybe_reap()
        return [None if row is None else self._lock(item[0], row) for item, row in zip(
            items, rows, strict=True
        )]

    def release(self, key: str, owner: str) -> bool:
        """Delete the row if ``owner`` holds it and it is live (one DELETE)."""
        params = {"b_key": key, "b_owner": owner}
        return self._run(lambda d, run: run(d.release, params).rowcount > 0, key)

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Set the expiry to now + ``ttl`` if ``owner`` holds the live lock (one UPDATE)."""
        params = {"b_key": key, "b_owner": owner, "b_ttl": float(ttl)}
        return self._run(lambda d, run: run(d.extend, params).rowcount > 0, key)

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder; return the previous live holder.

        One statement on PostgreSQL; a short transaction that inserts the row
        or locks the existing one first on MySQL/MariaDB and SQLite.
        """
        params = self._params(key, owner, ttl, meta)
        return self._previous(key, self._run(lambda d, run: d.take_over(run, params), key))

    def take_over_queued(
        self, key: str, owner: str, ttl: float, meta: LockMeta
    ) -> Lock | None:
        """``take_over`` unless a started holder holds the key (``QueuedTakeOver``).

        The same shape and cost as ``take_over``: one statement on
        PostgreSQL, a short transaction elsewhere; a started holder is
        returned and nothing is written.
        """
        params = self._params(key, owner, ttl, meta)
        row = self._run(lambda d, run: d.take_over_queued(run, params), key)
        return self._previous(key, row)

    def take_over_revoking(
        self,
        key: str,
        owner: str,
        ttl: float,
        meta: LockMeta,
        revoked_ttl: float,
        *,
        queued_only: bool = False,
    ) -> Lock | None:
        """``take_over`` (``take_over_queued``) revoking the displaced owner (``RevokingTakeOver``).

        One statement on PostgreSQL. MySQL/MariaDB and SQLite revoke in a
        transaction of their own after the take-over's (two round trips):
        the marker's lock would come after the key's, the reverse of the
        order their start check takes them in.
        """
        params = self._params(key, owner, ttl, meta)
        params["b_revoked_ttl"] = float(revoked_ttl)
        row, revoked = self._run(
            lambda d, run: d.take_over_revoking(run, params, queued_only=queued_only), key
        )
        previous = self._previous(key, row)
        if revoked or previous is None or previous.owner == owner:
            return previous
        if not (queued_only and previous.started):
            self.revoke(key, previous.owner, max(previous.ttl, revoked_ttl))
        return previous

    @classmethod
    def _previous(cls, key: str, row: Any) -> Lock | None:
        """The previous holder a take-over returned, if it was live."""
        if row is None or float(row.expires_at) <= float(row.now):
            return None
        return cls._lock(key, row)

    def claim(
        self,
        key: str,
        owner: str,
        *,
        release: bool,
        ttl: float | None,
        meta: LockMeta,
        fence: bool = False,
    ) -> Claim:
        """The worker's start check (see ``LockStore.claim``); with ``fence``, an
        ``OWNED`` or ``FREE`` answer carries the key's next fence (``FencedClaims``:
        PostgreSQL, in the same statement).

        One statement on PostgreSQL. On MySQL/MariaDB and SQLite one
        ``UPDATE`` (or ``DELETE`` with ``release``) when ``owner`` holds the
        key and is not revoked, the common case; else a short transaction.
        """
        params = self._params(key, owner, ttl or 0.0, {**meta, "started": "1"})
        params["b_marker"] = revoked_marker_key(key, owner)
        params["b_release"] = release
        params["b_take"] = ttl is not None and not release
        if fence:
            outcome, row, issued = self._run(
                lambda d, run: self._fencing(d).claim_fenced(run, params), key
            )
            return Claim(outcome, None if row is None else self._lock(key, row), fence=issued)
        outcome, row = self._run(lambda d, run: d.claim(run, params), key)
        return Claim(outcome, None if row is None else self._lock(key, row))

    def _fencing(self, dialect: _Dialect) -> _Postgres:
        """The dialect that issues fences (PostgreSQL); elsewhere ``FencingNotSupported``."""
        if not isinstance(dialect, _Postgres):
            raise FencingNotSupported("a fenced claim", f"{self.name} ({dialect.dialect.name})")
        return dialect

    def fence_of(self, key: str) -> int | None:
        """The last fence issued for ``key`` (one SELECT; ``FencedClaims``)."""
        row = self._run(lambda d, run: run(d.fence_of, {"b_key": key}).first(), key)
        return None if row is None else int(row.fence)

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Write the revoked marker of ``owner``; release its lock unless it started.

        One statement on PostgreSQL; a short transaction elsewhere.
        """
        params = self._params(key, owner, ttl, {})
        params["b_marker"] = revoked_marker_key(key, owner)
        return self._run(lambda d, run: d.revoke(run, params), key)

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Mark the owner's live lock not started, keeping or resetting its expiry (one UPDATE)."""
        params = {"b_key": key, "b_owner": owner, "b_ttl": None if ttl is None else float(ttl)}
        return self._run(lambda d, run: run(d.settle, params).rowcount > 0, key)

    def unrevoke(self, key: str, owner: str) -> None:
        """Delete the revoked marker of ``owner`` on ``key`` (one DELETE)."""
        params = {"b_marker": revoked_marker_key(key, owner)}
        self._run(lambda d, run: run(d.unrevoke, params), key)

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key`` (one SELECT)."""
        row = self._run(lambda d, run: run(d.get, {"b_key": key}).first(), key)
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

    # -- RunRecords --------------------------------------------------------

    @staticmethod
    def _run_params(run: RunRef, ttl: float, policy: str) -> dict[str, Any]:
        """The bound values of ``run``'s record: a row of the lock table at ``run.record``."""
        return {
            "b_record": run.record,
            "b_run": run.token,
            "b_run_owner": run.token,
            "b_run_policy": policy,
            "b_run_token": secrets.token_hex(16),
            "b_lease": float(ttl),
            "b_inherit": run.inherits,
        }

    def _gate_params(self, run: RunRef) -> dict[str, Any]:
        """The bound values of ``run``'s gate (statements that keep gates natively)."""
        if not self.run_gates:
            return {}
        return {"b_gated": run.gated, "b_gate": run.gate if run.gated else ""}

    def claim_run(
        self,
        run: RunRef,
        lease: float,
        meta: LockMeta,
        *,
        release: bool,
        ttl: float | None,
    ) -> tuple[RunOutcome, Claim | None]:
        """The lease, then the start claim (see ``RunRecords.claim_run``).

        A fenced run (``RunRef.fenced``, PostgreSQL) gets the key's next fence in
        the same statement (``FencedClaims``).

        One statement on PostgreSQL. Elsewhere the lease's upsert (MySQL:
        plus a read), then ``claim`` (one statement when the holder starts).
        """
        params = self._params(run.key, run.owner, ttl or 0.0, {**meta, "started": "1"})
        params["b_marker"] = revoked_marker_key(run.key, run.owner)
        params["b_release"] = release
        params["b_take"] = ttl is not None and not release
        params.update(self._run_params(run, lease, RUNNING_POLICY))
        params.update(self._gate_params(run))
        issued: int | None = None
        if run.fenced:
            outcome, answer, issued = self._run(
                lambda d, r: self._fencing(d).claim_run_fenced(r, params), run.key
            )
        else:
            outcome, answer = self._run(lambda d, r: d.claim_run(r, params), run.key)
        if answer is None:
            return outcome, None
        claimed, row = answer
        lock = None if row is None else self._lock(run.key, row)
        return outcome, Claim(claimed, lock, fence=issued)

    def end_run(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> bool:
        """The done marker, then release, settle or leave the lock (see ``RunRecords``).

        One statement on PostgreSQL; elsewhere the marker's upsert, then the
        ``DELETE`` or ``UPDATE`` of the lock (none when it is left).
        """
        params = self._end_params(run, done_ttl, meta, release)
        return self._run(lambda d, r: d.end_run(r, params), run.key)

    def _end_params(
        self, run: RunRef, done_ttl: float, meta: LockMeta, release: bool | None
    ) -> dict[str, Any]:
        params = self._params(run.key, run.owner, done_ttl, meta)
        params.update(self._run_params(run, done_ttl, DONE_POLICY))
        if outcome := meta.get(OUTCOME_FIELD, ""):
            params["b_run_owner"] = f"{run.token} {outcome}"[:255]  # (done_by)
        params["b_release"] = release is True
        params["b_settle"] = release is False
        params["b_ttl"] = None  # a settle keeps the lock's expiry
        params.update(self._gate_params(run))
        return params

    def end_run_in_turn(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> tuple[bool, bytes | None]:
        """``end_run``, with the message of the follow-up waiting at the gate it opened
        (``GateHandoff``: the same one statement, PostgreSQL; elsewhere nobody waits)."""
        if not (run.gated and self.run_gates):
            return self.end_run(run, done_ttl, meta, release=release), None
        params = self._end_params(run, done_ttl, meta, release)
        held, woken = self._run(lambda d, r: d.end_run_in_turn(r, params), run.key)
        return held, (base64.b64decode(woken) if woken else None)

    def wait_at_gate(self, run: RunRef, payload: bytes, life: float) -> bool:
        """List the follow-up at the gate another copy holds (``GateHandoff``; one
        statement, PostgreSQL; elsewhere the gate is a plain lock: ``False``)."""
        if not self.run_gates:
            return False
        params = {
            "gate": run.gate,
            "run": run.token,
            "running": RUNNING_POLICY,
            "payload": base64.b64encode(payload).decode("ascii"),
            "life": float(life),
        }

        def wait(_dialect: _Dialect, runner: _Runner) -> bool:
            return runner.connection.execute(WAIT_AT_GATE, params).first() is not None

        return self._run(wait, run.key)

    # -- GateWaiters (MySQL/MariaDB, SQLite: gates kept as lock rows) ----------

    def _transactional(self, dialect: _Dialect) -> _Transactional:
        if not isinstance(dialect, _Transactional):
            # PostgreSQL keeps gates in its run records and wakes their waiters there.
            raise NotImplementedError("gate waiters of gates kept as locks: not on PostgreSQL")
        return dialect

    def list_gate_waiter(self, gate: str, token: str, payload: bytes, life: float) -> bool:
        """List the follow-up at the gate another owner holds (``GateWaiters``): a short
        transaction locking the gate's row, then writing the gate-wait row."""
        params = {
            "b_key": gate,
            "b_owner": token,
            "b_payload": base64.b64encode(payload).decode("ascii"),
            "b_life": float(life),
        }
        return self._run(
            lambda d, r: self._transactional(d).list_gate_waiter(r, params), gate
        )

    def open_gate(self, gate: str, token: str) -> bytes | None:
        """Release ``token``'s gate and take its waiter (``GateWaiters``): one DELETE, as
        ``release``, when nobody waits; a short transaction when a waiter is listed."""
        params = {"b_key": gate, "b_owner": token}
        woken = self._run(lambda d, r: self._transactional(d).open_gate(r, params), gate)
        return base64.b64decode(woken) if woken else None

    def abandon_run(self, run: RunRef) -> bool:
        """Delete the lease if ``run``'s copy holds it (one DELETE; a done marker stays).

        A gated run's gate goes with it, in the same DELETE, where the store
        keeps gates natively.
        """
        params = {"b_key": run.record, "b_owner": run.token, "b_policy": RUNNING_POLICY}
        if run.gated and self.run_gates:
            params["b_gate"] = run.gate
            return self._run(lambda d, r: r(d.abandon_gated, params).rowcount > 0, run.key)
        return self._run(lambda d, r: r(d.abandon, params).rowcount > 0, run.key)

    def renew_runs(self, runs: Sequence[RunRef], lease: float, *, batch: int = 5000) -> int:
        """Renew every live lease its copy holds: one UPDATE per ``batch`` runs."""


        def renew(pairs: list[tuple[str, str]], dialect: _Dialect, run: _Runner) -> int:
            return dialect.renew_runs(run, pairs, lease)

        renewed = 0
        for start in range(0, len(runs), batch):
            some = runs[start : start + batch]
            pairs = [(run.record, run.token) for run in some]
            if self.run_gates:
                pairs += [(run.gate, run.token) for run in some if run.gated]
            renewed += self._run(partial(renew, pairs))
        return renewed

    def keep_runs(
        self, runs: Sequence[RunRef], lease: float, retake: Collection[str]
    ) -> list[bool]:
        """Renew every live lease in one batch (``renew_runs``); when some were not
        renewed, read and keep each run's record on its own (a lapsed lease to
        take back is taken with the lock upsert: atomic against a copy's claim).
        """
        gated = sum(1 for run in runs if run.gated) if self.run_gates else 0
        if self.renew_runs(runs, lease) == len(runs) + gated:
            return [True] * len(runs)
        kept = [self._keep_run(run, lease, run.token in retake) for run in runs]
        return kept

    def _keep_run(self, run: RunRef, lease: float, retake: bool) -> bool:
        held = self._keep_row(run.record, run.token, lease, retake)
        if held and run.gated and self.run_gates:
            self._keep_row(run.gate, run.token, lease, retake)
        return held

    def _keep_row(self, record: str, token: str, lease: float, retake: bool) -> bool:
        row = self.get(record)
        if row is not None:
            if row.owner != token or row.policy != RUNNING_POLICY:
                return False
            return self.extend(record, token, lease)
        if not retake:
            return False
        meta = {"task_name": "", "policy": RUNNING_POLICY, "task_id": ""}
        return self.acquire(record, token, lease, meta) is None

    def peek_run(self, run: RunRef) -> RunOutcome | None:
        """Read the attempt's run record (one SELECT)."""
        row = self.get(run.record)
        if row is None:
            return None
        if row.policy == DONE_POLICY:
            return RunOutcome.DONE
        return RunOutcome.BEGUN if row.owner == run.token else RunOutcome.RUNNING

    def lease_token(self, run: RunRef) -> str | None:
        """The token of the attempt's live lease (one SELECT)."""
        row = self.get(run.record)
        return None if row is None or row.policy == DONE_POLICY else str(row.owner)

    def done_by(self, run: RunRef) -> tuple[str, str] | None:
        """The attempt's done marker: its token and outcome (one SELECT)."""
        row = self.get(run.record)
        if row is None or row.policy != DONE_POLICY:
            return None
        token, _, outcome = str(row.owner).partition(" ")
        return token, outcome

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
            self._run(lambda d, run: run.connection.execute(d.add_counts(rows)))

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix`` (one SELECT)."""
        rows = self._run(partial(_fetch_all, "read_counts", {"b_prefix": prefix}))
        return {(row.task_name, row.event): int(row.total) for row in rows}

    # -- housekeeping ------------------------------------------------------

    def purge_expired(self) -> int:
        """Delete every expired lock, revoked marker, gate waiter and fence counter now;
        returns how many locks."""

        def purge(dialect: _Dialect, run: _Runner) -> int:
            run(dialect.reap_revoked, {})
            run(dialect.reap_gate_waits, {})
            run(dialect.reap_fences, {})
            return run(dialect.reap, {}).rowcount

        return self._run(purge)

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


def _answer(exc: BaseException) -> str:
    """The driver's error (never SQLAlchemy's text: it shows the statement's parameters)."""
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    if isinstance(orig, BaseException):
        return driver_answer(orig)
    return server_answer(exc)


def _backoff(tries: int) -> float:
    """Seconds to sleep after the ``tries``-th lost race: half fixed, half random."""
    ceiling = min(_BACKOFF_CAP, _BACKOFF_BASE * 2.0**tries)
    return ceiling / 2 + random.uniform(0, ceiling / 2)
