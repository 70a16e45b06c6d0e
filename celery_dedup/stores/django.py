"""Django DB lock store (``django-db``): locks in a table of the project's database.

Selected when the result backend is ``django-db`` (django-celery-results) or
``dedup_store="django-db"``; ``django-db://ALIAS`` (or
``dedup_store_options={"using": ALIAS}``) picks a ``DATABASES`` alias. Needs
``"celery_dedup.contrib.django"`` in ``INSTALLED_APPS`` and its migration.

The queries live on ``DedupLock.objects`` (``contrib/django/managers.py``):
one atomic statement per operation on SQLite and PostgreSQL, TTLs by the
database clock. Lock writes join the caller's transaction, like every ORM
write: enqueue inside ``transaction.on_commit`` (as Celery recommends for
Django), or point the store at a second alias of the same database so its
writes commit on their own.

Connections: Django closes them around requests and Celery's Django fixup
around tasks and after a pool child forks. This store also drops an
inherited connection in a process forked outside Celery (without closing the
parent's socket) and replaces a connection after a failed query, so the next
operation reconnects.
"""

from __future__ import annotations

import os
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.utils import InterfaceError, OperationalError

from ..exceptions import ImproperlyConfigured
from .base import Lock, LockMeta, unavailable_on

if TYPE_CHECKING:
    from celery import Celery

    from ..contrib.django.managers import CounterManager, LockManager, LockRow

__all__ = ["UNREACHABLE", "DjangoStore"]

#: The driver errors that mean "the database cannot be reached".
UNREACHABLE: tuple[type[BaseException], ...] = (OperationalError, InterfaceError)

E_NOT_INSTALLED = (
    "The django-db lock store needs 'celery_dedup.contrib.django' in INSTALLED_APPS "
    "(and `manage.py migrate`)."
)
E_NO_ALIAS = "The django-db lock store names database alias {alias!r}, which is not in DATABASES."

_STORES: weakref.WeakSet[DjangoStore] = weakref.WeakSet()


def _forget_inherited_connections() -> None:
    """In a forked child: drop the parent's connections without any network I/O.

    Closing a psycopg connection sends a goodbye on the socket the parent
    still uses; letting go of the wrapper's handle reconnects on next use.
    """
    for store in list(_STORES):
        conn = connections[store.using]
        if conn.connection is not None and not conn.in_atomic_block:
            conn.connection = None


os.register_at_fork(after_in_child=_forget_inherited_connections)


class DjangoStore:
    """Owner-checked TTL locks in the ``celery_dedup_lock`` table, through the ORM."""

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
        _STORES.add(self)

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> DjangoStore:
        """``django-db`` (alias ``default``) or ``django-db://ALIAS``."""
        alias = (options or {}).get("using") or url.partition("://")[2].strip("/") or "default"
        return cls(using=str(alias))

    def __repr__(self) -> str:
        return f"<DjangoStore using={self.using!r}>"

    # -- helpers -------------------------------------------------------------

    def _call(self, operation: Callable[[], Any]) -> Any:
        """Run one query, translating "database unreachable" into ``StoreUnavailable``."""
        conn = connections[self.using]
        if conn.errors_occurred and not conn.in_atomic_block:
            conn.close_if_unusable_or_obsolete()
        try:
            with unavailable_on(UNREACHABLE, self.name, lambda: self.label):
                return operation()
        except Exception:
            if conn.errors_occurred and not conn.in_atomic_block:
                conn.close_if_unusable_or_obsolete()
            raise

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
        )

    # -- LockStore -----------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock if free or expired (one upsert), else return the holder."""
        token = uuid.uuid4().hex
        row: LockRow = self._call(
            lambda: self._locks.acquire(
                self.using, key, owner, token, ttl,
                meta.get("task_name", ""), meta.get("policy", ""),
            )
        )
        return None if row.token == token else self._lock(row)

    def release(self, key: str, owner: str) -> bool:
        """Delete the lock if ``owner`` holds it (one ``DELETE … WHERE key AND owner``)."""
        return bool(self._call(lambda: self._locks.release(self.using, key, owner)))

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Set the TTL to ``ttl`` from now if ``owner`` holds the lock (one ``UPDATE``)."""
        return bool(self._call(lambda: self._locks.extend(self.using, key, owner, ttl)))

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder; return the previous live holder."""
        token = uuid.uuid4().hex
        row: LockRow | None = self._call(
            lambda: self._locks.take_over(
                self.using, key, owner, token, ttl,
                meta.get("task_name", ""), meta.get("policy", ""),
            )
        )
        return self._lock(row) if row is not None and row.live else None

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key``."""
        row: LockRow | None = self._call(lambda: self._locks.get_live(self.using, key))
        return None if row is None else self._lock(row)

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix``, in key order (read in chunks)."""
        rows: list[LockRow] = self._call(lambda: list(self._locks.scan(self.using, prefix)))
        for row in rows:
            yield self._lock(row)

    def purge_expired(self, prefix: str = "") -> int:
        """Delete expired rows under ``prefix``; returns how many (only reclaims space)."""
        return int(self._call(lambda: self._locks.purge_expired(self.using, prefix)))

    # -- CounterSupport ------------------------------------------------------

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add to the shared counters in one statement."""
        self._call(lambda: self._counters.add(self.using, prefix, counts))

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix``."""
        counts: dict[tuple[str, str], int] = self._call(
            lambda: self._counters.read(self.using, prefix)
        )
        return counts
