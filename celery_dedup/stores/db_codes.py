"""What a database's error code means for a lock store, whatever the DB-API driver.

Shared by the SQL store (SQLAlchemy) and the Django DB store, which both end
up holding the driver's own exception: PostgreSQL drivers carry the
SQLSTATE (``sqlstate``, psycopg 3; ``pgcode``, psycopg2), MySQL drivers the
server's error number first in ``args``, ``sqlite3`` its result code. No
database driver and no SQLAlchemy are imported here.
"""

from __future__ import annotations

from ..exceptions import (
    StoreContention,
    StoreError,
    StorePermissionDenied,
    StoreRefused,
    StoreUnavailable,
)

__all__ = ["classify_driver_error", "driver_answer", "driver_code"]

# -- PostgreSQL (SQLSTATE) ------------------------------------------------------

#: Lost races: serialization failure, deadlock, lock not available.
POSTGRES_CONTENTION = frozenset({"40001", "40P01", "55P03"})
#: The server cannot serve this session now: shut down, starting, too many
#: connections, the statement or idle time ran out.
POSTGRES_UNAVAILABLE = frozenset({
    "57P01", "57P02", "57P03", "57P05", "57014", "53300",
})
#: insufficient_privilege; class 28 is invalid authorization (wrong password, pg_hba).
POSTGRES_PERMISSION = frozenset({"42501"})

# -- MySQL / MariaDB (error numbers) ---------------------------------------------

#: lock wait timeout, deadlock, "record has changed since last read" (MariaDB)
MYSQL_CONTENTION = frozenset({1205, 1213, 1020})
#: too many connections, server shutdown, connection killed or dropped as
#: idle, query interrupted or past max_execution_time (client errors, 2000-2999,
#: are all about the connection and count too)
MYSQL_UNAVAILABLE = frozenset({1040, 1053, 1152, 1153, 1158, 1159, 1160, 1161, 1317, 1927,
                               3024, 4031})
#: database, table, column or command denied; access denied (password);
#: account locked; need a privilege (SUPER, READ_ONLY ADMIN...)
MYSQL_PERMISSION = frozenset({1044, 1045, 1142, 1143, 1227, 1370, 1698, 3118, 4151})
#: for reference (every other server error is ``StoreRefused`` too): read-only
#: (--read-only 1290, read-only transaction 1792, innodb_read_only 1874,
#: ER_READ_ONLY_MODE 1836), disk or table full (1021, 1114)
MYSQL_REFUSED = frozenset({1290, 1792, 1836, 1874, 1021, 1114})

# -- SQLite (primary result codes) -----------------------------------------------

#: SQLITE_BUSY, SQLITE_LOCKED
SQLITE_CONTENTION = frozenset({5, 6})
#: SQLITE_IOERR, SQLITE_CANTOPEN (the file cannot be reached)
SQLITE_UNAVAILABLE = frozenset({10, 14})
#: SQLITE_PERM, SQLITE_AUTH
SQLITE_PERMISSION = frozenset({3, 23})


def driver_code(error: BaseException) -> str | int | None:
    """The server's code in a DB-API error: a SQLSTATE, a MySQL error number, a SQLite code."""
    sqlite_code = getattr(error, "sqlite_errorcode", None)
    if isinstance(sqlite_code, int):
        return sqlite_code
    sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate
    code = error.args[0] if error.args else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def classify_driver_error(error: BaseException | None) -> type[StoreError] | None:
    """The ``StoreError`` class a DB-API error's code stands for, or ``None`` without a code.

    A code the tables above do not name is the server refusing the
    statement: ``StoreRefused``. Without any code (a driver error raised
    before the server answered), the caller decides by the error's class.
    """
    if error is None:
        return None
    if isinstance(getattr(error, "sqlite_errorcode", None), int):
        return _sqlite(error.sqlite_errorcode & 0xFF)  # type: ignore[attr-defined]
    code = driver_code(error)
    if isinstance(code, str):
        return _postgres(code)
    if isinstance(code, int):
        return _mysql(code)
    return _refused_login(str(error))


#: What libpq says when the server refused the login: its error then carries
#: no SQLSTATE (the server's would be class 28, or 3D000).
_LOGIN_DENIED = ("password authentication failed", "no pg_hba.conf entry",
                 "permission denied for database", "is not permitted to log in")


def _refused_login(text: str) -> type[StoreError] | None:
    """A PostgreSQL connection the server refused, known only by its text."""
    if "FATAL:" not in text:
        return None
    if any(words in text for words in _LOGIN_DENIED) or (
        'role "' in text and "does not exist" in text
    ):
        return StorePermissionDenied
    if 'database "' in text and "does not exist" in text:
        return StoreRefused
    return None


def _postgres(sqlstate: str) -> type[StoreError]:
    if sqlstate in POSTGRES_CONTENTION:
        return StoreContention
    if sqlstate.startswith("08") or sqlstate in POSTGRES_UNAVAILABLE:
        return StoreUnavailable
    if sqlstate in POSTGRES_PERMISSION or sqlstate.startswith("28"):
        return StorePermissionDenied
    # read_only_sql_transaction 25006 (a standby after a failover,
    # default_transaction_read_only), disk_full 53100, out_of_memory 53200,
    # missing tables 42P01, ...: the server answered with an error.
    return StoreRefused


def _mysql(number: int) -> type[StoreError]:
    if number in MYSQL_CONTENTION:
        return StoreContention
    if 2000 <= number < 3000 or number in MYSQL_UNAVAILABLE:
        return StoreUnavailable
    if number in MYSQL_PERMISSION:
        return StorePermissionDenied
    return StoreRefused


def _sqlite(code: int) -> type[StoreError]:
    if code in SQLITE_CONTENTION:
        return StoreContention
    if code in SQLITE_UNAVAILABLE:
        return StoreUnavailable
    if code in SQLITE_PERMISSION:
        return StorePermissionDenied
    # SQLITE_READONLY 8 ("attempt to write a readonly database"),
    # SQLITE_FULL 13, SQLITE_ERROR 1 (a missing table), corruption...
    return StoreRefused


def driver_answer(error: BaseException) -> str:
    """A DB-API error as text for a message: class, the server's words and code.

    Never the statement or its parameters (an owner token is a secret): only
    the first line of the server's message (PostgreSQL adds the statement's
    text under it).
    """
    text = str(error).strip().split("\n", 1)[0]
    code = driver_code(error)
    name = getattr(error, "sqlite_errorname", None)
    if isinstance(name, str) and name:
        text = f"{text} ({name})"
    elif isinstance(code, str) and code not in text:
        text = f"{text} (SQLSTATE {code})"
    return f"{type(error).__name__}: {text}"
