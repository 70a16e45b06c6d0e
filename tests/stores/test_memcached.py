"""memcached and Django-cache stores: add/gets/cas semantics against a real memcached."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dedup.exceptions import ImproperlyConfigured, ScanNotSupported, StoreUnavailable
from celery_dedup.stores import store_from_url
from celery_dedup.stores.memcached import MemcachedStore, expiry_for, parse_servers
from tests.fixtures._servers import free_port, running
from tests.fixtures.memcached import MemcachedServer, memcached_argv
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.memcached

META = {"task_name": "tasks.add", "policy": "success"}


@pytest.fixture
def store(memcached_server: MemcachedServer) -> Iterator[MemcachedStore]:
    """A memcached store on a flushed server."""
    memcached_server.flush()
    store = MemcachedStore.from_url(memcached_server.url)
    yield store
    store.close()
    memcached_server.flush()


def _stats(server: MemcachedServer) -> dict[str, int]:
    client = server.client()
    try:
        raw = client.stats()
    finally:
        client.close()
    return {k.decode(): v for k, v in raw.items() if isinstance(v, int)}


def _raw_get(server: MemcachedServer, physical: str) -> bytes | None:
    client = server.client()
    try:
        value: bytes | None = client.get(physical)
        return value
    finally:
        client.close()


def test_acquire_free_key_is_one_add(
    store: MemcachedStore, memcached_server: MemcachedServer
) -> None:
    """Taking a free lock costs exactly one storage command and no read."""
    store.get("warm-up")  # open the connection first
    before = _stats(memcached_server)
    assert store.acquire("celery-dedup:tasks.add:aa", "t1", 30, META) is None
    after = _stats(memcached_server)
    assert after["cmd_set"] - before["cmd_set"] == 1
    assert after["cmd_get"] - before["cmd_get"] == 0


def test_duplicate_returns_holder(store: MemcachedStore) -> None:
    """A second owner gets the holder's owner, task, policy and remaining TTL back."""
    assert store.acquire("celery-dedup:tasks.add:bb", "t1", 30, META) is None
    holder = store.acquire("celery-dedup:tasks.add:bb", "t2", 30, META)
    assert holder is not None
    assert (holder.owner, holder.task_name, holder.policy) == ("t1", "tasks.add", "success")
    assert holder.key == "celery-dedup:tasks.add:bb"
    assert 29 < holder.ttl <= 30


def test_release_is_owner_checked_compare_and_delete(
    store: MemcachedStore, memcached_server: MemcachedServer
) -> None:
    """A foreign release is refused; the owner's cas with a negative expiry deletes the item."""
    key = "celery-dedup:tasks.add:cc"
    store.acquire(key, "t1", 30, META)
    assert store.release(key, "intruder") is False
    assert _raw_get(memcached_server, key) is not None
    assert store.release(key, "t1") is True
    assert _raw_get(memcached_server, key) is None
    assert store.release(key, "t1") is False
    assert store.acquire(key, "t2", 30, META) is None


def test_late_release_never_frees_a_newer_holder(store: MemcachedStore) -> None:
    """After a take-over, the previous owner's release and extend are refused."""
    key = "celery-dedup:tasks.add:dd"
    store.acquire(key, "old", 30, META)
    previous = store.take_over(key, "new", 30, META)
    assert previous is not None and previous.owner == "old"
    assert store.release(key, "old") is False
    assert store.extend(key, "old", 60) is False
    lock = store.get(key)
    assert lock is not None and lock.owner == "new"


def test_take_over_free_key_returns_none(store: MemcachedStore) -> None:
    """Taking over a free key reports no previous holder and holds it."""
    assert store.take_over("celery-dedup:tasks.add:ee", "t1", 30, META) is None
    lock = store.get("celery-dedup:tasks.add:ee")
    assert lock is not None and lock.owner == "t1"


def test_extend_sets_new_expiry_and_keeps_owner(store: MemcachedStore) -> None:
    """The owner's extend rewrites expires_at (via cas) and keeps owner and acquired_at."""
    key = "celery-dedup:tasks.add:ff"
    store.acquire(key, "t1", 5, META)
    first = store.get(key)
    assert store.extend(key, "t1", 100) is True
    lock = store.get(key)
    assert first is not None and lock is not None
    assert lock.owner == "t1" and lock.acquired_at == first.acquired_at
    assert 99 < lock.ttl <= 100


def test_expiry_rounds_up_and_lock_ends_at_exact_time(
    store: MemcachedStore, memcached_server: MemcachedServer
) -> None:
    """The item outlives its lock (ceil(ttl) + 1 s); the lock is free at expires_at exactly."""
    key = "celery-dedup:tasks.add:gg"
    now = time.time()
    store.clock = lambda: now
    store.acquire(key, "t1", 1.2, META)
    store.clock = lambda: now + 1.3  # past expires_at, well within the item's 3 s
    assert _raw_get(memcached_server, key) is not None
    assert store.get(key) is None
    assert store.release(key, "t1") is False
    assert store.acquire(key, "t2", 10, META) is None  # cas over the stale record
    lock = store.get(key)
    assert lock is not None and lock.owner == "t2"


