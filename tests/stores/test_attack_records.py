"""Attacks on the packed Redis record: foreign values, earlier versions, protocols, key shapes.

A lock is one string parsed by the scripts (owner up to the first ``|``)
and by Python (``_unpack``); earlier versions' hashes are still honoured.
Each test tries to get a wrong answer, a crash or a lock nobody can release
out of that, on a real redis-server.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import ClaimOutcome, RevokeOutcome
from celery_dedup.stores.redis import RedisStore
from celery_dedup.testing import held_locks
from tests.fixtures.redis import RedisServer
from tests.stores.test_redis_records import ACQUIRE_0_1_0  # what a 0.1.0 producer runs

pytestmark = pytest.mark.redis

DB = 54
NAME = "proj.billing.tasks.sync_orders"
META = {"task_name": NAME, "policy": "success", "task_id": "id-1"}

@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    redis_server.flush(DB)
    with redis_server.client(DB) as client:
        yield client
    redis_server.flush(DB)


@pytest.fixture
def store(raw: redis.Redis, redis_server: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore.from_url(redis_server.url(DB))
    yield store
    store.close()


def key_0_1_0(material: str) -> str:
    """A key as 0.1.0 made it: a full 64-character sha256."""
    return f"celery-dedup:{NAME}:{hashlib.sha256(material.encode()).hexdigest()}"


def key_now(material: str) -> str:
    return f"celery-dedup:{NAME}:{hashlib.sha256(material.encode()).hexdigest()[:32]}"


# -- values that are not records ------------------------------------------------------------


@pytest.mark.parametrize("value", [b"\xff\xfe|\x80", b"0s\xff|abc|tid", b"1b\xc3|\xff|x"])
def test_a_foreign_binary_value_under_the_prefix_is_not_a_lock_and_breaks_nothing(
    raw: redis.Redis, store: RedisStore, value: bytes
) -> None:
    """Undecodable bytes at a key: listed by nobody, held by nobody known, never a crash.

    The hash format answered WRONGTYPE inside the pipeline for these (and
    ``scan`` skipped them); the string format reads them with ``GET``.
    """
    foreign = key_now("foreign")
    raw.set(foreign, value, px=30_000)
    assert store.acquire(key_now("mine"), "tok", 30, META) is None
    assert [lock.key for lock in store.scan("celery-dedup:")] == [key_now("mine")]
    holder = store.get(foreign)
    assert holder is not None and holder.owner == ""
    held = store.acquire(foreign, "tok", 30, META)
    assert held is not None and held.owner == ""
    assert raw.get(foreign) == value


def test_a_value_of_another_type_under_the_prefix_is_skipped_by_scan(
    raw: redis.Redis, store: RedisStore
) -> None:
    raw.rpush(key_now("list"), "x")
    raw.sadd(key_now("set"), "x")
    raw.hset(key_now("hash"), "at", "1")  # a hash without owner: no lock
    raw.script_flush()  # the pipelined get script must be loaded again
    assert store.acquire(key_now("mine"), "tok", 30, META) is None
    assert [lock.owner for lock in store.scan("celery-dedup:")] == ["tok"]


# -- a producer not yet upgraded --------------------------------------------------------------


def test_a_0_1_0_producer_still_sees_a_lock_an_upgraded_worker_retook(
    raw: redis.Redis, store: RedisStore
) -> None:
    """Workers first, then producers (docs/stores/redis.md): the old producer keeps working.

    A 0.1.0 message whose lock expired before it started is retaken by the
    upgraded worker's start claim (policy ``success``). The 0.1.0 producer
    makes the same key for the same call; its acquire must report the lock
    as held, not fail with WRONGTYPE (its ``apply_async`` would raise).
    """
    key = key_0_1_0("args")
    old_acquire = raw.register_script(ACQUIRE_0_1_0)
    at = int(time.time() * 1000)
    assert old_acquire(keys=[key], args=["task-1", 30_000, NAME, "success", at]) is None
    raw.delete(key)  # the lock expired while the message waited in the queue
    claim = store.claim(key, "task-1", release=False, ttl=60, meta={**META, "task_id": "task-1"})
    assert claim.outcome is ClaimOutcome.FREE
    holder = old_acquire(keys=[key], args=["task-2", 30_000, NAME, "success", at])
    assert holder is not None and holder[0] == b"task-1"


# -- protocols and decoding ------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"protocol": 3}, {"decode_responses": True}, {"protocol": 3, "decode_responses": True}],
    ids=["resp3", "decoded", "resp3-decoded"],
)
def test_every_operation_on_resp3_and_decoding_clients(
    raw: redis.Redis, redis_server: RedisServer, options: dict[str, Any]
) -> None:
    """``dedup_store_options`` may change the reply types: every answer stays the same."""
    app = Celery("records-resp3", broker="memory://", set_as_current=False)
    app.conf.result_backend = redis_server.url(DB)
    store = RedisStore.from_url(redis_server.url(DB), app=app, options=options)
    try:
        key, legacy = key_now("resp3"), key_0_1_0("resp3")
        meta = {**META, "task_id": "id|é"}
        assert store.acquire(key, "a|%", 30, meta) is None
        holder = store.acquire(key, "b", 30, meta)
        assert holder is not None
        assert (holder.owner, holder.task_id, holder.task_name) == ("a|%", "id|é", NAME)
        assert store.claim(key, "b", release=False, ttl=30, meta=meta).outcome is (
            ClaimOutcome.HELD
        )
        assert store.claim(key, "a|%", release=False, ttl=None, meta=meta).outcome is (
            ClaimOutcome.OWNED
        )
        assert store.revoke(key, "a|%", 30) is RevokeOutcome.RUNNING
        assert store.settle(key, "a|%") is True
        raw.hset(legacy, mapping={"owner": "old|id", "task": NAME, "policy": "success", "at": 5})
        raw.pexpire(legacy, 30_000)
        listed = {lock.key: lock for lock in store.scan("celery-dedup:")}
        assert listed[key].owner == "a|%" and listed[key].started is False
        assert listed[legacy].owner == "old|id" and listed[legacy].acquired_at == 0.005
        assert store.take_over(legacy, "c", 30, meta) is not None
        assert store.release(legacy, "old|id") is False
        assert store.release(legacy, "c") is True
        assert store.get("nothing") is None and store.release("nothing", "x") is False
        assert store.claim(key, "a|%", release=False, ttl=30, meta=meta).outcome is (
            ClaimOutcome.REVOKED
        )
        assert raw.exists(key, legacy) == 0
        assert list(store.scan("celery-dedup:")) == []
    finally:
        store.close()
        app.close()


# -- owners that look like each other ---------------------------------------------------------


OWNERS = ["tok", "to", "tok|", "tok%7C", "tok|x", "%", "%25", "|", "guard:" + "f" * 32, "é"]


@pytest.mark.parametrize("legacy", [False, True], ids=["record", "hash"])
@pytest.mark.parametrize("owner", OWNERS)
def test_only_the_exact_owner_settles_claims_revokes_or_takes_back(
    raw: redis.Redis, store: RedisStore, owner: str, legacy: bool
) -> None:
    """Prefixes, separators and their encodings of an owner are other owners, for every script."""
    key = key_now("owners")
    if legacy:
        raw.hset(key, mapping={"owner": owner, "task": NAME, "policy": "success", "at": 1})
        raw.pexpire(key, 30_000)
    else:
        assert store.acquire(key, owner, 30, META) is None
    others = [o for o in OWNERS if o != owner]
    for other in others:
        assert store.settle(key, other) is False, other
        assert store.extend(key, other, 90) is False, other
        assert store.claim(key, other, release=True, ttl=None, meta=META).outcome is (
            ClaimOutcome.HELD
        ), other
        assert store.revoke(key, other, 30) is RevokeOutcome.NOT_HELD, other
        store.unrevoke(key, other)
    lock = store.get(key)
    assert lock is not None and lock.owner == owner and lock.started is False
    assert store.claim(key, owner, release=False, ttl=None, meta=META).outcome is (
        ClaimOutcome.OWNED
    )
    assert store.revoke(key, owner, 30) is RevokeOutcome.RUNNING
    assert store.claim(key, owner, release=False, ttl=None, meta=META).outcome is (
        ClaimOutcome.REVOKED
    )
    assert raw.exists(key) == 0


# -- key shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key_prefix", "keyprefix"),
    [("app:dedup", ""), ("celery-dedup", "tenant:{t1}:"), ("a", "x")],
)
def test_task_names_read_back_whatever_the_prefixes(
    redis_server: RedisServer, raw: redis.Redis, key_prefix: str, keyprefix: str
) -> None:
    """A prefix with ":" (the name is stored) or a global key prefix (the name is derived)."""
    app = Celery("records-prefix", broker="memory://", set_as_current=False)
    app.conf.update(
        result_backend=redis_server.url(DB),
        result_backend_transport_options={"global_keyprefix": keyprefix},
        dedup_key_prefix=key_prefix,
    )

    @app.task(base=DedupTask, name="tasks:with:colons", shared=False, unique_for=30)
    def first(x: int) -> int:
        return x

    @app.task(base=DedupTask, name="tasks", shared=False, unique_for=30)
    def second(x: int) -> int:
        return x

    try:
        one, two = first.delay(1), second.delay(1)
        assert {k.decode() for k in raw.keys("*")} == {
            keyprefix + one.deduplication_key,
            keyprefix + two.deduplication_key,
        }
        found = {lock.key: lock.task_name for lock in held_locks(app)}
        assert found == {one.deduplication_key: "tasks:with:colons", two.deduplication_key: "tasks"}
        store = runtime_for(app).store
        assert store is not None
        # What the CLI lists for one task: the keys under its name, of that name.
        under = store.scan(f"{key_prefix}:tasks:")
        named = [lock.key for lock in under if lock.task_name == "tasks"]
        assert named == [two.deduplication_key]
        lock = store.get(one.deduplication_key)
        assert lock is not None and lock.task_name == "tasks:with:colons"
        assert first.delay(1).deduplicated is True and second.delay(1).deduplicated is True
    finally:
        app.close()
