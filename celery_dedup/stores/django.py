"""Django DB lock store (``django-db``): locks in a table of the project's database.

Selected when the result backend is ``django-db`` (django-celery-results) or
``dedup_store="django-db"``; ``django-db://ALIAS`` (or
``dedup_store_options={"using": ALIAS}``) picks a ``DATABASES`` alias. Needs
``"celery_dedup.contrib.django"`` in ``INSTALLED_APPS`` and its migrations.

The SQL lives in ``LockQueries`` (``contrib/django/managers.py``).

**Which connection.** A lock must be visible and durable as soon as the call
returns, whatever the caller's transaction does next, and the store must
never keep a connection the project's requests and tasks need. So, per
operation and per thread, as Django itself would:

- outside any ``atomic()`` block (PostgreSQL, SQLite): Django's own
  connection of the thread (``connections[alias]``), in autocommit. If the
  store opened it, it hands it back when the operation ends through
  ``close_if_unusable_or_obsolete()``: closed with ``CONN_MAX_AGE = 0``,
  returned to the pool with ``OPTIONS["pool"]``, kept with a persistent
  ``CONN_MAX_AGE``, exactly as at the end of a request;
- inside the caller's ``atomic()`` (or ``ATOMIC_REQUESTS``), and always on
  MySQL/MariaDB (whose store sessions are UTC): a second connection of this
  thread with the alias's settings in autocommit, so the lock escapes the
  caller's transaction. It is handed back the same way at the end of each
  operation; on a pooled alias it comes from a pool of the store's own with
  the alias's pool options and ``min_size`` 0 (the thread may hold one of the
  project's pooled connections, and must never wait for a second one);
- inside a ``TestCase`` (Django's or pytest-django's ``db``), and on SQLite
  inside ``atomic()`` (one writer: a second connection would wait for the
  commit that waits for it): the caller's connection, so locks roll back with
  the test and the test database has no other user when it is dropped.

**Contention is not an outage.** Deadlocks, serialization failures, lock
waits and lost first-insert races are retried here with bounded, jittered
backoff; every other database error becomes a ``StoreError`` (``classify``).
"""

from __future__ import annotations

import base64
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connections
from django.db.backends.signals import connection_created
from django.db.utils import DatabaseError, InterfaceError, OperationalError, ProgrammingError
from django.db.utils import Error as DjangoDatabaseError

from ..contrib.django.managers import is_contention
from ..exceptions import (
    ImproperlyConfigured,
    StoreContention,
    StoreError,
    StorePermissionDenied,
    StoreRefused,
    StoreUnavailable,
)
from .base import (
    Claim,
    ClaimOutcome,
    Lock,
    LockMeta,
    RevokeOutcome,
    revoked_marker_key,
    server_answer,
    store_errors,
)
from .db_codes import classify_driver_error, driver_answer
from .off_loop import run_off_loop

if TYPE_CHECKING:
    from celery import Celery

    from ..contrib.django.managers import CounterManager, LockManager, LockQueries, LockRow

__all__ = ["UNREACHABLE", "DjangoStore"]

T = TypeVar("T")

logger = logging.getLogger("celery_dedup")

#: The driver errors that mean "the database cannot be reached".
UNREACHABLE: tuple[type[BaseException], ...] = (OperationalError, InterfaceError)

E_REFUSED = (
    "{error}; have the celery_dedup migrations run (manage.py migrate celery_dedup) "
    "and does the database user have the rights to use its tables?"
)


def _refused(exc: BaseException) -> bool:
    """A statement the database refuses for missing tables or rights."""
    if isinstance(exc, ProgrammingError):
        return True
    text = str(exc).lower()
    return isinstance(exc, OperationalError) and (
        "no such table" in text or "doesn't exist" in text
    )


def classify(exc: BaseException) -> type[StoreError] | None:
    """What a Django database error means, by the driver's code (``db_codes``) first.

    Without a code, "cannot reach the database" (``OperationalError``,
    ``InterfaceError``) is ``StoreUnavailable`` unless the text says a table
    is missing; every other database error is ``StoreRefused``.
    """
    if isinstance(exc, DjangoDatabaseError):
        kind = classify_driver_error(exc.__cause__)
        if kind is not None:
            return kind
        if isinstance(exc, UNREACHABLE) and not _refused(exc):
            return StoreUnavailable
        return StoreRefused
    if isinstance(exc, OSError):
        return StoreUnavailable
    return None


