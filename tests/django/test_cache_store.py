"""The Django cache lock store on each backend: the whole contract, then what is cache-specific."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_dedup.exceptions import ImproperlyConfigured, StoreUnavailable
from celery_dedup.stores import store_from_url
from celery_dedup.stores.base import RevokeOutcome
from celery_dedup.stores.django_cache import CacheGuarantee, DjangoCacheStore
from celery_dedup.stores.memcached import MemcachedStore
from celery_dedup.stores.redis import RedisStore
from tests.fixtures._store_case import StoreCase
from tests.fixtures.cache_stores import CACHE_ALIAS, django_cache_config
from tests.fixtures.memcached import MemcachedServer
from tests.fixtures.redis import RedisServer
from tests.stores.contract import StoreContract

META = {"task_name": "shop.tasks.sync", "policy": "success", "task_id": "id-1"}
BACKEND = "django.core.cache.backends."


class TestDjangoCacheContract(StoreContract):
    """``django-cache://dedup`` on PyMemcacheCache, RedisCache, LocMem, file and database caches."""

    @pytest.fixture
    def store_case(self, store_django_cache: StoreCase) -> StoreCase:
        """Every backend of ``DJANGO_CACHES``."""
        return store_django_cache


# -- a lock at the end of its TTL has one next holder -------------------------------------

EXPIRY_KEYS = [f"celery-dedup:expiring:{i:02d}" for i in range(40)]
EXPIRY_RACERS = 4


def _take_expiring(url: str, owner: str, start: Callable[[], Any]) -> list[str]:
    """Poll every key until someone other than ``old`` holds it; return the keys won."""
    store = store_from_url(url)
    start()
    pending = set(EXPIRY_KEYS)
    won: list[str] = []
    deadline = time.monotonic() + 6
    while pending and time.monotonic() < deadline:
        for key in sorted(pending):
            holder = store.acquire(key, owner, 30, META)
            if holder is None:
                won.append(key)
            if holder is None or holder.owner != "old":
                pending.discard(key)
    assert not pending, f"{owner}: still held by old: {sorted(pending)}"
    return won


def _expiring_process(url: str, owner: str, barrier: Any, results: Any) -> None:
    try:
        results.put((owner, _take_expiring(url, owner, barrier.wait)))
    except BaseException as exc:
        results.put((owner, repr(exc)))
        raise


