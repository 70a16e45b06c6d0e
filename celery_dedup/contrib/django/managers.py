"""The queries of the Django DB lock store, one method per store operation.

On SQLite (3.35+) and PostgreSQL, ``acquire`` is one ``INSERT … ON CONFLICT
(key) DO UPDATE … RETURNING`` statement: it inserts the row, or takes over an
expired one, and returns whoever holds the key afterwards. Django's
``bulk_create(update_conflicts=True)`` cannot put the expiry condition on the
update, so the statement is written by hand. Each ``SET`` is a ``CASE`` on
the expiry: a live row is "updated" to itself, so the statement always
returns the holder, and a random per-acquire ``token`` tells the caller
whether that holder is this call (an owner alone cannot: with deterministic
task ids a duplicate carries the holder's id). Other databases (MySQL,
MariaDB, Oracle) use a short transaction of ORM queries with the same result.

Release and extend are one ``DELETE``/``UPDATE … WHERE key AND owner``.
Times are epoch seconds by the database clock (``statement_timestamp()``,
SQLite's ``'now'``, MySQL's ``NOW(6)``), so producers on several hosts agree
on expiry; on other databases the Python clock is used.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, connections, models, transaction
from django.db.models import F, Func

__all__ = ["CounterManager", "DbEpoch", "LockManager", "LockRow"]

#: SQL for "now, as epoch seconds" by the database clock, per vendor.
NOW_SQL: Mapping[str, str] = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS double precision)",
    "mysql": "UNIX_TIMESTAMP(NOW(6))",
}

_COLUMNS = ("owner", "token", "task_name", "policy", "acquired_at", "expires_at")


class DbEpoch(Func):  # type: ignore[misc]
    """The database's clock as epoch seconds (a float), for ORM filters and updates."""

    output_field = models.FloatField()
    arity = 0

    def as_sql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        """Render the vendor's "now" expression, or the Python clock as a parameter."""
        return _now_sql(connection)


@dataclass(frozen=True)
class LockRow:
    """A lock row as a query returned it, with the database's "now" of that query."""

    key: str
    owner: str
    token: str
    task_name: str
    policy: str
    acquired_at: float
    expires_at: float
    now: float

    @property
    def live(self) -> bool:
        """Whether the lock had not expired when the query ran."""
        return self.expires_at > self.now


def _now_sql(connection: Any) -> tuple[str, list[Any]]:
    """The vendor's "now" SQL, or a parameter holding the Python clock."""
    sql = NOW_SQL.get(connection.vendor)
    return (sql, []) if sql is not None else ("%s", [time.time()])


def _has_upsert_returning(connection: Any) -> bool:
    if connection.vendor == "postgresql":
        return True
    if connection.vendor == "sqlite":
        return bool(connection.Database.sqlite_version_info >= (3, 35, 0))
    return False


