"""Limits that depend on the call (issue 34, item 4): ``concurrency_limit`` and
``rate_limit_per_key`` given as callables of the call's arguments.

Real in-thread workers, Redis broker and backend, the slots and windows kept
in Redis or PostgreSQL. Each body counts itself in Redis: ``INCR`` on entry
(the highest value seen is the most bodies of a key that ran at once),
``DECR`` on exit, and an ``RPUSH`` of its argument (how many times it ran).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import Celery, states

from celery_dedup import DedupTask, InvalidOptionError, RateLimited
from celery_dedup.limits import concurrency_store_key, live_keys
from celery_dedup.runtime import runtime_for
from celery_dedup.signals import task_skipped
from celery_dedup.stores.base import SlotSupport, slot_holder
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

# KEYS[1] - running counter, KEYS[2] - the highest value it reached
_ENTER = """
local v = redis.call('INCR', KEYS[1])
if v > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], v)
end
return v
"""


@pytest.fixture(params=["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_conf(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The store keeping slots and windows: the Redis result backend, or PostgreSQL."""
    if request.param == "redis":
        return {}
    return {"dedup_store": request.getfixturevalue("store_postgres").url}


def _tier(customer: str, *_: Any, **__: Any) -> int:
    return 3 if customer.startswith("vip") else 1


def test_per_tier_concurrency_limits_hold(
    app_factory: AppFactory,
    worker_for: Any,
    redis_server: RedisServer,
    store_conf: dict[str, Any],
) -> None:
    """``concurrency_limit=`` a function of the customer: 8 calls of a vip customer run at
    most 3 at once and 8 of a basic one at most 1 at once, each call exactly once; every
    body waits until its key's limit is reached, so the highest count is exactly the
    limit (a key let over it would show more)."""
    app = app_factory("tiers", dedup_lease_ttl=6, **store_conf)
    marks = redis_server.client(4)
    enter = marks.register_script(_ENTER)

    @app.task(
        base=DedupTask, shared=False, concurrency_limit=_tier,
        concurrency_key="{customer}", concurrency_backoff=0.5,
    )  # fmt: skip
    def work(customer: str, n: int) -> int:
        enter(keys=[f"tiers:running:{customer}", f"tiers:max:{customer}"])
        try:
            marks.rpush(f"tiers:ran:{customer}", n)
            # Until the key's limit is reached (or the key has no more calls to run).
            wait_until(
                lambda: int(marks.get(f"tiers:max:{customer}") or 0) >= _tier(customer)
                or marks.llen(f"tiers:ran:{customer}") == 8,
                timeout=60,
            )
            threading.Event().wait(0.2)
        finally:
            marks.decr(f"tiers:running:{customer}")
        return n

    worker_for(app, concurrency=8, prefetch_multiplier=4)
    results = [work.delay(c, n) for n in range(8) for c in ("vip-1", "basic-1")]
    assert sorted(r.get(timeout=120) for r in results) == sorted([*range(8), *range(8)])
    for customer, limit in (("vip-1", 3), ("basic-1", 1)):
        ran = sorted(int(x) for x in marks.lrange(f"tiers:ran:{customer}", 0, -1))
        assert ran == list(range(8)), (customer, ran)
        assert int(marks.get(f"tiers:max:{customer}") or 0) == limit, customer
    store = runtime_for(app).store
    assert isinstance(store, SlotSupport)
    for customer in ("vip-1", "basic-1"):
        key = concurrency_store_key("celery-dedup", work.name, customer)
        wait_until(lambda k=key: store.slots_in_use(k) == 0, timeout=60)