def _answer(exc: BaseException) -> str:
    """The driver's error; for missing tables or rights, how to fix them."""
    cause = exc.__cause__
    text = driver_answer(cause) if cause is not None else server_answer(exc)
    if _refused(exc) or classify(exc) is StorePermissionDenied:
        return E_REFUSED.format(error=text)
    return text


#: Attempts of one operation under contention, and the backoff cap (seconds).
CONTENTION_ATTEMPTS = 40
BACKOFF_CAP = 0.2

E_NOT_INSTALLED = (
    "The django-db lock store needs 'celery_dedup.contrib.django' in INSTALLED_APPS "
    "(and `manage.py migrate`)."
)
E_NO_ALIAS = "The django-db lock store names database alias {alias!r}, which is not in DATABASES."

#: Connections a forked child inherited: kept, never used or closed (closing
#: one could say goodbye on the socket its parent still uses).
_INHERITED: list[Any] = []
_OWN = "celery_dedup_own"
_QUERIES = "_celery_dedup_queries"
_PID = "_celery_dedup_pid"
#: The store's own pool of a pooled alias is keyed ``ALIAS + POOL_SUFFIX + .PID``.
POOL_SUFFIX = ".celery_dedup"


def _utc_session(sender: Any, connection: Any, **kwargs: Any) -> None:
    """A new MySQL connection of the store: UTC session, so ``NOW()`` is exact."""
    if getattr(connection, _OWN, False) and connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SET time_zone = '+00:00'")


connection_created.connect(_utc_session, dispatch_uid="celery_dedup.utc_session")


def _note_process(sender: Any, connection: Any, **kwargs: Any) -> None:
    """Remember which process opened ``connection`` (a forked child must not use it)."""
    connection.__dict__[_PID] = os.getpid()


connection_created.connect(_note_process, dispatch_uid="celery_dedup.note_process")


def _opened_here(connection: Any) -> bool:
    """Whether ``connection`` is closed or was opened by this process."""
    return connection.connection is None or connection.__dict__.get(_PID) == os.getpid()


