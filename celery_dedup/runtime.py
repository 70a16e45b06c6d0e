"""Per-app state: the resolved ``dedup_*`` settings and the lock store.

Resolved on first use. A later change of a ``dedup_*`` setting made on
``app.conf`` (``app.conf.dedup_default_ttl = 5``, ``app.conf.update(...)``,
common in test fixtures) is noticed by the next call, at the cost of a few
dict lookups, and takes effect: the settings are read again, and the store
is resolved again when a setting it depends on changed. Settings that live
elsewhere (Django settings read through ``config_from_object``) are re-read
after ``reset_runtime(app)`` (the Django app does it on ``setting_changed``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .app_urls import broker_scheme, result_backend
from .events import default_send_events
from .exceptions import DeduplicationUnavailable, ImproperlyConfigured, StoreError
from .identity import Identity
from .metrics import Metrics, flush_interval
from .native import Native
from .options import (
    DedupMode,
    Fallback,
    OnDuplicate,
    OnKeyReuse,
    read_setting,
    warn_unknown_settings,
)
from .policy import UniqueUntil
from .signals import dedup_fallback
from .stores import derive_store_url, store_from_url
from .stores.base import Durability, LockStore

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "WATCHED_SETTINGS",
    "AppSettings",
    "Runtime",
    "broker_redelivers",
    "invalidate_all",
    "reset_runtime",
    "runtime_for",
    "visibility_timeout",
]

logger = logging.getLogger("celery_dedup")

_ATTR = "_celery_dedup_runtime"
_CREATE_LOCK = threading.Lock()
#: Every live runtime, whichever app it belongs to (``invalidate_all``).
_RUNTIMES: weakref.WeakSet[Runtime] = weakref.WeakSet()

#: settings whose change on ``app.conf`` makes the next call re-read them
WATCHED_SETTINGS = (
    "dedup_store",
    "dedup_store_options",
    "dedup_key_prefix",
    "dedup_default_ttl",
    "dedup_default_unique_until",
    "dedup_default_identity",
    "dedup_default_on_duplicate",
    "dedup_on_key_reuse",
    "dedup_fallback",
    "dedup_send_events",
    "dedup_metrics_flush_interval",
    "dedup_native",
    "dedup_revoked_ttl",
    "dedup_lease_ttl",
    "dedup_done_ttl",
    "dedup_silenced_warnings",
    "dedup_cancel_wait",
    "dedup_cancel_signal",
    "dedup_retry_window",
    "dedup_mode",
    "broker_transport_options",
    # Read by Celery on each publish (``task_routes`` and a bound task's
    # serializer are not: Celery keeps them from the first use on).
    "task_default_queue",
    "task_send_sent_event",
    "worker_send_task_events",
    "result_backend",
    "broker_url",
)
#: the settings the store is resolved from
_STORE_SETTINGS = frozenset({"dedup_store", "dedup_store_options", "result_backend", "broker_url"})

W_NO_STORE = (
    "celery-dedup: no lock store can be derived from this app (result backend %s, "
    "broker %s) and dedup_store is not set; publishing without deduplication, as "
    "dedup_fallback='open' asks. Set dedup_store to a redis://, db+…, django-db or "
    "memcached:// URL to deduplicate."
)
E_NOT_CONFIGURED = (
    "celery-dedup cannot deduplicate {task}: no lock store can be derived from this app "
    "(result backend {backend}, broker {broker}) and dedup_store is not set, so nothing was "
    "published. Set dedup_store (CELERY_DEDUP_STORE) to a redis://, db+…, django-db or "
    "memcached:// URL; or set dedup_fallback='open' explicitly to publish without "
    "deduplication."
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
    #: seconds a started message's running lease lives unrenewed (``dedup_lease_ttl``)
    lease_ttl: float = 60.0
    #: seconds a done marker lives (``dedup_done_ttl``; ``None``: see ``done_ttl_for``)
    done_ttl: float | None = None
    #: the broker transport's ``visibility_timeout`` (redelivery of unacked messages), or 0
    visibility_timeout: float = 0.0
    #: whether calls to a broker queue that deduplicates itself skip the store
    native: Native = Native.AUTO
    #: the broker URL's scheme (``sqs``, ``redis``, ``amqp``…)
    broker_scheme: str = ""
    store_options: dict[str, Any] = field(default_factory=dict)
    #: settings-lint ids silenced app-wide (``dedup_silenced_warnings``)
    silenced_warnings: frozenset[str] = frozenset()
    #: what a caller's key held for different arguments does (``dedup_on_key_reuse``)
    on_key_reuse: OnKeyReuse = OnKeyReuse.WARN
    #: ``on_duplicate="cancel_running"``: seconds a call waits for the key (``dedup_cancel_wait``)
    cancel_wait: float = 10.0
    #: ``on_duplicate="cancel_running"``: the terminating signal (``dedup_cancel_signal``)
    cancel_signal: str = "SIGUSR1"
    #: ``"success"``/``"expiry"``: seconds a failed run's key stays held (``dedup_retry_window``)
    retry_window: float | None = None
    #: ``"observe"``: refusals are published anyway and counted (``dedup_mode``)
    mode: DedupMode = DedupMode.ENFORCE

    @classmethod
    def from_conf(cls, conf: Any) -> AppSettings:
        """Read and validate every setting from ``app.conf``."""
        send_events = read_setting(conf, "dedup_send_events")
        if send_events is None:
            send_events = default_send_events(conf)
        return cls(
            key_prefix=read_setting(conf, "dedup_key_prefix"),
            default_ttl=read_setting(conf, "dedup_default_ttl"),
            default_unique_until=read_setting(conf, "dedup_default_unique_until"),
            default_identity=read_setting(conf, "dedup_default_identity"),
            default_on_duplicate=read_setting(conf, "dedup_default_on_duplicate"),
            fallback=read_setting(conf, "dedup_fallback"),
            send_events=send_events,
            revoked_ttl=read_setting(conf, "dedup_revoked_ttl"),
            lease_ttl=read_setting(conf, "dedup_lease_ttl"),
            done_ttl=read_setting(conf, "dedup_done_ttl"),
            visibility_timeout=visibility_timeout(conf),
            native=read_setting(conf, "dedup_native"),
            broker_scheme=broker_scheme(conf),
            store_options=dict(conf.get("dedup_store_options") or {}),
            silenced_warnings=read_setting(conf, "dedup_silenced_warnings"),
            on_key_reuse=read_setting(conf, "dedup_on_key_reuse"),
            cancel_wait=read_setting(conf, "dedup_cancel_wait"),
            cancel_signal=read_setting(conf, "dedup_cancel_signal"),
            retry_window=read_setting(conf, "dedup_retry_window"),
            mode=read_setting(conf, "dedup_mode"),
        )


class Runtime:
    """celery-dedup's state for one Celery app."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        warn_unknown_settings(app.conf)
        self.settings = AppSettings.from_conf(app.conf)
        self._seen = self._watched()
        self._stale = False
        #: bumped each time the settings are read again (tasks rebuild their options)
        self.generation = 0
        self._store: LockStore | None = None
        self._store_resolved = False
        self._store_lock = threading.Lock()
        self._warned: set[str] = set()
        #: what the store's server said about keeping keys (worker start,
        #: ``celery dedup check``): the settings lint of a task's first call reuses it
        self.durability: Durability | None = None
        #: names of the tasks whose settings were linted in this process
        self.linted: set[str] = set()
        #: (key, owner, deadline) of acquires that failed with the store
        #: unreachable: such a write may still land when the store answers
        #: again (a paused server runs what it had read). Unless the call's
        #: message carries the owner token, a sweeper thread releases it
        #: (owner-checked) until a release deletes it or its TTL has passed.
        self.orphans: list[tuple[str, str, float]] = []
        self._sweeper: threading.Thread | None = None
        #: counters not yet flushed to the store
        self.metrics = Metrics(
            lambda: self.store,
            prefix=self.settings.key_prefix,
            interval=flush_interval(app.conf),
        )

    def _watched(self) -> tuple[Any, ...]:
        changes = self.app.conf.changes or {}
        return tuple(map(changes.get, WATCHED_SETTINGS))

    def invalidate(self) -> None:
        """Make the next use read the settings (and resolve the store) again."""
        self._stale = True

    def changed_since(self, generation: int) -> bool:
        """Re-read the settings if they changed; whether they differ from ``generation``'s.

        ``DedupTask.dedup_config`` calls it on each call with the generation
        its options were built from, and rebuilds them when it returns True.
        """
        self.refresh()
        return self.generation != generation

    def refresh(self) -> None:
        """Read the settings again if ``app.conf`` changed them (or ``invalidate`` was called)."""
        seen = self._watched()
        if seen == self._seen and not self._stale:
            return
        with self._store_lock:
            before, self._seen, self._stale = self._seen, seen, False
            warn_unknown_settings(self.app.conf)
            self.settings = AppSettings.from_conf(self.app.conf)
            self.metrics.prefix = self.settings.key_prefix
            self.metrics.interval = flush_interval(self.app.conf)
            changed = {name for name, old, new in zip(WATCHED_SETTINGS, before, seen, strict=True)
                       if old != new}
            if changed & _STORE_SETTINGS or not changed:
                self._store, self._store_resolved = None, False
            self._warned.clear()
            self.linted.clear()
            self.generation += 1

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

    def add_orphan(self, key: str, owner: str, ttl: float) -> tuple[str, str, float]:
        """Remember a failed acquire whose lock may still land (see ``orphans``)."""
        orphan = (key, owner, time.monotonic() + ttl)
        self.orphans.append(orphan)
        with self._store_lock:
            if self._sweeper is None or not self._sweeper.is_alive():
                self._sweeper = threading.Thread(
                    target=self._sweep_orphans, name="celery-dedup-orphans", daemon=True
                )
                self._sweeper.start()
        return orphan

    def forget_orphan(self, orphan: tuple[str, str, float]) -> None:
        """The call's message carries the owner token: it owns such a lock."""
        with contextlib.suppress(ValueError):
            self.orphans.remove(orphan)

    def _sweep_orphans(self) -> None:
        delay = 0.1
        while self.orphans:
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            store = self._store
            for orphan in list(self.orphans):
                key, owner, deadline = orphan
                try:
                    released = store is not None and store.release(key, owner)
                except Exception:  # unreachable still: try again later
                    continue
                if released or time.monotonic() > deadline or store is None:
                    self.forget_orphan(orphan)
                    delay = 0.1

    def use_store(self, store: LockStore | None) -> None:
        """Replace the store (tests, or a store built by hand)."""
        with self._store_lock:
            self._store = store
            self._store_resolved = True

    def fall_back(self, task_name: str, error: StoreError | None) -> None:
        """Apply ``dedup_fallback`` for a call that could not take a lock.

        Returns (publish without a lock) in open mode; raises
        ``DeduplicationUnavailable`` in closed mode. With no store at all
        (``error`` is ``None``) and ``dedup_fallback`` not set explicitly,
        raises ``ImproperlyConfigured`` naming the task: an app that cannot
        deduplicate is a configuration error, not a warning.
        """
        reason = "no_store" if error is None else "unavailable"
        if error is None and self.app.conf.get("dedup_fallback") is None:
            raise ImproperlyConfigured(
                E_NOT_CONFIGURED.format(
                    task=task_name,
                    backend=_backend_scheme(self.app),
                    broker=_broker_scheme(self.app),
                )
            )
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
                    W_NO_STORE, result_backend(self.app.conf) or None, _broker_scheme(self.app)
                )
            else:
                logger.warning(W_UNAVAILABLE, error)
        else:
            logger.debug("celery-dedup: publishing %s without a lock (%s)", task_name, reason)


