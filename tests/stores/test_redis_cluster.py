"""Redis Cluster store: the Redis scripts routed by slot, scan over every primary."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from redis.exceptions import RedisClusterException

from celery_dedup.exceptions import StoreUnavailable
from celery_dedup.stores import store_from_url
from celery_dedup.stores.base import ClaimOutcome
from celery_dedup.stores.redis_cluster import RedisClusterStore, cluster_url
from tests.fixtures._servers import free_port
from tests.fixtures.redis_cluster import RedisClusterServer

pytestmark = pytest.mark.redis_cluster

META = {"task_name": "tasks.add", "policy": "success"}


@pytest.fixture
def store(redis_cluster: RedisClusterServer) -> Iterator[RedisClusterStore]:
    """A cluster store on flushed primaries."""
    redis_cluster.flush()
    store = store_from_url(redis_cluster.url)
    assert isinstance(store, RedisClusterStore)
    yield store
    store.close()
    redis_cluster.flush()


def _keys_per_node(cluster: RedisClusterServer) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for port in cluster.ports:
        with cluster.node(port) as client:
            found[port] = {k.decode() for k in client.scan_iter(count=500)}
    return found


def test_locks_spread_over_every_primary(
    store: RedisClusterStore, redis_cluster: RedisClusterServer
) -> None:
    """Locks on many keys land on all three primaries, each on the owner of its slot."""
    keys = [f"celery-dedup:tasks.add:{i:03d}" for i in range(60)]
    for key in keys:
        assert store.acquire(key, "o", 30, META) is None
    per_node = _keys_per_node(redis_cluster)
    assert all(per_node[port] for port in redis_cluster.ports)
    assert set().union(*per_node.values()) == set(keys)


def test_scan_walks_every_primary(store: RedisClusterStore) -> None:
    """scan yields the live locks of every slot under the prefix, and nothing else."""
    keys = {f"celery-dedup:tasks.a:{i:03d}": f"o{i}" for i in range(40)}
    for key, owner in keys.items():
        store.acquire(key, owner, 30, META)
    store.acquire("celery-dedup:tasks.b:1", "b", 30, META)
    store.acquire("other:tasks.a:1", "x", 30, META)
    found = {lock.key: lock.owner for lock in store.scan("celery-dedup:tasks.a:")}
    assert found == keys
    assert all(0 < lock.ttl <= 30 for lock in store.scan("celery-dedup:"))


def test_owner_checked_operations(store: RedisClusterStore) -> None:
    """Duplicate, foreign release, extend, take-over and release behave as on one Redis."""
    key = "celery-dedup:tasks.add:x"
    assert store.acquire(key, "a", 5, META) is None
    holder = store.acquire(key, "b", 5, META)
    assert holder is not None and holder.owner == "a" and holder.task_name == "tasks.add"
    assert store.release(key, "b") is False
    assert store.extend(key, "a", 100) is True
    lock = store.get(key)
    assert lock is not None and 99 < lock.ttl <= 100
    previous = store.take_over(key, "c", 30, META)
    assert previous is not None and previous.owner == "a"
    assert store.release(key, "a") is False
    assert store.release(key, "c") is True
    assert store.get(key) is None


def test_string_records_and_earlier_hashes(store: RedisClusterStore) -> None:
    """Locks are strings on the cluster too, and a hash of an earlier version is honoured."""
    client = store.client
    store.acquire("celery-dedup:tasks.add:new", "a", 30, META)
    assert client.type("celery-dedup:tasks.add:new") == b"string"
    old = "celery-dedup:tasks.add:old"
    client.hset(old, mapping={"owner": "task-1", "task": "tasks.add", "policy": "success",
                              "at": int(time.time() * 1000)})
    client.pexpire(old, 30_000)
    holder = store.acquire(old, "b", 30, META)
    assert holder is not None and (holder.owner, holder.task_id) == ("task-1", "task-1")
    claim = store.claim(old, "task-1", release=False, ttl=None, meta=META)
    assert claim.outcome is ClaimOutcome.OWNED
    assert {lock.key: lock.started for lock in store.scan("celery-dedup:")} == {
        "celery-dedup:tasks.add:new": False, old: True,
    }
    assert store.release(old, "b") is False
    assert store.release(old, "task-1") is True


@pytest.mark.parametrize("keyprefix", ["", "app1:"])
def test_take_over_revoking_writes_the_marker_on_the_lock_s_primary(
    store: RedisClusterStore, redis_cluster: RedisClusterServer, keyprefix: str
) -> None:
    """The marker the take-over script names from the record shares its lock's slot: each
    lands beside its lock on the lock's primary, and the displaced owner is refused."""
    revoking = RedisClusterStore.from_url(
        redis_cluster.url, options={"global_keyprefix": keyprefix}
    )
    keys = [f"celery-dedup:tasks.add:{i:03d}" for i in range(30)]
    try:
        for i, key in enumerate(keys):
            assert revoking.acquire(key, f"a|{i}", 30, META) is None
            previous = revoking.take_over_revoking(key, f"b{i}", 30, META, 60)
            assert previous is not None and previous.owner == f"a|{i}"
        per_node = _keys_per_node(redis_cluster)
        assert all(per_node[port] for port in redis_cluster.ports)
        for i, key in enumerate(keys):
            physical = keyprefix + key
            (node,) = [found for found in per_node.values() if physical in found]
            assert "{" + physical + "}:revoked:" + f"a|{i}" in node
            assert revoking.release(key, f"b{i}") is True
            claim = revoking.claim(key, f"a|{i}", release=False, ttl=30, meta=META)
            assert claim.outcome is ClaimOutcome.REVOKED
            assert revoking.get(key) is None
    finally:
        revoking.close()


