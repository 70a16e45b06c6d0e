"""memcached store: add/gets/cas semantics, server clock, no failover, against real memcached."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dedup.exceptions import ImproperlyConfigured, ScanNotSupported, StoreUnavailable
from celery_dedup.stores import store_from_url
from celery_dedup.stores.base import ClaimOutcome, RevokeOutcome
from celery_dedup.stores.memcached import MemcachedStore, expiry_for, parse_servers
from tests.fixtures._servers import free_port, running
from tests.fixtures.memcached import MemcachedServer, memcached_argv
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.memcached

META = {"task_name": "tasks.add", "policy": "success", "task_id": "id-1"}
#: a client clock this far off must change nothing but the times it reports
SKEW = 31.0


@pytest.fixture
def store(memcached_server: MemcachedServer) -> Iterator[MemcachedStore]:
    """A memcached store on a flushed server."""
    memcached_server.flush()
    store = MemcachedStore.from_url(memcached_server.url)
    yield store
    store.close()
    memcached_server.flush()


def _skewed(server: MemcachedServer, skew: float) -> MemcachedStore:
    """A store on ``server`` whose host clock is ``skew`` seconds off."""
    return MemcachedStore([("127.0.0.1", server.port)], clock=lambda: time.time() + skew)


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
    store.acquire("warm-up", "t0", 30, META)  # open the connection and read the clock first
    before = _stats(memcached_server)
    assert store.acquire("celery-dedup:tasks.add:aa", "t1", 30, META) is None
    after = _stats(memcached_server)
    assert after["cmd_set"] - before["cmd_set"] == 1
    assert after["cmd_get"] - before["cmd_get"] == 0


def test_duplicate_returns_holder(store: MemcachedStore) -> None:
    """A second owner gets the holder's owner, task id, task, policy and remaining TTL back."""
    assert store.acquire("celery-dedup:tasks.add:bb", "t1", 30, META) is None
    holder = store.acquire("celery-dedup:tasks.add:bb", "t2", 30, META)
    assert holder is not None
    assert (holder.owner, holder.task_id, holder.task_name, holder.policy) == (
        "t1", "id-1", "tasks.add", "success",
    )
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
    """After a take-over, the previous owner's release, extend and claim are refused."""
    key = "celery-dedup:tasks.add:dd"
    store.acquire(key, "old", 30, META)
    previous = store.take_over(key, "new", 30, META)
    assert previous is not None and previous.owner == "old"
    assert store.release(key, "old") is False
    assert store.extend(key, "old", 60) is False
    assert store.claim(key, "old", release=True, ttl=None, meta=META).outcome is ClaimOutcome.HELD
    lock = store.get(key)
    assert lock is not None and lock.owner == "new"


def test_extend_sets_new_expiry_and_keeps_fields(store: MemcachedStore) -> None:
    """The owner's extend rewrites the end (cas), keeping owner, task id, start, acquired_at."""
    key = "celery-dedup:tasks.add:ff"
    store.acquire(key, "t1", 5, {**META, "started": "1"})
    first = store.get(key)
    assert store.extend(key, "t1", 100) is True
    lock = store.get(key)
    assert first is not None and lock is not None
    assert (lock.owner, lock.task_id, lock.started) == ("t1", "id-1", True)
    assert lock.acquired_at == first.acquired_at
    assert 99 < lock.ttl <= 100


def test_expiry_for_memcached_seconds() -> None:
    """TTLs become whole seconds rounded up plus one tick of memcached's clock."""
    assert expiry_for(0.2) == 2
    assert expiry_for(1.0) == 2
    assert expiry_for(59.01) == 61


def test_liveness_is_the_server_item_expiry(store: MemcachedStore) -> None:
    """A lock holds until memcached drops its item (at least the TTL, under 2 s more)."""
    key = "celery-dedup:tasks.add:hh"
    started = time.monotonic()
    store.acquire(key, "t1", 0.3, META)
    time.sleep(0.4)
    holder = store.acquire(key, "t2", 0.3, META)
    assert holder is not None and holder.owner == "t1" and holder.ttl == 0
    while store.acquire(key, "t2", 30, META) is not None:
        time.sleep(0.05)
    assert time.monotonic() - started < 2.5