#: Transports that redeliver a message nobody acknowledged within
#: ``visibility_timeout`` (kombu's default for them is one hour).
_REDELIVERING = frozenset({"redis", "rediss", "redis+socket", "sentinel", "sqs", "gcpubsub"})


def broker_redelivers(conf: Any) -> bool:
    """Whether the broker delivers an unacknowledged message again after ``visibility_timeout``."""
    return broker_scheme(conf) in _REDELIVERING


def visibility_timeout(conf: Any) -> float:
    """The broker's ``visibility_timeout``: how late a copy of a message can come.

    ``0`` for a transport that never redelivers an unacknowledged message by time.
    """
    options = conf.get("broker_transport_options") or {}
    scheme = broker_scheme(conf)
    given = options.get("visibility_timeout")
    if given is not None:
        return float(given)
    return 3600.0 if scheme in _REDELIVERING else 0.0


def _broker_scheme(app: Celery) -> str:
    return broker_scheme(app.conf) or "none"


def _backend_scheme(app: Celery) -> str:
    backend = result_backend(app.conf)
    return f"{backend.partition('://')[0]}://" if backend else "none"


def runtime_for(app: Celery) -> Runtime:
    """The ``Runtime`` of ``app``, created on first use, its settings up to date."""
    runtime: Runtime | None = getattr(app, _ATTR, None)
    if runtime is None:
        with _CREATE_LOCK:
            runtime = getattr(app, _ATTR, None)
            if runtime is None:
                runtime = Runtime(app)
                setattr(app, _ATTR, runtime)
                _RUNTIMES.add(runtime)
                return runtime
    runtime.refresh()
    return runtime


def invalidate_all() -> None:
    """Make every Celery app's next call re-read its ``dedup_*`` settings.

    For settings that live outside ``app.conf`` and change under it (Django's
    ``override_settings``): every app, not only ``celery.current_app``, since a
    project may have several.
    """
    for runtime in list(_RUNTIMES):
        runtime.invalidate()


def reset_runtime(app: Celery) -> None:
    """Forget ``app``'s resolved settings, store and its tasks' resolved options.

    Call it after changing ``dedup_*`` settings of an app already in use.
    """
    if hasattr(app, _ATTR):
        delattr(app, _ATTR)
    for task in app.tasks.values():
        if "_dedup_config" in vars(task):
            vars(task)["_dedup_config"] = None
