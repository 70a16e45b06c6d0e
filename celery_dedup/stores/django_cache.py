"""Django-cache lock store: ``django-cache`` (the default cache) or ``django-cache://alias``.

On Django's ``PyMemcacheCache`` it is the memcached store (``stores/memcached.py``)
on the cache's servers, options and key prefix, with its own per-process
clients; on ``RedisCache`` the Redis store's Lua scripts on the cache's
client. Any other backend gets the same algorithms as memcached over the
plain cache API (``add``, ``get_many``, ``set``, ``delete``), which has no
compare-and-set: see ``CacheGuarantee`` for what each backend then promises.
Django loads inside the functions that use it, never at module import.
"""

from __future__ import annotations

import os
import pickle
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
from typing import TYPE_CHECKING, Any, cast

from ..exceptions import (
    ImproperlyConfigured,
    ScanNotSupported,
    StoreError,
    StoreRefused,
    StoreUnavailable,
)
from .base import (
    Claim,
    Durability,
    DurabilityReport,
    GateWaiters,
    Lock,
    LockMeta,
    LockStore,
    QueuedTakeOver,
    RevokeOutcome,
    os_error_kind,
    refused_unless_passed,
    store_errors,
)
from .db_codes import classify_driver_error
from .memcached import (
    E_NO_SCAN,
    MAX_KEY_LENGTH,
    MAX_UNIX_EXPIRY,
    SCAN_BATCH,
    TRANSPORT_OPTIONS,
    CacheLocks,
    MemcachedStore,
    Slot,
    _decode,
    _safe_key,
    expiry_for,
    parse_servers,
)
from .off_loop import run_off_loop

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["CacheGuarantee", "DjangoCacheStore"]

E_DUMMY_CACHE = (
    "django-cache://{alias} is a DummyCache, which stores nothing: it cannot hold a lock. "
    "Point dedup_store at a real cache."
)
E_UNKNOWN_ALIAS = "django-cache://{alias}: no cache named {alias!r} in settings.CACHES"
_BUILD_LOCK = threading.Lock()
#: The file a ``FileBasedCache`` directory is locked with (not a ``.djcache`` entry).
LOCK_FILE = "celery-dedup.lock"


class CacheGuarantee(str, Enum):
    """How far a Django cache makes the lock operations atomic."""

    #: memcached ``cas`` or Redis scripts: atomic on the server, for every process
    ATOMIC = "atomic"
    #: ``LocMemCache``: atomic, but its locks exist in one process only, so a
    #: producer and a worker in different processes never see each other's
    ATOMIC_IN_PROCESS = "atomic-in-process"
    #: ``FileBasedCache``: atomic between the processes of one host (each
    #: operation holds a lock file in the cache directory); best effort on a
    #: directory shared over a network file system
    ATOMIC_ON_HOST = "atomic-on-host"
    #: any other backend: acquire is as atomic as its ``add``; the owner check
    #: of release, extend, take-over, the start check and revoke is a read
    #: followed by a write, so a late caller can free or overwrite a lock
    #: re-taken by someone else in between
    BEST_EFFORT = "best-effort"