class LockManager(models.Manager):  # type: ignore[misc]
    """Atomic lock operations on ``DedupLock``; ``DjangoStore`` calls these."""

    # -- helpers -------------------------------------------------------------

    def _sql_parts(self, using: str) -> tuple[Any, str, dict[str, str]]:
        connection = connections[using]
        quote = connection.ops.quote_name
        opts = self.model._meta
        cols = {f: quote(opts.get_field(f).column) for f in ("key", *_COLUMNS)}
        return connection, quote(opts.db_table), cols

    def _now(self, using: str) -> float:
        """The database's clock, as epoch seconds."""
        connection = connections[using]
        sql = NOW_SQL.get(connection.vendor)
        if sql is None:
            return time.time()
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {sql}")
            return float(cursor.fetchone()[0])

    @staticmethod
    def _row(key: str, values: Any) -> LockRow:
        owner, token, task_name, policy, acquired_at, expires_at, now = values
        return LockRow(
            key=key,
            owner=owner,
            token=token,
            task_name=task_name,
            policy=policy,
            acquired_at=float(acquired_at),
            expires_at=float(expires_at),
            now=float(now),
        )

    def _returning(self, cols: Mapping[str, str], now: str) -> str:
        return ", ".join([*(cols[c] for c in _COLUMNS), now])

    # -- operations ----------------------------------------------------------

    def acquire(
        self, using: str, key: str, owner: str, token: str, ttl: float, task_name: str, policy: str
    ) -> LockRow:
        """Insert the lock or take over an expired one; return the holder afterwards.

        The caller got the lock when the returned row's ``token`` is its own.
        """
        connection, table, cols = self._sql_parts(using)
        if not _has_upsert_returning(connection):
            return self._acquire_portable(using, key, owner, token, ttl, task_name, policy)
        now = NOW_SQL[connection.vendor]
        expired = f"{table}.{cols['expires_at']} <= {now}"
        sets = ",\n".join(
            f"{cols[c]} = CASE WHEN {expired} THEN excluded.{cols[c]} ELSE {table}.{cols[c]} END"
            for c in _COLUMNS
        )
        sql = (
            f"INSERT INTO {table} ({cols['key']}, {', '.join(cols[c] for c in _COLUMNS)}) "
            f"VALUES (%s, %s, %s, %s, %s, {now}, {now} + %s) "
            f"ON CONFLICT ({cols['key']}) DO UPDATE SET {sets} "
            f"RETURNING {self._returning(cols, now)}"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, [key, owner, token, task_name, policy, ttl])
            return self._row(key, cursor.fetchone())

    def _acquire_portable(
        self, using: str, key: str, owner: str, token: str, ttl: float, task_name: str, policy: str
    ) -> LockRow:
        """``acquire`` as a short transaction of ORM queries (databases without the upsert)."""
        locks = self.using(using)
        fields = {"owner": owner, "token": token, "task_name": task_name, "policy": policy}
        with transaction.atomic(using=using):
            now = self._now(using)
            taken = locks.filter(key=key, expires_at__lte=now).update(
                **fields, acquired_at=now, expires_at=now + ttl
            )
            if not taken:
                try:
                    with transaction.atomic(using=using):
                        locks.create(key=key, **fields, acquired_at=now, expires_at=now + ttl)
                except IntegrityError:
                    pass  # held: read the holder below
            values = locks.select_for_update().filter(key=key).values_list(*_COLUMNS).get()
        return self._row(key, (*values, now))

    def take_over(
        self, using: str, key: str, owner: str, token: str, ttl: float, task_name: str, policy: str
    ) -> LockRow | None:
        """Make ``owner`` the holder unconditionally; return the previous row, if any."""
        connection, table, cols = self._sql_parts(using)
        if not _has_upsert_returning(connection):
            return self._take_over_portable(using, key, owner, token, ttl, task_name, policy)
        now = NOW_SQL[connection.vendor]
        names = ", ".join(cols[c] for c in _COLUMNS)
        insert = (
            f"INSERT INTO {table} ({cols['key']}, {names}) "
            f"VALUES (%s, %s, %s, %s, %s, {now}, {now} + %s) "
            f"ON CONFLICT ({cols['key']}) DO UPDATE SET "
            + ", ".join(f"{cols[c]} = excluded.{cols[c]}" for c in _COLUMNS)
        )
        params = [key, owner, token, task_name, policy, ttl]
        if connection.vendor == "postgresql":
            # Lock the row first; a concurrent take-over then sees ours as previous.
            first = (
                f"SELECT {self._returning(cols, now)} FROM {table} "
                f"WHERE {cols['key']} = %s FOR UPDATE"
            )
        else:
            # SQLite: write first, so the transaction holds the write lock from the start.
            first = (
                f"DELETE FROM {table} WHERE {cols['key']} = %s "
                f"RETURNING {self._returning(cols, now)}"
            )
        with transaction.atomic(using=using), connection.cursor() as cursor:
            cursor.execute(first, [key])
            previous = cursor.fetchone()
            cursor.execute(insert, params)
        return None if previous is None else self._row(key, previous)

    def _take_over_portable(
        self, using: str, key: str, owner: str, token: str, ttl: float, task_name: str, policy: str
    ) -> LockRow | None:
        locks = self.using(using)
        fields = {"owner": owner, "token": token, "task_name": task_name, "policy": policy}
        with transaction.atomic(using=using):
            now = self._now(using)
            found = locks.select_for_update().filter(key=key).values_list(*_COLUMNS).first()
            updated = locks.filter(key=key).update(**fields, acquired_at=now, expires_at=now + ttl)
            if not updated:
                locks.create(key=key, **fields, acquired_at=now, expires_at=now + ttl)
        return None if found is None else self._row(key, (*found, now))

    def release(self, using: str, key: str, owner: str) -> bool:
        """``DELETE … WHERE key AND owner`` on a live lock; whether a row went.

        Raw SQL: ``QuerySet.delete()`` turns into a SELECT then a DELETE as soon
        as any project connects a delete signal, and this must be one statement.
        """
        connection, table, cols = self._sql_parts(using)
        now, now_params = _now_sql(connection)
        with connection.cursor() as cursor:
            cursor.execute(
                f"DELETE FROM {table} WHERE {cols['key']} = %s AND {cols['owner']} = %s "
                f"AND {cols['expires_at']} > {now}",
                [key, owner, *now_params],
            )
            return bool(cursor.rowcount)

    def extend(self, using: str, key: str, owner: str, ttl: float) -> bool:
        """``UPDATE … SET expires_at = now + ttl WHERE key AND owner`` on a live lock."""
        updated = (
            self.using(using)
            .filter(key=key, owner=owner, expires_at__gt=DbEpoch())
            .update(expires_at=DbEpoch() + ttl)
        )
        return bool(updated)

    def live(self, using: str) -> Any:
        """Live locks, annotated with the database's ``now``."""
        return (
            self.using(using)
            .annotate(db_now=DbEpoch())
            .filter(expires_at__gt=F("db_now"))
        )

    def get_live(self, using: str, key: str) -> LockRow | None:
        """The live lock at ``key``, or ``None``."""
        values = self.live(using).filter(key=key).values_list(*_COLUMNS, "db_now").first()
        return None if values is None else self._row(key, values)

    def scan(self, using: str, prefix: str, chunk_size: int = 500) -> Iterator[LockRow]:
        """Every live lock whose key starts with ``prefix``, in key order."""
        rows = (
            self.live(using)
            .filter(key__startswith=prefix)
            .order_by("key")
            .values_list("key", *_COLUMNS, "db_now")
        )
        for key, *values in rows.iterator(chunk_size=chunk_size):
            yield self._row(key, values)

    def purge_expired(self, using: str, prefix: str = "") -> int:
        """Delete expired rows under ``prefix`` (they are free already; this reclaims space)."""
        deleted, _ = (
            self.using(using)
            .filter(key__startswith=prefix, expires_at__lte=DbEpoch())
            .delete()
        )
        return int(deleted)