def _own_connection(main: Any) -> Any:
    """A second ``DatabaseWrapper`` on ``main``'s database: autocommit.

    On a pooled alias it draws from a pool of its own (the alias's pool options,
    ``min_size`` 0), so a lock operation inside a request that holds one of the
    project's pooled connections never waits for another one of them.
    """
    settings = {**main.settings_dict, "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False}
    options = dict(settings.get("OPTIONS") or {})
    alias = main.alias
    pool = options.get("pool")
    if pool:
        sizes = {} if pool is True else dict(pool)
        size = int(sizes.get("max_size") or sizes.get("min_size") or 4)
        options["pool"] = {**sizes, "min_size": 0, "max_size": size}
        alias = f"{main.alias}{POOL_SUFFIX}.{os.getpid()}"
    if main.vendor == "mysql":
        options["isolation_level"] = "read committed"
    settings["OPTIONS"] = options
    wrapper = type(main)(settings, alias)
    setattr(wrapper, _OWN, True)
    return wrapper


def in_test_transaction(connection: Any) -> bool:
    """Whether ``connection`` is inside a ``TestCase``'s per-test transaction."""
    return any(getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


class DjangoStore:
    """Owner-checked TTL locks in the ``celery_dedup_lock`` table."""

    name = "django-db"

    def __init__(self, using: str = "default", clock: Callable[[], float] = time.time) -> None:
        from django.apps import apps

        if not apps.is_installed("celery_dedup.contrib.django"):
            raise ImproperlyConfigured(E_NOT_INSTALLED)
        if using not in connections.settings:
            raise ImproperlyConfigured(E_NO_ALIAS.format(alias=using))
        from ..contrib.django.models import DedupCounter, DedupLock

        self.using = using
        self.clock = clock
        self._locks: LockManager = DedupLock.objects
        self._counters: CounterManager = DedupCounter.objects
        self.label = f"django-db ({using})"
        self._local = threading.local()

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> DjangoStore:
        """``django-db`` (alias ``default``) or ``django-db://ALIAS``."""
        alias = (options or {}).get("using") or url.partition("://")[2].strip("/") or "default"
        return cls(using=str(alias))

    def __repr__(self) -> str:
        return f"<DjangoStore using={self.using!r}>"

    # -- connection and errors ----------------------------------------------

    def _uses_callers_connection(self, main: Any) -> bool:
        """Run on Django's connection of this thread (see the module docstring)?"""
        if main.in_atomic_block:
            return bool(main.vendor == "sqlite" or in_test_transaction(main))
        # A connection a forked child inherited is its parent's: never touched here.
        return bool(
            main.vendor != "mysql" and main.settings_dict["AUTOCOMMIT"] and _opened_here(main)
        )

    def _queries(self) -> LockQueries:
        """The SQL bound to the connection this thread's next operation uses."""
        main = connections[self.using]
        if self._uses_callers_connection(main):
            return self._bound(main)
        state = self._local
        if getattr(state, "pid", None) != os.getpid():
            if getattr(state, "own", None) is not None:
                _INHERITED.append(state.own)
            state.own = _own_connection(main)
            state.pid = os.getpid()
        return self._bound(state.own)

    def _bound(self, wrapper: Any) -> LockQueries:
        """``LockQueries`` for ``wrapper``, made once per wrapper."""
        queries: LockQueries | None = wrapper.__dict__.get(_QUERIES)
        if queries is None:
            queries = wrapper.__dict__[_QUERIES] = self._locks.queries(wrapper)
        return queries

    @contextmanager
    def _connection(self) -> Iterator[LockQueries]:
        """This operation's connection, handed back as Django would at a request's end.

        A connection the store opened is closed (``CONN_MAX_AGE = 0``),
        returned to the pool, or kept (persistent ``CONN_MAX_AGE``) by
        ``close_if_unusable_or_obsolete``; one the caller had open is the
        caller's, left as it is unless an error made it unusable.
        """
        queries = self._queries()
        wrapper = queries.connection
        own = getattr(wrapper, _OWN, False)
        if own:
            # A persistent connection past CONN_MAX_AGE, or dropped while idle: renew it.
            wrapper.close_if_unusable_or_obsolete()
        opened = wrapper.connection is None
        try:
            yield queries
        finally:
            if not wrapper.in_atomic_block:
                with suppress(DatabaseError):
                    if own or opened:
                        wrapper.close_if_unusable_or_obsolete()
                    elif wrapper.errors_occurred and not wrapper.is_usable():
                        wrapper.close()

    def _run(self, operation: Callable[[LockQueries], T]) -> T:
        """Run ``operation``, again under contention; "unreachable" → ``StoreUnavailable``.

        On an event loop's thread (an async view) it runs where Django allows
        (``off_loop``), as for a plain task's publish.
        """
        return run_off_loop(lambda: self._run_here(operation))

    def _run_here(self, operation: Callable[[LockQueries], T]) -> T:
        for attempt in range(CONTENTION_ATTEMPTS):
            with self._connection() as queries, store_errors(
                classify, self.name, lambda: self.label, _answer
            ):
                try:
                    return operation(queries)
                except DatabaseError as exc:
                    if not is_contention(exc):
                        raise
                    reason = type(exc).__name__
                    logger.debug("%s lost a race (%s), attempt %d", self.label, reason, attempt)
            time.sleep(random.uniform(0, min(BACKOFF_CAP, 0.002 * 2**attempt)))
        raise StoreContention(
            f"lock store {self.label} gave up after {CONTENTION_ATTEMPTS} attempts "
            "lost to concurrent writers",
            store=self.name,
        )

    def _lock(self, row: LockRow) -> Lock:
        """A row as a ``Lock``, its times moved from the database clock to ours."""
        skew = self.clock() - row.now
        return Lock(
            key=row.key,
            owner=row.owner,
            task_name=row.task_name,
            acquired_at=row.acquired_at + skew,
            expires_at=row.expires_at + skew,
            policy=row.policy,
            task_id=row.task_id or row.owner,
            started=row.started,
        )

    # -- LockStore -----------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock if free or expired (one upsert), else return the holder."""
        token = uuid.uuid4().hex
        row = self._run(lambda q: q.acquire(key, owner, token, ttl, meta))
        return None if row.token == token else self._lock(row)

    def release(self, key: str, owner: str) -> bool:
        """Delete the lock if ``owner`` holds it (one ``DELETE … WHERE key AND owner``)."""
        return self._run(lambda q: q.release(key, owner))

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Set the TTL to ``ttl`` from now if ``owner`` holds the lock (one ``UPDATE``)."""
        return self._run(lambda q: q.extend(key, owner, ttl))

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder (not started); return the previous live holder."""
        token = uuid.uuid4().hex
        row = self._run(lambda q: q.take_over(key, owner, token, ttl, meta))
        return self._lock(row) if row is not None and row.live else None

    def take_over_queued(
        self, key: str, owner: str, ttl: float, meta: LockMeta
    ) -> Lock | None:
        """``take_over`` unless a started holder holds the key (``QueuedTakeOver``).

        The same transaction as ``take_over``; a started holder is returned
        and keeps the key.
        """
        token = uuid.uuid4().hex
        row = self._run(lambda q: q.take_over_queued(key, owner, token, ttl, meta))
        return self._lock(row) if row is not None and row.live else None

    def claim(
        self, key: str, owner: str, *, release: bool, ttl: float | None, meta: LockMeta
    ) -> Claim:
        """The start check: one statement when ``owner`` holds ``key``, else a transaction."""
        marker = revoked_marker_key(key, owner)
        if self._run(lambda q: q.claim_owned(key, owner, marker, release=release)):
            return Claim(ClaimOutcome.OWNED)
        token = uuid.uuid4().hex
        outcome, holder = self._run(
            lambda q: q.claim(
                key, owner, marker, release=release, ttl=ttl, token=token, meta=meta
            )
        )
        return Claim(ClaimOutcome(outcome), None if holder is None else self._lock(holder))

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Write the revoked marker and release an unstarted lock of ``owner`` (one transaction)."""
        marker = revoked_marker_key(key, owner)
        return RevokeOutcome(self._run(lambda q: q.revoke(key, owner, marker, ttl)))

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Mark the owner's lock not started, keeping or resetting its TTL (one ``UPDATE``)."""
        return self._run(lambda q: q.settle(key, owner, ttl))

    def unrevoke(self, key: str, owner: str) -> None:
        """Delete the revoked marker of ``owner`` on ``key``."""
        marker = revoked_marker_key(key, owner)
        self._run(lambda q: q.unrevoke(marker))

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key``."""
        row = self._run(lambda q: q.get(key))
        return None if row is None else self._lock(row)

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix``, in key order (never a revoked marker)."""
        rows = self._run(lambda q: q.scan(prefix))
        for row in rows:
            yield self._lock(row)

    def purge_expired(self, prefix: str = "") -> int:
        """Delete expired locks under ``prefix`` (and expired revoked markers); how many locks."""
        return self._run(lambda q: q.purge_expired(prefix))

    # -- GateWaiters ---------------------------------------------------------

    def list_gate_waiter(self, gate: str, token: str, payload: bytes, life: float) -> bool:
        """List the follow-up at the gate another owner holds (``GateWaiters``; one
        transaction, the gate's row locked first)."""
        text = base64.b64encode(payload).decode("ascii")
        return self._run(lambda q: q.list_gate_waiter(gate, token, text, life))

    def open_gate(self, gate: str, token: str) -> bytes | None:
        """Release ``token``'s gate and take its waiter (``GateWaiters``): one ``DELETE``,
        as ``release``, when nobody waits; a transaction when a waiter is listed."""
        woken = self._run(lambda q: q.open_gate(gate, token))
        return base64.b64decode(woken) if woken else None

    # -- CounterSupport ------------------------------------------------------

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add to the shared counters in one statement."""
        self._run(lambda q: self._counters.add(q.connection, prefix, counts))

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix``."""
        return self._run(lambda q: self._counters.read(q.connection, prefix))
