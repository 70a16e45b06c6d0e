"""Django DB lock store (``django-db``): locks in a table of the project's database.

Selected when the result backend is ``django-db`` (django-celery-results) or
``dedup_store="django-db"``; ``django-db://ALIAS`` (or
``dedup_store_options={"using": ALIAS}``) picks a ``DATABASES`` alias. Needs
``"celery_dedup.contrib.django"`` in ``INSTALLED_APPS`` and its migrations.

The SQL lives in ``LockQueries`` (``contrib/django/managers.py``).

**Its own connection.** Lock writes never join the caller's transaction:
each thread (and each process: a forked child opens its own) uses a second
connection to the alias, made by the store, in autocommit, so a lock is
visible and durable as soon as the call returns whatever the caller's
``transaction.atomic()`` or ``ATOMIC_REQUESTS`` does next. SQLite is the
exception: it has a single writer, so inside the caller's ``atomic()`` a
second connection would wait for the commit that waits for it; there the
store writes through the caller's connection (docs/django.md).

**Contention is not an outage.** Deadlocks, serialization failures, lock
waits and lost first-insert races are retried here with bounded, jittered
backoff; every other database error becomes a ``StoreError`` (``classify``).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
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
#: A connection idle this long is pinged before use (servers drop idle ones).
IDLE_CHECK = 30.0

E_NOT_INSTALLED = (
    "The django-db lock store needs 'celery_dedup.contrib.django' in INSTALLED_APPS "
    "(and `manage.py migrate`)."
)
E_NO_ALIAS = "The django-db lock store names database alias {alias!r}, which is not in DATABASES."

#: Connections a forked child inherited: kept, never used or closed (closing
#: one could say goodbye on the socket its parent still uses).
_INHERITED: list[Any] = []
_OWN = "celery_dedup_own"


def _utc_session(sender: Any, connection: Any, **kwargs: Any) -> None:
    """A new MySQL connection of the store: UTC session, so ``NOW()`` is exact."""
    if getattr(connection, _OWN, False) and connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SET time_zone = '+00:00'")


connection_created.connect(_utc_session, dispatch_uid="celery_dedup.utc_session")


def _own_connection(main: Any) -> Any:
    """A second ``DatabaseWrapper`` on ``main``'s database: autocommit, kept open."""
    settings = {
        **main.settings_dict,
        "AUTOCOMMIT": True,
        "ATOMIC_REQUESTS": False,
        "CONN_MAX_AGE": None,
        "CONN_HEALTH_CHECKS": True,
    }
    if main.vendor == "mysql":
        settings["OPTIONS"] = {**settings.get("OPTIONS", {}), "isolation_level": "read committed"}
    wrapper = type(main)(settings, main.alias)
    setattr(wrapper, _OWN, True)
    return wrapper


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

    def _queries(self) -> LockQueries:
        """The SQL bound to this thread's connection (see the module docstring)."""
        main = connections[self.using]
        if main.vendor == "sqlite" and main.in_atomic_block:
            return self._locks.queries(main)
        state = self._local
        if getattr(state, "pid", None) != os.getpid():
            if getattr(state, "queries", None) is not None:
                _INHERITED.append(state.queries.connection)
            state.queries = self._locks.queries(_own_connection(main))
            state.pid = os.getpid()
            state.used = time.monotonic()
        queries: LockQueries = state.queries
        wrapper = queries.connection
        now = time.monotonic()
        if wrapper.errors_occurred or now - state.used > IDLE_CHECK:
            # Pings it on next use (CONN_HEALTH_CHECKS) and reconnects if it is gone.
            wrapper.close_if_unusable_or_obsolete()
        state.used = now
        return queries

    def _run(self, operation: Callable[[LockQueries], T]) -> T:
        """Run ``operation``, again under contention; "unreachable" → ``StoreUnavailable``."""
        for attempt in range(CONTENTION_ATTEMPTS):
            queries = self._queries()
            try:
                with store_errors(classify, self.name, lambda: self.label, _answer):
                    try:
                        return operation(queries)
                    except DatabaseError as exc:
                        if not is_contention(exc):
                            raise
                        reason = type(exc).__name__
                        logger.debug("%s lost a race (%s), attempt %d", self.label, reason, attempt)
            except StoreUnavailable:
                if getattr(queries.connection, _OWN, False):
                    queries.connection.close_if_unusable_or_obsolete()
                raise
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

    # -- CounterSupport ------------------------------------------------------

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add to the shared counters in one statement."""
        self._run(lambda q: self._counters.add(q.connection, prefix, counts))

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix``."""
        return self._run(lambda q: self._counters.read(q.connection, prefix))
