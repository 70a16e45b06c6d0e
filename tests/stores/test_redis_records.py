"""The Redis lock record: one compact string, and the hashes of earlier versions still honoured.

Locks written by 0.1.0 (a hash ``{owner, task, policy, at}``, the owner being
the task id) and by the versions between (``id`` and ``st`` added) are made
here the way those versions made them, on a real server, and every store
operation is run against them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_dedup.header import new_token
from celery_dedup.identity import lock_key
from celery_dedup.stores.base import ClaimOutcome, RevokeOutcome
from celery_dedup.stores.redis import RedisStore
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

DB = 56
#: a 30-character task name: the benchmark's bytes-per-lock target is for this size
NAME = "proj.billing.tasks.sync_orders"

#: 0.1.0's acquire script, verbatim: the record it wrote
ACQUIRE_0_1_0 = """
local holder = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at')
if holder[1] then
    return {holder[1], holder[2], holder[3], holder[4], redis.call('pttl', KEYS[1])}
end
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'task', ARGV[3], 'policy', ARGV[4], 'at', ARGV[5])
redis.call('pexpire', KEYS[1], ARGV[2])
return false
"""


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on this module's flushed database."""
    redis_server.flush(DB)
    with redis_server.client(DB) as client:
        yield client
    redis_server.flush(DB)


@pytest.fixture
def store(client: redis.Redis, redis_server: RedisServer) -> Iterator[RedisStore]:
    """A Redis store on the same database."""
    store = RedisStore.from_url(redis_server.url(DB))
    yield store
    store.close()


def real_key(material: str = "args") -> str:
    return lock_key("celery-dedup", NAME, material)


def write_0_1_0(client: redis.Redis, key: str, task_id: str, ttl_ms: int = 30_000) -> int:
    """A 0.1.0 lock: returns its acquired-at (epoch ms)."""
    at = int(time.time() * 1000)
    script = client.register_script(ACQUIRE_0_1_0)
    assert script(keys=[key], args=[task_id, ttl_ms, NAME, "success", at]) is None
    return at


def write_hash(
    client: redis.Redis, key: str, owner: str, task_id: str, *, started: bool, ttl_ms: int = 30_000
) -> None:
    """A lock of the versions between 0.1.0 and the string record (owner token, id, st)."""
    fields: list[Any] = [
        "owner", owner, "id", task_id, "task", NAME, "policy", "finish",
        "at", int(time.time() * 1000),
    ]
    if started:
        fields += ["st", "1"]
    client.hset(key, items=fields)
    client.pexpire(key, ttl_ms)


# -- the record ---------------------------------------------------------------------------


def test_a_live_lock_takes_at_most_200_bytes(client: redis.Redis, store: RedisStore) -> None:
    """A real key, token and task id: one string of MEMORY USAGE <= 200, started or not."""
    key, owner, task_id = real_key(), new_token(), str(uuid.uuid4())
    assert len(key) == 76  # "celery-dedup:" + 30 + ":" + 32 hex
    meta = {"task_name": NAME, "policy": "success", "task_id": task_id}
    assert store.acquire(key, owner, 3600, meta) is None
    assert client.type(key) == b"string"
    record = client.get(key)
    assert record is not None and NAME.encode() not in record  # derived from the key
    assert (client.memory_usage(key, samples=0) or 0) <= 200
    assert store.claim(key, owner, release=False, ttl=None, meta=meta).outcome is (
        ClaimOutcome.OWNED
    )
    assert (client.memory_usage(key, samples=0) or 0) <= 200
    lock = store.get(key)
    assert lock is not None
    assert (lock.owner, lock.task_name, lock.policy, lock.task_id, lock.started) == (
        owner, NAME, "success", task_id, True,
    )
    assert 3590 < lock.ttl <= 3600