def test_long_ttl_is_a_unix_time_on_the_server_clock(
    store: MemcachedStore, memcached_server: MemcachedServer
) -> None:
    """Beyond 30 days the expiry is absolute, computed on the server's clock, not the host's."""
    skewed = _skewed(memcached_server, -10 * 86400.0)
    try:
        forty_days = 40 * 86400.0
        assert skewed.acquire("celery-dedup:long", "t1", forty_days, META) is None
        lock = store.get("celery-dedup:long")
        # Two stores' readings of the server clock agree within about a second.
        assert lock is not None and forty_days - 5 < lock.ttl <= forty_days + 1
    finally:
        skewed.close()


def test_ttl_beyond_2038_never_expires(store: MemcachedStore) -> None:
    """memcached cannot expire an item after 2038: such a lock is stored without expiry."""
    ttl = 1e10
    assert store.acquire("celery-dedup:forever", "t1", ttl, META) is None
    lock = store.get("celery-dedup:forever")
    assert lock is not None and ttl - 5 < lock.ttl <= ttl
    assert store.claim("celery-dedup:forever", "t1", release=False, ttl=None, meta=META).outcome \
        is ClaimOutcome.OWNED
    assert store.extend("celery-dedup:forever", "t1", ttl) is True
    assert store.release("celery-dedup:forever", "t1") is True