def test_a_limit_change_takes_effect_without_a_restart(
    app_factory: AppFactory,
    worker_for: Any,
    redis_server: RedisServer,
    store_conf: dict[str, Any],
) -> None:
    """The limit is read from Redis at each call. 3 bodies run under limit 3; the limit
    drops to 1: two new calls wait while any of the 3 runs (the body freeing a slot under
    limit 3 hands it to nobody waiting under 1), then the first of them runs alone. The
    limit rises to 2 while it runs: the other starts beside it (when its deferred copy
    comes back and asks again), and a new call finds 2 running and waits."""
    app = app_factory("change", dedup_lease_ttl=6, **store_conf)
    marks = redis_server.client(4)
    enter = marks.register_script(_ENTER)
    marks.set("change:limit", 3)
    gates = {n: threading.Event() for n in range(10)}
    seen: dict[int, int] = {}
    deferred: set[str] = set()

    def limit(customer: str, n: int) -> int:
        return int(marks.get("change:limit") or 0)

    @app.task(
        base=DedupTask, shared=False, concurrency_limit=limit,
        concurrency_key="{customer}", concurrency_backoff=0.5,
    )  # fmt: skip
    def work(customer: str, n: int) -> int:
        seen[n] = int(enter(keys=["change:running", "change:max"]))
        try:
            marks.rpush("change:ran", n)
            gates[n].wait(60)
        finally:
            marks.decr("change:running")
        return n

    def on_skip(sender: Any = None, reason: str = "", task_id: str = "", **_: Any) -> None:
        if getattr(sender, "name", None) == work.name and reason.startswith("deferred"):
            deferred.add(task_id)

    task_skipped.connect(on_skip, weak=False)
    try:
        worker_for(app, concurrency=8, prefetch_multiplier=4)
        first = [work.delay("acme", n) for n in range(3)]
        wait_until(lambda: marks.llen("change:ran") == 3, timeout=60)
        marks.set("change:limit", 1)
        later = [work.delay("acme", n) for n in (3, 4)]
        wait_until(lambda: {r.id for r in later} <= deferred, timeout=60)
        gates[0].set()  # 2 still run: over the new limit of 1
        assert first[0].get(timeout=60) == 0
        gates[1].set()
        assert first[1].get(timeout=60) == 1
        gates[2].set()
        assert first[2].get(timeout=60) == 2
        # Now one of the later calls runs, alone.
        wait_until(lambda: marks.llen("change:ran") == 4, timeout=60)
        running = int(marks.lrange("change:ran", 3, 3)[0])
        assert seen[running] == 1
        # The limit rises to 2 while it runs: the other waiting call starts beside it.
        marks.set("change:limit", 2)
        wait_until(lambda: marks.llen("change:ran") == 5, timeout=60)
        other = int(marks.lrange("change:ran", 4, 4)[0])
        assert {running, other} == {3, 4}
        assert seen[other] == 2
        # A new call finds 2 running under the limit 2: it waits; one ends, it runs.
        last = work.delay("acme", 5)
        wait_until(lambda: last.id in deferred, timeout=60)
        assert marks.llen("change:ran") == 5
        gates[3].set()
        gates[4].set()
        assert [r.get(timeout=60) for r in later] == [3, 4]
        gates[5].set()
        assert last.get(timeout=60) == 5
    finally:
        task_skipped.disconnect(on_skip)
        for gate in gates.values():
            gate.set()
    assert sorted(int(x) for x in marks.lrange("change:ran", 0, -1)) == list(range(6))
    assert int(marks.get("change:max") or 0) == 3  # never more than the first limit
    store = runtime_for(app).store
    assert isinstance(store, SlotSupport)
    key = concurrency_store_key("celery-dedup", work.name, "acme")
    wait_until(lambda: store.slots_in_use(key) == 0, timeout=60)


def test_a_bad_limit_from_the_callable_fails_the_task_without_its_body(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer
) -> None:
    """A callable answering no positive int fails the call with ``InvalidOptionError``
    naming the task, the option, the value and what is allowed; the body never runs."""
    app = app_factory("bad-limit")
    marks = redis_server.client(4)

    @app.task(
        base=DedupTask, shared=False, unique_until="finish", name="bad.limit",
        concurrency_limit=lambda n: 0 if n == 0 else "2",
    )  # fmt: skip
    def work(n: int) -> int:
        marks.rpush("bad:ran", n)
        return n

    worker_for(app)
    for n, value in ((0, "0"), (1, "'2'")):
        result = work.delay(n)
        wait_until(lambda r=result: r.state == states.FAILURE, timeout=60)
        text = str(result.result)
        assert "bad.limit" in text and "concurrency_limit" in text, text
        assert value in text and "int >= 1" in text, text
    assert marks.llen("bad:ran") == 0


