"""The queries of the Django DB lock store, one method per store operation.

``LockQueries`` holds the SQL of every operation for one database
connection (the store's own, see ``stores/django.py``); it runs on SQLite,
PostgreSQL and MySQL/MariaDB. Times are epoch seconds by the database clock
(SQLite's ``'now'``, ``statement_timestamp()``, ``NOW(6)`` in a UTC
session), so producers on several hosts agree on expiry.

- ``acquire`` is one upsert that inserts the lock, or takes over an expired
  row, and returns the holder afterwards: ``INSERT … ON CONFLICT (key) DO
  UPDATE … RETURNING`` (SQLite ≥ 3.35, PostgreSQL), ``INSERT … ON DUPLICATE
  KEY UPDATE … RETURNING`` (MariaDB ≥ 10.5), the same upsert then a read of
  the row (MySQL). A random per-acquire ``token`` tells the caller whether
  the holder is this call.
- ``claim`` in the common case (the owner holds the key and is not revoked)
  is one ``UPDATE``/``DELETE`` guarded by ``NOT EXISTS`` the revoked marker.
- ``take_over`` (and ``take_over_queued``), ``revoke`` and ``claim``'s
  other outcomes are a short transaction: read the lock and marker rows with
  ``SELECT … FOR UPDATE``, then write. A concurrent first insert loses
  with a duplicate-key error and the store runs the operation again
  (``is_contention``).
- ``release``, ``extend``, ``settle``, ``unrevoke``, ``get``, ``scan`` are one
  statement.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from django.db import DatabaseError, models, transaction
from django.db.models import F, Func

from ...exceptions import ImproperlyConfigured
from ...stores.base import RECORD_POLICIES, REVOKED_POLICY

__all__ = [
    "CounterManager",
    "DbEpoch",
    "LockManager",
    "LockQueries",
    "LockRow",
    "LostRace",
    "is_contention",
]

#: The table of ``DedupGateWaiter`` (the follow-up waiting at a run gate).
GATE_WAIT_TABLE = "celery_dedup_gate_wait"

#: SQL for "now, as epoch seconds" by the database clock, per vendor.
NOW_SQL: Mapping[str, str] = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS double precision)",
    # Exact because the store's MySQL sessions are in UTC (no DST gap).
    "mysql": "UNIX_TIMESTAMP(NOW(6))",
}

E_VENDOR = (
    "The django-db lock store supports SQLite, PostgreSQL and MySQL/MariaDB databases, "
    "not {vendor!r} (alias {alias!r}); use another lock store (dedup_store)."
)

#: every column but the key, in the order queries read and write them
_COLUMNS = (
    "owner", "token", "task_name", "policy", "task_id", "started", "acquired_at", "expires_at",
)
#: columns a write sets from parameters (the times come from the database clock)
_GIVEN = _COLUMNS[:-2]

#: PostgreSQL SQLSTATEs and MySQL error codes of a lost race, retried by the store:
#: serialization failure, deadlock, lock not available; duplicate key.
_PG_CONTENTION = frozenset({"40001", "40P01", "55P03", "23505"})
_MYSQL_CONTENTION = frozenset({1213, 1205, 1062})
#: SQLite: SQLITE_BUSY and SQLITE_LOCKED (any extended code), a duplicate primary
#: key or unique value. Numbers, not ``sqlite3.SQLITE_BUSY``: the module has those
#: names only from Python 3.11 on.
_SQLITE_BUSY = frozenset({5, 6})
_SQLITE_DUPLICATE = frozenset({1555, 2067})
#: The same errors by message, for Python 3.10, whose sqlite3 errors carry no code.
_SQLITE_CONTENTION_MESSAGES = (
    "database is locked", "database table is locked", "UNIQUE constraint failed",
)


class LostRace(DatabaseError):  # type: ignore[misc]
    """A row changed between two statements of one operation: run it again."""


def is_contention(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost race (deadlock, serialization, lock wait, duplicate insert).

    The store runs the operation again for these; they are never an outage.
    """
    if isinstance(exc, LostRace):
        return True
    if not isinstance(exc, DatabaseError):
        return False
    cause = exc.__cause__ or exc
    if isinstance(cause, sqlite3.Error):
        code = getattr(cause, "sqlite_errorcode", None)
        if code is None:  # Python 3.10
            return any(text in str(cause) for text in _SQLITE_CONTENTION_MESSAGES)
        return code & 0xFF in _SQLITE_BUSY or code in _SQLITE_DUPLICATE
    args: tuple[Any, ...] = getattr(cause, "args", ())
    if args and isinstance(args[0], int):  # MySQL drivers: (errno, message)
        return args[0] in _MYSQL_CONTENTION
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return sqlstate in _PG_CONTENTION