class DjangoCacheStore:
    """Locks in a Django cache (``django-cache`` = ``default``, ``django-cache://alias``).

    The cache is looked up per call (Django caches are per thread). See the
    module docstring for the path each backend takes and ``guarantee()`` for
    what it promises; only the memcached and Redis paths can list locks.
    """

    name = "django-cache"

    def __init__(self, alias: str = "default", *, clock: Callable[[], float] = time.time) -> None:
        self.alias = alias
        self.label = f"django-cache ({alias})"
        self.clock = clock
        self._memcached: tuple[str, MemcachedStore] | None = None
        self._redis: tuple[str, LockStore] | None = None

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
            return self._memcached_store(cache_)
        if native and isinstance(cache_, RedisCache):
            return self._redis_store(cache_)
        return _GenericCacheLocks(cache_, self.label, self.clock)

    def _redis_store(self, cache_: Any) -> LockStore:
        """The Redis store on the cache's primary, one client and pool per process.

        Django makes a cache object, and so a connection pool, per thread: a
        store on that would open a connection per thread (per request under a
        thread-per-request server) and never close it. The pool is made here
        from the cache's settings instead and shared by every thread.
        """
        from redis import Redis

        from .redis import DEFAULT_TIMEOUTS, RedisStore

        client_ = cache_._cache
        server = client_._servers[0]
        options = client_._pool_options
        keyprefix = cache_.make_key("")
        fingerprint = repr((server, sorted(options.items(), key=repr), keyprefix, os.getpid()))
        built = self._redis
        if built is None or built[0] != fingerprint:
            with _BUILD_LOCK:
                built = self._redis
                if built is None or built[0] != fingerprint:
                    pool = client_._pool_class.from_url(server, **options)
                    timeouts = {k: options[k] for k in DEFAULT_TIMEOUTS if k in options}
                    store = RedisStore(
                        Redis(connection_pool=pool), keyprefix=keyprefix, label=self.label,
                        timeouts=timeouts,
                    )
                    built = self._redis = (fingerprint, store)
        return built[1]

    def _memcached_store(self, cache_: Any) -> MemcachedStore:
        """The memcached store on the cache's servers (rebuilt if its settings change)."""
        servers = [parse_servers(f"memcached://{s}")[0][0] for s in cache_._servers]
        options = {k: v for k, v in cache_._options.items() if k in TRANSPORT_OPTIONS}
        keyprefix = cache_.make_key("")
        fingerprint = repr((servers, sorted(options.items()), keyprefix))
        built = self._memcached
        if built is None or built[0] != fingerprint:
            store = MemcachedStore(
                servers, options=options, keyprefix=keyprefix, label=self.label, clock=self.clock
            )
            built = self._memcached = (fingerprint, store)
        return built[1]

    def guarantee(self) -> CacheGuarantee:
        """How atomic the operations are on this cache's backend (for checks and docs)."""
        locks = self.locks()
        if isinstance(locks, _GenericCacheLocks):
            return locks.guarantee
        return CacheGuarantee.ATOMIC

    def durability(self) -> Durability:
        """Whether the cache keeps keys until their TTL, and across a restart.

        A ``RedisCache`` asks its server (as the Redis store); memcached and
        ``LocMemCache`` keep keys in memory only; the database and file
        caches keep them.
        """
        from django.core.cache import caches

        locks = self.locks()
        if isinstance(locks, DurabilityReport):
            return locks.durability()
        if isinstance(locks, MemcachedStore):
            return Durability(None, None, persistent=False)
        backend = type(caches[self.alias]).__name__
        if backend in ("DatabaseCache", "FileBasedCache"):
            return Durability(None, None, persistent=True)
        in_memory = backend in ("LocMemCache", "PyLibMCCache", "PyMemcacheCache", "MemcachedCache")
        return Durability(None, None, persistent=False if in_memory else None)

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock or return the holder."""
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

    def take_over_queued(
        self, key: str, owner: str, ttl: float, meta: LockMeta
    ) -> Lock | None:
        """``take_over`` unless a started holder holds the key (``QueuedTakeOver``)."""
        return cast(QueuedTakeOver, self.locks()).take_over_queued(key, owner, ttl, meta)

    def claim(
        self, key: str, owner: str, *, release: bool, ttl: float | None, meta: LockMeta
    ) -> Claim:
        """The worker's start check (see ``LockStore.claim``)."""
        return self.locks().claim(key, owner, release=release, ttl=ttl, meta=meta)

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Revoke ``owner`` (see ``LockStore.revoke``)."""
        return self.locks().revoke(key, owner, ttl)

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Mark the owner's lock not started (see ``LockStore.settle``)."""
        return self.locks().settle(key, owner, ttl)

    def unrevoke(self, key: str, owner: str) -> None:
        """Delete the revoked marker of ``owner``."""
        self.locks().unrevoke(key, owner)

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key``."""
        return self.locks().get(key)

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix`` (memcached and Redis caches only)."""
        return self.locks().scan(prefix)

    def list_gate_waiter(self, gate: str, token: str, payload: bytes, life: float) -> bool:
        """List the follow-up at the gate another owner holds (``GateWaiters``)."""
        return cast(GateWaiters, self.locks()).list_gate_waiter(gate, token, payload, life)

    def open_gate(self, gate: str, token: str) -> bytes | None:
        """Release ``token``'s gate and take its waiter (``GateWaiters``)."""
        return cast(GateWaiters, self.locks()).open_gate(gate, token)


def classify(exc: BaseException) -> type[StoreError] | None:
    """What an error of any Django cache backend means.

    Database caches by the driver's code (as the Django DB store), Redis and
    memcached clients as their stores do, files and sockets by ``errno``; an
    error wrapping one of those (``__cause__``) as the one it wraps; any
    other exception from the backend is ``StoreRefused``, while programming
    errors and time limits (``PASS_THROUGH``) pass unchanged.
    """
    kind = _classify_known(exc)
    if kind is None and exc.__cause__ is not None:
        kind = _classify_known(exc.__cause__)
    return kind if kind is not None else refused_unless_passed(exc)