def test_ttl_expiry_in_milliseconds(store: RedisClusterStore) -> None:
    """A 200 ms lock is gone after its TTL (Redis keeps millisecond TTLs)."""
    key = "celery-dedup:tasks.add:short"
    store.acquire(key, "a", 0.2, META)
    assert store.acquire(key, "b", 0.2, META) is not None
    time.sleep(0.3)
    assert store.acquire(key, "b", 30, META) is None


def test_counters_on_one_hash_tagged_key(
    store: RedisClusterStore, redis_cluster: RedisClusterServer
) -> None:
    """Counters add up in a single hash whose name carries a hash tag."""
    store.add_counts("celery-dedup", {("tasks.a", "acquired"): 2, ("tasks.b", "released"): 1})
    store.add_counts("celery-dedup", {("tasks.a", "acquired"): 1})
    assert store.read_counts("celery-dedup") == {
        ("tasks.a", "acquired"): 3,
        ("tasks.b", "released"): 1,
    }
    everywhere = set().union(*_keys_per_node(redis_cluster).values())
    assert everywhere == {"{celery-dedup}/counters"}


def test_building_never_connects_and_closed_port_is_unavailable() -> None:
    """from_url on a dead address succeeds; the first call raises StoreUnavailable."""
    store = RedisClusterStore.from_url(f"redis+cluster://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        store.acquire("celery-dedup:t:1", "o", 30, META)
    with pytest.raises(StoreUnavailable):
        list(store.scan("celery-dedup:"))
    assert info.value.store == "redis-cluster"
    assert isinstance(info.value.__cause__, (redis.RedisError, RedisClusterException))
    assert time.monotonic() - started < 30
    store.close()


def test_global_keyprefix_option(
    store: RedisClusterStore, redis_cluster: RedisClusterServer
) -> None:
    """global_keyprefix in the store options prefixes every physical key, not the reported one."""
    prefixed = RedisClusterStore.from_url(redis_cluster.url, options={"global_keyprefix": "app1:"})
    try:
        assert prefixed.acquire("celery-dedup:t:1", "o", 30, META) is None
        assert set().union(*_keys_per_node(redis_cluster).values()) == {"app1:celery-dedup:t:1"}
        assert [lock.key for lock in prefixed.scan("celery-dedup:")] == ["celery-dedup:t:1"]
        assert store.get("celery-dedup:t:1") is None
    finally:
        prefixed.close()


def test_cluster_url_mapping() -> None:
    """redis+cluster and rediss+cluster URLs map to redis-py's redis and rediss URLs."""
    assert cluster_url("redis+cluster://h:7000/0") == "redis://h:7000/0"
    assert cluster_url("rediss+cluster://:pw@h:7000") == "rediss://:pw@h:7000"


def test_rate_and_lock_in_one_script_only_within_one_hash_slot(store: RedisClusterStore) -> None:
    """``acquire_rated`` sends nothing for keys in two slots (the two steps run instead) and,
    for hash-tagged keys in one slot, counts and locks on that slot's primary."""
    meta = {"task_name": "t", "policy": "success", "task_id": "id-1"}
    assert store.acquire_rated("lock:a", "o", 5, meta, "rate:a", "id-1", 1, 60,
                               delay=False, unique_for=5) is None  # fmt: skip
    assert store.get("lock:a") is None
    first = store.acquire_rated("{u}:lock", "o", 5, meta, "{u}:rate", "id-1", 1, 60,
                                delay=False, unique_for=5)  # fmt: skip
    assert first is not None and first.acquired
    held = store.acquire_rated("{u}:lock", "p", 5, meta, "{u}:rate", "id-2", 1, 60,
                               delay=False, unique_for=5)  # fmt: skip
    assert held is not None and held.holder is not None and held.holder.owner == "o"
    assert store.rate_window("{u}:rate", 1, 60).count == 1


def _evalsha_calls(cluster: RedisClusterServer) -> int:
    total = 0
    for port in cluster.ports:
        with cluster.node(port) as client:
            stats = client.info("commandstats")
            total += int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    return total


def test_acquire_many_sends_one_script_per_hash_slot(
    store: RedisClusterStore, redis_cluster: RedisClusterServer
) -> None:
    """acquire_many runs one EVALSHA per hash slot among its keys: one for keys sharing a
    hash tag (a tagged prefix), one per key for keys that spread over the slots."""
    from redis.crc import key_slot

    from celery_dedup.stores.base import acquire_many

    tagged = [f"{{celery-dedup}}:tasks.add:{i:03d}" for i in range(40)]
    spread = [f"celery-dedup:tasks.add:{i:03d}" for i in range(40)]
    acquire_many(store, [("warm", "o", 30, META)])  # loads the script on a primary
    for keys in (tagged, spread):
        before = _evalsha_calls(redis_cluster)
        answers = acquire_many(store, [(key, "o", 30, META) for key in keys])
        slots = {key_slot(key.encode()) for key in keys}
        # (a primary that never ran the script loads it once: NOSCRIPT, then again)
        sent = _evalsha_calls(redis_cluster) - before
        assert len(slots) <= sent <= len(slots) + len(redis_cluster.ports)
        assert answers == [None] * len(keys)
    assert len({key_slot(key.encode()) for key in tagged}) == 1
    holders = acquire_many(store, [(key, "p", 30, META) for key in tagged])
    assert all(holder is not None and holder.owner == "o" for holder in holders)