class DbEpoch(Func):  # type: ignore[misc]
    """The database's clock as epoch seconds (a float), for ORM filters."""

    output_field = models.FloatField()
    arity = 0

    def as_sql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        """Render the vendor's "now" expression."""
        return NOW_SQL[connection.vendor], []


@dataclass(frozen=True)
class LockRow:
    """A row as a query returned it, with the database's "now" of that query."""

    key: str
    owner: str
    token: str
    task_name: str
    policy: str
    task_id: str
    started: bool
    acquired_at: float
    expires_at: float
    now: float

    @classmethod
    def from_db(cls, values: Sequence[Any]) -> LockRow:
        """A row from ``key, *_COLUMNS, now`` as the driver returned them."""
        key, owner, token, task_name, policy, task_id, started, acquired, expires, now = values
        return cls(
            key, owner, token, task_name, policy, task_id, bool(started),
            float(acquired), float(expires), float(now),
        )

    @property
    def live(self) -> bool:
        """Whether the row had not expired when the query ran."""
        return self.expires_at > self.now


class LockQueries:
    """The SQL of every lock operation, for one connection (a ``DatabaseWrapper``)."""

    def __init__(self, connection: Any, model: Any) -> None:
        if connection.vendor not in NOW_SQL:
            raise ImproperlyConfigured(
                E_VENDOR.format(vendor=connection.vendor, alias=connection.alias)
            )
        self.connection = connection
        self.vendor: str = connection.vendor
        quote = connection.ops.quote_name
        opts = model._meta
        self.table = quote(opts.db_table)
        self.col = {name: quote(opts.get_field(name).column) for name in ("key", *_COLUMNS)}
        self.now = NOW_SQL[self.vendor]
        key, exp = self.col["key"], self.col["expires_at"]
        names = ", ".join(self.col[c] for c in ("key", *_COLUMNS))
        self.select = f"SELECT {names}, {self.now} FROM {self.table}"
        self.returning = f"RETURNING {names}, {self.now}"
        self.insert = (
            f"INSERT INTO {self.table} ({names}) "
            f"VALUES ({', '.join(['%s'] * (1 + len(_GIVEN)))}, {self.now}, {self.now} + %s)"
        )
        records = ", ".join(f"'{policy}'" for policy in sorted(RECORD_POLICIES))
        self.is_lock = f"{self.col['policy']} NOT IN ({records})"
        self.is_record = f"{self.col['policy']} IN ({records})"
        # Run records are operated on as locks (their own keys); revoked markers never.
        self.live_lock = (
            f"{key} = %s AND {exp} > {self.now} AND {self.col['policy']} <> '{REVOKED_POLICY}'"
        )
        self.for_update = " FOR UPDATE" if connection.features.has_select_for_update else ""
        #: the gate-wait table (``DedupGateWaiter``: the follow-up waiting at a run gate)
        self.waits = quote(GATE_WAIT_TABLE)
        self.payload = quote("payload")

    @cached_property
    def upsert_returns(self) -> bool:
        """Whether the upsert can return the row (SQLite ≥ 3.35, PostgreSQL, MariaDB ≥ 10.5)."""
        return _has_upsert_returning(self.connection)

    # -- helpers -------------------------------------------------------------

    @contextmanager
    def transaction(self, *, serializable: bool = False) -> Iterator[Any]:
        """A short explicit transaction on the store's autocommit connection.

        ``serializable`` closes the write skew between a start check and a
        revoke of a key nobody holds (each would read "absent" and write the
        other's row); SQLite's ``BEGIN IMMEDIATE`` is serial anyway. On a
        connection already in ``atomic()`` (SQLite joining the caller's
        transaction) it is a savepoint.
        """
        conn = self.connection
        if conn.in_atomic_block:
            with transaction.atomic(using=conn.alias), conn.cursor() as cursor:
                yield cursor
            return
        with conn.cursor() as cursor:
            for statement in self._begin(serializable):
                cursor.execute(statement)
            try:
                yield cursor
            except BaseException:
                with suppress(DatabaseError):
                    cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")

    def _begin(self, serializable: bool) -> list[str]:
        if self.vendor == "sqlite":
            return ["BEGIN IMMEDIATE"]
        level = "SERIALIZABLE" if serializable else "READ COMMITTED"
        if self.vendor == "postgresql":
            return [f"BEGIN ISOLATION LEVEL {level}"]
        # The store's MySQL sessions are READ COMMITTED already (no gap locks).
        if not serializable:
            return ["START TRANSACTION"]
        return [f"SET TRANSACTION ISOLATION LEVEL {level}", "START TRANSACTION"]

    def _fetch(self, sql: str, params: Sequence[Any], cursor: Any = None) -> LockRow | None:
        if cursor is None:
            with self.connection.cursor() as own:
                return self._fetch(sql, params, own)
        cursor.execute(sql, params)
        values = cursor.fetchone()
        return None if values is None else LockRow.from_db(values)

    def _fetch_one(self, sql: str, params: Sequence[Any]) -> LockRow:
        row = self._fetch(sql, params)
        if row is None:  # never: an upsert returns the row it wrote or kept
            raise LostRace("the upsert returned no row")
        return row

    def _rowcount(self, sql: str, params: Sequence[Any]) -> int:
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return int(cursor.rowcount)

    @staticmethod
    def _given(
        key: str, owner: str, token: str, meta: Mapping[str, str], *, started: bool
    ) -> list[Any]:
        """``key`` and the ``_GIVEN`` column values of a new row."""
        return [
            key, owner, token, meta.get("task_name", ""), meta.get("policy", ""),
            meta.get("task_id", ""), started,
        ]

    def _rows(self, cursor: Any, *keys: str) -> dict[str, LockRow]:
        """Lock the rows of ``keys`` for this transaction; key → row."""
        marks = ", ".join(["%s"] * len(keys))
        cursor.execute(f"{self.select} WHERE {self.col['key']} IN ({marks}){self.for_update}", keys)
        return {row.key: row for row in map(LockRow.from_db, cursor.fetchall())}

    def _put(self, cursor: Any, exists: bool, given: list[Any], ttl: float) -> None:
        """Write a whole row in this transaction: update it in place, or insert it."""
        if not exists:
            cursor.execute(self.insert, [*given, ttl])
            return
        sets = ", ".join(f"{self.col[c]} = %s" for c in _GIVEN)
        cursor.execute(
            f"UPDATE {self.table} SET {sets}, {self.col['acquired_at']} = {self.now}, "
            f"{self.col['expires_at']} = {self.now} + %s WHERE {self.col['key']} = %s",
            [*given[1:], ttl, given[0]],
        )

    def _delete(self, cursor: Any, key: str) -> None:
        cursor.execute(f"DELETE FROM {self.table} WHERE {self.col['key']} = %s", [key])

    # -- operations ----------------------------------------------------------

    def acquire(
        self, key: str, owner: str, token: str, ttl: float, meta: Mapping[str, str]
    ) -> LockRow:
        """Insert the lock or take over an expired one; return the row afterwards.

        The caller got the lock when the row's ``token`` is its own.
        """
        given = self._given(key, owner, token, meta, started=meta.get("started") == "1")
        if self.vendor == "mysql":
            return self._acquire_mysql(given, ttl)
        if not self.upsert_returns:
            return self._acquire_in_transaction(given, ttl)
        expired = f"{self.table}.{self.col['expires_at']} <= {self.now}"
        sets = ", ".join(
            f"{self.col[c]} = CASE WHEN {expired} THEN excluded.{self.col[c]} "
            f"ELSE {self.table}.{self.col[c]} END"
            for c in _COLUMNS
        )
        return self._fetch_one(
            f"{self.insert} ON CONFLICT ({self.col['key']}) DO UPDATE SET {sets} "
            f"{self.returning}",
            [*given, ttl],
        )

    def _acquire_mysql(self, given: list[Any], ttl: float) -> LockRow:
        # Assignments run left to right and later ones see earlier results:
        # expires_at, which every condition reads, goes last.
        expired = f"{self.col['expires_at']} <= {self.now}"
        sets = ", ".join(
            f"{self.col[c]} = IF({expired}, VALUES({self.col[c]}), {self.col[c]})"
            for c in _COLUMNS
        )
        upsert = f"{self.insert} ON DUPLICATE KEY UPDATE {sets}"
        if self.upsert_returns:
            return self._fetch_one(f"{upsert} {self.returning}", [*given, ttl])
        # MySQL has no RETURNING: read the row in the upsert's transaction,
        # which holds the row's lock, so no take-over slips in between.
        with self.transaction() as cursor:
            cursor.execute(upsert, [*given, ttl])
            row = self._fetch(f"{self.select} WHERE {self.col['key']} = %s", [given[0]], cursor)
        if row is None:  # never: the upsert wrote or locked the row
            raise LostRace("the upserted row was not found")
        return row

    def _acquire_in_transaction(self, given: list[Any], ttl: float) -> LockRow:
        """``acquire`` as a transaction (SQLite before 3.35, which has no ``RETURNING``)."""
        with self.transaction() as cursor:
            row = self._rows(cursor, given[0]).get(given[0])
            if row is not None and row.live:
                return row
            self._put(cursor, row is not None, given, ttl)
            return self._rows(cursor, given[0])[given[0]]

    def take_over(
        self, key: str, owner: str, token: str, ttl: float, meta: Mapping[str, str]
    ) -> LockRow | None:
        """Make ``owner`` the holder unconditionally; return the previous row, if any."""
        given = self._given(key, owner, token, meta, started=meta.get("started") == "1")
        with self.transaction() as cursor:
            previous = self._rows(cursor, key).get(key)
            self._put(cursor, previous is not None, given, ttl)
        return previous

    def take_over_queued(
        self, key: str, owner: str, token: str, ttl: float, meta: Mapping[str, str]
    ) -> LockRow | None:
        """``take_over`` unless a live started holder holds the key (returned, nothing written)."""
        given = self._given(key, owner, token, meta, started=meta.get("started") == "1")
        with self.transaction() as cursor:
            previous = self._rows(cursor, key).get(key)
            if previous is None or not (previous.live and previous.started):
                self._put(cursor, previous is not None, given, ttl)
        return previous

    def claim_owned(self, key: str, owner: str, marker: str, *, release: bool) -> bool:
        """The start check's common case in one statement: ``owner`` holds ``key``, not revoked.

        Marks the lock started (or deletes it when ``release``); False when
        ``owner`` does not hold the key or a revoked marker exists.
        """
        c, now, table = self.col, self.now, self.table
        if self.vendor == "mysql":
            # MySQL cannot read the target table in a subquery: a self-join instead.
            join = (
                f"{table} AS l LEFT JOIN {table} AS m "
                f"ON m.{c['key']} = %s AND m.{c['expires_at']} > {now}"
            )
            mine = (
                f"l.{c['key']} = %s AND l.{c['owner']} = %s AND l.{c['expires_at']} > {now} "
                f"AND m.{c['key']} IS NULL"
            )
            if release:
                sql = f"DELETE l FROM {join} WHERE {mine}"
                return bool(self._rowcount(sql, [marker, key, owner]))
            sql = f"UPDATE {join} SET l.{c['started']} = %s WHERE {mine}"
            return bool(self._rowcount(sql, [marker, True, key, owner]))
        mine = (
            f"{c['key']} = %s AND {c['owner']} = %s AND {c['expires_at']} > {now} "
            f"AND NOT EXISTS (SELECT 1 FROM {table} AS m "
            f"WHERE m.{c['key']} = %s AND m.{c['expires_at']} > {now})"
        )
        if release:
            return bool(self._rowcount(f"DELETE FROM {table} WHERE {mine}", [key, owner, marker]))
        sql = f"UPDATE {table} SET {c['started']} = %s WHERE {mine}"
        return bool(self._rowcount(sql, [True, key, owner, marker]))

    def claim(
        self, key: str, owner: str, marker: str, *, release: bool, ttl: float | None,
        token: str, meta: Mapping[str, str],
    ) -> tuple[str, LockRow | None]:
        """The whole start check in one transaction; ``(outcome, holder)``.

        ``outcome`` is a ``ClaimOutcome`` value; ``holder`` the other holder for "held".
        """
        with self.transaction(serializable=True) as cursor:
            rows = self._rows(cursor, key, marker)
            lock, revoked = rows.get(key), rows.get(marker)
            held = lock is not None and lock.live
            mine = held and lock is not None and lock.owner == owner
            if revoked is not None and revoked.live:
                if mine:
                    self._delete(cursor, key)
                return "revoked", None
            if mine:
                if release:
                    self._delete(cursor, key)
                else:
                    cursor.execute(
                        f"UPDATE {self.table} SET {self.col['started']} = %s "
                        f"WHERE {self.col['key']} = %s",
                        [True, key],
                    )
                return "owned", None
            if held:
                return "held", lock
            if ttl is not None and not release:
                given = self._given(key, owner, token, meta, started=True)
                self._put(cursor, lock is not None, given, ttl)
            return "free", None

    def revoke(self, key: str, owner: str, marker: str, ttl: float) -> str:
        """Mark ``owner`` revoked, release its unstarted lock; a ``RevokeOutcome`` value."""
        with self.transaction(serializable=True) as cursor:
            rows = self._rows(cursor, key, marker)
            if marker in rows:
                # Never shorten a marker's life: a second revoke only extends it.
                exp = self.col["expires_at"]
                cursor.execute(
                    f"UPDATE {self.table} SET {exp} = CASE WHEN {exp} > {self.now} + %s "
                    f"THEN {exp} ELSE {self.now} + %s END WHERE {self.col['key']} = %s",
                    [ttl, ttl, marker],
                )
            else:
                meta = {"policy": REVOKED_POLICY}
                self._put(cursor, False, self._given(marker, owner, "", meta, started=False), ttl)
            lock = rows.get(key)
            if lock is None or not lock.live or lock.owner != owner:
                return "not_held"
            if lock.started:
                return "running"
            self._delete(cursor, key)
            return "released"

    def unrevoke(self, marker: str) -> None:
        """Delete a revoked marker."""
        self._rowcount(
            f"DELETE FROM {self.table} WHERE {self.col['key']} = %s AND {self.col['policy']} = %s",
            [marker, REVOKED_POLICY],
        )

    def release(self, key: str, owner: str) -> bool:
        """``DELETE … WHERE key AND owner`` on a live lock; whether a row went."""
        sql = f"DELETE FROM {self.table} WHERE {self.live_lock} AND {self.col['owner']} = %s"
        return bool(self._rowcount(sql, [key, owner]))

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """``UPDATE … SET expires_at = now + ttl WHERE key AND owner`` on a live lock."""
        exp = self.col["expires_at"]
        sql = (
            f"UPDATE {self.table} SET {exp} = {self.now} + %s "
            f"WHERE {self.live_lock} AND {self.col['owner']} = %s"
        )
        return bool(self._rowcount(sql, [ttl, key, owner]))

    def settle(self, key: str, owner: str, ttl: float | None) -> bool:
        """``UPDATE … SET started = false [, expires_at = now + ttl] WHERE key AND owner``.

        On a live lock; the expiry is kept when ``ttl`` is ``None``. Whether
        ``owner`` holds ``key``.
        """
        sets = f"{self.col['started']} = %s"
        params: list[Any] = [False]
        if ttl is not None:
            sets += f", {self.col['expires_at']} = {self.now} + %s"
            params.append(ttl)
        sql = f"UPDATE {self.table} SET {sets} WHERE {self.live_lock} AND {self.col['owner']} = %s"
        return bool(self._rowcount(sql, [*params, key, owner]))

    def get(self, key: str) -> LockRow | None:
        """The live lock at ``key``, or ``None``."""
        return self._fetch(f"{self.select} WHERE {self.live_lock}", [key])

    def _starts_with(self, prefix: str) -> tuple[str, str]:
        """A case-sensitive "key starts with ``prefix``" condition and its parameter.

        SQLite's ``LIKE`` ignores case, so it gets ``GLOB`` (``[x]`` quotes a
        wildcard); PostgreSQL's ``LIKE`` and MySQL's ``LIKE BINARY`` respect it.
        """
        if self.vendor == "sqlite":
            quoted = "".join(f"[{ch}]" if ch in "*?[" else ch for ch in prefix)
            return f"{self.col['key']} GLOB %s", quoted + "*"
        like = self.connection.operators["startswith"] % "%s"
        return f"{self.col['key']} {like}", self.connection.ops.prep_for_like_query(prefix) + "%"

    def scan(self, prefix: str) -> list[LockRow]:
        """Every live lock whose key starts with ``prefix``, in key order."""
        c = self.col
        starts, pattern = self._starts_with(prefix)
        with self.connection.cursor() as cursor:
            cursor.execute(
                f"{self.select} WHERE {starts} AND {c['expires_at']} > {self.now} "
                f"AND {self.is_lock} ORDER BY {c['key']}",
                [pattern],
            )
            return [LockRow.from_db(values) for values in cursor.fetchall()]

    # -- run gate waiters (``GateWaiters``) ------------------------------------
    #
    # A gate is a lock row whose ``started`` flag (never set on a run record
    # otherwise) says a follow-up is listed in the gate-wait table: the
    # opening of a gate nobody waits at stays one DELETE.

    def list_gate_waiter(self, gate: str, token: str, payload: str, life: float) -> bool:
        """List ``payload`` (base64) at ``gate`` while another owner holds it: one
        transaction locking the gate's row first (an opening waits for it, or it
        finds the gate open and lists nothing)."""
        key, exp = self.col["key"], self.col["expires_at"]
        insert = (
            f"INSERT INTO {self.waits} ({key}, {self.payload}, {exp}) "
            f"VALUES (%s, %s, {self.now} + %s)"
        )
        if self.vendor == "mysql":
            upsert = (
                f"{insert} ON DUPLICATE KEY UPDATE {self.payload} = VALUES({self.payload}), "
                f"{exp} = VALUES({exp})"
            )
        else:
            upsert = (
                f"{insert} ON CONFLICT ({key}) DO UPDATE SET "
                f"{self.payload} = excluded.{self.payload}, {exp} = excluded.{exp}"
            )
        with self.transaction() as cursor:
            row = self._rows(cursor, gate).get(gate)
            if row is None or not row.live or row.owner == token:
                return False
            cursor.execute(upsert, [gate, payload, life])
            cursor.execute(
                f"UPDATE {self.table} SET {self.col['started']} = %s WHERE {key} = %s", [True, gate]
            )
            return True

    def open_gate(self, gate: str, token: str) -> str | None:
        """Release ``token``'s gate and take its waiter (base64): one DELETE when none is
        listed, else a transaction locking the gate's row, then the waiter's."""
        c = self.col
        unlisted = (
            f"DELETE FROM {self.table} WHERE {self.live_lock} AND {c['owner']} = %s "
            f"AND {c['started']} = %s"
        )
        if self._rowcount(unlisted, [gate, token, False]):
            return None
        with self.transaction() as cursor:
            row = self._rows(cursor, gate).get(gate)
            if row is not None and row.live:
                if row.owner != token:
                    return None  # another run's gate: its waiter is its own
                self._delete(cursor, gate)
            cursor.execute(
                f"SELECT {self.payload} FROM {self.waits} WHERE {c['key']} = %s "
                f"AND {c['expires_at']} > {self.now}{self.for_update}",
                [gate],
            )
            found = cursor.fetchone()
            if found is None:
                return None
            cursor.execute(f"DELETE FROM {self.waits} WHERE {c['key']} = %s", [gate])
            return str(found[0])

    def purge_expired(self, prefix: str) -> int:
        """Delete expired locks under ``prefix``, every expired revoked marker and gate
        waiter.

        Returns how many locks went (markers are never counted).
        """
        c = self.col
        starts, pattern = self._starts_with(prefix)
        expired = f"{c['expires_at']} <= {self.now}"
        self._rowcount(f"DELETE FROM {self.table} WHERE {expired} AND {self.is_record}", [])
        self._rowcount(f"DELETE FROM {self.waits} WHERE {expired}", [])
        return self._rowcount(
            f"DELETE FROM {self.table} WHERE {starts} AND {expired} AND {self.is_lock}", [pattern]
        )


