"""Schema and per-dialect SQL of the SQL lock store.

The two tables (``celery_dedup_lock``, ``celery_dedup_counter``) and one
``_Dialect`` per database family, each building the single statement (or
the shortest transaction) an operation needs: PostgreSQL, SQLite,
MySQL and MariaDB. ``stores/sql.py`` holds the store that runs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar

from kombu.utils.url import maybe_sanitize_url
from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Index,
    MetaData,
    String,
    Table,
    delete,
    exists,
    false,
    func,
    literal_column,
    null,
    select,
    true,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.sql.expression import ColumnElement, Executable, bindparam

from ..exceptions import ImproperlyConfigured, StoreUnavailable
from . import E_MISSING_DRIVER

if TYPE_CHECKING:
    pass

__all__ = [
    "COUNTER_TABLE",
    "LOCK_TABLE",
    "counter_table",
    "lock_table",
    "metadata",
]


T = TypeVar("T")

LOCK_TABLE = "celery_dedup_lock"
COUNTER_TABLE = "celery_dedup_counter"
#: The longest key the lock table holds (a MySQL utf8mb4 primary key limit).
KEY_LENGTH = 255

#: The driver errors that mean "the database cannot be reached".
UNREACHABLE: tuple[type[BaseException], ...] = (
    OperationalError,
    InterfaceError,
    DisconnectionError,
    PoolTimeoutError,
)

E_MISSING_OTHER_DRIVER = (
    "The lock store for {url!r} needs the {driver} driver, which is not installed ({error}). "
    "Install it, or use a db+{alternative} URL and: pip install 'celery-dedup[{extra}]'"
)
E_NO_DIALECT = "No SQLAlchemy dialect for the lock store {url!r} ({error})"
E_OLD_SQLITE = "The SQL lock store needs SQLite >= 3.35 (RETURNING); this is SQLite {version}"
E_KEY_TOO_LONG = "lock key is {length} characters; the SQL lock store holds keys up to {limit}"

#: How many times an operation is re-run when a concurrent writer changed the
#: row between the statement's snapshot and its write (rare; see _Postgres).
_RACE_RETRIES = 20
_MYSQL_DEADLOCK = 1213


def _varchar(length: int) -> String:
    # MySQL's default collations are case-insensitive: keys and owners must
    # compare byte for byte, as they do on every other store.
    return String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


#: The tables of the SQL store (for Alembic or ``metadata.create_all``).
metadata = MetaData()

#: One row per lock key; times are epoch seconds on the database's clock.
lock_table = Table(
    LOCK_TABLE,
    metadata,
    Column("key", _varchar(KEY_LENGTH), primary_key=True),
    Column("owner", _varchar(255), nullable=False),
    Column("task_name", _varchar(255), nullable=False),
    Column("policy", _varchar(32), nullable=False),
    # A random value per acquire: MySQL cannot return the row's previous
    # values, so its acquire tells its own write from an older one by this.
    Column("token", _varchar(32), nullable=False),
    Column("acquired_at", Double(), nullable=False),
    Column("expires_at", Double(), nullable=False),
    Index(f"ix_{LOCK_TABLE}_expires_at", "expires_at"),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

#: Shared metric counters, one row per (prefix, task name, event).
counter_table = Table(
    COUNTER_TABLE,
    metadata,
    Column("prefix", _varchar(191), primary_key=True),
    Column("task_name", _varchar(255), primary_key=True),
    Column("event", _varchar(64), primary_key=True),
    Column("count", BigInteger(), nullable=False),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

_L = lock_table.c
_C = counter_table.c
#: Columns every statement that reports a lock returns, then the database's now.
_LOCK_COLUMNS = (_L.owner, _L.task_name, _L.policy, _L.acquired_at, _L.expires_at)


#: dialect → (the driver its pip extra installs, the extra)
_EXTRAS = {
    "postgresql": ("psycopg", "postgres"),
    "mysql": ("pymysql", "mysql"),
    "mariadb": ("pymysql", "mysql"),
}


def _missing_driver(url: str, dialect: str, driver: str, error: ImportError) -> str:
    """The ImproperlyConfigured message for a driver that cannot be imported."""
    url = maybe_sanitize_url(url)
    extra_driver, extra = _EXTRAS.get(dialect, (driver, "sql"))
    if driver == extra_driver:
        return E_MISSING_DRIVER.format(url=url, error=error, extra=extra)
    return E_MISSING_OTHER_DRIVER.format(
        url=url, error=error, driver=driver, alternative=f"{dialect}+{extra_driver}://", extra=extra
    )


class _Dialect:
    """The statements of one database family, built once per store."""

    #: how "now" reads as epoch seconds, stable within one statement
    now_sql = ""

    def __init__(self) -> None:
        self.now: ColumnElement[float] = literal_column(self.now_sql, Double())
        live = _L.expires_at > self.now
        self.get = select(*_LOCK_COLUMNS, self.now.label("now")).where(
            _L.key == bindparam("b_key"), live
        )
        self.release = delete(lock_table).where(
            _L.key == bindparam("b_key"), _L.owner == bindparam("b_owner"), live
        )
        self.extend = (
            update(lock_table)
            .where(_L.key == bindparam("b_key"), _L.owner == bindparam("b_owner"), live)
            .values(expires_at=self.now + bindparam("b_ttl", type_=Double()))
        )
        self.scan = (
            select(_L.key, *_LOCK_COLUMNS, self.now.label("now"))
            .where(
                _L.key.like(bindparam("b_pattern", type_=String()), escape="!"),
                _L.key > bindparam("b_after"),
                live,
            )
            .order_by(_L.key)
            .limit(bindparam("b_limit"))
        )
        self.reap = delete(lock_table).where(_L.expires_at <= self.now)
        self.read_counts = select(_C.task_name, _C.event, _C.count.label("total")).where(
            _C.prefix == bindparam("b_prefix")
        )

    def row_values(self) -> dict[str, Any]:
        """The VALUES of a new lock row, on the database's clock."""
        return {
            "key": bindparam("b_key", type_=String()),
            "owner": bindparam("b_owner", type_=String()),
            "task_name": bindparam("b_task_name", type_=String()),
            "policy": bindparam("b_policy", type_=String()),
            "token": bindparam("b_token", type_=String()),
            "acquired_at": self.now,
            "expires_at": self.now + bindparam("b_ttl", type_=Double()),
        }

    def acquire(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        """Take the key; ``None`` when taken, else the holder's row."""
        raise NotImplementedError

    def take_over(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        """Become the holder; the previous row (live or not), or ``None``."""
        raise NotImplementedError

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        """One statement adding ``rows`` to the counters."""
        raise NotImplementedError


class _Postgres(_Dialect):
    # statement_timestamp() is fixed for the statement; clock_timestamp()
    # would move between the VALUES and the WHERE of one upsert.
    now_sql = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"

    def __init__(self) -> None:
        super().__init__()
        ins = postgresql.insert(lock_table).values(**self.row_values())
        taken = (
            ins.on_conflict_do_update(
                index_elements=[_L.key],
                set_={name: ins.excluded[name] for name in self.row_values() if name != "key"},
                where=_L.expires_at <= self.now,
            )
            .returning(*_LOCK_COLUMNS)
            .cte("taken")
        )
        # The second branch reads the holder in the statement's snapshot, so a
        # row committed after the snapshot is missed (no row) or seen in an
        # older version (expired): acquire() re-runs the statement for those.
        held = select(false(), *_LOCK_COLUMNS, self.now).where(
            _L.key == bindparam("b_key"), ~exists(select(taken.c.owner))
        )
        self.acquire_stmt = select(
            true().label("taken"), *taken.c, self.now.label("now")
        ).union_all(held)

        # UPDATE … FROM (SELECT … FOR UPDATE) returns the row's values before
        # the update, re-read after waiting for a concurrent writer.
        old = (
            select(lock_table)
            .where(_L.key == bindparam("b_key"))
            .with_for_update()
            .subquery("old")
        )
        replaced = (
            update(lock_table)
            .where(_L.key == old.c.key)
            .values({k: v for k, v in self.row_values().items() if k != "key"})
            .returning(*(old.c[c.name] for c in _LOCK_COLUMNS))
            .cte("replaced")
        )
        inserted = (
            postgresql.insert(lock_table)
            .from_select(
                list(self.row_values()),
                select(*self.row_values().values()).where(~exists(select(replaced.c.owner))),
            )
            .on_conflict_do_nothing(index_elements=[_L.key])
            .returning(_L.owner)
            .cte("inserted")
        )
        self.take_over_stmt = select(
            true().label("replaced"), *replaced.c, self.now.label("now")
        ).union_all(
            select(false(), inserted.c.owner, null(), null(), null(), null(), self.now)
        )

    def acquire(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        for _ in range(_RACE_RETRIES):
            row = conn.execute(self.acquire_stmt, params).first()
            if row is None or (not row.taken and row.expires_at <= row.now):
                continue
            return None if row.taken else row
        raise _contention(params["b_key"])

    def take_over(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        for _ in range(_RACE_RETRIES):
            row = conn.execute(self.take_over_stmt, params).first()
            if row is None:
                # Inserted by another writer after our snapshot: run again.
                continue
            return row if row.replaced else None
        raise _contention(params["b_key"])

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        ins = postgresql.insert(counter_table).values(rows)
        return ins.on_conflict_do_update(
            index_elements=[_C.prefix, _C.task_name, _C.event],
            set_={"count": _C.count + ins.excluded.count},
        )


class _SQLite(_Dialect):
    # 'now' is fixed for one sqlite3_step(), and RETURNING writes in the first.
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self) -> None:
        super().__init__()
        ins = sqlite.insert(lock_table).values(**self.row_values())
        self.acquire_stmt = ins.on_conflict_do_update(
            index_elements=[_L.key],
            set_={name: ins.excluded[name] for name in self.row_values() if name != "key"},
            where=_L.expires_at <= self.now,
        ).returning(_L.owner)
        self.holder = select(*_LOCK_COLUMNS, self.now.label("now")).where(
            _L.key == bindparam("b_key")
        )
        self.take_over_stmt = ins.on_conflict_do_update(
            index_elements=[_L.key],
            set_={name: ins.excluded[name] for name in self.row_values() if name != "key"},
        )

    def acquire(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        for _ in range(_RACE_RETRIES):
            if conn.execute(self.acquire_stmt, params).first() is not None:
                return None
            # The key was live when the upsert ran; read the holder. A release
            # or expiry in between leaves no live holder: try again.
            row = conn.execute(self.holder, params).first()
            if row is not None and row.expires_at > row.now:
                return row
        raise _contention(params["b_key"])

    def take_over(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        # BEGIN IMMEDIATE takes the write lock first, so the read and the
        # write see the same row.
        with _transaction(conn, "BEGIN IMMEDIATE"):
            row = conn.execute(self.holder, params).first()
            conn.execute(self.take_over_stmt, params)
        return row

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        ins = sqlite.insert(counter_table).values(rows)
        return ins.on_conflict_do_update(
            index_elements=[_C.prefix, _C.task_name, _C.event],
            set_={"count": _C.count + ins.excluded.count},
        )


class _MySQL(_Dialect):
    # The session time zone is UTC (set on connect), so this is exact even
    # across a DST change.
    now_sql = "UNIX_TIMESTAMP(NOW(6))"

    def __init__(self) -> None:
        super().__init__()
        ins = mysql.insert(lock_table).values(**self.row_values())
        expired = _L.expires_at <= self.now
        # MySQL applies the assignments left to right and later ones see the
        # new values: expires_at, which every condition reads, goes last.
        names = ["owner", "task_name", "policy", "token", "acquired_at", "expires_at"]
        self.upsert = ins.on_duplicate_key_update(
            [(name, func.if_(expired, ins.inserted[name], _L[name])) for name in names]
        )
        self.holder = select(*_LOCK_COLUMNS, _L.token, self.now.label("now")).where(
            _L.key == bindparam("b_key")
        )
        self.locked_holder = self.holder.with_for_update()
        self.take_over_stmt = ins.on_duplicate_key_update(
            [(name, ins.inserted[name]) for name in names]
        )

    def acquire(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        for _ in range(_RACE_RETRIES):
            conn.execute(self.upsert, params)
            row = conn.execute(self.holder, params).first()
            if row is not None and row.token == params["b_token"]:
                return None
            if row is not None and row.expires_at > row.now:
                return row
        raise _contention(params["b_key"])

    def take_over(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        with _transaction(conn, "START TRANSACTION"):
            row = conn.execute(self.locked_holder, params).first()
            conn.execute(self.take_over_stmt, params)
        return row

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        ins = mysql.insert(counter_table).values(rows)
        return ins.on_duplicate_key_update(count=_C.count + ins.inserted.count)


class _MariaDB(_MySQL):
    """MariaDB ≥ 10.5: the upsert returns the row, so acquire is one statement."""

    def __init__(self) -> None:
        super().__init__()
        self.upsert_returning = self.upsert.returning(
            *_LOCK_COLUMNS, _L.token, self.now.label("now")
        )

    def acquire(self, conn: Connection, params: dict[str, Any]) -> Row[Any] | None:
        row = conn.execute(self.upsert_returning, params).one()
        return None if row.token == params["b_token"] else row


def _fetch_all(
    statement: str, params: dict[str, Any], dialect: _Dialect, conn: Connection
) -> Sequence[Row[Any]]:
    """Run one of ``dialect``'s statements and fetch every row."""
    return conn.execute(getattr(dialect, statement), params).fetchall()


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``!``) matching keys that start with ``prefix``."""
    escaped = prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_")
    return escaped + "%"


def _contention(key: str) -> StoreUnavailable:
    # Unreachable in practice: every retry means another writer changed this
    # very row during our statement. Reported as an outage so that
    # dedup_fallback decides, rather than failing the caller.
    return StoreUnavailable(
        f"lock store sql gave up on {key!r}: it changed under concurrent writers "
        f"{_RACE_RETRIES} times in a row",
        store="sql",
    )


@contextmanager
def _transaction(conn: Connection, begin: str) -> Iterator[None]:
    """An explicit transaction on an autocommit connection."""
    conn.exec_driver_sql(begin)
    try:
        yield
    except BaseException:
        with suppress(DBAPIError):
            conn.exec_driver_sql("ROLLBACK")
        raise
    conn.exec_driver_sql("COMMIT")


def _pick_dialect(engine: Engine) -> _Dialect:
    dialect = engine.dialect
    version = dialect.server_version_info or ()
    if dialect.name == "postgresql":
        return _Postgres()
    if dialect.name == "sqlite":
        if tuple(version) < (3, 35):
            raise ImproperlyConfigured(E_OLD_SQLITE.format(version=".".join(map(str, version))))
        return _SQLite()
    if dialect.name in ("mysql", "mariadb"):
        if getattr(dialect, "is_mariadb", False) and tuple(version) >= (10, 5):
            return _MariaDB()
        return _MySQL()
    raise ImproperlyConfigured(
        f"The SQL lock store supports PostgreSQL, MySQL/MariaDB and SQLite, not {dialect.name}"
    )


def _set_utc(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET time_zone = '+00:00'")
    finally:
        cursor.close()