@pytest.mark.parametrize("skew", [SKEW, -SKEW])
def test_a_skewed_client_clock_changes_nothing(
    store: MemcachedStore, memcached_server: MemcachedServer, skew: float
) -> None:
    """A host whose clock is 31 s off can neither take nor shorten a live 30-second lock.

    Liveness is the item on the server; the times in the record are on the
    server's clock; the skewed host reports them on its own clock.
    """
    skewed = _skewed(memcached_server, skew)
    try:
        assert store.acquire("celery-dedup:skew:a", "t1", 30, META) is None
        holder = skewed.acquire("celery-dedup:skew:a", "t2", 30, META)
        assert holder is not None and holder.owner == "t1"
        assert holder.expires_at - skewed.clock() == pytest.approx(30, abs=1.5)
        assert skewed.claim("celery-dedup:skew:a", "t2", release=False, ttl=30, meta=META).outcome \
            is ClaimOutcome.HELD
        # The skewed host's locks and its start check keep their TTL on the server.
        assert skewed.acquire("celery-dedup:skew:b", "t3", 2, META) is None
        claim = skewed.claim("celery-dedup:skew:b", "t3", release=False, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.OWNED
        lock = store.get("celery-dedup:skew:b")
        assert lock is not None and lock.started and 0.5 < lock.ttl <= 3
        time.sleep(1.5)
        assert store.acquire("celery-dedup:skew:b", "t4", 30, META) is not None
        lock = store.get("celery-dedup:skew:a")
        assert lock is not None and lock.owner == "t1" and 25 < lock.ttl <= 30
    finally:
        skewed.close()


def test_claim_keeps_the_lock_end_within_the_margin(store: MemcachedStore) -> None:
    """The start check rewrites the item with the remaining time plus 2 s, never less."""
    key = "celery-dedup:claim:end"
    started = time.monotonic()
    store.acquire(key, "t1", 1, META)
    assert store.claim(key, "t1", release=False, ttl=None, meta=META).outcome is ClaimOutcome.OWNED
    time.sleep(1.1)
    lock = store.get(key)
    assert lock is not None and lock.started  # past its TTL, within the margin
    while store.get(key) is not None:
        time.sleep(0.1)
    assert time.monotonic() - started < 5.5


RACE_ROUNDS = 150


@pytest.mark.parametrize("held", [True, False], ids=["queued", "lock-expired"])
def test_claim_racing_revoke_never_runs_a_revoked_message(
    store: MemcachedStore, memcached_server: MemcachedServer, held: bool
) -> None:
    """A start check and a revoke of the same token, at the same moment, 150 times.

    Whatever the interleaving of their round trips, a message that starts
    (OWNED or FREE) is one the revoke saw running, never one it reported
    released or not held.
    """
    other = MemcachedStore.from_url(memcached_server.url)
    barrier = threading.Barrier(2)
    claims: list[ClaimOutcome] = []
    revokes: list[RevokeOutcome] = []
    keys = [f"celery-dedup:race:{i:03d}" for i in range(RACE_ROUNDS)]
    if held:
        for key in keys:
            assert store.acquire(key, "tok", 30, META) is None

    def start_checks() -> None:
        for key in keys:
            barrier.wait()
            claims.append(store.claim(key, "tok", release=False, ttl=30, meta=META).outcome)

    def revokes_() -> None:
        for key in keys:
            barrier.wait()
            revokes.append(other.revoke(key, "tok", 60))

    threads = [threading.Thread(target=start_checks), threading.Thread(target=revokes_)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        other.close()
    pairs = Counter(zip(claims, revokes, strict=True))
    started = {ClaimOutcome.OWNED, ClaimOutcome.FREE}
    ran_revoked = [p for p in pairs if p[0] in started and p[1] is not RevokeOutcome.RUNNING]
    assert not ran_revoked, pairs
    assert sum(pairs.values()) == RACE_ROUNDS
    for key, claim in zip(keys, claims, strict=True):
        lock = store.get(key)
        assert (lock is not None) == (claim in started), (key, claim, lock)


def test_reads_a_0_1_0_record(store: MemcachedStore, memcached_server: MemcachedServer) -> None:
    """A record written by 0.1.0 (no task id, no start flag): the owner is its task id."""
    now = time.time()
    record = json.dumps({"k": "celery-dedup:old", "o": "task-id-1", "t": "tasks.add",
                         "p": "success", "a": now, "e": now + 30})
    client = memcached_server.client()
    try:
        client.set("celery-dedup:old", record, 31)
    finally:
        client.close()
    holder = store.acquire("celery-dedup:old", "token", 30, META)
    assert holder is not None
    assert (holder.owner, holder.task_id, holder.started) == ("task-id-1", "task-id-1", False)
    claim = store.claim("celery-dedup:old", "task-id-1", release=False, ttl=None, meta=META)
    assert claim.outcome is ClaimOutcome.OWNED
    lock = store.get("celery-dedup:old")
    assert lock is not None and lock.started and lock.task_id == "task-id-1"


def test_markers_are_never_listed(store: MemcachedStore) -> None:
    """Revoked markers share no key with locks and never decode as one (scan of a bare prefix)."""
    store.acquire("celery-dedup:m:1", "t1", 30, META)
    assert store.revoke("celery-dedup:m:2", "t2", 30) is RevokeOutcome.NOT_HELD
    assert [lock.key for lock in store.scan("celery-dedup")] == ["celery-dedup:m:1"]


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
    for i in range(5):
        store.acquire(f"celery-dedup:tasks.a:{i}", f"o{i}", 30, META)
    store.acquire("celery-dedup:tasks.b:0", "b", 30, META)
    store.acquire("other:tasks.a:0", "x", 30, META)
    found = {lock.key: lock.owner for lock in store.scan("celery-dedup:tasks.a:")}
    assert found == {f"celery-dedup:tasks.a:{i}": f"o{i}" for i in range(5)}


def test_several_servers_spread_keys_and_scan_all(
    memcached_pair: tuple[MemcachedServer, MemcachedServer],
) -> None:
    """A ';'-separated URL spreads locks over both servers and scan finds them on each."""
    first, second = memcached_pair
    store = store_from_url(f"cache+memcached://127.0.0.1:{first.port};127.0.0.1:{second.port}/")
    assert isinstance(store, MemcachedStore)
    try:
        keys = [f"celery-dedup:tasks.spread:{i:02d}" for i in range(40)]
        for key in keys:
            assert store.acquire(key, "o", 30, META) is None
        on_first = [k for k in keys if _raw_get(first, k) is not None]
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


def test_bad_options_are_configuration_errors(memcached_server: MemcachedServer) -> None:
    """HashClient failover options and a key prefix memcached refuses fail at construction."""
    with pytest.raises(ImproperlyConfigured, match="retry_attempts"):
        store_from_url(memcached_server.url, options={"retry_attempts": 2, "timeout": 0.5})
    with pytest.raises(ImproperlyConfigured, match="key_prefix"):
        store_from_url(memcached_server.url, options={"key_prefix": "my app:"})


def test_wrong_protocol_server_is_unavailable(redis_server: RedisServer) -> None:
    """A memcached:// URL at a Redis port gives StoreUnavailable, never a raw driver error."""
    from pymemcache.exceptions import MemcacheError

    store = MemcachedStore.from_url(f"memcached://127.0.0.1:{redis_server.port}")
    try:
        calls = [
            lambda: store.acquire("celery-dedup:t:1", "o", 30, META),
            lambda: store.get("celery-dedup:t:1"),
            lambda: store.release("celery-dedup:t:1", "o"),
            lambda: store.claim("celery-dedup:t:1", "o", release=False, ttl=30, meta=META),
            lambda: store.revoke("celery-dedup:t:1", "o", 30),
            lambda: store.add_counts("celery-dedup", {("t", "acquired"): 1}),
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable, match="did not answer as memcached") as info:
                call()
            assert isinstance(info.value.__cause__, MemcacheError | ValueError)
    finally:
        store.close()


# -- several servers: a key never moves while its server is alive -----------------------------

PAUSE_KEYS = [f"celery-dedup:pause:{i:03d}" for i in range(200)]
PAUSE_RACERS = 4


def _pause_racer(url: str, owner: str, ready: Any, deadline: float, results: Any) -> None:
    """Acquire every key once, wait for the pause, then keep acquiring until the deadline."""
    wins: Counter[str] = Counter()
    unavailable = 0
    try:
        store = store_from_url(url)
        for key in PAUSE_KEYS:
            if store.acquire(key, owner, 60, META) is None:
                wins[key] += 1
        ready.wait()
        while time.monotonic() < deadline:
            for key in PAUSE_KEYS:
                try:
                    if store.acquire(key, owner, 60, META) is None:
                        wins[key] += 1
                except StoreUnavailable:
                    unavailable += 1
        results.put((owner, dict(wins), unavailable))
    except BaseException as exc:
        results.put((owner, repr(exc), 0))
        raise


@pytest.mark.slow
def test_paused_server_never_lets_a_second_holder_in(
    memcached_pair: tuple[MemcachedServer, MemcachedServer],
) -> None:
    """One of two servers frozen for 1 s while 4 processes race for its keys: one winner each.

    Its keys raise StoreUnavailable while it is frozen (a client with
    failover would move them to the other server, where a second owner
    would take them), and are held again by their first owner after.
    """
    first, second = memcached_pair
    # A client timeout shorter than the pause, so calls do notice it.
    url = f"memcached://127.0.0.1:{first.port};127.0.0.1:{second.port}/?timeout=0.5"
    context = multiprocessing.get_context("fork")
    ready = context.Barrier(PAUSE_RACERS + 1)
    results = context.Queue()
    deadline = time.monotonic() + 4.0
    racers = [
        context.Process(target=_pause_racer, args=(url, f"owner-{i}", ready, deadline, results))
        for i in range(PAUSE_RACERS)
    ]
    for racer in racers:
        racer.start()
    try:
        ready.wait(timeout=60)
        time.sleep(0.2)
        with first.paused():
            time.sleep(1.0)
        outcomes = [results.get(timeout=60) for _ in racers]
    finally:
        for racer in racers:
            racer.join(30)
    wins: Counter[str] = Counter()
    owners: dict[str, str] = {}
    unavailable = 0
    for owner, won, failed in outcomes:
        assert isinstance(won, dict), f"{owner} failed: {won}"
        wins.update(won)
        owners.update(dict.fromkeys(won, owner))
        unavailable += failed
    assert unavailable > 0, "no call noticed the paused server"
    assert wins == Counter(dict.fromkeys(PAUSE_KEYS, 1))
    store = store_from_url(url)
    try:
        for key in PAUSE_KEYS:
            lock = store.get(key)
            assert lock is not None and lock.owner == owners[key], key
        on_first = [k for k in PAUSE_KEYS if _raw_get(first, k) is not None]
        assert 0 < len(on_first) < len(PAUSE_KEYS)
    finally:
        store.close()