def test_expiring_lock_has_one_next_holder(
    store_django_cache: StoreCase, request: pytest.FixtureRequest
) -> None:
    """Racers polling locks that expire under them: exactly one takes each (no blind delete).

    The database cache does not promise this: its own ``get`` deletes an
    expired row by key, which can delete the lock another caller just wrote
    over it. It is labelled best effort (docs/stores/memcached.md, and a
    Django system check warns), which is what this test asserts for it.
    """
    case = store_django_cache
    assert isinstance(case.store, DjangoCacheStore)
    if request.node.callspec.params["store_django_cache"] == "database":
        assert case.store.guarantee() is CacheGuarantee.BEST_EFFORT
        return
    assert case.store.guarantee() is not CacheGuarantee.BEST_EFFORT
    for key in EXPIRY_KEYS:
        assert case.store.acquire(key, "old", 1, META) is None
    owners = [f"racer-{i}" for i in range(EXPIRY_RACERS)]
    outcomes: list[tuple[str, Any]] = []
    if case.shared_across_processes:
        context = multiprocessing.get_context("fork")
        barrier = context.Barrier(EXPIRY_RACERS)
        results = context.Queue()
        procs = [
            context.Process(target=_expiring_process, args=(case.url, owner, barrier, results))
            for owner in owners
        ]
        for proc in procs:
            proc.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(30)
    else:
        thread_barrier = threading.Barrier(EXPIRY_RACERS)
        found: queue.Queue[tuple[str, Any]] = queue.Queue()

        def run(owner: str) -> None:
            found.put((owner, _take_expiring(case.url, owner, thread_barrier.wait)))

        threads = [threading.Thread(target=run, args=(owner,)) for owner in owners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        outcomes = [found.get_nowait() for _ in threads]
    wins: Counter[str] = Counter()
    for owner, won in outcomes:
        assert isinstance(won, list), f"{owner} failed: {won}"
        wins.update(won)
        for key in won:
            lock = case.store.get(key)
            assert lock is not None and lock.owner == owner
    assert wins == Counter(dict.fromkeys(EXPIRY_KEYS, 1))


def test_ttl_beyond_2038(store_django_cache: StoreCase) -> None:
    """A TTL past what a backend can date is kept without expiry, never a raw error."""
    store = store_django_cache.store
    assert store.acquire("celery-dedup:forever", "t1", 1e10, META) is None
    lock = store.get("celery-dedup:forever")
    assert lock is not None and lock.ttl > 1e10 - 5
    assert store.revoke("celery-dedup:forever", "t1", 1e10) is RevokeOutcome.RELEASED


# -- which path each backend takes, and what it promises -----------------------------------


@pytest.fixture
def caches_of_every_kind(
    settings: Any, memcached_server: MemcachedServer, redis_server: RedisServer, tmp_path: Path,
    request: pytest.FixtureRequest,
) -> dict[str, DjangoCacheStore]:
    """A store per backend, on aliases named after them."""
    settings.CACHES = {
        **settings.CACHES,
        **{
            kind: django_cache_config(request, kind, tmp_path)
            for kind in ("memcached", "redis", "locmem", "file")
        },
        "custom-key": {"BACKEND": BACKEND + "locmem.LocMemCache", "LOCATION": "custom",
                       "KEY_FUNCTION": "tests.django.test_cache_store.custom_key"},
        "dummy": {"BACKEND": BACKEND + "dummy.DummyCache"},
    }
    return {alias: DjangoCacheStore(alias) for alias in settings.CACHES if alias != "dummy"}


def custom_key(key: str, key_prefix: str, version: int) -> str:
    """A project's own ``KEY_FUNCTION``."""
    return f"custom/{version}/{key}"


def test_each_backend_path_and_guarantee(caches_of_every_kind: dict[str, DjangoCacheStore]) -> None:
    """memcached and Redis caches use their atomic primitives; the others say what they promise."""
    stores = caches_of_every_kind
    assert isinstance(stores["memcached"].locks(), MemcachedStore)
    assert isinstance(stores["redis"].locks(), RedisStore)
    assert {alias: stores[alias].guarantee() for alias in stores if alias != "default"} == {
        "memcached": CacheGuarantee.ATOMIC,
        "redis": CacheGuarantee.ATOMIC,
        "locmem": CacheGuarantee.ATOMIC_IN_PROCESS,
        "file": CacheGuarantee.ATOMIC_ON_HOST,
        "custom-key": CacheGuarantee.ATOMIC_IN_PROCESS,
    }
    with pytest.raises(ImproperlyConfigured, match="DummyCache"):
        store_from_url("django-cache://dummy")
    with pytest.raises(ImproperlyConfigured, match="'nope'"):
        store_from_url("django-cache://nope")


def test_database_cache_is_best_effort(store_django_cache: StoreCase) -> None:
    """Only the database cache (of the tested backends) is labelled best effort."""
    store = store_django_cache.store
    assert isinstance(store, DjangoCacheStore)
    expected = {
        "django.core.cache.backends.db.DatabaseCache": CacheGuarantee.BEST_EFFORT,
        "django.core.cache.backends.locmem.LocMemCache": CacheGuarantee.ATOMIC_IN_PROCESS,
        "django.core.cache.backends.filebased.FileBasedCache": CacheGuarantee.ATOMIC_ON_HOST,
    }
    from django.conf import settings

    backend = settings.CACHES[CACHE_ALIAS]["BACKEND"]
    assert store.guarantee() is expected.get(backend, CacheGuarantee.ATOMIC)


def test_memcached_cache_keys_follow_the_cache(
    caches_of_every_kind: dict[str, DjangoCacheStore], memcached_server: MemcachedServer
) -> None:
    """On PyMemcacheCache the items carry the cache's KEY_PREFIX and VERSION."""
    store = caches_of_every_kind["memcached"]
    assert store.acquire("celery-dedup:k", "t1", 30, META) is None
    client = memcached_server.client()
    try:
        assert client.get("site:1:celery-dedup:k") is not None
    finally:
        client.close()
    assert [lock.key for lock in store.scan("celery-dedup:")] == ["celery-dedup:k"]


def test_custom_key_function_uses_the_cache_api(
    caches_of_every_kind: dict[str, DjangoCacheStore],
) -> None:
    """With a custom KEY_FUNCTION the store goes through the cache API (no listing)."""
    from celery_dedup.exceptions import ScanNotSupported

    store = caches_of_every_kind["custom-key"]
    assert store.acquire("celery-dedup:k", "t1", 30, META) is None
    holder = store.acquire("celery-dedup:k", "t2", 30, META)
    assert holder is not None and holder.owner == "t1"
    with pytest.raises(ScanNotSupported):
        list(store.scan("celery-dedup:"))


@pytest.mark.parametrize("skew", [31.0, -31.0])
def test_a_skewed_client_clock_cannot_take_a_live_lock(
    store_django_cache: StoreCase, skew: float
) -> None:
    """A store whose clock is 31 s off neither takes nor shortens a live 30-second lock."""
    case = store_django_cache
    skewed = DjangoCacheStore(CACHE_ALIAS, clock=lambda: time.time() + skew)
    assert case.store.acquire("celery-dedup:skew", "t1", 30, META) is None
    holder = skewed.acquire("celery-dedup:skew", "t2", 30, META)
    assert holder is not None and holder.owner == "t1"
    assert skewed.extend("celery-dedup:skew", "t2", 30) is False
    assert skewed.acquire("celery-dedup:short", "t3", 2, META) is None
    time.sleep(1.2)
    held = case.store.acquire("celery-dedup:short", "t4", 30, META)
    assert held is not None and held.owner == "t3"


def test_wrong_protocol_memcached_cache_is_unavailable(
    settings: Any, redis_server: RedisServer
) -> None:
    """A PyMemcacheCache whose LOCATION is a Redis port gives StoreUnavailable."""
    settings.CACHES = {
        **settings.CACHES,
        "wrong": {"BACKEND": BACKEND + "memcached.PyMemcacheCache",
                  "LOCATION": f"127.0.0.1:{redis_server.port}"},
    }
    store = store_from_url("django-cache://wrong")
    with pytest.raises(StoreUnavailable, match="did not answer as memcached"):
        store.acquire("celery-dedup:k", "t1", 30, META)
    with pytest.raises(StoreUnavailable):
        store.claim("celery-dedup:k", "t1", release=False, ttl=30, meta=META)


def test_store_works_on_an_event_loops_thread(store_django_cache: StoreCase) -> None:
    """From an async view (a thread running an event loop) every cache backend takes,
    refuses and releases a lock as from sync code (the database cache's ORM work runs off
    the loop, never ``SynchronousOnlyOperation``).
    """
    import asyncio

    store = store_django_cache.store
    key = "celery-dedup:async-view"

    async def view() -> tuple[Any, Any, bool]:
        first = store.acquire(key, "owner-a", 30, META)
        second = store.acquire(key, "owner-b", 30, META)
        return first, second, store.release(key, "owner-a")

    first, second, released = asyncio.run(view())
    assert first is None and second is not None and second.owner == "owner-a"
    assert released is True and store.get(key) is None
