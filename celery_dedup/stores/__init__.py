"""Resolve a lock store from a URL, the way Celery resolves result backends.

``x+y://…`` selects alias ``x`` with inner URL ``y://…`` (``db+postgresql://``,
``cache+memcached://``); a scheme that is itself an alias wins
(``redis+cluster://``). Aliases map to import strings loaded on first use, so
``import celery_dedup`` imports no driver. Third-party stores register under
the ``celery_dedup.stores`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from kombu.utils.imports import symbol_by_name
from kombu.utils.url import maybe_sanitize_url

from ..app_urls import broker_url, result_backend
from ..exceptions import ImproperlyConfigured
from .base import CounterSupport, Lock, LockMeta, LockStore

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "ALIASES",
    "ENTRY_POINT_GROUP",
    "CounterSupport",
    "Lock",
    "LockMeta",
    "LockStore",
    "StoreFactory",
    "derive_store_url",
    "is_result_backend",
    "store_from_url",
]

ENTRY_POINT_GROUP = "celery_dedup.stores"

#: scheme → (import string, pip extra that installs its driver)
ALIASES: dict[str, tuple[str, str]] = {
    "redis": ("celery_dedup.stores.redis:RedisStore", "redis"),
    "rediss": ("celery_dedup.stores.redis:RedisStore", "redis"),
    "sentinel": ("celery_dedup.stores.redis:RedisStore", "redis"),
    "sentinels": ("celery_dedup.stores.redis:RedisStore", "redis"),
    "redis+cluster": ("celery_dedup.stores.redis_cluster:RedisClusterStore", "redis"),
    "rediss+cluster": ("celery_dedup.stores.redis_cluster:RedisClusterStore", "redis"),
    "db": ("celery_dedup.stores.sql:SQLStore", "sql"),
    "django-db": ("celery_dedup.stores.django:DjangoStore", "django"),
    "django-cache": ("celery_dedup.stores.django_cache:DjangoCacheStore", "django"),
    "cache": ("celery_dedup.stores.memcached:MemcachedStore", "memcached"),
    "memcached": ("celery_dedup.stores.memcached:MemcachedStore", "memcached"),
    "memory": ("celery_dedup.stores.memory:MemoryStore", ""),
}

#: Result-backend and broker schemes a store can be derived from.
_BROKER_SCHEMES = frozenset({"redis", "rediss", "sentinel", "sentinels"})

E_UNKNOWN_SCHEME = (
    "No celery-dedup lock store for {url!r}. Known schemes: {known}; "
    "third-party stores register under the {group!r} entry-point group."
)
E_MISSING_DRIVER = (
    "The lock store for {url!r} needs a driver that is not installed ({error}). "
    "Install it with: pip install 'celery-dedup[{extra}]'"
)


class StoreFactory(Protocol):
    """**Protocol:** a store class, built from a URL."""

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> LockStore:
        """Build the store for ``url`` (the inner URL for ``x+y://`` schemes)."""


def split_url(url: str) -> tuple[str, str]:
    """Return ``(alias, url for the store)`` for a store URL."""
    scheme = url.partition("://")[0] if "://" in url else url
    if scheme in ALIASES or scheme in _plugin_schemes():
        return scheme, url
    if "+" in scheme:
        alias, inner = url.split("+", 1)
        return alias, inner
    return scheme, url


@cache
def _plugin_schemes() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _factory_for(alias: str, url: str) -> StoreFactory:
    plugins = _plugin_schemes()
    if alias in ALIASES:
        path, extra = ALIASES[alias]
    elif alias in plugins:
        path, extra = plugins[alias], ""
    else:
        known = ", ".join(sorted({*ALIASES, *plugins}))
        raise ImproperlyConfigured(
            E_UNKNOWN_SCHEME.format(
                url=maybe_sanitize_url(url), known=known, group=ENTRY_POINT_GROUP
            )
        )
    try:
        factory: StoreFactory = symbol_by_name(path)
    except ImportError as exc:
        raise ImproperlyConfigured(
            E_MISSING_DRIVER.format(url=maybe_sanitize_url(url), error=exc, extra=extra or alias)
        ) from exc
    return factory


def store_from_url(
    url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
) -> LockStore:
    """Build the lock store that ``url`` names.

    Raises ``ImproperlyConfigured`` naming the (sanitised) URL for an unknown
    scheme, and the extra to install when its driver is missing.
    """
    alias, inner = split_url(url)
    return _factory_for(alias, url).from_url(inner, app=app, options=options)


def is_result_backend(app: Celery, url: str) -> bool:
    """Whether ``url`` (as handed to a store's ``from_url``) is ``app``'s result backend.

    A store is given the inner URL of an ``x+y://`` scheme (``socket://``
    for ``redis+socket://``), as Celery gives its backend: both forms match.
    """
    backend = result_backend(app.conf)
    if not backend:
        return False
    return url in (backend, split_url(backend)[1])


def derive_store_url(app: Celery) -> str | None:
    """The store URL for ``app``: ``dedup_store``, else the result backend, else the broker.

    Returns ``None`` when none of them can hold a conditional write (for
    example an ``rpc://`` backend with an AMQP broker); the caller then
    applies ``dedup_fallback``.
    """
    configured = app.conf.get("dedup_store")
    if configured:
        return str(configured)
    backend = result_backend(app.conf)
    if backend:
        alias, inner = split_url(backend)
        # cache+memory:// and memory:// keep results in one process only.
        if alias in ALIASES and "memory" not in (alias, inner.partition("://")[0]):
            return backend
    # The broker in use: the first of a failover list.
    first = broker_url(app.conf)
    if first and split_url(first)[0] in _BROKER_SCHEMES:
        return first
    return None
