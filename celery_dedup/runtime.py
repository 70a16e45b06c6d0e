"""Per-app state: the resolved ``dedup_*`` settings and the lock store.

Resolved once per app on first use, so no call re-reads settings or
re-resolves the store.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .exceptions import DeduplicationUnavailable, StoreUnavailable
from .identity import Identity
from .metrics import Metrics, flush_interval
from .native import Native
from .options import Fallback, OnDuplicate, read_setting
from .policy import UniqueUntil
from .signals import dedup_fallback
from .stores import derive_store_url, store_from_url
from .stores.base import LockStore

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["AppSettings", "Runtime", "runtime_for"]

logger = logging.getLogger("celery_dedup")

_ATTR = "_celery_dedup_runtime"
_CREATE_LOCK = threading.Lock()

W_NO_STORE = (
    "celery-dedup: no lock store can be derived from this app (result backend %s, "
    "broker %s) and dedup_store is not set; publishing without deduplication "
    "(dedup_fallback='open'). Set dedup_store to a redis://, db+…, django-db or "
    "memcached:// URL."
)
W_UNAVAILABLE = (
    "celery-dedup: lock store unavailable (%s); publishing without deduplication "
    "(dedup_fallback='open')"
)
E_NO_STORE = (
    "celery-dedup cannot deduplicate {task}: no lock store can be derived from this app "
    "and dedup_fallback='closed'; nothing was published. Set dedup_store."
)
E_UNAVAILABLE = (
    "celery-dedup cannot deduplicate {task}: {error}; dedup_fallback='closed', so "
    "nothing was published"
)


@dataclass(frozen=True)
class AppSettings:
    """The app's ``dedup_*`` settings, validated."""

    key_prefix: str
    default_ttl: float
    default_unique_until: UniqueUntil
    default_identity: Identity
    default_on_duplicate: OnDuplicate
    fallback: Fallback
    send_events: bool
    #: seconds a revoked owner token stays refused at start (``dedup_revoked_ttl``)
    revoked_ttl: float = 86400.0
    #: whether calls to a broker queue that deduplicates itself skip the store
    native: Native = Native.AUTO
    #: the broker URL's scheme (``sqs``, ``redis``, ``amqp``…)
    broker_scheme: str = ""
    store_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_conf(cls, conf: Any) -> AppSettings:
        """Read and validate every setting from ``app.conf``."""
        send_events = read_setting(conf, "dedup_send_events")
        if send_events is None:
            send_events = bool(conf.get("task_send_sent_event"))
        return cls(
            key_prefix=read_setting(conf, "dedup_key_prefix"),
            default_ttl=read_setting(conf, "dedup_default_ttl"),
            default_unique_until=read_setting(conf, "dedup_default_unique_until"),
            default_identity=read_setting(conf, "dedup_default_identity"),
            default_on_duplicate=read_setting(conf, "dedup_default_on_duplicate"),
            fallback=read_setting(conf, "dedup_fallback"),
            send_events=send_events,
            revoked_ttl=read_setting(conf, "dedup_revoked_ttl"),
            native=read_setting(conf, "dedup_native"),
            broker_scheme=str(conf.get("broker_url") or "").split(";")[0].partition("://")[0],
            store_options=dict(conf.get("dedup_store_options") or {}),
        )


class Runtime:
    """celery-dedup's state for one Celery app."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.settings = AppSettings.from_conf(app.conf)
        self._store: LockStore | None = None
        self._store_resolved = False
        self._store_lock = threading.Lock()
        self._warned: set[str] = set()
        #: counters not yet flushed to the store
        self.metrics = Metrics(
            lambda: self.store,
            prefix=self.settings.key_prefix,
            interval=flush_interval(app.conf),
        )

    @property
    def store(self) -> LockStore | None:
        """The lock store, or ``None`` when none can be derived (see ``dedup_fallback``)."""
        if not self._store_resolved:
            with self._store_lock:
                if not self._store_resolved:
                    url = derive_store_url(self.app)
                    if url is not None:
                        self._store = store_from_url(
                            url, app=self.app, options=self.settings.store_options or None
                        )
                    self._store_resolved = True
        return self._store

    def use_store(self, store: LockStore | None) -> None:
        """Replace the store (tests, or a store built by hand)."""
        with self._store_lock:
            self._store = store
            self._store_resolved = True

    def fall_back(self, task_name: str, error: StoreUnavailable | None) -> None:
        """Apply ``dedup_fallback`` for a call that could not take a lock.

        Returns (publish without a lock) in open mode; raises
        ``DeduplicationUnavailable`` in closed mode.
        """
        reason = "no_store" if error is None else "unavailable"
        self.metrics.incr(task_name, "fallback")
        if self.settings.fallback is Fallback.CLOSED:
            dedup_fallback.send(sender=task_name, reason=reason, action="closed", error=error)
            message = (
                E_NO_STORE.format(task=task_name)
                if error is None
                else E_UNAVAILABLE.format(task=task_name, error=error)
            )
            raise DeduplicationUnavailable(message, task_name=task_name, reason=reason) from error
        dedup_fallback.send(sender=task_name, reason=reason, action="open", error=error)
        cause = reason if error is None else f"{reason}:{type(error.__cause__).__name__}"
        if cause not in self._warned:
            self._warned.add(cause)
            if error is None:
                logger.warning(
                    W_NO_STORE, self.app.conf.get("result_backend"), _broker_scheme(self.app)
                )
            else:
                logger.warning(W_UNAVAILABLE, error)
        else:
            logger.debug("celery-dedup: publishing %s without a lock (%s)", task_name, reason)


def _broker_scheme(app: Celery) -> str:
    broker = app.conf.get("broker_url") or ""
    return str(broker).partition("://")[0] or "none"


def runtime_for(app: Celery) -> Runtime:
    """The ``Runtime`` of ``app``, created on first use."""
    runtime: Runtime | None = getattr(app, _ATTR, None)
    if runtime is None:
        with _CREATE_LOCK:
            runtime = getattr(app, _ATTR, None)
            if runtime is None:
                runtime = Runtime(app)
                setattr(app, _ATTR, runtime)
    return runtime


def reset_runtime(app: Celery) -> None:
    """Forget ``app``'s resolved settings, store and its tasks' resolved options.

    Call it after changing ``dedup_*`` settings of an app already in use.
    """
    if hasattr(app, _ATTR):
        delattr(app, _ATTR)
    for task in app.tasks.values():
        if "_dedup_config" in vars(task):
            vars(task)["_dedup_config"] = None