def _has_upsert_returning(connection: Any) -> bool:
    if connection.vendor == "postgresql":
        return True
    if connection.vendor == "sqlite":
        return bool(connection.Database.sqlite_version_info >= (3, 35, 0))
    if connection.vendor == "mysql":
        return bool(connection.mysql_is_mariadb and connection.mysql_version >= (10, 5))
    return False


class LockQuerySet(models.QuerySet):  # type: ignore[misc]
    """``DedupLock`` rows for the ORM: ``objects`` never includes revoked markers."""

    def live(self) -> LockQuerySet:
        """Locks that have not expired by the database clock, annotated with ``db_now``."""
        live: LockQuerySet = self.annotate(db_now=DbEpoch()).filter(expires_at__gt=F("db_now"))
        return live


class LockManager(models.Manager.from_queryset(LockQuerySet)):  # type: ignore[misc]
    """Locks only (never revoked markers); ``queries()`` gives the store's SQL."""

    def get_queryset(self) -> LockQuerySet:
        """Every lock row, revoked markers excluded."""
        locks: LockQuerySet = super().get_queryset().exclude(policy__in=RECORD_POLICIES)
        return locks

    def queries(self, connection: Any) -> LockQueries:
        """The store's SQL for ``connection`` (a ``DatabaseWrapper``)."""
        return LockQueries(connection, self.model)