def test_per_tier_rates_and_a_rate_change(
    app_factory: AppFactory,
    worker_for: Any,
    redis_server: RedisServer,
    store_conf: dict[str, Any],
) -> None:
    """``rate_limit_per_key=`` a function of the call: a vip customer's window admits 3
    publishes a minute, a basic one's 1; the rate read from Redis changes between calls
    and the next call obeys it; every admitted publish runs exactly once."""
    app = app_factory("rates", **store_conf)
    marks = redis_server.client(4)
    marks.set("rates:override", "")

    def rate(customer: str, n: int) -> str:
        override = (marks.get("rates:override") or b"").decode()
        if override and customer == "acme":
            return override
        return "3/m" if customer.startswith("vip") else "1/m"

    @app.task(
        base=DedupTask, shared=False, name="rates.send", rate_limit_per_key=rate,
        rate_key="{customer}",
    )  # fmt: skip
    def send(customer: str, n: int) -> int:
        marks.rpush(f"rates:ran:{customer}", n)
        return n

    worker_for(app)
    admitted = []

    def call(customer: str, n: int) -> bool:
        try:
            admitted.append(send.delay(customer, n))
        except RateLimited:
            return False
        return True

    assert [call("vip-1", n) for n in range(4)] == [True, True, True, False]
    assert [call("basic-1", n) for n in range(2)] == [True, False]
    # acme: 1/m, then 3/m (two more at once), then 2/m (full: 3 in the window).
    assert [call("acme", n) for n in range(2)] == [True, False]
    marks.set("rates:override", "3/m")
    assert [call("acme", n) for n in range(2, 5)] == [True, True, False]
    marks.set("rates:override", "2/m")
    assert call("acme", 5) is False
    for result in admitted:
        result.get(timeout=60)
    ran = {c: sorted(int(x) for x in marks.lrange(f"rates:ran:{c}", 0, -1))
           for c in ("vip-1", "basic-1", "acme")}  # fmt: skip
    assert ran == {"vip-1": [0, 1, 2], "basic-1": [0], "acme": [0, 2, 3]}
    # A callable answering no rate: a typed error before anything is published.
    marks.set("rates:override", "often")
    with pytest.raises(InvalidOptionError) as caught:
        send.delay("acme", 9)
    text = str(caught.value)
    assert "rates.send" in text and "rate_limit_per_key" in text and "'often'" in text, text
    assert marks.llen("rates:ran:acme") == 3


def test_the_listing_shows_a_callable_limit_from_its_records() -> None:
    """``celery dedup limits`` (``live_keys``): a callable's limit is the one the key's
    newest slot or publish was admitted under, as the store recorded it."""
    app = Celery("listing", set_as_current=False)
    app.conf.update(
        broker_url="memory://", result_backend=None, dedup_store="memory://listing",
        task_default_queue="listing",
    )  # fmt: skip

    @app.task(
        base=DedupTask, shared=False, name="listing.job", concurrency_limit=_tier,
        concurrency_key="{customer}", rate_limit_per_key=lambda customer, n: "7/m",
        rate_key="{customer}",
    )  # fmt: skip
    def job(customer: str, n: int) -> int:
        return n

    assert job.delay("vip-1", 1).deduplicated is False
    store = runtime_for(app).store
    assert isinstance(store, SlotSupport)
    key = concurrency_store_key("celery-dedup", job.name, "vip-1")
    assert store.take_slot(key, slot_holder("id-1", "00", 3), 3, 30)[0]
    found = live_keys(store, "celery-dedup", app.tasks)
    assert [row["limit"] for row in found["concurrency"]] == [3]
    assert [(row["limit"], row["period"], row["count"]) for row in found["rate"]] == [
        (7, 60.0, 1)
    ]
