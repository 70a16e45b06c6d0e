"""Schema and per-dialect SQL of the SQL lock store.

Three tables (``celery_dedup_sql_lock``, ``celery_dedup_sql_revoked``,
``celery_dedup_sql_counter``) and one ``_Dialect`` per database family, each
building the single statement (or the shortest transaction) an operation
needs: PostgreSQL, SQLite, MySQL and MariaDB. Statements are written in
SQLAlchemy Core and rendered once per store for its engine (``_Statement``);
each call then only binds values. ``stores/sql.py`` holds the store that
runs them (through a ``_Runner``) and retries lost races. Run records
(``RunRecords``) are rows of the lock table at ``RunRef.record``, owned by
the copy's delivery token: a lease (``RUNNING_POLICY``) or a done marker
(``DONE_POLICY``).
"""

from __future__ import annotations

import sqlite3
from collections import namedtuple
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any, NamedTuple, Protocol, TypeVar

from kombu.utils.url import maybe_sanitize_url
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    Index,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    cast,
    delete,
    exists,
    false,
    func,
    literal_column,
    null,
    or_,
    select,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    MultipleResultsFound,
    NoResultFound,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.expression import (
    CTE,
    ColumnElement,
    CompoundSelect,
    Executable,
    ReturnsRows,
    Select,
    bindparam,
)

from ..exceptions import ImproperlyConfigured, StoreContention
from . import E_MISSING_DRIVER
from .base import (
    DONE_POLICY,
    FENCE_TTL,
    REVOKED_PREFIX,
    RUNNING_POLICY,
    ClaimOutcome,
    RevokeOutcome,
    RunOutcome,
)

__all__ = [
    "COUNTER_TABLE",
    "FENCE_TABLE",
    "GATE_WAIT_TABLE",
    "LOCK_TABLE",
    "REVOKED_TABLE",
    "counter_table",
    "fence_table",
    "gate_wait_table",
    "lock_table",
    "metadata",
    "revoked_table",
]


T = TypeVar("T")
#: the engine's ``schema_translate_map`` execution option, if any
SchemaMap = Mapping[str | None, str | None] | None

LOCK_TABLE = "celery_dedup_sql_lock"
REVOKED_TABLE = "celery_dedup_sql_revoked"
COUNTER_TABLE = "celery_dedup_sql_counter"
GATE_WAIT_TABLE = "celery_dedup_sql_gate_wait"
FENCE_TABLE = "celery_dedup_sql_fence"
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
E_CONTENTION = (
    "lock store sql gave up on {key!r}: concurrent writers kept winning the race "
    "({tries} tries); nothing was written"
)

#: How many times an operation is re-run when a concurrent writer changed the
#: row between the statement's snapshot and its write (rare; see _Postgres).
_RACE_RETRIES = 20

#: MySQL/MariaDB errors of a lost race: lock wait timeout, deadlock, and
#: "record has changed since last read" (MariaDB's snapshot isolation).
_MYSQL_CONTENTION = frozenset({1205, 1213, 1020})
#: PostgreSQL SQLSTATEs of a lost race: serialization failure, deadlock, lock timeout.
_POSTGRES_CONTENTION = frozenset({"40001", "40P01", "55P03"})
#: SQLite's SQLITE_BUSY and SQLITE_LOCKED ("database is locked").
_SQLITE_CONTENTION = frozenset({5, 6})
#: The same errors by message, for Python 3.10, whose sqlite3 errors carry no code.
_SQLITE_CONTENTION_MESSAGES = ("database is locked", "database table is locked")


def is_contention(exc: BaseException) -> bool:
    """Whether a driver error is a lost race with concurrent writers (retry), not an outage."""
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    if orig is None:
        return False
    # MySQL drivers carry the server's error number first (and a generic
    # SQLSTATE), sqlite3 its result code, PostgreSQL drivers the SQLSTATE.
    code = orig.args[0] if orig.args else None
    if isinstance(code, int):
        return code in _MYSQL_CONTENTION
    sqlite_code = getattr(orig, "sqlite_errorcode", None)
    if sqlite_code is not None:
        return sqlite_code & 0xFF in _SQLITE_CONTENTION
    if isinstance(orig, sqlite3.Error):  # Python 3.10: no sqlite_errorcode
        return any(text in str(orig) for text in _SQLITE_CONTENTION_MESSAGES)
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return sqlstate in _POSTGRES_CONTENTION


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
    #: the owner token of the publish holding the lock
    Column("owner", _varchar(255), nullable=False),
    Column("task_id", _varchar(255), nullable=False),
    Column("task_name", _varchar(255), nullable=False),
    Column("policy", _varchar(32), nullable=False),
    Column("started", Boolean(), nullable=False),
    # A random value per write of a new holder: MySQL cannot return the row's
    # previous values, so a statement tells its own write from an older one
    # by this.
    Column("token", _varchar(32), nullable=False),
    Column("acquired_at", Double(), nullable=False),
    Column("expires_at", Double(), nullable=False),
    Index(f"ix_{LOCK_TABLE}_expires_at", "expires_at"),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