@pytest.mark.parametrize(
    ("key", "meta"),
    [
        # the name is not the key's middle segment: stored
        ("celery-dedup:other.task:abc", {"task_name": NAME, "policy": "start"}),
        ("no-colons", {"task_name": "a|b%7C%25:c", "policy": "expiry"}),
        ("celery-dedup-secret:guard", {"task_name": "", "policy": "expiry", "task_id": ""}),
        # a policy without a one-letter code, and one that looks like a field
        (real_key(), {"task_name": NAME, "policy": "custom|x%", "task_id": "t"}),
        (real_key(), {"task_name": NAME, "policy": "", "task_id": "t"}),
        # anything in the task id, which comes last
        (real_key(), {"task_name": NAME, "policy": "finish", "task_id": "id|with|bars%7C é"}),
        ("p:é|ü:1", {"task_name": "é|ü", "policy": "success", "task_id": "|"}),
    ],
)
@pytest.mark.parametrize("owner", ["tok", "a|b", "a%7Cb", "%", "guard:" + "f" * 32, "é|"])
def test_every_field_reads_back_as_written(
    store: RedisStore, key: str, meta: dict[str, str], owner: str
) -> None:
    """Owner, task name, policy and task id of any characters read back; only the owner releases."""
    assert store.acquire(key, owner, 30, meta) is None
    lock = store.get(key)
    assert lock is not None
    assert (lock.owner, lock.task_name, lock.policy, lock.task_id) == (
        owner, meta["task_name"], meta["policy"], meta.get("task_id") or owner,
    )
    listed = {found.key: found for found in store.scan(key[:3])}
    assert listed[key].owner == owner and listed[key].task_name == meta["task_name"]
    for other in (owner[:-1], owner + "|", owner + "|x", owner + "%", owner.replace("|", "%7C")):
        if other != owner:
            assert store.release(key, other) is False, other
            assert store.extend(key, other, 60) is False, other
    assert store.release(key, owner) is True


def test_strings_that_are_not_locks(client: redis.Redis, store: RedisStore) -> None:
    """A foreign string at a key is held (never taken over by acquire); scan skips it."""
    client.set("celery-dedup:x:1", "1", px=30_000)
    holder = store.acquire("celery-dedup:x:1", "tok", 30, {"task_name": "x", "policy": "success"})
    assert holder is not None and holder.owner == ""
    assert client.get("celery-dedup:x:1") == b"1"
    assert store.release("celery-dedup:x:1", "") is False
    assert list(store.scan("celery-dedup:")) == []


# -- locks of earlier versions --------------------------------------------------------------


def test_a_0_1_0_lock_is_reported_and_owned_by_its_task_id(
    client: redis.Redis, store: RedisStore
) -> None:
    """acquire, get and scan report a 0.1.0 hash; its task id (the owner) releases it."""
    key = real_key("old")
    at = write_0_1_0(client, key, "task-1")
    holder = store.acquire(key, new_token(), 30, {"task_name": NAME, "policy": "success"})
    assert holder is not None
    assert (holder.owner, holder.task_id, holder.task_name, holder.policy, holder.started) == (
        "task-1", "task-1", NAME, "success", False,
    )
    assert holder.acquired_at == at / 1000 and 25 < holder.ttl <= 30
    assert client.type(key) == b"hash"
    assert [lock.owner for lock in store.scan("celery-dedup:")] == ["task-1"]
    got = store.get(key)
    assert got is not None and got.owner == "task-1"
    assert store.release(key, "task-2") is False
    assert store.extend(key, "task-2", 100) is False
    assert store.extend(key, "task-1", 100) is True
    assert 95 < client.pttl(key) / 1000 <= 100
    assert store.release(key, "task-1") is True
    assert client.exists(key) == 0


@pytest.mark.parametrize("task_id", ["a|b", "50%", "%7C"])
def test_a_0_1_0_task_id_of_any_characters_owns_its_hash(
    client: redis.Redis, store: RedisStore, task_id: str
) -> None:
    """Task ids holding the record's separators own their 0.1.0 hash, and only they do."""
    key = real_key(task_id)
    write_0_1_0(client, key, task_id)
    for other in ("a", "a%7Cb", "50%25", "|"):
        assert store.release(key, other) is False
    assert store.claim(key, task_id, release=False, ttl=None, meta={}).outcome is (
        ClaimOutcome.OWNED
    )
    assert store.release(key, task_id) is True


@pytest.mark.parametrize("task_id", ["a|b", "50%", "%7C"])
def test_a_take_over_revoking_a_0_1_0_hash_revokes_its_task_id(
    client: redis.Redis, store: RedisStore, task_id: str
) -> None:
    """The script finds the displaced owner's marker key from the record (the hash's owner,
    percent-decoded): the 0.1.0 message's start is refused after the new owner released."""
    key = real_key(f"rv{task_id}")
    write_0_1_0(client, key, task_id)
    meta = {"task_name": NAME, "policy": "success"}
    previous = store.take_over_revoking(key, "tok-b", 30, meta, 60)
    assert previous is not None and previous.owner == task_id
    assert client.type(key) == b"string"
    assert store.release(key, "tok-b") is True
    outcome = store.claim(key, task_id, release=False, ttl=30, meta=meta).outcome
    assert outcome is ClaimOutcome.REVOKED
    assert client.exists(key) == 0