def test_expiry_for_memcached_seconds() -> None:
    """TTLs become whole seconds rounded up plus one tick; beyond 30 days a Unix time."""
    assert expiry_for(0.2, 1000.0) == 2
    assert expiry_for(1.0, 1000.0) == 2
    assert expiry_for(59.01, 1000.0) == 61
    assert expiry_for(40 * 86400, 1000.5) == 1001 + 40 * 86400 + 1


def test_real_expiry_frees_the_lock(store: MemcachedStore) -> None:
    """A lock with a sub-second TTL is free once that time has passed on the clock."""
    key = "celery-dedup:tasks.add:hh"
    store.acquire(key, "t1", 0.3, META)
    assert store.acquire(key, "t2", 0.3, META) is not None
    time.sleep(0.4)
    assert store.acquire(key, "t2", 30, META) is None


def test_long_and_unsafe_keys_are_hashed(
    store: MemcachedStore, memcached_server: MemcachedServer
) -> None:
    """Keys over 250 bytes or with spaces are stored under their sha256 and still listed."""
    long_key = "celery-dedup:" + "t" * 300 + ":abc"
    spaced = "celery-dedup:my task:abc"
    for key in (long_key, spaced):
        assert store.acquire(key, "t1", 30, META) is None
        lock = store.get(key)
        assert lock is not None and lock.key == key
        physical = store._physical(key)
        assert physical.startswith("#") and len(physical) == 65
        assert _raw_get(memcached_server, physical) is not None
    assert {lock.key for lock in store.scan("celery-dedup:")} == {long_key, spaced}
    assert store.release(long_key, "t1") is True


def test_scan_lists_live_locks_under_prefix(store: MemcachedStore) -> None:
    """scan walks the server's keys and yields only live locks under the prefix."""
    now = time.time()
    for i in range(5):
        store.acquire(f"celery-dedup:tasks.a:{i}", f"o{i}", 30, META)
    store.acquire("celery-dedup:tasks.b:0", "b", 30, META)
    store.acquire("other:tasks.a:0", "x", 30, META)
    store.acquire("celery-dedup:tasks.a:short", "s", 1, META)
    store.clock = lambda: now + 2
    found = {lock.key: lock.owner for lock in store.scan("celery-dedup:tasks.a:")}
    assert found == {f"celery-dedup:tasks.a:{i}": f"o{i}" for i in range(5)}


def test_several_servers_spread_keys_and_scan_all(
    memcached_server: MemcachedServer, tmp_path: Path
) -> None:
    """A ';'-separated URL spreads locks over both servers and scan finds them on each."""
    port = free_port()
    with running(memcached_argv(port), port, log=tmp_path / "mc2.log"):
        url = f"cache+memcached://127.0.0.1:{memcached_server.port};127.0.0.1:{port}/"
        store = store_from_url(url)
        assert isinstance(store, MemcachedStore)
        try:
            memcached_server.flush()
            keys = [f"celery-dedup:tasks.spread:{i:02d}" for i in range(40)]
            for key in keys:
                assert store.acquire(key, "o", 30, META) is None
            on_first = [k for k in keys if _raw_get(memcached_server, k) is not None]
            assert 0 < len(on_first) < len(keys)
            assert sorted(lock.key for lock in store.scan("celery-dedup:")) == keys
            assert all(store.release(k, "o") for k in keys)
        finally:
            store.close()


def test_scan_refused_raises_typed_error(tmp_path: Path) -> None:
    """Without the LRU crawler, scan raises ScanNotSupported while locks keep working."""
    port = free_port()
    argv = [*memcached_argv(port), "-o", "no_lru_crawler"]
    with running(argv, port, log=tmp_path / "mc.log"):
        store = MemcachedStore.from_url(f"memcached://127.0.0.1:{port}")
        try:
            assert store.acquire("celery-dedup:t:1", "o", 30, META) is None
            with pytest.raises(ScanNotSupported) as info:
                list(store.scan("celery-dedup:"))
            assert isinstance(info.value, NotImplementedError)
            assert store.get("celery-dedup:t:1") is not None
        finally:
            store.close()