class CounterManager(models.Manager):  # type: ignore[misc]
    """Batched metric counters on ``DedupCounter``."""

    def add(self, using: str, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add ``counts`` in one upsert statement (SQLite, PostgreSQL) or one transaction."""
        if not counts:
            return
        connection = connections[using]
        if not _has_upsert_returning(connection):
            with transaction.atomic(using=using):
                for (task_name, event), n in counts.items():
                    counters = self.using(using).filter(
                        prefix=prefix, task_name=task_name, event=event
                    )
                    if not counters.update(count=F("count") + n):
                        self.using(using).create(
                            prefix=prefix, task_name=task_name, event=event, count=n
                        )
            return
        quote = connection.ops.quote_name
        opts = self.model._meta
        table = quote(opts.db_table)
        prefix_c, task_c, event_c, count_c = (
            quote(opts.get_field(f).column) for f in ("prefix", "task_name", "event", "count")
        )
        values = ", ".join(["(%s, %s, %s, %s)"] * len(counts))
        params: list[Any] = []
        for (task_name, event), n in counts.items():
            params += [prefix, task_name, event, n]
        sql = (
            f"INSERT INTO {table} ({prefix_c}, {task_c}, {event_c}, {count_c}) VALUES {values} "
            f"ON CONFLICT ({prefix_c}, {task_c}, {event_c}) "
            f"DO UPDATE SET {count_c} = {table}.{count_c} + excluded.{count_c}"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, params)

    def read(self, using: str, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix``."""
        rows = self.using(using).filter(prefix=prefix).values_list("task_name", "event", "count")
        return {(task_name, event): int(count) for task_name, event, count in rows}