def test_a_take_over_revoking_a_foreign_string_writes_no_marker(
    client: redis.Redis, store: RedisStore
) -> None:
    """A string that is no record has no owner to revoke: the take-over writes only its lock."""
    client.set("celery-dedup:x:2", "1", px=30_000)
    meta = {"task_name": "x", "policy": "success"}
    previous = store.take_over_revoking("celery-dedup:x:2", "tok", 30, meta, 60)
    assert previous is not None and previous.owner == ""
    assert sorted(client.keys("*")) == [b"celery-dedup:x:2", b"{celery-dedup:x:2}:replaced:tok"]


def test_a_0_1_0_message_claims_its_hash(client: redis.Redis, store: RedisStore) -> None:
    """A message published by 0.1.0 (owner = task id) starts, is marked started and releases."""
    key = real_key("claim")
    write_0_1_0(client, key, "task-1")
    meta = {"task_name": NAME, "policy": "success", "task_id": "task-1"}
    held = store.claim(key, "other", release=False, ttl=30, meta=meta)
    assert held.outcome is ClaimOutcome.HELD and held.holder is not None
    assert held.holder.owner == "task-1"
    assert store.claim(key, "task-1", release=False, ttl=30, meta=meta).outcome is (
        ClaimOutcome.OWNED
    )
    assert client.hget(key, "st") == b"1"
    lock = store.get(key)
    assert lock is not None and lock.started is True
    assert store.revoke(key, "task-1", 60) is RevokeOutcome.RUNNING
    assert client.exists(key) == 1
    assert store.claim(key, "task-1", release=False, ttl=30, meta=meta).outcome is (
        ClaimOutcome.REVOKED
    )
    assert client.exists(key) == 0
    write_0_1_0(client, key, "task-2")
    assert store.claim(key, "task-2", release=True, ttl=None, meta=meta).outcome is (
        ClaimOutcome.OWNED
    )
    assert client.exists(key) == 0


@pytest.mark.parametrize("started", [False, True])
def test_a_token_hash_lock_is_honoured(
    client: redis.Redis, store: RedisStore, started: bool
) -> None:
    """A hash with an owner token, task id and start flag: settle, revoke and take over."""
    key = real_key("token")
    write_hash(client, key, "tok-a", "id-a", started=started)
    lock = store.get(key)
    assert lock is not None
    assert (lock.owner, lock.task_id, lock.policy, lock.started) == (
        "tok-a", "id-a", "finish", started,
    )
    assert store.settle(key, "tok-b") is False
    assert store.settle(key, "tok-a", 90) is True
    assert client.hget(key, "st") is None and 85 < client.pttl(key) / 1000 <= 90
    if started:
        store.claim(key, "tok-a", release=False, ttl=None, meta={})
        assert store.revoke(key, "tok-a", 60) is RevokeOutcome.RUNNING
        store.unrevoke(key, "tok-a")
        previous = store.take_over(key, "tok-b", 30, {"task_name": NAME, "policy": "success"})
        assert previous is not None
        assert (previous.owner, previous.task_id, previous.started) == ("tok-a", "id-a", True)
        assert client.type(key) == b"string"
        assert store.release(key, "tok-a") is False
        assert store.release(key, "tok-b") is True
    else:
        assert store.revoke(key, "tok-b", 60) is RevokeOutcome.NOT_HELD
        assert store.revoke(key, "tok-a", 60) is RevokeOutcome.RELEASED
        assert client.exists(key) == 0


def test_a_hash_without_owner_is_free(client: redis.Redis, store: RedisStore) -> None:
    """A hash with no owner at a key (never a lock) is free, as it always was."""
    key = real_key("empty")
    client.hset(key, "at", "1")
    assert store.get(key) is None
    assert store.acquire(key, "tok", 30, {"task_name": NAME, "policy": "success"}) is None
    lock = store.get(key)
    assert lock is not None and lock.owner == "tok" and client.type(key) == b"string"
