"""Django-cache lock store: ``django-cache`` (the default cache) or ``django-cache://alias``.

On Django's ``PyMemcacheCache`` it speaks the memcached protocol of
``stores/memcached.py`` through the cache's own client, and on ``RedisCache``
the Redis store's Lua scripts; any other backend gets ``cache.add`` to
acquire and a check-then-write for release/extend/take-over (the race is
documented on ``_GenericCacheLocks``). Django loads inside the functions
that use it, never at module import.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

from ..exceptions import ImproperlyConfigured, ScanNotSupported, StoreUnavailable
from .base import Lock, LockMeta, LockStore, unavailable_on
from .memcached import (
    E_CONTENDED,
    E_NO_SCAN,
    MAX_KEY_LENGTH,
    MemcachedStore,
    _decode,
    _encode,
    _safe_key,
    _with_meta,
    parse_servers,
)

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["DjangoCacheStore"]

E_DUMMY_CACHE = (
    "django-cache://{alias} is a DummyCache, which stores nothing: it cannot hold a lock. "
    "Point dedup_store at a real cache."
)
E_UNKNOWN_ALIAS = "django-cache://{alias}: no cache named {alias!r} in settings.CACHES"


class DjangoCacheStore:
    """Locks in a Django cache (``django-cache`` = ``default``, ``django-cache://alias``).

    The cache is looked up per call (Django caches are per thread). On a
    pymemcache backend (``PyMemcacheCache``) and on Django's ``RedisCache``
    the store uses their atomic primitives through the cache's own client:
    the memcached ``add``/``gets``/``cas`` protocol above, or the Redis Lua
    scripts. Any other backend gets ``cache.add`` to acquire (atomic where the
    backend's ``add`` is) and a check-then-write for release/extend/take-over,
    whose race is documented on ``_GenericCacheLocks``; such caches cannot list
    keys, so ``scan`` raises ``ScanNotSupported``.
    """

    name = "django-cache"

    def __init__(self, alias: str = "default") -> None:
        self.alias = alias
        self.label = f"django-cache ({alias})"

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> DjangoCacheStore:
        """``django-cache`` or ``django-cache://ALIAS`` (a key of ``settings.CACHES``)."""
        from django.conf import settings

        alias = url.partition("://")[2].strip("/") or "default"
        if alias not in settings.CACHES:
            raise ImproperlyConfigured(E_UNKNOWN_ALIAS.format(alias=alias))
        backend = str(settings.CACHES[alias].get("BACKEND", ""))
        if backend.endswith(".DummyCache"):
            raise ImproperlyConfigured(E_DUMMY_CACHE.format(alias=alias))
        return cls(alias)

    def locks(self) -> LockStore:
        """The store doing the work for this thread's cache object."""
        from django.core.cache import caches
        from django.core.cache.backends.base import default_key_func
        from django.core.cache.backends.memcached import PyMemcacheCache
        from django.core.cache.backends.redis import RedisCache

        cache_ = caches[self.alias]
        native = cache_.key_func is default_key_func
        if native and isinstance(cache_, PyMemcacheCache):
            servers = [parse_servers(f"memcached://{s}")[0][0] for s in cache_._servers]
            return MemcachedStore(
                lambda: cache_._cache,
                servers=servers,
                keyprefix=cache_.make_key(""),
                label=self.label,
                per_process=False,
            )
        if native and isinstance(cache_, RedisCache):
            from .redis import RedisStore

            client = cache_._cache.get_client(write=True)
            return RedisStore(client, keyprefix=cache_.make_key(""), label=self.label)
        return _GenericCacheLocks(cache_, self.label)

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock or return the holder (see the class docstring per backend)."""
        return self.locks().acquire(key, owner, ttl, meta)

    def release(self, key: str, owner: str) -> bool:
        """Owner-checked release."""
        return self.locks().release(key, owner)

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Owner-checked TTL reset."""
        return self.locks().extend(key, owner, ttl)

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Become the holder; return the previous live one."""
        return self.locks().take_over(key, owner, ttl, meta)

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key``."""
        return self.locks().get(key)

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix`` (memcached and Redis caches only)."""
        return self.locks().scan(prefix)


@cache
def _generic_unreachable() -> tuple[type[BaseException], ...]:
    from django.db.utils import InterfaceError, OperationalError

    return (ConnectionError, socket.timeout, OSError, OperationalError, InterfaceError)


class _GenericCacheLocks:
    """Locks through the plain Django cache API, for backends without native primitives.

    ``acquire`` is ``cache.add`` (atomic on the database and local-memory
    caches). Release, extend and take-over read the record and then write or
    delete it: two calls with nothing tying them together, so a lock that
    expires and is re-taken by another task in between can be deleted or
    overwritten by the late caller. The window is one cache round trip, and
    only a lock that is already at the end of its TTL can fall in it.
    """

    name = "django-cache"

    def __init__(self, cache_: Any, label: str) -> None:
        self.cache = cache_
        self.label = label

    def _key(self, key: str) -> str:
        room = MAX_KEY_LENGTH - len(self.cache.make_key(""))
        return _safe_key(key, room)

    def _boundary(self) -> Any:
        return unavailable_on(_generic_unreachable(), self.name, lambda: self.label)

    def _live(self, key: str, raw: Any, now: float) -> Lock | None:
        lock = _decode(raw)
        return lock if lock is not None and lock.key == key and lock.expires_at > now else None

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """``add``, else the holder; a record past its time is deleted and ``add`` retried once."""
        physical = self._key(key)
        with self._boundary():
            for _ in range(2):
                now = time.time()
                record = _encode(key, owner, meta, now, now + ttl)
                if self.cache.add(physical, record, timeout=math.ceil(ttl) + 1):
                    return None
                raw = self.cache.get(physical)
                holder = self._live(key, raw, now)
                if holder is not None:
                    return holder
                if raw is not None:
                    self.cache.delete(physical)
            raw = self.cache.get(physical)
        holder = self._live(key, raw, time.time())
        if holder is None:
            raise StoreUnavailable(
                E_CONTENDED.format(store=self.label, op="acquire", attempts=2), store=self.name
            )
        return holder

    def release(self, key: str, owner: str) -> bool:
        """Read, compare the owner, delete (see the class docstring for the race)."""
        physical = self._key(key)
        with self._boundary():
            holder = self._live(key, self.cache.get(physical), time.time())
            if holder is None or holder.owner != owner:
                return False
            return bool(self.cache.delete(physical))

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Read, compare the owner, write the record with a new expiry."""
        physical = self._key(key)
        with self._boundary():
            now = time.time()
            holder = self._live(key, self.cache.get(physical), now)
            if holder is None or holder.owner != owner:
                return False
            record = _encode(key, owner, _with_meta(holder), holder.acquired_at, now + ttl)
            self.cache.set(physical, record, timeout=math.ceil(ttl) + 1)
            return True

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Read the holder, then write the new record unconditionally."""
        physical = self._key(key)
        with self._boundary():
            now = time.time()
            previous = self._live(key, self.cache.get(physical), now)
            self.cache.set(physical, _encode(key, owner, meta, now, now + ttl),
                           timeout=math.ceil(ttl) + 1)
        return previous

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key``."""
        with self._boundary():
            raw = self.cache.get(self._key(key))
        return self._live(key, raw, time.time())

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Not possible: a generic Django cache cannot list its keys."""
        raise ScanNotSupported(
            E_NO_SCAN.format(
                store=self.label,
                reason=f"{type(self.cache).__name__} cannot list keys "
                "(use a PyMemcacheCache or RedisCache backend)",
            ),
            store=self.name,
        )
