"""``SlotSupport`` and ``RateSupport`` on every store that keeps them, on real servers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import cast

import pytest

from celery_dedup.runs import records_of
from celery_dedup.stores import store_from_url
from celery_dedup.stores.base import (
    GateHandoff,
    LimitListing,
    LockStore,
    RateSupport,
    RunOutcome,
    RunRef,
    SlotHandoff,
    SlotSupport,
    SlotTurn,
    SlotWaiter,
)
from celery_dedup.stores.memory import MemoryStore
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer
from tests.stores.contract import META


@pytest.fixture(params=[
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("redis-cluster", marks=pytest.mark.redis_cluster, id="redis-cluster"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("memory", id="memory"),
])
def limited_store(request: pytest.FixtureRequest) -> Iterator[object]:
    """A store with slots and rates, emptied."""
    yield from _emptied(request, request.param)


def _emptied(request: pytest.FixtureRequest, kind: str) -> Iterator[object]:
    if kind in ("postgres", "redis-cluster"):
        fixture = "store_postgres" if kind == "postgres" else "store_redis_cluster"
        case: StoreCase = request.getfixturevalue(fixture)
        yield case.store
        return
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        server.flush(9)
        store = store_from_url(server.url(9))
        yield store
        server.flush(9)
        return
    yield MemoryStore()


def test_slots_hold_a_limit_under_contention(limited_store: object) -> None:
    """20 threads take a slot of one key with limit 3: exactly 3 get one."""
    assert isinstance(limited_store, SlotSupport)
    store = limited_store
    taken: list[str] = []
    barrier = threading.Barrier(20)

    def take(n: int) -> None:
        barrier.wait()
        ok, in_use = store.take_slot("celery-dedup-slots:t:k", f"h{n}", 3, 30)
        assert in_use <= 3
        if ok:
            taken.append(f"h{n}")

    threads = [threading.Thread(target=take, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(taken) == 3
    assert store.slots_in_use("celery-dedup-slots:t:k") == 3
    assert store.take_slot("celery-dedup-slots:t:k", taken[0], 3, 30) == (True, 3)  # re-entry
    assert store.renew_slots([("celery-dedup-slots:t:k", h) for h in taken], 30) == 3
    assert store.give_slot("celery-dedup-slots:t:k", taken[0]) is True
    assert store.give_slot("celery-dedup-slots:t:k", taken[0]) is False
    assert store.take_slot("celery-dedup-slots:t:k", "late", 3, 30) == (True, 3)
    assert store.renew_slots([("celery-dedup-slots:t:k", taken[0])], 30) == 0


def test_rate_window_admits_exactly_the_limit(limited_store: object) -> None:
    """20 threads hit a 5-per-minute window at once: 5 admitted, 15 refused with a wait."""
    assert isinstance(limited_store, RateSupport)
    store = limited_store
    answers = []
    lock = threading.Lock()
    barrier = threading.Barrier(20)

    def hit(n: int) -> None:
        barrier.wait()
        answer = store.hit_rate("celery-dedup-rate:t:k", f"id{n}", 5, 60, delay=False)
        with lock:
            answers.append((f"id{n}", answer))

    threads = [threading.Thread(target=hit, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    admitted = [member for member, a in answers if a.admitted]
    refused = [a for _, a in answers if not a.admitted]
    assert len(admitted) == 5
    assert all(0 < a.wait <= 60 and a.count == 5 and a.last in admitted for a in refused)
    window = store.rate_window("celery-dedup-rate:t:k", 5, 60)
    assert window.count == 5 and window.last in admitted and 0 < window.wait <= 60
    # Delayed: every call admitted, at places 60 s apart per 5.
    waits = [
        store.hit_rate("celery-dedup-rate:t:k", f"later{n}", 5, 60, delay=True).wait
        for n in range(10)
    ]
    assert all(55 < w <= 60 for w in waits[:5])
    assert all(115 < w <= 120 for w in waits[5:])


def test_sqlite_keeps_no_limits(sqlite_url: str) -> None:
    """A SQL dialect other than PostgreSQL refuses loudly instead of running unlimited."""
    from celery_dedup import LimitsNotSupported

    store = store_from_url(sqlite_url)
    assert isinstance(store, SlotSupport) and isinstance(store, RateSupport)
    with pytest.raises(LimitsNotSupported, match="sqlite"):
        store.take_slot("k", "h", 1, 10)
    with pytest.raises(LimitsNotSupported, match="sqlite"):
        store.hit_rate("k", "m", 1, 10, delay=False)


def test_redis_limit_keys_carry_a_ttl(redis_server: RedisServer) -> None:
    """Every slot and rate key Redis keeps expires by itself (a crashed holder's too)."""
    redis_server.flush(9)
    store = store_from_url(redis_server.url(9))
    assert isinstance(store, SlotSupport) and isinstance(store, RateSupport)
    store.take_slot("celery-dedup-slots:t:k", "h", 2, 30)
    store.hit_rate("celery-dedup-rate:t:k", "id1", 1, 60, delay=False)
    store.hit_rate("celery-dedup-rate:t:k", "id2", 1, 60, delay=True)  # reserved 60 s ahead
    client = redis_server.client(9)
    assert 0 < client.pttl("celery-dedup-slots:t:k") <= 30_000
    assert 60_000 < client.pttl("celery-dedup-rate:t:k") <= 120_000
    redis_server.flush(9)


def test_listing_finds_the_live_slot_and_rate_keys(limited_store: object) -> None:
    """``LimitListing`` lists each key with live slots / window entries, under a prefix only.

    ``a_b`` and ``a%b`` must not match ``axb`` (SQL LIKE wildcards, glob characters).
    """
    assert isinstance(limited_store, LimitListing)
    assert isinstance(limited_store, SlotSupport) and isinstance(limited_store, RateSupport)
    store = limited_store
    for holder in ("h1", "h2"):
        assert store.take_slot("celery-dedup-slots:a_b:d1", holder, 3, 60)[0]
    assert store.take_slot("celery-dedup-slots:axb:d2", "h3", 3, 60)[0]
    assert store.take_slot("celery-dedup-slots:a*b:d3", "h4", 3, 60)[0]
    assert store.take_slot("celery-dedup-slots:a_b:gone", "h5", 3, 60)[0]
    assert store.give_slot("celery-dedup-slots:a_b:gone", "h5")
    assert store.take_slot("other-slots:a_b:d1", "h6", 3, 60)[0]
    assert store.hit_rate("celery-dedup-rate:a_b:r1", "id1", 2, 60, delay=False).admitted
    assert store.hit_rate("celery-dedup-rate:a_b:r1", "id2", 2, 60, delay=False).admitted
    assert store.hit_rate("celery-dedup-rate:a_b:r1", "id3", 2, 60, delay=True).wait > 50
    assert store.hit_rate("celery-dedup-rate:axb:r2", "id4", 2, 60, delay=False).admitted

    slots = {s.key: s.in_use for s in store.list_slots("celery-dedup-slots:")}
    assert slots == {
        "celery-dedup-slots:a_b:d1": 2,
        "celery-dedup-slots:axb:d2": 1,
        "celery-dedup-slots:a*b:d3": 1,
    }
    assert [s.key for s in store.list_slots("celery-dedup-slots:a_b:")] == [
        "celery-dedup-slots:a_b:d1"
    ]
    assert [s.key for s in store.list_slots("celery-dedup-slots:a*b:")] == [
        "celery-dedup-slots:a*b:d3"
    ]
    assert store.list_slots("celery-dedup-slots:a%b:") == []

    windows = {w.key: w for w in store.list_rates("celery-dedup-rate:")}
    assert set(windows) == {"celery-dedup-rate:a_b:r1", "celery-dedup-rate:axb:r2"}
    r1 = windows["celery-dedup-rate:a_b:r1"]
    # newest first: the place reserved ~60 s ahead, then the two admitted now
    assert len(r1.ages) == 3 and r1.last == "id3"
    assert -60 <= r1.ages[0] < -50 and all(0 <= age < 30 for age in r1.ages[1:])
    assert [w.key for w in store.list_rates("celery-dedup-rate:axb:")] == [
        "celery-dedup-rate:axb:r2"
    ]


def test_redis_listing_skips_other_keys_under_the_prefix(redis_server: RedisServer) -> None:
    """A key of another type that happens to match the prefix is not a limit key."""
    redis_server.flush(9)
    store = store_from_url(redis_server.url(9))
    assert isinstance(store, LimitListing) and isinstance(store, SlotSupport)
    redis_server.client(9).set("celery-dedup-slots:t:not-a-zset", "x", ex=60)
    store.take_slot("celery-dedup-slots:t:k", "h", 2, 30)
    assert [s.key for s in store.list_slots("celery-dedup-slots:")] == ["celery-dedup-slots:t:k"]
    redis_server.flush(9)


def test_rate_window_counts_publishes_not_task_ids(limited_store: object) -> None:
    """5 publishes sharing one task id (``deterministic_id=True``) at 2 per minute: 2 admitted.

    The window holds one entry per publish; its answers and listings still
    name the task id.
    """
    assert isinstance(limited_store, RateSupport) and isinstance(limited_store, LimitListing)
    store = limited_store
    answers = [
        store.hit_rate("celery-dedup-rate:t:same", "fixed-id", 2, 60, delay=False)
        for _ in range(5)
    ]
    assert [a.admitted for a in answers] == [True, True, False, False, False]
    assert all(a.last == "fixed-id" for a in answers)
    assert all(a.count == 2 and 0 < a.wait <= 60 for a in answers[2:])
    window = store.rate_window("celery-dedup-rate:t:same", 2, 60)
    assert (window.count, window.last) == (2, "fixed-id")
    delayed = store.hit_rate("celery-dedup-rate:t:same", "fixed-id", 2, 60, delay=True)
    assert delayed.admitted and 55 < delayed.wait <= 60 and delayed.last == "fixed-id"
    (listed,) = store.list_rates("celery-dedup-rate:t:same")
    assert len(listed.ages) == 3 and listed.last == "fixed-id"


@pytest.fixture(params=[
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("redis-cluster", marks=pytest.mark.redis_cluster, id="redis-cluster"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("memory", id="memory"),
])
def handoff_store(request: pytest.FixtureRequest) -> Iterator[SlotHandoff]:
    """A store that hands freed slots to waiters (``SlotHandoff``), emptied."""
    for store in _emptied(request, request.param):
        assert isinstance(store, SlotHandoff)
        yield store


def _waiter(name: str, order: float, life: float = 60.0) -> SlotWaiter:
    return SlotWaiter(name, order, f"payload of {name}".encode(), life)


def test_handoff_serves_waiters_oldest_first(handoff_store: SlotHandoff) -> None:
    """Limit 1: the holder's give wakes the oldest waiter, whose copy takes the reserved slot;
    a newcomer never jumps the line; the last give leaves the key empty."""
    store, key = handoff_store, "celery-dedup-slots:t:hand"
    assert store.take_slot_in_turn(key, "a:1", 1, 30, _waiter("a", 1.0), 5) == SlotTurn(True, 1)
    # Registered out of call order: the list follows the call time, not the arrival.
    for name, order in (("c", 3.0), ("b", 2.0), ("d", 4.0)):
        assert store.take_slot_in_turn(key, f"{name}:1", 1, 30, _waiter(name, order), 5) == (
            SlotTurn(False, 1)
        )
    # A waiter coming back (its parked copy) keeps its place, even with a later time.
    assert not store.take_slot_in_turn(key, "c:2", 1, 30, _waiter("c", 9.0), 5).taken
    assert store.give_slot_in_turn(key, "a:1", 1, 5) == (b"payload of b",)
    # The slot is reserved for b: a newcomer (even an older call) and c wait.
    assert store.take_slot_in_turn(key, "e:1", 1, 30, _waiter("e", 0.5), 5) == SlotTurn(False, 1)
    assert store.take_slot_in_turn(key, "b:2", 1, 30, _waiter("b", 2.0), 5) == SlotTurn(True, 1)
    order = []
    holder = "b:2"
    for _ in range(3):
        woken = store.give_slot_in_turn(key, holder, 1, 5)
        assert len(woken) == 1
        name = woken[0].decode().rsplit(" ", 1)[1]
        order.append(name)
        holder = f"{name}:3"
        assert store.take_slot_in_turn(key, holder, 1, 30, _waiter(name, 99.0), 5).taken
    assert order == ["e", "c", "d"]
    assert store.give_slot_in_turn(key, holder, 1, 5) == ()
    assert store.slots_in_use(key) == 0


def test_handoff_orders_calls_made_within_one_millisecond(handoff_store: SlotHandoff) -> None:
    """Calls published a fraction of a millisecond apart (a loop of ``delay``) are woken in
    call order, whatever order they were listed in and whatever their ids sort as."""
    store, key = handoff_store, "celery-dedup-slots:t:close"
    called = 1_795_846_663.974
    assert store.take_slot_in_turn(key, "h", 1, 30, _waiter("h", called - 1), 5).taken
    # "z-first" was called 0.2 ms before "a-second", and listed after it.
    for name, order in (("a-second", called + 0.0004), ("z-first", called + 0.0002)):
        assert not store.take_slot_in_turn(key, name, 1, 30, _waiter(name, order), 5).taken
    assert store.give_slot_in_turn(key, "h", 1, 5) == (b"payload of z-first",)
    assert store.take_slot_in_turn(key, "z-first", 1, 30, _waiter("z-first", called), 5).taken
    assert store.give_slot_in_turn(key, "z-first", 1, 5) == (b"payload of a-second",)


def test_handoff_fills_every_free_slot(handoff_store: SlotHandoff) -> None:
    """Limit 3, all held, 4 waiters: giving two back wakes the two oldest in one call each;
    a take without a waiter (a renewal) leaves listed waiters their turn."""
    store, key = handoff_store, "celery-dedup-slots:t:fill"
    for n in range(3):
        assert store.take_slot_in_turn(key, f"h{n}", 3, 30, _waiter(f"h{n}", n), 5).taken
    for n in range(4):
        assert not store.take_slot_in_turn(key, f"w{n}", 3, 30, _waiter(f"w{n}", 10 + n), 5).taken
    assert store.give_slot_in_turn(key, "h0", 3, 5) == (b"payload of w0",)
    assert store.give_slot_in_turn(key, "h1", 3, 5) == (b"payload of w1",)
    assert store.take_slot_in_turn(key, "x", 3, 30, None, 5) == SlotTurn(False, 3)
    assert store.take_slot_in_turn(key, "h2", 3, 30, None, 5) == SlotTurn(True, 3)  # renewal


def test_handoff_lapses_reservations_and_waiters(handoff_store: SlotHandoff) -> None:
    """A reservation whose copy never comes (revoked) lapses after its grace: the next take
    wakes the next waiter; a waiter whose parked copy stops coming back lapses too."""
    store, key = handoff_store, "celery-dedup-slots:t:lapse"
    assert store.take_slot_in_turn(key, "a", 1, 30, _waiter("a", 1), 0.2).taken
    assert not store.take_slot_in_turn(key, "gone", 1, 30, _waiter("gone", 2, life=0.2), 0.2).taken
    assert not store.take_slot_in_turn(key, "lost", 1, 30, _waiter("lost", 3), 0.2).taken
    assert not store.take_slot_in_turn(key, "next", 1, 30, _waiter("next", 4), 0.2).taken
    time.sleep(0.3)  # "gone" lapsed: "lost" is the oldest live waiter
    assert store.give_slot_in_turn(key, "a", 1, 0.2) == (b"payload of lost",)
    time.sleep(0.3)  # the reservation for "lost" lapsed: its copy never came
    turn = store.take_slot_in_turn(key, "next:2", 1, 30, _waiter("next", 4), 0.2)
    assert turn == SlotTurn(True, 1)


def test_handoff_holds_the_limit_under_contention(handoff_store: SlotHandoff) -> None:
    """20 threads take a slot of one key with limit 2 as waiters: exactly 2 hold one, the
    other 18 are listed; each give wakes exactly one of them, oldest first."""
    store, key = handoff_store, "celery-dedup-slots:t:race"
    barrier = threading.Barrier(20)
    turns: dict[int, SlotTurn] = {}

    def take(n: int) -> None:
        barrier.wait()
        turns[n] = store.take_slot_in_turn(key, f"h{n}", 2, 30, _waiter(f"w{n}", n), 5)

    threads = [threading.Thread(target=take, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    holders = sorted(n for n, turn in turns.items() if turn.taken)
    assert len(holders) == 2 and all(turn.in_use <= 2 for turn in turns.values())
    waiting = sorted(set(range(20)) - set(holders))
    assert store.give_slot_in_turn(key, f"h{holders[0]}", 2, 5) == (
        f"payload of w{waiting[0]}".encode(),
    )
    assert store.give_slot_in_turn(key, f"h{holders[1]}", 2, 5) == (
        f"payload of w{waiting[1]}".encode(),
    )


def test_postgres_handoff_counts_a_slot_taken_by_an_older_worker(
    request: pytest.FixtureRequest,
) -> None:
    """A holder written by ``take_slot`` (a worker without the handoff) holds its slot for the
    handoff; the handoff's function is created again when the database lost it."""
    pytest.importorskip("psycopg")
    case: StoreCase = request.getfixturevalue("store_postgres")
    store = case.store
    assert isinstance(store, SlotHandoff) and isinstance(store, SlotSupport)
    key = "celery-dedup-slots:t:old"
    assert store.take_slot(key, "old", 1, 30) == (True, 1)
    from sqlalchemy import text

    from celery_dedup.stores.sql_limits import TURN_FUNCTION

    with store.engine.connect() as conn:  # type: ignore[attr-defined]
        conn.execute(text(f"DROP FUNCTION {TURN_FUNCTION}"))
        conn.commit()
    assert store.take_slot_in_turn(key, "new", 1, 30, _waiter("new", 1), 5) == SlotTurn(False, 1)
    assert store.give_slot(key, "old") is True
    # The older worker's give wakes nobody: the waiter's next take finds the slot free.
    assert store.take_slot_in_turn(key, "new:2", 1, 30, _waiter("new", 1), 5) == SlotTurn(True, 1)


@pytest.fixture(params=[
    pytest.param("store_redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("store_redis_cluster", marks=pytest.mark.redis_cluster, id="redis-cluster"),
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
])
def gate_store(request: pytest.FixtureRequest) -> GateHandoff:
    """A store whose run's end wakes the follow-up waiting at its gate (``GateHandoff``)."""
    case: StoreCase = request.getfixturevalue(request.param)
    assert isinstance(case.store, GateHandoff)
    return case.store


def test_gate_handoff_wakes_the_follow_up_when_the_run_ends(gate_store: GateHandoff) -> None:
    """A follow-up listed at the gate a run holds is taken out by that run's end (its
    payload, byte for byte); an end with no waiter, or not opening the gate, wakes nobody;
    an open gate lists nobody."""
    records = records_of(cast(LockStore, gate_store))
    run = RunRef("gate:a", "owner-a", "0.0", "copy-1", gated=True)
    assert records.claim_run(run, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
    follow_up = RunRef("gate:a", "owner-b", "0.0", "copy-b", gated=True)
    assert records.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is RunOutcome.WAITING
    payload = b"application/x-python-serialize;binary\n\x00\xff\x80 payload"
    assert gate_store.wait_at_gate(follow_up, payload, 30) is True
    assert gate_store.wait_at_gate(run, b"its own gate", 30) is False  # nobody else holds it
    # A copy of the run that does not hold the gate opens nothing and wakes nobody.
    stray = RunRef("gate:a", "owner-a", "0.0", "copy-2", gated=True)
    assert gate_store.end_run_in_turn(stray, 30, META, release=None)[1] is None
    assert gate_store.end_run_in_turn(run, 30, META, release=None)[1] == payload
    assert gate_store.wait_at_gate(follow_up, payload, 30) is False  # the gate is open
    assert records.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
    assert gate_store.end_run_in_turn(follow_up, 30, META, release=None)[1] is None
    plain = RunRef("gate:b", "owner-c", "0.0", "copy-c")
    assert records.claim_run(plain, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
    assert gate_store.end_run_in_turn(plain, 30, META, release=None) == (False, None)


def test_handoff_wakes_a_waiter_only_below_its_own_limit(handoff_store: SlotHandoff) -> None:
    """Limits per call (issue 34, item 4): 3 slots held under a limit of 3; two messages
    wait under a limit of 1. A give under 3 wakes neither while 2 or 1 are held; the last
    give wakes the oldest only. A newcomer under a limit of 3 takes a free slot at once,
    past a waiter whose own limit is reached; a waiter asking again with a higher limit
    is served under it."""
    store, key = handoff_store, "celery-dedup-slots:t:per-call"
    for n in range(3):
        assert store.take_slot_in_turn(key, f"h{n}", 3, 30, _waiter(f"h{n}", n), 5).taken
    for name, order in (("a", 10.0), ("b", 11.0)):
        assert store.take_slot_in_turn(key, name, 1, 30, _waiter(name, order), 5) == SlotTurn(
            False, 3
        )
    assert store.give_slot_in_turn(key, "h0", 3, 5) == ()
    assert store.give_slot_in_turn(key, "h1", 3, 5) == ()
    assert store.give_slot_in_turn(key, "h2", 3, 5) == (b"payload of a",)
    assert store.take_slot_in_turn(key, "a:2", 1, 30, _waiter("a", 10.0), 5) == SlotTurn(True, 1)
    # b waits under 1 (1 in use); a newcomer under 3 takes a slot past it.
    assert store.take_slot_in_turn(key, "c", 3, 30, _waiter("c", 12.0), 5) == SlotTurn(True, 2)
    assert not store.take_slot_in_turn(key, "b:2", 1, 30, _waiter("b", 11.0), 5).taken
    # b asks again under 3 (its limit rose): served at once, keeping its place.
    assert store.take_slot_in_turn(key, "b:3", 3, 30, _waiter("b", 11.0), 5) == SlotTurn(True, 3)


def test_window_entries_keep_their_own_period(limited_store: object) -> None:
    """A call under a shorter period does not erase what a call under a longer one counts:
    each entry records the rate it was admitted under and stays for its own period."""
    assert isinstance(limited_store, RateSupport)
    store, key = limited_store, "celery-dedup-rate:t:periods"
    for n in range(2):
        assert store.hit_rate(key, f"long{n}", 2, 60.0, delay=False).admitted
    time.sleep(0.4)
    # Under "5/0.2s" the two entries are out of its window: admitted.
    assert store.hit_rate(key, "short", 5, 0.2, delay=False).admitted
    time.sleep(0.3)
    # Back under "2/60s": the two entries (and the short one) still count.
    refused = store.hit_rate(key, "long2", 2, 60.0, delay=False)
    assert not refused.admitted and refused.count == 3
    assert isinstance(limited_store, LimitListing)
    (window,) = limited_store.list_rates("celery-dedup-rate:t:periods")
    assert window.rate == (5, 0.2) and window.last == "short"


def test_listing_shows_the_limit_a_slot_was_taken_under(limited_store: object) -> None:
    from celery_dedup.stores.base import slot_holder

    assert isinstance(limited_store, SlotSupport) and isinstance(limited_store, LimitListing)
    key = "celery-dedup-slots:t:recorded"
    assert limited_store.take_slot(key, slot_holder("id-1", "00", 4), 4, 30)[0]
    (usage,) = limited_store.list_slots("celery-dedup-slots:t:recorded")
    assert (usage.in_use, usage.limit) == (1, 4)