def _classify_known(exc: BaseException) -> type[StoreError] | None:
    from django.db.utils import Error, InterfaceError, OperationalError

    if isinstance(exc, Error):
        kind = classify_driver_error(exc.__cause__)
        if kind is not None:
            return kind
        return StoreUnavailable if isinstance(exc, (OperationalError, InterfaceError)) else (
            StoreRefused
        )
    module = type(exc).__module__
    if module.startswith("redis."):
        from .redis import classify as classify_redis

        return classify_redis(exc)
    if module.startswith("pymemcache."):
        from .memcached import classify as classify_memcached

        return classify_memcached(exc)
    if isinstance(exc, OSError):
        return os_error_kind(exc)
    return None


_PROCESS_LOCKS: dict[tuple[object, ...], threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def _process_lock(*name: object) -> threading.Lock:
    """One lock per name and process (a lock inherited through a fork is never reused)."""
    key = (os.getpid(), *name)
    with _PROCESS_LOCKS_GUARD:
        return _PROCESS_LOCKS.setdefault(key, threading.Lock())


@contextmanager
def _directory_lock(directory: str) -> Iterator[None]:
    """This process's lock for ``directory``, then an exclusive ``flock`` on its lock file."""
    import fcntl

    with _process_lock("file", directory):
        os.makedirs(directory, 0o700, exist_ok=True)
        with open(os.path.join(directory, LOCK_FILE), "ab") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield  # closing the file releases the flock


class _GenericCacheLocks(CacheLocks):
    """The memcached algorithms through the plain Django cache API.

    ``cas`` becomes a write (or delete) after the read. Where every
    operation can hold a lock of its own around read and write (local
    memory: a process lock; files: a lock file), that is atomic; elsewhere it
    is best effort (``CacheGuarantee``). A lock lives as long as the cache
    keeps its entry, by the backend's own expiry.
    """

    name = "django-cache"

    def __init__(self, cache_: Any, label: str, clock: Callable[[], float]) -> None:
        from django.core.cache.backends.base import default_key_func
        from django.core.cache.backends.db import DatabaseCache
        from django.core.cache.backends.filebased import FileBasedCache
        from django.core.cache.backends.locmem import LocMemCache

        self.cache = cache_
        self.label = label
        self.clock = clock
        self._room = MAX_KEY_LENGTH - len(cache_.make_key(""))
        self._exclusive: Callable[[], AbstractContextManager[Any]] = nullcontext
        #: Django's own local-memory and file caches keep float timeouts exactly.
        self._exact = isinstance(cache_, (LocMemCache, FileBasedCache))
        self._whole_seconds = isinstance(cache_, DatabaseCache)
        self.guarantee = CacheGuarantee.BEST_EFFORT
        if isinstance(cache_, LocMemCache):
            # Every LocMemCache of one LOCATION shares this dict in the process.
            self._exclusive = lambda: _process_lock("locmem", id(cache_._cache))
            self.guarantee = CacheGuarantee.ATOMIC_IN_PROCESS
        elif isinstance(cache_, DatabaseCache):
            # Threads of one process take turns (Django's ``add`` reports a
            # write lost to a concurrent one as "present", which the read after
            # it then contradicts); across processes it stays best effort.
            self._exclusive = lambda: _process_lock("database", cache_._table)
        elif isinstance(cache_, FileBasedCache) and os.name == "posix":
            self._exclusive = lambda: _directory_lock(cache_._dir)
            self.guarantee = CacheGuarantee.ATOMIC_ON_HOST
        #: prefix → the raw values that may be locks under it (None: cannot list)
        self._values: Callable[[str], Iterator[Any]] | None = None
        listed = cache_.key_func is default_key_func
        if isinstance(cache_, LocMemCache) and listed:
            self._values = self._by_key_listing(_locmem_keys(cache_))
        elif isinstance(cache_, DatabaseCache) and listed:
            self._values = self._by_key_listing(_database_keys(cache_))
        elif isinstance(cache_, FileBasedCache):
            self._values = _file_values(cache_)

    @contextmanager
    def _operation(self) -> Iterator[None]:
        with store_errors(classify, self.name, lambda: self.label), self._exclusive():
            yield

    def _physical(self, key: str) -> str:
        return _safe_key(key, self._room)

    def _now(self, physical: str) -> float:
        return self.clock()

    def _timeout(self, seconds: float) -> float | None:
        # As memcached: an entry meant to outlive 2038 never expires (some
        # backends cannot store such a date).
        if time.time() + seconds > MAX_UNIX_EXPIRY:
            return None
        if self._whole_seconds:
            # The database cache drops the fraction of its expiry time: one more second
            # keeps the entry at least ``seconds``, and at most a second past its record.
            return seconds + 1
        if self._exact:
            # The entry ends when its record says (not up to 2 s later, as memcached's
            # whole seconds would): an expired holder never answers a later acquire.
            return max(seconds, 0.001)
        return expiry_for(seconds)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.cache.method(...)``; a database cache's lost race is run again.

        Each cache call is its own transaction, rolled back when it loses (an
        SQLite writer upgrading a read snapshot, a deadlock): running it again
        is safe, and contention is never an outage. On an event loop's thread
        (an async view) it runs where Django allows (``off_loop``).
        """
        return run_off_loop(lambda: self._call_here(method, *args, **kwargs))

    def _call_here(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if not self._whole_seconds:
            return getattr(self.cache, method)(*args, **kwargs)
        from ..contrib.django.managers import is_contention
        from .django import BACKOFF_CAP, CONTENTION_ATTEMPTS

        for attempt in range(CONTENTION_ATTEMPTS):
            try:
                return getattr(self.cache, method)(*args, **kwargs)
            except Exception as exc:
                if attempt == CONTENTION_ATTEMPTS - 1 or not is_contention(exc):
                    raise
            time.sleep(random.uniform(0, min(BACKOFF_CAP, 0.002 * 2**attempt)))
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, physical: str, *others: str) -> tuple[Slot, set[str]]:
        if not others:
            return Slot(physical, self._call("get", physical), None), set()
        found = self._call("get_many", [physical, *others])
        return Slot(physical, found.get(physical), None), set(found) - {physical}

    def _add(self, physical: str, value: str, seconds: float) -> bool:
        return bool(self._call("add", physical, value, timeout=self._timeout(seconds)))

    def _cas(self, slot: Slot, value: str | None, seconds: float) -> bool:
        # No compare here: the read that decided this write is the check.
        if value is None:
            self._call("delete", slot.physical)
        else:
            self._call("set", slot.physical, value, timeout=self._timeout(seconds))
        return True

    def _set(self, physical: str, value: str, seconds: float) -> None:
        self._call("set", physical, value, timeout=self._timeout(seconds))

    def _delete(self, physical: str) -> None:
        self._call("delete", physical)

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix``, read through the backend's own storage.

        Local-memory and database caches (default key function) list their
        keys, then read the candidates with ``get_many``; a file cache reads
        every entry. Other backends cannot list keys: ``ScanNotSupported``.
        """
        if self._values is None:
            raise ScanNotSupported(
                E_NO_SCAN.format(
                    store=self.label,
                    reason=f"{type(self.cache).__name__} cannot list keys (use a PyMemcacheCache, "
                    "RedisCache, LocMemCache, FileBasedCache or DatabaseCache backend)",
                ),
                store=self.name,
            )
        with self._op("scan"):
            locks = [
                lock
                for raw in self._values(prefix)
                if (lock := _decode(raw)) is not None and lock.key.startswith(prefix)
            ]
        yield from locks

    def _by_key_listing(self, keys: Callable[[], list[str]]) -> Callable[[str], Iterator[Any]]:
        """Values under a prefix, from a listing of the cache's made keys."""
        head = self.cache.make_key("")

        def values(prefix: str) -> Iterator[Any]:
            wanted = (head + prefix, head + "#")  # hashed keys may hold any logical key
            physicals = [k[len(head) :] for k in keys() if k.startswith(wanted)]
            for start in range(0, len(physicals), SCAN_BATCH):
                yield from self.cache.get_many(physicals[start : start + SCAN_BATCH]).values()

        return values


def _locmem_keys(cache_: Any) -> Callable[[], list[str]]:
    def keys() -> list[str]:
        with cache_._lock:
            return list(cache_._cache)

    return keys


def _database_keys(cache_: Any) -> Callable[[], list[str]]:
    def keys() -> list[str]:
        from django.db import connections, router

        connection = connections[router.db_for_read(cache_.cache_model_class)]
        quote = connection.ops.quote_name
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {quote('cache_key')} FROM {quote(cache_._table)}")
            return [str(row[0]) for row in cursor.fetchall()]

    return keys


def _file_values(cache_: Any) -> Callable[[str], Iterator[Any]]:
    """Every live entry of a file cache (its file names are digests: no key to filter on)."""

    def values(prefix: str) -> Iterator[Any]:
        for name in cache_._list_cache_files():
            try:
                with open(name, "rb") as handle:
                    # As FileBasedCache.get: the expiry, then the compressed value.
                    if not cache_._is_expired(handle):
                        yield pickle.loads(zlib.decompress(handle.read()))
            except FileNotFoundError:
                continue

    return values
