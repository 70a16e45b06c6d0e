"""Drop-in shims for users of celery-once and celery-singleton.

Change one import and keep the task code::

    from celery_dedup.compat.celery_once import QueueOnce, AlreadyQueued
    from celery_dedup.compat.celery_singleton import Singleton, DuplicateTaskError, clear_locks

``import celery_dedup`` never imports this package. See ``docs/migrating.md``
for the option mapping and every behaviour difference.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kombu.utils.url import maybe_sanitize_url

from ..exceptions import ImproperlyConfigured
from ..identity import caller_key_material, lock_key
from ..options import validate_key
from ..runtime import runtime_for
from ..stores import derive_store_url

if TYPE_CHECKING:
    from celery import Celery

    from ..task import DedupTask

__all__ = [
    "adopt_matching_store",
    "adopt_setting",
    "class_path",
    "django_cache_configured",
    "native_key",
    "require_store",
    "store_in_use",
    "store_key",
    "warn_once",
]

logger = logging.getLogger("celery_dedup")

E_NO_STORE = (
    "{task} ({library} shim) has no lock store: the shims never publish without one. "
    "Set dedup_store (redis://…, db+…) or {hint}."
)

#: Lock-key digests: the last segment of every key celery-dedup writes.
_DIGEST = re.compile(r"[0-9a-f]{32}(?:[0-9a-f]{32})?")


def adopt_setting(app: Celery, name: str, value: Any) -> bool:
    """Set ``app.conf[name] = value`` when ``name`` is unset and ``value`` is not ``None``.

    The shims copy the other library's settings (a lock URL, a key prefix)
    into the ``dedup_*`` setting they stand for, so an explicit ``dedup_*``
    setting always wins. Returns whether the setting was written.
    """
    if value is None or app.conf.get(name) is not None:
        return False
    app.conf[name] = value
    return True


def class_path(value: Any) -> str:
    """``module.QualName`` of a class, or the string itself (a backend setting)."""
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)


def store_in_use(app: Celery) -> str:
    """The (sanitised) URL of the store ``app``'s shim tasks lock in, for messages."""
    url = derive_store_url(app)
    return maybe_sanitize_url(url) if url else "no lock store (shim tasks refuse to publish)"


def django_cache_configured() -> bool:
    """Whether this process runs Django with a default cache that can hold a lock.

    Never imports Django itself: a project that has not loaded it is not a
    Django project for this purpose. A ``DummyCache`` (which stores nothing)
    does not count.
    """
    if "django" not in sys.modules:
        return False
    try:
        from django.conf import settings

        if not (settings.configured or os.environ.get("DJANGO_SETTINGS_MODULE")):
            return False
        default = (settings.CACHES or {}).get("default") or {}
    except Exception:  # settings that cannot be loaded: not a usable cache
        return False
    return bool(default) and not str(default.get("BACKEND", "")).endswith("DummyCache")


def adopt_matching_store(app: Celery, what: str) -> None:
    """Pick the store for a lock backend celery-dedup has no equivalent of; warn naming it.

    ``what`` names that backend (``"ONCE['backend']='proj.locks.DjangoBackend'"``).
    Unless ``dedup_store`` is set: Django's default cache (``django-cache``)
    when this is a Django project with a real cache, since a custom lock
    backend there is almost always one over that cache; else the store the
    app derives (its result backend, then its broker).
    """
    if app.conf.get("dedup_store") is None and django_cache_configured():
        adopt_setting(app, "dedup_store", "django-cache")
    warn_once(app, f"{what} has no celery-dedup equivalent; using {store_in_use(app)} instead")


def warn_once(app: Celery, message: str) -> None:
    """Log ``message`` as a warning, once per app."""
    warned: set[str] = app.__dict__.setdefault("_celery_dedup_compat_warned", set())
    if message not in warned:
        warned.add(message)
        logger.warning("celery-dedup: %s", message)


def require_store(task: DedupTask, library: str, hint: str) -> None:
    """Raise ``ImproperlyConfigured`` when ``task``'s app has no lock store.

    The libraries fail without their lock server; a shim task does the same
    at its first call instead of publishing without deduplication.
    """
    if task.dedup_config().runtime.store is None:
        raise ImproperlyConfigured(E_NO_STORE.format(task=task.name, library=library, hint=hint))


def native_key(
    task: DedupTask, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> str | None:
    """The key celery-dedup gives ``task.delay(*args, **kwargs)``.

    Calls ``DedupTask.dedup_key`` itself, so a shim's override of
    ``dedup_key`` (which may call the upstream key hook) is skipped.
    """
    from ..task import DedupTask

    call = task.dedup_config().resolve({})
    return DedupTask.dedup_key(task, args, kwargs, call, task.routed_queue({}, args, kwargs))


def store_key(app: Celery, namespace: str, value: Any, hook: str) -> str:
    """The store key for a key string made by an upstream hook (``get_key``, ``generate_lock``).

    A key celery-dedup made is used as is; any other string is hashed under
    ``namespace``, so equal strings share one lock whichever task made them,
    as they did in the library.
    """
    key = validate_key(value, hook)
    assert key is not None
    prefix = runtime_for(app).settings.key_prefix
    head, _, digest = key.rpartition(":")
    if head.startswith(prefix + ":") and _DIGEST.fullmatch(digest):
        return key
    return lock_key(prefix, namespace, caller_key_material(key))