def test_closed_port_raises_store_unavailable() -> None:
    """Every operation on a port nothing listens on raises StoreUnavailable, quickly."""
    store = MemcachedStore.from_url(f"memcached://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        store.acquire("celery-dedup:t:1", "o", 30, META)
    with pytest.raises(StoreUnavailable):
        store.release("celery-dedup:t:1", "o")
    with pytest.raises(StoreUnavailable):
        list(store.scan("celery-dedup:"))
    assert info.value.store == "memcached"
    assert isinstance(info.value.__cause__, OSError)
    assert time.monotonic() - started < 5
    store.close()


def test_stopped_server_raises_then_recovers(tmp_path: Path) -> None:
    """A server that dies under an open client gives StoreUnavailable; a restart heals it."""
    port = free_port()
    store = MemcachedStore.from_url(f"memcached://127.0.0.1:{port}")
    try:
        with running(memcached_argv(port), port, log=tmp_path / "a.log"):
            assert store.acquire("celery-dedup:t:1", "o", 30, META) is None
        with pytest.raises(StoreUnavailable):
            store.acquire("celery-dedup:t:1", "o", 30, META)
        with running(memcached_argv(port), port, log=tmp_path / "b.log"):
            assert store.acquire("celery-dedup:t:1", "o", 30, META) is None
    finally:
        store.close()


def test_counters_add_up(store: MemcachedStore) -> None:
    """add_counts increments (creating on first use); read_counts finds each under the prefix."""
    store.add_counts("celery-dedup", {("tasks.a", "acquired"): 2, ("tasks.b", "fallback"): 1})
    store.add_counts("celery-dedup", {("tasks.a", "acquired"): 3})
    store.add_counts("other", {("tasks.a", "acquired"): 7})
    assert store.read_counts("celery-dedup") == {
        ("tasks.a", "acquired"): 5,
        ("tasks.b", "fallback"): 1,
    }


def test_url_parsing() -> None:
    """Server lists, default ports, IPv6 and query timeouts are read from the URL."""
    assert parse_servers("memcached://a:1;b:2/") == ([("a", 1), ("b", 2)], {})
    assert parse_servers("memcached://a,[::1]:3")[0] == [("a", 11211), ("::1", 3)]
    assert parse_servers("memcached://h:5/?timeout=0.5")[1] == {"timeout": "0.5"}


def test_store_modules_import_no_driver() -> None:
    """Importing the cache store modules loads neither pymemcache nor Django's settings or caches.

    (kombu itself imports ``django.utils.functional`` when Django is installed.)
    """
    code = (
        "import sys, celery_dedup, celery_dedup.stores.memcached, "
        "celery_dedup.stores.django_cache, celery_dedup.stores.redis_cluster; "
        "print(sorted(m for m in ('pymemcache', 'django.conf', 'django.core.cache') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"


DJANGO_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import django
    from django.conf import settings
    settings.configure(CACHES={
        "default": {"BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
                    "LOCATION": sys.argv[1], "KEY_PREFIX": "site"},
        "redis": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                  "LOCATION": sys.argv[2]},
        "loc": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "dummy": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"},
    })
    django.setup()
    from celery_dedup.stores import store_from_url
    from celery_dedup.exceptions import ScanNotSupported
    meta = {"task_name": "t", "policy": "success"}
    out = {}
    for url in ("django-cache", "django-cache://redis", "django-cache://loc"):
        s = store_from_url(url)
        key = "celery-dedup:t:" + url
        row = [type(s.locks()).__name__, s.acquire(key, "a", 30, meta) is None]
        holder = s.acquire(key, "b", 30, meta)
        row += [holder.owner, s.release(key, "b"), s.extend(key, "a", 60),
                round(s.get(key).ttl), s.take_over(key, "c", 30, meta).owner,
                s.release(key, "a"), s.release(key, "c"), s.get(key)]
        try:
            row.append(sorted(l.key for l in s.scan("celery-dedup:")))
        except ScanNotSupported:
            row.append("no-scan")
        out[url] = row
    try:
        store_from_url("django-cache://dummy")
    except Exception as exc:
        out["dummy"] = type(exc).__name__
    print(json.dumps(out))
    """
)


def test_django_cache_store_backends(
    memcached_server: MemcachedServer, redis_url: str, tmp_path: Path
) -> None:
    """django-cache uses cas on PyMemcacheCache, Lua on RedisCache, get/delete elsewhere."""
    script = tmp_path / "django_cache.py"
    script.write_text(DJANGO_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), f"127.0.0.1:{memcached_server.port}", redis_url],
        capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    common = ["a", False, True, 60, "a", False, True, None]
    assert rows["django-cache"] == ["MemcachedStore", True, *common, []]
    assert rows["django-cache://redis"] == ["RedisStore", True, *common, []]
    assert rows["django-cache://loc"] == ["_GenericCacheLocks", True, *common, "no-scan"]
    assert rows["dummy"] == "ImproperlyConfigured"


def test_django_cache_unknown_alias(redis_server: RedisServer) -> None:
    """An alias missing from settings.CACHES is an ImproperlyConfigured naming it."""
    code = textwrap.dedent(
        """
        import django
        from django.conf import settings
        settings.configure(CACHES={"default": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache"}})
        django.setup()
        from celery_dedup.stores import store_from_url
        from celery_dedup.exceptions import ImproperlyConfigured
        try:
            store_from_url("django-cache://nope")
        except ImproperlyConfigured as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2], timeout=60, check=False)
    assert "'nope'" in out.stdout, out.stderr
    assert issubclass(ImproperlyConfigured, Exception)