#: One row per revoked owner token (``revoked_marker_key``), until it expires.
revoked_table = Table(
    REVOKED_TABLE,
    metadata,
    Column("key", _varchar(KEY_LENGTH), primary_key=True),
    Column("expires_at", Double(), nullable=False),
    Index(f"ix_{REVOKED_TABLE}_expires_at", "expires_at"),
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

#: One row per ``keep_last`` run gate with a follow-up waiting at it (``GateHandoff``,
#: PostgreSQL): the follow-up's message to publish when the gate opens (base64).
gate_wait_table = Table(
    GATE_WAIT_TABLE,
    metadata,
    Column("key", _varchar(KEY_LENGTH), primary_key=True),
    Column("payload", Text(), nullable=False),
    Column("expires_at", Double(), nullable=False),
    Index(f"ix_{GATE_WAIT_TABLE}_expires_at", "expires_at"),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

#: One row per key a fenced claim admitted a run of (``FencedClaims``, PostgreSQL):
#: the last fencing token issued for it, kept ``FENCE_TTL`` after that claim.
fence_table = Table(
    FENCE_TABLE,
    metadata,
    Column("key", _varchar(KEY_LENGTH), primary_key=True),
    Column("fence", BigInteger(), nullable=False),
    Column("expires_at", Double(), nullable=False),
    Index(f"ix_{FENCE_TABLE}_expires_at", "expires_at"),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

_L = lock_table.c
_R = revoked_table.c
_G = gate_wait_table.c
_C = counter_table.c
_F = fence_table.c
#: Columns every statement that reports a lock returns, then the database's now.
_LOCK_COLUMNS = (
    _L.owner,
    _L.task_id,
    _L.task_name,
    _L.policy,
    _L.started,
    _L.acquired_at,
    _L.expires_at,
)


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


def _flag(name: str) -> ColumnElement[bool]:
    return bindparam(name, type_=Boolean())


class _Statement:
    """One statement, rendered once for the store's engine and run as that SQL.

    Calls bind values in the driver's paramstyle and nothing else: no
    compilation, cache key or result metadata per call. Rows are named
    tuples of the driver's own values (no SQLAlchemy type processing:
    ``started`` may be 0/1, MySQL's ``now`` a ``Decimal``), the same on
    either ``_Runner``.
    """

    __slots__ = ("defaults", "order", "row", "sql")

    def __init__(
        self, statement: ReturnsRows, dialect: Dialect, schema_map: SchemaMap = None
    ) -> None:
        options: dict[str, Any] = {}
        if schema_map:
            options["schema_translate_map"] = schema_map
            options["render_schema_translate"] = True
        compiled = statement.compile(dialect=dialect, **options)
        assert isinstance(compiled, SQLCompiler)
        if compiled.literal_execute_params or compiled.post_compile_params:
            raise TypeError(f"statement is rendered per call on {dialect.name}: {compiled}")
        self.sql: str = compiled.string
        #: the bound names in order, for a positional paramstyle
        self.order: tuple[str, ...] | None = (
            tuple(compiled.positiontup or ()) if compiled.positional else None
        )
        #: values SQLAlchemy bound itself (e.g. SQLite's ``OFFSET 0``)
        self.defaults: dict[str, Any] = {
            name: bind.effective_value
            for bind, name in compiled.bind_names.items()
            if not bind.required
        }
        columns = list(statement.exported_columns.keys())
        self.row: type[Any] | None = namedtuple("Row", columns) if columns else None

    def parameters(self, params: Mapping[str, Any]) -> Any:
        """``params`` as the driver takes them for this statement."""
        if self.defaults:
            params = {**self.defaults, **params}
        if self.order is None:
            return params
        return tuple([params[name] for name in self.order])

    def __repr__(self) -> str:
        return f"<_Statement {self.sql!r}>"


class _Result(NamedTuple):
    """What a statement returned: its rows (named tuples) and the rows it matched."""

    rows: list[Any]
    rowcount: int

    def first(self) -> Any:
        """The first row, or ``None``."""
        return self.rows[0] if self.rows else None

    def one(self) -> Any:
        """The only row (an error unless there is exactly one)."""
        if not self.rows:
            raise NoResultFound("No row was found when one was required")
        if len(self.rows) > 1:
            raise MultipleResultsFound("Multiple rows were found when exactly one was required")
        return self.rows[0]


class _Runner(Protocol):
    """Runs rendered statements on one checked-out connection (see ``stores/sql.py``)."""

    #: the SQLAlchemy connection, for the few statements built per call
    connection: Connection

    def __call__(self, statement: _Statement, params: Mapping[str, Any]) -> _Result:
        """Run ``statement`` with ``params``; fetch its rows if it returns any."""

    def sql(self, text: str) -> None:
        """Run a statement without parameters or rows (``BEGIN``, ``COMMIT``…)."""


class _Dialect:
    """The statements of one database family, rendered once per store.

    Bound parameters: ``b_key``, ``b_owner``, ``b_task_id``, ``b_task_name``,
    ``b_policy``, ``b_started``, ``b_token``, ``b_ttl``; ``b_marker`` (the
    revoked marker key); for claims ``b_release`` and ``b_take``; ``b_ttl``
    is NULL for a settle that keeps the expiry.
    """

    #: how "now" reads as epoch seconds, stable within one statement
    now_sql = ""

    def __init__(self, dialect: Dialect, schema_map: SchemaMap = None) -> None:
        self.dialect = dialect
        self.schema_map = schema_map
        self.now: ColumnElement[float] = literal_column(self.now_sql, Double())
        self.live = _L.expires_at > self.now
        self.at_key = _L.key == bindparam("b_key")
        #: the row of ``b_key`` while ``b_owner`` holds it
        self.mine = and_(self.at_key, _L.owner == bindparam("b_owner"), self.live)
        #: the live revoked marker of ``b_owner`` on ``b_key``
        self.marker = and_(_R.key == bindparam("b_marker"), _R.expires_at > self.now)
        self.get = self.render(
            select(*_LOCK_COLUMNS, self.now.label("now")).where(self.at_key, self.live)
        )
        self.release = self.render(delete(lock_table).where(self.mine))
        self.extend = self.render(
            update(lock_table)
            .where(self.mine)
            .values(expires_at=self.now + bindparam("b_ttl", type_=Double()))
        )
        # A NULL ``b_ttl`` keeps the expiry.
        self.settle = self.render(
            update(lock_table)
            .where(self.mine)
            .values(
                started=False,
                expires_at=func.coalesce(
                    self.now + bindparam("b_ttl", type_=Double()), _L.expires_at
                ),
            )
        )
        self.unrevoke = self.render(delete(revoked_table).where(_R.key == bindparam("b_marker")))
        self.scan = self.render(
            select(_L.key, *_LOCK_COLUMNS, self.now.label("now"))
            .where(
                _L.key.like(bindparam("b_pattern", type_=String()), escape="!"),
                _L.key > bindparam("b_after"),
                self.live,
            )
            .order_by(_L.key)
            .limit(bindparam("b_limit"))
        )
        self.reap = self.render(delete(lock_table).where(_L.expires_at <= self.now))
        self.reap_revoked = self.render(delete(revoked_table).where(_R.expires_at <= self.now))
        self.reap_gate_waits = self.render(
            delete(gate_wait_table).where(_G.expires_at <= self.now)
        )
        self.reap_fences = self.render(delete(fence_table).where(_F.expires_at <= self.now))
        self.fence_of = self.render(
            select(_F.fence).where(_F.key == bindparam("b_key"), _F.expires_at > self.now)
        )
        self.read_counts = self.render(
            select(_C.task_name, _C.event, _C.count.label("total")).where(
                _C.prefix == bindparam("b_prefix")
            )
        )
        # Run records: rows of the lock table keyed by ``RunRef.record``, owned
        # by the copy's delivery token (``b_key``/``b_owner`` here).
        self.abandon = self.render(
            delete(lock_table).where(self.mine, _L.policy == bindparam("b_policy"))
        )
        # A gated run's lease and its key's gate (``b_gate``) at once.
        self.abandon_gated = self.render(
            delete(lock_table).where(
                _L.key.in_([bindparam("b_key"), bindparam("b_gate")]),
                _L.owner == bindparam("b_owner"),
                self.live,
                _L.policy == bindparam("b_policy"),
            )
        )
        self.run_record = self.render(
            select(_L.owner, _L.policy, _L.token, _L.expires_at, self.now.label("now")).where(
                _L.key == bindparam("b_record")
            )
        )

    def render(self, statement: ReturnsRows) -> _Statement:
        """``statement`` rendered for the store's engine."""
        return _Statement(statement, self.dialect, self.schema_map)

    def row_values(self) -> dict[str, Any]:
        """The VALUES of a new lock row, on the database's clock."""
        return {
            "key": bindparam("b_key", type_=String()),
            "owner": bindparam("b_owner", type_=String()),
            "task_id": bindparam("b_task_id", type_=String()),
            "task_name": bindparam("b_task_name", type_=String()),
            "policy": bindparam("b_policy", type_=String()),
            "started": _flag("b_started"),
            "token": bindparam("b_token", type_=String()),
            "acquired_at": self.now,
            "expires_at": self.now + bindparam("b_ttl", type_=Double()),
        }

    def run_values(self) -> dict[str, Any]:
        """The VALUES of a run record: ``b_record`` owned by ``b_run_owner`` (the
        delivery token ``b_run``; a done marker's adds how the body ended).

        Its policy is ``b_run_policy`` (lease or done marker), it lives
        ``b_lease`` seconds and is never started.
        """
        return {
            "key": bindparam("b_record", type_=String()),
            "owner": bindparam("b_run_owner", type_=String()),
            "task_id": bindparam("b_task_id", type_=String()),
            "task_name": bindparam("b_task_name", type_=String()),
            "policy": bindparam("b_run_policy", type_=String()),
            "started": false(),
            "token": bindparam("b_run_token", type_=String()),
            "acquired_at": self.now,
            "expires_at": self.now + bindparam("b_lease", type_=Double()),
        }

    def lease_taken(self) -> ColumnElement[bool]:
        """Whether the existing run record may become this copy's lease: lapsed, its own,
        or the lease of the delivery it inherits (``b_inherit``: ``RunRef.inherits``).
        """
        return or_(
            _L.expires_at <= self.now,
            _L.owner == bindparam("b_run", type_=String()),
            and_(_L.owner == bindparam("b_inherit", type_=String()), _L.policy == RUNNING_POLICY),
        )

    def renew_runs(self, run: _Runner, pairs: Sequence[tuple[str, str]], lease: float) -> int:
        """One ``UPDATE`` renewing the live leases of ``(record, delivery token)`` pairs.

        Built per call (Core: the list's length varies); how many it renewed.
        """
        statement = (
            update(lock_table)
            .where(
                tuple_(_L.key, _L.owner).in_(list(pairs)),
                _L.policy == RUNNING_POLICY,
                self.live,
            )
            .values(expires_at=self.now + bindparam("b_renew", float(lease), type_=Double()))
        )
        return run.connection.execute(statement).rowcount

    def marker_values(self) -> dict[str, Any]:
        """The VALUES of a revoked marker living ``b_ttl`` seconds."""
        return {
            "key": bindparam("b_marker", type_=String()),
            "expires_at": self.now + bindparam("b_ttl", type_=Double()),
        }

    def acquire(self, run: _Runner, params: dict[str, Any]) -> Any:
        """Take the key; ``None`` when taken, else the holder's row."""
        raise NotImplementedError

    def acquire_many(self, run: _Runner, items: Sequence[dict[str, Any]]) -> list[Any]:
        """``acquire`` for each item on one connection: one statement each (a dialect
        without one statement for many)."""
        return [self.acquire(run, params) for params in items]

    def take_over(self, run: _Runner, params: dict[str, Any]) -> Any:
        """Become the holder; the previous row (live or not), or ``None``."""
        raise NotImplementedError

    def take_over_queued(self, run: _Runner, params: dict[str, Any]) -> Any:
        """``take_over`` unless a live started holder holds the key (returned, nothing written)."""
        raise NotImplementedError

    def take_over_revoking(
        self, run: _Runner, params: dict[str, Any], *, queued_only: bool
    ) -> tuple[Any, bool]:
        """``take_over`` (``take_over_queued`` when ``queued_only``), revoking the displaced
        owner (``b_revoked_ttl``) when the dialect can in the same statement.

        Returns the previous row and whether its marker was written: when
        not, the store revokes it in a statement of its own.
        """
        take = self.take_over_queued if queued_only else self.take_over
        return take(run, params), False

    def claim(self, run: _Runner, params: dict[str, Any]) -> tuple[ClaimOutcome, Any]:
        """The start check; the outcome and, for ``HELD``, the holder's row."""
        raise NotImplementedError

    def revoke(self, run: _Runner, params: dict[str, Any]) -> RevokeOutcome:
        """Write the revoked marker and release an unstarted holder."""
        raise NotImplementedError

    def claim_run(
        self, run: _Runner, params: dict[str, Any]
    ) -> tuple[RunOutcome, tuple[ClaimOutcome, Any] | None]:
        """Take the lease, then the start claim; ``claim``'s answer when begun."""
        raise NotImplementedError

    def end_run(self, run: _Runner, params: dict[str, Any]) -> bool:
        """Write the done marker, then release (``b_release``) or settle (``b_settle``)."""
        raise NotImplementedError

    def end_run_in_turn(self, run: _Runner, params: dict[str, Any]) -> tuple[bool, str | None]:
        """``end_run``, with the payload its gate's opening woke (a gate-keeping dialect)."""
        return self.end_run(run, params), None

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        """One statement adding ``rows`` to the counters (built per call: Core)."""
        raise NotImplementedError


class _Postgres(_Dialect):
    """Every operation is one statement: data-modifying CTEs."""

    # statement_timestamp() is fixed for the statement; clock_timestamp()
    # would move between the VALUES and the WHERE of one upsert.
    now_sql = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"

    def __init__(self, dialect: Dialect, schema_map: SchemaMap = None) -> None:
        super().__init__(dialect, schema_map)
        values = self.row_values()
        new = {name: value for name, value in values.items() if name != "key"}
        ins = postgresql.insert(lock_table).values(**values)
        taken = self._take_lapsed(ins, new)
        # The second branch reads the holder in the statement's snapshot, so a
        # row committed after the snapshot is missed (no row) or seen in an
        # older version (expired): acquire() re-runs the statement for those.
        # A taken key returns no holder columns: nothing to send or decode.
        held = select(false(), *_LOCK_COLUMNS, self.now).where(
            self.at_key, ~exists(select(taken.c.key))
        )
        self.acquire_stmt = self.render(
            select(
                true().label("taken"),
                *(null().label(column.name) for column in _LOCK_COLUMNS),
                self.now.label("now"),
            )
            .select_from(taken)
            .union_all(held)
        )

        self.acquire_many_stmt = self.render(self._acquire_many_statement(new))

        # UPDATE … FROM (SELECT … FOR UPDATE) returns the row's values before
        # the update, re-read after waiting for a concurrent writer.
        old = select(lock_table).where(self.at_key).with_for_update().subquery("old")
        replaced = (
            update(lock_table)
            .where(_L.key == old.c.key)
            .values(new)
            .returning(*(old.c[c.name] for c in _LOCK_COLUMNS))
            .cte("replaced")
        )
        inserted = (
            postgresql.insert(lock_table)
            .from_select(
                list(values),
                select(*values.values()).where(~exists(select(replaced.c.owner))),
            )
            .on_conflict_do_nothing(index_elements=[_L.key])
            .returning(_L.owner)
            .cte("inserted")
        )
        blanks = [null()] * (len(_LOCK_COLUMNS) - 1)
        take_over = select(true().label("replaced"), *replaced.c, self.now.label("now")).union_all(
            select(false(), inserted.c.owner, *blanks, self.now)
        )
        self.take_over_stmt = self.render(take_over)
        self.take_over_revoking_stmt = self.render(take_over.add_cte(self._revoked(replaced)))
        queued, taken = self._take_over_queued_statement(values, new)
        self.take_over_queued_stmt = self.render(queued)
        self.take_over_queued_revoking_stmt = self.render(queued.add_cte(self._revoked(taken)))

        self.claim_stmt = self.render(self._claim_statement(values, new))
        self.claim_fenced_stmt = self.render(self._claim_statement(values, new, fence=True))
        self.revoke_stmt = self.render(self._revoke_statement())
        self.claim_run_stmt = self.render(self._claim_run_statement(values, new))
        self.claim_run_fenced_stmt = self.render(
            self._claim_run_statement(values, new, fence=True)
        )
        self.end_run_stmt = self.render(self._end_run_statement())
        # renew_runs: two arrays, so the statement is rendered once and
        # planned as a join, whatever the number of runs.
        runs = func.unnest(
            bindparam("b_records", type_=postgresql.ARRAY(String())),
            bindparam("b_runs", type_=postgresql.ARRAY(String())),
        ).table_valued("record", "run").render_derived(name="runs")
        self.renew_stmt = self.render(
            update(lock_table)
            .where(
                _L.key == runs.c.record,
                _L.owner == runs.c.run,
                _L.policy == RUNNING_POLICY,
                self.live,
            )
            .values(expires_at=self.now + bindparam("b_lease", type_=Double()))
        )

    def _acquire_many_statement(self, new: dict[str, Any]) -> Select[Any]:
        """``acquire`` for every row of eight arrays (``b_keys``…``b_ttls``), one statement.

        The rows are inserted in key order (two bulk calls never wait on
        each other in a cycle); a row answers ``taken`` or its holder as
        read in the statement's snapshot (``acquire_many`` runs again the
        rows whose holder committed after it).
        """
        arrays: dict[str, Any] = {
            "key": String(), "owner": String(), "task_id": String(), "task_name": String(),
            "policy": String(), "started": Boolean(), "token": String(), "ttl": Double(),
        }  # fmt: skip
        rows = (
            func.unnest(
                *(
                    bindparam(f"b_{name}s", type_=postgresql.ARRAY(kind))
                    for name, kind in arrays.items()
                )
            )
            .table_valued(*arrays, with_ordinality="ord")
            .render_derived(name="rows")
        )
        items = select(rows).cte("items")
        columns = [name for name in arrays if name != "ttl"]
        ins = postgresql.insert(lock_table).from_select(
            [*columns, "acquired_at", "expires_at"],
            select(
                *(items.c[name] for name in columns), self.now, self.now + items.c.ttl
            ).order_by(items.c.key),
        )
        taken = self._take_lapsed(ins, new)
        return (
            select(
                items.c.ord,
                taken.c.key.is_not(None).label("taken"),
                *_LOCK_COLUMNS,
                self.now.label("now"),
            )
            .select_from(
                items.outerjoin(taken, taken.c.key == items.c.key).outerjoin(
                    lock_table, and_(_L.key == items.c.key, taken.c.key.is_(None))
                )
            )
            .order_by(items.c.ord)
        )

    def _take_lapsed(self, ins: postgresql.Insert, columns: Iterable[str]) -> CTE:
        """``ins``, overwriting ``columns`` of a lock whose TTL lapsed; the keys it wrote."""
        return (
            ins.on_conflict_do_update(
                index_elements=[_L.key],
                set_={name: ins.excluded[name] for name in columns},
                where=_L.expires_at <= self.now,
            )
            .returning(_L.key)
            .cte("taken")
        )

    def _revoked(self, displaced: CTE) -> CTE:
        """The upsert of the revoked marker of the live owner a take-over CTE displaced.

        Its key is ``revoked_marker_key`` computed here: the hex SHA-256 of
        the key, a NUL byte and the owner, as UTF-8. It lives the longer of
        the holder's remaining time and ``b_revoked_ttl``; a longer marker
        is kept (as ``revoke``).
        """
        utf8: ColumnElement[str] = literal_column("'UTF8'", String())
        nul = func.decode(literal_column("'00'"), literal_column("'hex'"), type_=LargeBinary())
        text = (
            func.convert_to(cast(bindparam("b_key"), String()), utf8, type_=LargeBinary())
            .op("||", return_type=LargeBinary())(nul)
            .op("||", return_type=LargeBinary())(
                func.convert_to(displaced.c.owner, utf8, type_=LargeBinary())
            )
        )
        digest = func.encode(func.sha256(text, type_=LargeBinary()), literal_column("'hex'"))
        marker = literal_column(f"'{REVOKED_PREFIX}'", String()).op("||", return_type=String())(
            digest
        )
        remaining = displaced.c.expires_at - self.now
        ins = postgresql.insert(revoked_table).from_select(
            ["key", "expires_at"],
            select(
                marker,
                self.now + func.greatest(remaining, bindparam("b_revoked_ttl", type_=Double())),
            ).where(displaced.c.owner != bindparam("b_owner"), displaced.c.expires_at > self.now),
        )
        return (
            ins.on_conflict_do_update(
                index_elements=[_R.key],
                set_={"expires_at": func.greatest(_R.expires_at, ins.excluded.expires_at)},
            )
            .returning(_R.key)
            .cte("revoked")
        )

    def _take_over_queued_statement(
        self, values: dict[str, Any], new: dict[str, Any]
    ) -> tuple[CompoundSelect[Any], CTE]:
        """As ``take_over_stmt``, but a live started holder keeps the key (and is returned);
        with the CTE of the row it took over (for ``_revoked``).

        The locking read is a CTE, read once by the three branches: the row
        as it is after waiting for a concurrent writer (a claim that started
        the holder meanwhile), so the started test sees what the update
        would overwrite.
        """
        old = select(lock_table).where(self.at_key).with_for_update().cte("old")
        queued = or_(~old.c.started, old.c.expires_at <= self.now)
        previous = [old.c[c.name] for c in _LOCK_COLUMNS]
        taken = (
            update(lock_table)
            .where(_L.key == old.c.key, queued)
            .values(new)
            .returning(*previous)
            .cte("taken")
        )
        inserted = (
            postgresql.insert(lock_table)
            .from_select(
                list(values),
                select(*values.values()).where(~exists(select(old.c.key))),
            )
            .on_conflict_do_nothing(index_elements=[_L.key])
            .returning(_L.owner)
            .cte("inserted")
        )
        blanks = [null()] * (len(_LOCK_COLUMNS) - 1)
        statement = select(true().label("replaced"), *taken.c, self.now.label("now")).union_all(
            select(true(), *previous, self.now).where(~queued),
            select(false(), inserted.c.owner, *blanks, self.now),
        )
        return statement, taken

    def _run_upsert(
        self,
        where: ColumnElement[bool] | None,
        *,
        at: str = "b_record",
        only_if: ColumnElement[bool] | None = None,
    ) -> Insert:
        """Insert the run record (or the gate: ``at="b_gate"``), or overwrite it
        (when ``where`` holds); nothing at all unless ``only_if`` holds.
        """
        run_values = {**self.run_values(), "key": bindparam(at, type_=String())}
        if only_if is None:
            ins = postgresql.insert(lock_table).values(**run_values)
        else:
            ins = postgresql.insert(lock_table).from_select(
                list(run_values), select(*run_values.values()).where(only_if)
            )
        return ins.on_conflict_do_update(
            index_elements=[_L.key],
            set_={name: ins.excluded[name] for name in run_values if name != "key"},
            where=where,
        )

    def _claim_run_statement(
        self, values: dict[str, Any], new: dict[str, Any], *, fence: bool = False
    ) -> Select[Any]:
        # The record's holder in the snapshot, for RUNNING or DONE.
        record = (
            select(_L.owner, _L.policy, _L.expires_at)
            .where(_L.key == bindparam("b_record"))
            .cte("record")
        )
        inherited = and_(
            record.c.owner == bindparam("b_inherit", type_=String()),
            record.c.policy == RUNNING_POLICY,
        )
        busy = exists(
            select(record.c.owner).where(
                record.c.owner != bindparam("b_run", type_=String()),
                ~inherited,
                record.c.expires_at > self.now,
            )
        )
        # A gated run takes its key's gate first (lapsed, or its own), unless
        # another copy of its attempt holds the record; the lease only then.
        gated = _flag("b_gated")
        gate = (
            self._run_upsert(self.lease_taken(), at="b_gate", only_if=and_(gated, ~busy))
            .returning(_L.key)
            .cte("gate")
        )
        gate_taken = exists(select(gate.c.key))
        # The lease next: every write of the claim waits for its answer
        # (they read it), so the record's row is always locked before the
        # key's, as end_run does.
        lease = (
            self._run_upsert(self.lease_taken(), only_if=or_(~gated, gate_taken))
            .returning(_L.key)
            .cte("lease")
        )
        begun = exists(select(lease.c.key))
        return self._claim_statement(values, new, begun, fence=fence).add_columns(
            begun.label("begun"),
            gate_taken.label("gate_taken"),
            select(record.c.owner).scalar_subquery().label("run_owner"),
            select(record.c.policy).scalar_subquery().label("run_policy"),
            select(record.c.expires_at).scalar_subquery().label("run_expires_at"),
        )

    def _end_run_statement(self) -> Select[Any]:
        done = self._run_upsert(None).returning(_L.key).cte("done")
        # A gated run opens its key's gate in the same statement.
        opened = (
            delete(lock_table)
            .where(
                _flag("b_gated"),
                _L.key == bindparam("b_gate", type_=String()),
                _L.owner == bindparam("b_run", type_=String()),
                _L.policy == RUNNING_POLICY,
            )
            .returning(_L.key)
            .cte("opened")
        )
        written = exists(select(done.c.key))
        gone = (
            delete(lock_table)
            .where(self.mine, _flag("b_release"), written)
            .returning(_L.key)
            .cte("gone")
        )
        settled = (
            update(lock_table)
            .where(self.mine, _flag("b_settle"), written)
            .values(started=False)
            .returning(_L.key)
            .cte("settled")
        )
        # The gate it opened goes to the follow-up waiting at it (``GateHandoff``).
        woken = (
            delete(gate_wait_table)
            .where(
                _G.key == bindparam("b_gate", type_=String()),
                exists(select(opened.c.key)),
                _G.expires_at > self.now,
            )
            .returning(_G.payload)
            .cte("woken")
        )
        return select(
            or_(exists(select(gone.c.key)), exists(select(settled.c.key))).label("held"),
            select(woken.c.payload).scalar_subquery().label("woken"),
        ).add_cte(done, opened, woken)

    def _claim_statement(
        self,
        values: dict[str, Any],
        new: dict[str, Any],
        gate: ColumnElement[bool] | None = None,
        *,
        fence: bool = False,
    ) -> Select[Any]:
        # Every CTE reads one snapshot; the DELETE, UPDATE and INSERT see the
        # latest row (re-checked after waiting for a concurrent writer).
        # claim() re-runs the statement when the two disagree.
        rev = select(_R.key).where(self.marker).cte("rev")
        revoked = exists(select(rev.c.key))
        current = select(*_LOCK_COLUMNS).where(self.at_key, self.live).cte("current")
        release = _flag("b_release")
        # claim_run: no write unless the lease was taken.
        gated = () if gate is None else (gate,)
        gone = (
            delete(lock_table)
            .where(self.mine, *gated, or_(release, revoked))
            .returning(_L.key)
            .cte("gone")
        )
        marked = (
            update(lock_table)
            .where(self.mine, *gated, ~release, ~revoked)
            .values(started=True)
            .returning(_L.key)
            .cte("marked")
        )
        fresh = postgresql.insert(lock_table).from_select(
            list(values),
            select(*values.values()).where(
                *gated, _flag("b_take"), ~revoked, ~exists(select(current.c.owner))
            ),
        )
        taken = (
            fresh.on_conflict_do_update(
                index_elements=[_L.key],
                set_={name: fresh.excluded[name] for name in new},
                where=_L.expires_at <= self.now,
            )
            .returning(_L.key)
            .cte("taken")
        )
        owned = or_(exists(select(gone.c.key)), exists(select(marked.c.key)))
        answer = select(
            revoked.label("revoked"),
            owned.label("owned"),
            exists(select(taken.c.key)).label("taken"),
            *(select(column).scalar_subquery().label(column.name) for column in current.c),
            self.now.label("now"),
        )
        if not fence:
            return answer
        # Exactly the answers _claim_answer reads as OWNED or FREE (the body
        # runs): owned, taken, or no holder and nothing to take.
        runs = and_(
            *gated,
            ~revoked,
            or_(
                owned,
                exists(select(taken.c.key)),
                and_(~_flag("b_take"), ~exists(select(current.c.owner))),
            ),
        )
        fenced = self._fence(runs)
        return answer.add_columns(select(fenced.c.fence).scalar_subquery().label("fence"))

    def _fence(self, runs: ColumnElement[bool]) -> CTE:
        """The upsert of ``b_key``'s fence counter when ``runs`` holds: the next fence,
        ``max(last + 1, now in microseconds)``, kept ``FENCE_TTL`` seconds.

        ``ON CONFLICT DO UPDATE`` locks the counter's row: concurrent claims
        of one key take their fences one after the other, each from the
        other's. A lapsed counter still counts (never below its last fence).
        """
        micros = cast(
            func.floor(literal_column("EXTRACT(EPOCH FROM statement_timestamp())") * 1_000_000),
            BigInteger(),
        )
        ins = postgresql.insert(fence_table).from_select(
            ["key", "fence", "expires_at"],
            select(bindparam("b_key", type_=String()), micros, self.now + FENCE_TTL).where(runs),
        )
        return (
            ins.on_conflict_do_update(
                index_elements=[_F.key],
                set_={
                    "fence": func.greatest(_F.fence + 1, ins.excluded.fence),
                    "expires_at": ins.excluded.expires_at,
                },
            )
            .returning(_F.fence)
            .cte("fenced")
        )

    def _revoke_statement(self) -> Select[Any]:
        ins = postgresql.insert(revoked_table).values(**self.marker_values())
        marker = (
            ins.on_conflict_do_update(
                index_elements=[_R.key],
                set_={"expires_at": func.greatest(_R.expires_at, ins.excluded.expires_at)},
            )
            .returning(_R.key)
            .cte("marker")
        )
        current = select(_L.started).where(self.mine).cte("current")
        gone = delete(lock_table).where(self.mine, ~_L.started).returning(_L.key).cte("gone")
        return select(
            exists(select(gone.c.key)).label("released"),
            select(current.c.started).scalar_subquery().label("started"),
        ).add_cte(marker)

    def acquire(self, run: _Runner, params: dict[str, Any]) -> Any:
        for _ in range(_RACE_RETRIES):
            row = run(self.acquire_stmt, params).first()
            if row is None or (not row.taken and row.expires_at <= row.now):
                continue
            return None if row.taken else row
        raise _contention(params["b_key"])

    def acquire_many(self, run: _Runner, items: Sequence[dict[str, Any]]) -> list[Any]:
        answers: list[Any] = [None] * len(items)
        pending = list(range(len(items)))
        for _ in range(_RACE_RETRIES):
            arrays = {
                f"{name}s": [items[i][name] for i in pending]
                for name in (
                    "b_key", "b_owner", "b_task_id", "b_task_name", "b_policy", "b_started",
                    "b_token", "b_ttl",
                )
            }  # fmt: skip
            again = []
            for row in run(self.acquire_many_stmt, arrays).rows:
                index = pending[int(row.ord) - 1]
                if not row.taken and (row.owner is None or row.expires_at <= row.now):
                    again.append(index)  # a holder committed after the snapshot
                else:
                    answers[index] = None if row.taken else row
            if not again:
                return answers
            pending = again
        raise _contention(items[pending[0]]["b_key"])

    def take_over(self, run: _Runner, params: dict[str, Any]) -> Any:
        return self._take_over(run, self.take_over_stmt, params)

    def take_over_queued(self, run: _Runner, params: dict[str, Any]) -> Any:
        return self._take_over(run, self.take_over_queued_stmt, params)

    def take_over_revoking(
        self, run: _Runner, params: dict[str, Any], *, queued_only: bool
    ) -> tuple[Any, bool]:
        if queued_only:
            return self._take_over(run, self.take_over_queued_revoking_stmt, params), True
        return self._take_over(run, self.take_over_revoking_stmt, params), True

    @staticmethod
    def _take_over(run: _Runner, statement: _Statement, params: dict[str, Any]) -> Any:
        for _ in range(_RACE_RETRIES):
            row = run(statement, params).first()
            if row is None:
                # Inserted by another writer after our snapshot: run again.
                continue
            return row if row.replaced else None
        raise _contention(params["b_key"])

    def claim(self, run: _Runner, params: dict[str, Any]) -> tuple[ClaimOutcome, Any]:
        outcome, holder, _ = self.claim_fenced(run, params, fence=False)
        return outcome, holder

    def claim_fenced(
        self, run: _Runner, params: dict[str, Any], *, fence: bool = True
    ) -> tuple[ClaimOutcome, Any, int | None]:
        """``claim``, with the fence its statement issued (``FencedClaims``; ``None``
        unless the answer is ``OWNED`` or ``FREE``)."""
        statement = self.claim_fenced_stmt if fence else self.claim_stmt
        for _ in range(_RACE_RETRIES):
            row = run(statement, params).one()
            answer = _claim_answer(row, params)
            if answer is not None:
                return (*answer, _fence_of(row, fence))
            # Our row changed, or another writer inserted the key, after the
            # snapshot: run again.
        raise _contention(params["b_key"])

    def claim_run(
        self, run: _Runner, params: dict[str, Any]
    ) -> tuple[RunOutcome, tuple[ClaimOutcome, Any] | None]:
        outcome, answer, _ = self.claim_run_fenced(run, params, fence=False)
        return outcome, answer

    def claim_run_fenced(
        self, run: _Runner, params: dict[str, Any], *, fence: bool = True
    ) -> tuple[RunOutcome, tuple[ClaimOutcome, Any] | None, int | None]:
        """``claim_run``, with the fence its statement issued (see ``claim_fenced``)."""
        statement = self.claim_run_fenced_stmt if fence else self.claim_run_stmt
        for _ in range(_RACE_RETRIES):
            row = run(statement, params).one()
            if row.begun:
                answer = _claim_answer(row, params)
                if answer is not None:
                    return RunOutcome.BEGUN, answer, _fence_of(row, fence)
                # As for claim; the lease is ours now, so running the
                # statement again takes it again (its own).
                continue
            if row.gate_taken:
                # A copy's record was written after the snapshot: this copy
                # does not run (now), so the gate it took goes back.
                gate = {"b_key": params["b_gate"], "b_owner": params["b_run"]}
                run(self.abandon, {**gate, "b_policy": RUNNING_POLICY})
            inherited = row.run_owner == params["b_inherit"] and row.run_policy == RUNNING_POLICY
            if (
                row.run_owner is not None
                and row.run_owner != params["b_run"]
                and not inherited
                and row.run_expires_at > row.now
            ):
                done = row.run_policy == DONE_POLICY
                return (RunOutcome.DONE if done else RunOutcome.RUNNING), None, None
            if params["b_gated"] and not row.gate_taken:
                return RunOutcome.WAITING, None, None  # another run of the key holds the gate
            # The record was written after the snapshot: run again.
        raise _contention(params["b_key"])

    def end_run(self, run: _Runner, params: dict[str, Any]) -> bool:
        return bool(run(self.end_run_stmt, params).one().held)

    def end_run_in_turn(self, run: _Runner, params: dict[str, Any]) -> tuple[bool, str | None]:
        """``end_run``, with the payload of the follow-up its gate's opening woke."""
        row = run(self.end_run_stmt, params).one()
        return bool(row.held), row.woken

    def renew_runs(self, run: _Runner, pairs: Sequence[tuple[str, str]], lease: float) -> int:
        params = {
            "b_records": [record for record, _ in pairs],
            "b_runs": [token for _, token in pairs],
            "b_lease": float(lease),
        }
        return run(self.renew_stmt, params).rowcount

    def revoke(self, run: _Runner, params: dict[str, Any]) -> RevokeOutcome:
        for _ in range(_RACE_RETRIES):
            row = run(self.revoke_stmt, params).one()
            if row.released:
                return RevokeOutcome.RELEASED
            if row.started is None:
                return RevokeOutcome.NOT_HELD
            if row.started:
                return RevokeOutcome.RUNNING
            # Unstarted in the snapshot, yet not deleted: it started or went
            # meanwhile. The marker upsert is idempotent: run again.
        raise _contention(params["b_key"])

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        ins = postgresql.insert(counter_table).values(rows)
        return ins.on_conflict_do_update(
            index_elements=[_C.prefix, _C.task_name, _C.event],
            set_={"count": _C.count + ins.excluded.count},
        )


class _Transactional(_Dialect):
    """Claim, revoke and take-over as short transactions (SQLite, MySQL, MariaDB).

    Every transaction takes its row locks in one order, so two of them never
    deadlock: first the owner's revoked marker (claim and revoke; InnoDB
    locks the gap where a missing one would go), then the key's row. The
    key's row is locked by an upsert that inserts the new row or keeps the
    existing one: unlike a locking read of a missing row it takes no gap
    lock, so concurrent first inserts never deadlock; the row's ``token``
    then tells which happened. The one-statement start check reads the
    marker first too (it runs its subquery before it locks the row).
    """

    #: the statement opening a transaction
    begin = ""

    def __init__(self, dialect: Dialect, schema_map: SchemaMap = None) -> None:
        super().__init__(dialect, schema_map)
        unrevoked = ~exists(select(_R.key).where(self.marker))
        # The holder starting, with no marker: the common claim, one statement.
        self.start_mine = self.render(
            update(lock_table).where(self.mine, unrevoked).values(started=True)
        )
        self.release_mine = self.render(delete(lock_table).where(self.mine, unrevoked))
        self.locked_marker = self.render(select(_R.key).where(self.marker).with_for_update())

        values = self.row_values()
        self.insert_or_keep = self.render(self.build_insert_or_keep(values))
        self.locked_row = self.render(
            select(*_LOCK_COLUMNS, _L.token, self.now.label("now"))
            .where(self.at_key)
            .with_for_update()
        )
        self.drop = self.render(delete(lock_table).where(self.at_key))
        self.start = self.render(update(lock_table).where(self.at_key).values(started=True))
        self.replace = self.render(
            update(lock_table)
            .where(self.at_key)
            .values({name: value for name, value in values.items() if name != "key"})
        )
        self.mark_revoked = self.render(self.build_mark_revoked())
        self.lease = self.render(self.build_run_upsert(self.lease_taken()))
        self.done = self.render(self.build_run_upsert(None))
        # Gate waiters (``GateWaiters``): the gate is a lock row (``b_key``) whose
        # started flag, never set on a run record otherwise, says a follow-up is
        # listed in the gate-wait table; an opening without one is one DELETE.
        self.open_unlisted = self.render(delete(lock_table).where(self.mine, _L.started == false()))
        self.flag_listed = self.render(update(lock_table).where(self.at_key).values(started=True))
        self.gate_wait_upsert = self.render(self.build_gate_wait_upsert())
        self.locked_gate_wait = self.render(
            select(_G.payload)
            .where(_G.key == bindparam("b_key", type_=String()), _G.expires_at > self.now)
            .with_for_update()
        )
        self.drop_gate_wait = self.render(
            delete(gate_wait_table).where(_G.key == bindparam("b_key", type_=String()))
        )

    def build_insert_or_keep(self, values: dict[str, Any]) -> Insert:
        """Insert the new row, or leave the existing one as it is (locked)."""
        raise NotImplementedError

    def build_run_upsert(self, where: ColumnElement[bool] | None) -> Insert:
        """Insert the run record, or overwrite it (when ``where`` holds, else always)."""
        raise NotImplementedError

    def build_gate_wait_upsert(self) -> Insert:
        """List ``b_payload`` at the gate ``b_key`` for ``b_life`` seconds (a newer one replaces
        an older one)."""
        raise NotImplementedError

    def gate_wait_values(self) -> dict[str, Any]:
        """The VALUES of a gate-wait row."""
        return {
            "key": bindparam("b_key", type_=String()),
            "payload": bindparam("b_payload", type_=Text()),
            "expires_at": self.now + bindparam("b_life", type_=Double()),
        }

    def list_gate_waiter(self, run: _Runner, params: dict[str, Any]) -> bool:
        """List the follow-up while another owner holds the gate: a transaction that
        locks the gate's row first, so an opening waits for it or it finds the gate open."""
        with _transaction(run, self.begin):
            row = run(self.locked_row, params).first()
            if row is None or row.expires_at <= row.now or row.owner == params["b_owner"]:
                return False
            run(self.gate_wait_upsert, params)
            run(self.flag_listed, params)
            return True

    def open_gate(self, run: _Runner, params: dict[str, Any]) -> str | None:
        """Release ``b_owner``'s gate and take its waiter: one DELETE when none is listed;
        else a transaction locking the gate's row, then the waiter's."""
        if run(self.open_unlisted, params).rowcount:
            return None
        with _transaction(run, self.begin):
            row = run(self.locked_row, params).first()
            if row is not None and row.expires_at > row.now:
                if row.owner != params["b_owner"]:
                    return None  # another run's gate: its waiter is its own
                run(self.drop, params)
            waiter = run(self.locked_gate_wait, params).first()
            if waiter is None:
                return None
            run(self.drop_gate_wait, params)
            return str(waiter.payload)

    def take_lease(self, run: _Runner, params: dict[str, Any]) -> tuple[bool, Any]:
        """Run the lease upsert: whether this copy holds the lease, else the record's row."""
        run(self.lease, params)
        row = run(self.run_record, params).first()
        return row is not None and row.token == params["b_run_token"], row

    def claim_run(
        self, run: _Runner, params: dict[str, Any]
    ) -> tuple[RunOutcome, tuple[ClaimOutcome, Any] | None]:
        # Two steps, as StoreRuns: the lease commits on its own (a failed
        # claim leaves it to abandon_run or to lapse, as there).
        for _ in range(_RACE_RETRIES):
            taken, holder = self.take_lease(run, params)
            if taken:
                return RunOutcome.BEGUN, self.claim(run, params)
            if (
                holder is not None
                and holder.owner != params["b_run"]
                and holder.expires_at > holder.now
            ):
                done = holder.policy == DONE_POLICY
                return (RunOutcome.DONE if done else RunOutcome.RUNNING), None
            # Released or lapsed between the upsert and the read: again.
        raise _contention(params["b_key"])

    def end_run(self, run: _Runner, params: dict[str, Any]) -> bool:
        # The done marker commits first, as StoreRuns: a release that then
        # fails is retried by the worker, and late copies are refused meanwhile.
        run(self.done, params)
        if params["b_release"]:
            return run(self.release, params).rowcount > 0
        if params["b_settle"]:
            return run(self.settle, params).rowcount > 0
        return False

    def build_mark_revoked(self) -> Insert:
        """Insert the revoked marker, or push its expiry out to now + ``b_ttl``."""
        raise NotImplementedError

    def hold(self, run: _Runner, params: dict[str, Any]) -> Any:
        """Inside a transaction: insert-or-keep the key's row, then read it."""
        run(self.insert_or_keep, params)
        return run(self.locked_row, params).one()

    def take_over(self, run: _Runner, params: dict[str, Any]) -> Any:
        with _transaction(run, self.begin):
            row = self.hold(run, params)
            if row.token == params["b_token"]:
                return None
            run(self.replace, params)
            return row

    def take_over_queued(self, run: _Runner, params: dict[str, Any]) -> Any:
        with _transaction(run, self.begin):
            row = self.hold(run, params)
            if row.token == params["b_token"]:
                return None
            if row.started and row.expires_at > row.now:
                return row  # running: it keeps the key
            run(self.replace, params)
            return row

    def claim(self, run: _Runner, params: dict[str, Any]) -> tuple[ClaimOutcome, Any]:
        fast = self.release_mine if params["b_release"] else self.start_mine
        if run(fast, params).rowcount:
            return ClaimOutcome.OWNED, None
        with _transaction(run, self.begin):
            return self.claim_locked(run, params)

    def claim_locked(self, run: _Runner, params: dict[str, Any]) -> tuple[ClaimOutcome, Any]:
        """The start check past its one-statement try, inside a transaction."""
        revoked = run(self.locked_marker, params).first() is not None
        row = self.hold(run, params)
        inserted = row.token == params["b_token"]
        live = not inserted and row.expires_at > row.now
        mine = live and row.owner == params["b_owner"]
        if revoked:
            if inserted or mine:
                run(self.drop, params)
            return ClaimOutcome.REVOKED, None
        if mine:
            run(self.drop if params["b_release"] else self.start, params)
            return ClaimOutcome.OWNED, None
        if live:
            return ClaimOutcome.HELD, row
        # Free: keep the row we inserted only when asked to take the key.
        if params["b_take"] and not inserted:
            run(self.replace, params)
        elif inserted and not params["b_take"]:
            run(self.drop, params)
        return ClaimOutcome.FREE, None

    def revoke(self, run: _Runner, params: dict[str, Any]) -> RevokeOutcome:
        with _transaction(run, self.begin):
            # The marker first: a claim of this owner that locked it (or the
            # gap where it goes) first commits before we read the key's row.
            run(self.mark_revoked, params)
            row = run(self.locked_row, params).first()
            if row is None or row.expires_at <= row.now or row.owner != params["b_owner"]:
                return RevokeOutcome.NOT_HELD
            if row.started:
                return RevokeOutcome.RUNNING
            run(self.drop, params)
            return RevokeOutcome.RELEASED


class _SQLite(_Transactional):
    # 'now' is fixed for one sqlite3_step(), and RETURNING writes in the first.
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    # Take the write lock first, so the reads and writes see the same rows.
    begin = "BEGIN IMMEDIATE"

    def __init__(self, dialect: Dialect, schema_map: SchemaMap = None) -> None:
        super().__init__(dialect, schema_map)
        values = self.row_values()
        ins = sqlite.insert(lock_table).values(**values)
        self.acquire_stmt = self.render(
            ins.on_conflict_do_update(
                index_elements=[_L.key],
                set_={name: ins.excluded[name] for name in values if name != "key"},
                where=_L.expires_at <= self.now,
            ).returning(_L.owner)
        )
        self.holder = self.render(
            select(*_LOCK_COLUMNS, self.now.label("now")).where(self.at_key)
        )
        self.lease_returning = self.render(
            self.build_run_upsert(self.lease_taken()).returning(_L.key)
        )

    def build_insert_or_keep(self, values: dict[str, Any]) -> Insert:
        return sqlite.insert(lock_table).values(**values).on_conflict_do_nothing()

    def build_run_upsert(self, where: ColumnElement[bool] | None) -> Insert:
        run_values = self.run_values()
        ins = sqlite.insert(lock_table).values(**run_values)
        return ins.on_conflict_do_update(
            index_elements=[_L.key],
            set_={name: ins.excluded[name] for name in run_values if name != "key"},
            where=where,
        )

    def build_gate_wait_upsert(self) -> Insert:
        values = self.gate_wait_values()
        ins = sqlite.insert(gate_wait_table).values(**values)
        return ins.on_conflict_do_update(
            index_elements=[_G.key],
            set_={name: ins.excluded[name] for name in values if name != "key"},
        )

    def take_lease(self, run: _Runner, params: dict[str, Any]) -> tuple[bool, Any]:
        # The upsert returns a row only when it wrote one: then it is ours.
        if run(self.lease_returning, params).first() is not None:
            return True, None
        return False, run(self.run_record, params).first()

    # In process, a statement costs no round trip but each commit a sync of
    # the file: the lease and the claim, or the done marker and the
    # release, commit together.

    def claim_run(
        self, run: _Runner, params: dict[str, Any]
    ) -> tuple[RunOutcome, tuple[ClaimOutcome, Any] | None]:
        with _transaction(run, self.begin):
            taken, holder = self.take_lease(run, params)
            if not taken:
                # BEGIN IMMEDIATE: no other writer ran since the upsert.
                done = holder is not None and holder.policy == DONE_POLICY
                return (RunOutcome.DONE if done else RunOutcome.RUNNING), None
            fast = self.release_mine if params["b_release"] else self.start_mine
            if run(fast, params).rowcount:
                return RunOutcome.BEGUN, (ClaimOutcome.OWNED, None)
            return RunOutcome.BEGUN, self.claim_locked(run, params)

    def end_run(self, run: _Runner, params: dict[str, Any]) -> bool:
        if not (params["b_release"] or params["b_settle"]):
            return super().end_run(run, params)
        with _transaction(run, self.begin):
            return super().end_run(run, params)

    def build_mark_revoked(self) -> Insert:
        ins = sqlite.insert(revoked_table).values(**self.marker_values())
        return ins.on_conflict_do_update(
            index_elements=[_R.key],
            set_={"expires_at": func.max(_R.expires_at, ins.excluded.expires_at)},
        )

    def acquire(self, run: _Runner, params: dict[str, Any]) -> Any:
        for _ in range(_RACE_RETRIES):
            if run(self.acquire_stmt, params).first() is not None:
                return None
            # The key was live when the upsert ran; read the holder. A release
            # or expiry in between leaves no live holder: try again.
            row = run(self.holder, params).first()
            if row is not None and row.expires_at > row.now:
                return row
        raise _contention(params["b_key"])

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        ins = sqlite.insert(counter_table).values(rows)
        return ins.on_conflict_do_update(
            index_elements=[_C.prefix, _C.task_name, _C.event],
            set_={"count": _C.count + ins.excluded.count},
        )


class _MySQL(_Transactional):
    # The session time zone is UTC (set on connect), so this is exact even
    # across a DST change.
    now_sql = "UNIX_TIMESTAMP(NOW(6))"
    begin = "START TRANSACTION"

    #: the upsert's columns; MySQL applies the assignments left to right and
    #: later ones see the new values: expires_at, which every condition
    #: reads, goes last.
    _ASSIGNED = (
        "owner", "task_id", "task_name", "policy", "started", "token", "acquired_at", "expires_at"
    )

    def __init__(self, dialect: Dialect, schema_map: SchemaMap = None) -> None:
        super().__init__(dialect, schema_map)
        self.upsert = self.render(self.build_upsert())
        self.holder = self.render(
            select(*_LOCK_COLUMNS, _L.token, self.now.label("now")).where(self.at_key)
        )

    def build_upsert(self) -> Insert:
        """Insert the new row, or take over the existing one only if it expired."""
        ins = mysql.insert(lock_table).values(**self.row_values())
        expired = _L.expires_at <= self.now
        return ins.on_duplicate_key_update(
            [(name, func.if_(expired, ins.inserted[name], _L[name])) for name in self._ASSIGNED]
        )

    def build_run_upsert(self, where: ColumnElement[bool] | None) -> Insert:
        # The conditions read owner (assigned first) and expires_at (last):
        # once one holds for the first column it holds for every later one.
        ins = mysql.insert(lock_table).values(**self.run_values())
        if where is None:
            return ins.on_duplicate_key_update(
                [(name, ins.inserted[name]) for name in self._ASSIGNED]
            )
        return ins.on_duplicate_key_update(
            [(name, func.if_(where, ins.inserted[name], _L[name])) for name in self._ASSIGNED]
        )

    def build_gate_wait_upsert(self) -> Insert:
        ins = mysql.insert(gate_wait_table).values(**self.gate_wait_values())
        return ins.on_duplicate_key_update(
            payload=ins.inserted.payload, expires_at=ins.inserted.expires_at
        )

    def build_insert_or_keep(self, values: dict[str, Any]) -> Insert:
        # ON DUPLICATE KEY takes an exclusive record lock on the existing row
        # (never a gap lock), so it cannot deadlock with another insert.
        return mysql.insert(lock_table).values(**values).on_duplicate_key_update(key=_L.key)

    def build_mark_revoked(self) -> Insert:
        ins = mysql.insert(revoked_table).values(**self.marker_values())
        return ins.on_duplicate_key_update(
            expires_at=func.greatest(_R.expires_at, ins.inserted.expires_at)
        )

    def acquire(self, run: _Runner, params: dict[str, Any]) -> Any:
        for _ in range(_RACE_RETRIES):
            run(self.upsert, params)
            row = run(self.holder, params).first()
            if row is not None and row.token == params["b_token"]:
                return None
            if row is not None and row.expires_at > row.now:
                return row
        raise _contention(params["b_key"])

    def add_counts(self, rows: list[dict[str, Any]]) -> Executable:
        ins = mysql.insert(counter_table).values(rows)
        return ins.on_duplicate_key_update(count=_C.count + ins.inserted.count)


class _MariaDB(_MySQL):
    """MariaDB ≥ 10.5: an upsert returns the row, so acquire is one statement."""

    def __init__(self, dialect: Dialect, schema_map: SchemaMap = None) -> None:
        super().__init__(dialect, schema_map)
        returned = (*_LOCK_COLUMNS, _L.token, self.now.label("now"))
        self.upsert_returning = self.render(self.build_upsert().returning(*returned))
        self.insert_or_keep_returning = self.render(
            self.build_insert_or_keep(self.row_values()).returning(*returned)
        )
        self.lease_returning = self.render(
            self.build_run_upsert(self.lease_taken()).returning(
                _L.owner, _L.policy, _L.token, _L.expires_at, self.now.label("now")
            )
        )

    def take_lease(self, run: _Runner, params: dict[str, Any]) -> tuple[bool, Any]:
        row = run(self.lease_returning, params).one()
        return row.token == params["b_run_token"], row

    def acquire(self, run: _Runner, params: dict[str, Any]) -> Any:
        row = run(self.upsert_returning, params).one()
        return None if row.token == params["b_token"] else row

    def hold(self, run: _Runner, params: dict[str, Any]) -> Any:
        return run(self.insert_or_keep_returning, params).one()


def _fetch_all(
    statement: str, params: dict[str, Any], dialect: _Dialect, run: _Runner
) -> Sequence[Any]:
    """Run one of ``dialect``'s statements and fetch every row."""
    rendered: _Statement = getattr(dialect, statement)
    return run(rendered, params).rows


def _claim_answer(row: Any, params: Mapping[str, Any]) -> tuple[ClaimOutcome, Any] | None:
    """PostgreSQL's claim answer from its statement's row; ``None`` when it must run again."""
    if row.revoked:
        return ClaimOutcome.REVOKED, None
    if row.owned:
        return ClaimOutcome.OWNED, None
    if row.owner is not None and row.owner != params["b_owner"]:
        return ClaimOutcome.HELD, row
    if row.owner is None and (row.taken or not params["b_take"]):
        return ClaimOutcome.FREE, None
    return None


def _fence_of(row: Any, fenced: bool) -> int | None:
    """The fence a claim statement's row carries (``None``: none issued)."""
    return int(row.fence) if fenced and row.fence is not None else None


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``!``) matching keys that start with ``prefix``."""
    escaped = prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_")
    return escaped + "%"


def _contention(key: str) -> StoreContention:
    # Every retry means another writer changed this very row during our
    # statement; never seen in practice.
    return StoreContention(E_CONTENTION.format(key=key, tries=_RACE_RETRIES), store="sql")


@contextmanager
def _transaction(run: _Runner, begin: str) -> Iterator[None]:
    """An explicit transaction on an autocommit connection."""
    run.sql(begin)
    try:
        yield
    except BaseException:
        with suppress(DBAPIError):
            run.sql("ROLLBACK")
        raise
    run.sql("COMMIT")


def _pick_dialect(engine: Engine) -> _Dialect:
    dialect = engine.dialect
    version = dialect.server_version_info or ()
    schema_map = engine.get_execution_options().get("schema_translate_map")
    if dialect.name == "postgresql":
        return _Postgres(dialect, schema_map)
    if dialect.name == "sqlite":
        if tuple(version) < (3, 35):
            raise ImproperlyConfigured(E_OLD_SQLITE.format(version=".".join(map(str, version))))
        return _SQLite(dialect, schema_map)
    if dialect.name in ("mysql", "mariadb"):
        if getattr(dialect, "is_mariadb", False) and tuple(version) >= (10, 5):
            return _MariaDB(dialect, schema_map)
        return _MySQL(dialect, schema_map)
    raise ImproperlyConfigured(
        f"The SQL lock store supports PostgreSQL, MySQL/MariaDB and SQLite, not {dialect.name}"
    )


def _set_session(dbapi_connection: Any, connection_record: Any) -> None:
    """MySQL/MariaDB session settings the store's SQL relies on, once per connection."""
    cursor = dbapi_connection.cursor()
    try:
        # UTC: UNIX_TIMESTAMP(NOW(6)) is then exact across DST changes.
        cursor.execute("SET time_zone = '+00:00'")
        # Repeatable read: a locking read of a missing key locks the gap where
        # it would go (revoke against a concurrent claim).
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    finally:
        cursor.close()
