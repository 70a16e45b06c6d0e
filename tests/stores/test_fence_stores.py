"""Fencing tokens in the start claim: per key, only growing, in the claim's round trip.

Redis, Redis Cluster (the same scripts, routed by slot) and the memory store
issue them (``FencedClaims``); the SQL, Django and memcached stores do not,
and a task asking for them is refused when its options are resolved.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_dedup import DedupTask, FencingNotSupported
from celery_dedup.runs import records_of
from celery_dedup.stores import store_from_url
from celery_dedup.stores.base import ClaimOutcome, FencedClaims, LockStore, RunOutcome, RunRef
from celery_dedup.stores.memory import MemoryStore
from celery_dedup.stores.redis import RedisStore
from tests.core.test_round_trips import counting_client, measure
from tests.fixtures.redis import RedisServer
from tests.fixtures.redis_cluster import RedisClusterServer

META = {"task_name": "t", "policy": "success", "task_id": "id"}


@pytest.fixture(params=["memory", "redis", "redis_cluster"])
def store(request: pytest.FixtureRequest) -> Iterator[LockStore]:
    if request.param == "memory":
        yield MemoryStore()
    elif request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        server.flush(9)
        yield RedisStore(server.client(9))
    else:
        cluster: RedisClusterServer = request.getfixturevalue("redis_cluster")
        cluster.flush()
        yield store_from_url(cluster.url)


def _fence(store: LockStore, key: str, owner: str, **kw: object) -> int | None:
    assert isinstance(store, FencedClaims)
    claim = store.claim(key, owner, release=False, ttl=60, meta=META, fence=True, **kw)  # type: ignore[call-arg]
    return claim.fence


def test_every_admitted_claim_of_a_key_gets_a_greater_fence(store: LockStore) -> None:
    """FREE (taken), OWNED, OWNED-and-released, and a new owner after a release: each greater."""
    fences = [_fence(store, "k", "a")]  # free: taken
    fences.append(_fence(store, "k", "a"))  # owned
    store.release("k", "a")
    store.acquire("k", "b", 60, META)
    fences.append(_fence(store, "k", "b"))
    claim = store.claim("k", "b", release=True, ttl=None, meta=META, fence=True)  # type: ignore[call-arg]
    assert claim.outcome is ClaimOutcome.OWNED
    fences.append(claim.fence)
    assert all(isinstance(f, int) for f in fences)
    assert fences == sorted(set(fences)), fences  # type: ignore[type-var]
    assert store.fence_of("k") == fences[-1]  # type: ignore[attr-defined]
    other = _fence(store, "other", "c")
    assert other is not None and store.fence_of("other") == other  # type: ignore[attr-defined]
    assert store.fence_of("k") == fences[-1]  # type: ignore[attr-defined]


def test_a_claim_that_does_not_run_the_body_issues_no_fence(store: LockStore) -> None:
    """HELD and REVOKED answers carry no fence and leave the counter as it was."""
    first = _fence(store, "k", "a")
    held = store.claim("k", "b", release=False, ttl=60, meta=META, fence=True)  # type: ignore[call-arg]
    assert held.outcome is ClaimOutcome.HELD and held.fence is None
    store.revoke("k", "c", 60)
    revoked = store.claim("k", "c", release=False, ttl=60, meta=META, fence=True)  # type: ignore[call-arg]
    assert revoked.outcome is ClaimOutcome.REVOKED and revoked.fence is None
    assert store.fence_of("k") == first  # type: ignore[attr-defined]
    plain = store.claim("k", "a", release=False, ttl=60, meta=META)
    assert plain.outcome is ClaimOutcome.OWNED and plain.fence is None


@pytest.mark.parametrize("gated", [False, True])
def test_run_claims_issue_fences_too(store: LockStore, gated: bool) -> None:
    """claim_run: a copy that begins gets a fence; a copy of a running attempt none;
    a copy taking over a dead run's lease, a greater one (a keep_last run: gated)."""
    records = records_of(store)
    run = RunRef("k", "a", "0.0", "tok1", gated=gated, fenced=True)
    outcome, claim = records.claim_run(run, 60, META, release=False, ttl=60)
    assert outcome is RunOutcome.BEGUN and claim is not None
    first = claim.fence
    assert first is not None
    copy = RunRef("k", "a", "0.0", "tok2", gated=gated, fenced=True)
    outcome, claim = records.claim_run(copy, 60, META, release=False, ttl=60)
    waiting = RunOutcome.WAITING if gated else RunOutcome.RUNNING  # a gate is checked first
    assert outcome in (RunOutcome.RUNNING, waiting) and claim is None
    heir = RunRef("k", "a", "0.0", "tok2", gated=gated, inherits="tok1", fenced=True)
    outcome, claim = records.claim_run(heir, 60, META, release=False, ttl=60)
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.fence is not None and claim.fence > first
    records.end_run(heir, 60, META, release=True)
    follow_up = RunRef("k", "b", "0.0", "tok3", gated=gated, fenced=True)
    outcome, claim = records.claim_run(follow_up, 60, META, release=False, ttl=60)
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.fence is not None and claim.fence > first
    assert store.fence_of("k") == claim.fence  # type: ignore[attr-defined]


def test_a_fenced_claim_is_one_round_trip(redis_server: RedisServer) -> None:
    """The fence rides on the claim's script: claim and claim_run stay one EVALSHA each."""
    client = counting_client(redis_server, 10)
    client.flushdb()
    store = RedisStore(client)
    store.claim("warm", "o", release=False, ttl=5, meta=META, fence=True)
    store.claim_run(RunRef("warm", "o", "0.0", "t", fenced=True), 5, META, release=False, ttl=5)
    store.claim_run(
        RunRef("warm", "o", "0.0", "t", gated=True, fenced=True), 5, META, release=False, ttl=5
    )
    assert measure(client, lambda: store.claim("k", "a", release=False, ttl=5, meta=META,
                                               fence=True)) == 1
    run = RunRef("k2", "a", "0.0", "t", fenced=True)
    assert measure(client, lambda: store.claim_run(run, 5, META, release=False, ttl=5)) == 1
    gated = RunRef("k3", "a", "0.0", "t", gated=True, fenced=True)
    assert measure(client, lambda: store.claim_run(gated, 5, META, release=False, ttl=5)) == 1
    assert client.pttl(store._fence_key("k")) > 0  # the counter has a TTL, as every record
    client.close()


def test_a_store_without_fences_is_refused_when_the_task_is_configured(tmp_path: object) -> None:
    """SQL (here SQLite), Django and memcached stores: FencingNotSupported naming task and store."""
    app = Celery("fence-sql", set_as_current=False)
    app.conf.update(broker_url="memory://", result_backend=None,
                    dedup_store=f"db+sqlite:///{tmp_path}/locks.db")

    @app.task(base=DedupTask, fence=True, shared=False)
    def fenced() -> None: ...

    with pytest.raises(FencingNotSupported) as caught:
        fenced.delay()
    assert "fenced" in str(caught.value) and "fence=True" in str(caught.value)
    assert caught.value.store == "sql"