class CounterManager(models.Manager):  # type: ignore[misc]
    """Batched metric counters on ``DedupCounter``."""

    def add(self, connection: Any, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add ``counts`` in one upsert statement on ``connection``."""
        if not counts:
            return
        quote = connection.ops.quote_name
        opts = self.model._meta
        table = quote(opts.db_table)
        prefix_c, task_c, event_c, count_c = (
            quote(opts.get_field(f).column) for f in ("prefix", "task_name", "event", "count")
        )
        values = ", ".join(["(%s, %s, %s, %s)"] * len(counts))
        params: list[Any] = []
        # Sorted, so concurrent batches lock rows in one order and cannot deadlock.
        for (task_name, event), n in sorted(counts.items()):
            params += [prefix, task_name, event, n]
        insert = f"INSERT INTO {table} ({prefix_c}, {task_c}, {event_c}, {count_c}) VALUES {values}"
        if connection.vendor == "mysql":
            sql = f"{insert} ON DUPLICATE KEY UPDATE {count_c} = {count_c} + VALUES({count_c})"
        else:
            sql = (
                f"{insert} ON CONFLICT ({prefix_c}, {task_c}, {event_c}) "
                f"DO UPDATE SET {count_c} = {table}.{count_c} + excluded.{count_c}"
            )
        with connection.cursor() as cursor:
            cursor.execute(sql, params)

    def read(self, connection: Any, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix``, read on ``connection``."""
        quote = connection.ops.quote_name
        opts = self.model._meta
        cols = ", ".join(quote(opts.get_field(f).column) for f in ("task_name", "event", "count"))
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {cols} FROM {quote(opts.db_table)} "
                f"WHERE {quote(opts.get_field('prefix').column)} = %s",
                [prefix],
            )
            return {(task_name, event): int(n) for task_name, event, n in cursor.fetchall()}
