"""The lock store contract: one set of tests every store must pass.

``StoreContract`` is applied to a ``store_case`` fixture returning a
``StoreCase``; ``tests/stores/test_conformance.py`` runs it against every
store of the table, and the Django suite subclasses it with its own fixture.
Waits are short: TTLs of about a second, polled.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_dedup import key_reuse
from celery_dedup.identity import digest
from celery_dedup.runs import gate_handoff, records_of
from celery_dedup.stores import store_from_url
from celery_dedup.stores.base import (
    ClaimOutcome,
    CounterSupport,
    GateHandoff,
    Lock,
    LockStore,
    QueuedTakeOver,
    RevokeOutcome,
    RevokingTakeOver,
    RunOutcome,
    RunRef,
    acquire_many,
)
from tests.fixtures._store_case import StoreCase

__all__ = ["StoreContract"]

META = {"task_name": "tests.add", "policy": "success", "task_id": "id-a"}
OTHER_META = {"task_name": "tests.other", "policy": "finish", "task_id": "id-b"}

RACE_WORKERS = 8
RACE_KEYS = [f"race:{i:03d}" for i in range(200)]
#: The racers' lock TTL: longer than any race on a loaded machine, so a key
#: that expired mid-race (a legitimate second winner) never stands in for one
#: a contended acquire gave twice.
RACE_TTL = 3600
#: seconds a race's parent waits for each racing process's answer (under the
#: test timeout of 300 s): MySQL/MariaDB through Django opens a connection per
#: operation under CONN_MAX_AGE=0 (and PyMySQL an SSL context per connection),
#: so 1,600 acquires take a minute alone, and three CI lanes share the CPUs.
RACE_WAIT = 240
TQ_RACE_KEYS = [f"tq-race:{i:03d}" for i in range(60)]

#: Stores without ``RevokingTakeOver`` (a take-over, then a revoke: two round
#: trips); every other store must have it.
WITHOUT_REVOKING_TAKE_OVER = frozenset({"memcached", "cache", "django-cache", "django-db"})

#: An owner token with the characters a Redis record percent-encodes.
ODD_OWNER = "owner|a%7C%"


def wait_until_gone(store: LockStore, key: str, timeout: float = 4.0) -> float:
    """Poll until ``key`` has no live lock; return the seconds waited."""
    start = time.monotonic()
    while store.get(key) is not None:
        assert time.monotonic() - start < timeout, f"{key} did not expire within {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - start


def race(store: LockStore, owner: str, start: Callable[[], Any]) -> dict[str, str]:
    """Acquire every race key as ``owner``; return key → the holder each call saw."""
    offset = int(owner.rsplit("-", 1)[1]) * (len(RACE_KEYS) // RACE_WORKERS)
    keys = RACE_KEYS[offset:] + RACE_KEYS[:offset]
    start()
    seen: dict[str, str] = {}
    for key in keys:
        holder = store.acquire(key, owner, RACE_TTL, META)
        seen[key] = owner if holder is None else holder.owner
    return seen


def _race_end_and_listing(
    turns: GateHandoff, run: RunRef, follow_up: RunRef, *, ending_late: bool
) -> list[bytes]:
    """``run``'s end and ``follow_up`` listing itself at the gate, on two threads started
    together (one of them a moment late, at random): the payloads woken, by the end
    or by the follow-up publishing itself on finding the gate open."""
    barrier = threading.Barrier(2)
    woken: list[bytes] = []
    errors: list[BaseException] = []

    def pause(late: bool) -> None:
        barrier.wait()
        if late:
            time.sleep(random.uniform(0, 0.01))

    def end() -> None:
        pause(ending_late)
        payload = turns.end_run_in_turn(run, 30, META, release=None)[1]
        woken.extend([payload] if payload is not None else [])

    def listing() -> None:
        pause(not ending_late)
        if not turns.wait_at_gate(follow_up, b"follow-up", 30):
            woken.append(b"follow-up")

    def guarded(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(body,)) for body in (end, listing)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return woken


def _race_process(url: str, owner: str, barrier: Any, results: Any) -> None:
    """A racing process: builds its own store from the URL (after fork or spawn)."""
    try:
        store = store_from_url(url)
        results.put((owner, race(store, owner, barrier.wait)))
    except BaseException as exc:
        results.put((owner, repr(exc)))
        raise


class StoreContract:
    """Behaviour every ``LockStore`` promises (DESIGN §3 and §6)."""

    def test_acquire_free_key(self, store_case: StoreCase) -> None:
        """Acquiring a free key returns None and the owner then holds it."""
        store = store_case.store
        assert store.acquire("k:free", "owner-a", 30, META) is None
        lock = store.get("k:free")
        assert lock is not None
        assert (lock.key, lock.owner, lock.task_name, lock.policy) == (
            "k:free", "owner-a", "tests.add", "success",
        )

    def test_conflict_returns_holder(self, store_case: StoreCase) -> None:
        """A second owner gets the holder back: owner, task name, policy and a TTL within bounds."""
        store = store_case.store
        before = time.time()
        assert store.acquire("k:held", "owner-a", 30, META) is None
        holder = store.acquire("k:held", "owner-b", 10, OTHER_META)
        after = time.time()
        assert isinstance(holder, Lock)
        assert (holder.key, holder.owner, holder.task_name, holder.policy) == (
            "k:held", "owner-a", "tests.add", "success",
        )
        assert 25 < holder.ttl <= 30.001
        assert before - 1 <= holder.acquired_at <= after + 1
        assert holder.expires_at - holder.acquired_at == pytest.approx(30, abs=1.5)
        lock = store.get("k:held")
        assert lock is not None and lock.owner == "owner-a"

    def test_same_owner_acquire_of_held_key_returns_holder(self, store_case: StoreCase) -> None:
        """An owner that already holds the key gets itself back as holder, not a new lock."""
        store = store_case.store
        assert store.acquire("k:mine", "owner-a", 30, META) is None
        holder = store.acquire("k:mine", "owner-a", 30, META)
        assert holder is not None and holder.owner == "owner-a"

    def test_fingerprinted_owner_is_kept_verbatim(self, store_case: StoreCase) -> None:
        """An owner token carrying an arguments fingerprint (``on_key_reuse``) is opaque.

        The producer reads the holder's fingerprint from the owner a
        conflicting acquire returns, so every store must hand it back byte
        for byte, and treat it as any token in every other operation.
        """
        store = store_case.store
        fingerprint = digest("canonical arguments")
        owner = key_reuse.token(fingerprint)
        assert store.acquire("k:fp", owner, 30, META) is None
        holder = store.acquire("k:fp", key_reuse.token(digest("other")), 30, OTHER_META)
        assert holder is not None and holder.owner == owner
        assert key_reuse.fingerprint_of(holder.owner) == fingerprint
        claim = store.claim("k:fp", owner, release=False, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.OWNED
        assert store.extend("k:fp", owner, 40) is True
        assert store.release("k:fp", owner) is True
        assert store.get("k:fp") is None

    def test_acquire_many_answers_as_acquire_per_item(self, store_case: StoreCase) -> None:
        """acquire_many takes free and expired keys, answers the holders of held ones (in
        the items' order, the holder's own fields) and refuses repeated keys."""
        store = store_case.store
        assert store.acquire("bulk:held", "owner-a", 30, META) is None
        assert store.acquire("bulk:expired", "owner-a", 0.3, META) is None
        wait_until_gone(store, "bulk:expired")
        keys = ["bulk:free-1", "bulk:held", "bulk:expired", "bulk:free-2"]
        answers = acquire_many(store, [(key, "owner-b", 30, OTHER_META) for key in keys])
        assert [a is None for a in answers] == [True, False, True, True]
        holder = answers[1]
        assert holder is not None
        assert (holder.key, holder.owner, holder.task_id, holder.task_name) == (
            "bulk:held", "owner-a", "id-a", "tests.add",
        )
        assert 25 < holder.ttl <= 30.001
        for key in ("bulk:free-1", "bulk:expired", "bulk:free-2"):
            lock = store.get(key)
            assert lock is not None and (lock.owner, lock.task_id) == ("owner-b", "id-b")
        again = acquire_many(store, [("bulk:free-1", "owner-c", 30, META)])
        assert again[0] is not None and again[0].owner == "owner-b"
        assert acquire_many(store, []) == []
        with pytest.raises(ValueError, match="distinct"):
            acquire_many(store, [("bulk:x", "o", 30, META), ("bulk:x", "p", 30, META)])
        assert store.get("bulk:x") is None

    def test_acquire_many_races_give_each_key_one_holder(self, store_case: StoreCase) -> None:
        """Threads bulk-acquiring overlapping keys in different orders: every key is taken
        by exactly one of them and every other one is told that holder."""
        store = store_case.store
        keys = [f"bulk-race:{i:03d}" for i in range(60)]
        seen: dict[str, list[str]] = {key: [] for key in keys}
        barrier = threading.Barrier(4)
        errors: list[BaseException] = []

        def run(n: int) -> None:
            mine = keys[n * 15 :] + keys[: n * 15]
            try:
                barrier.wait()
                answers = acquire_many(store, [(k, f"bulk-{n}", RACE_TTL, META) for k in mine])
            except BaseException as exc:  # reported below
                errors.append(exc)
                return
            for key, answer in zip(mine, answers, strict=True):
                seen[key].append(f"bulk-{n}" if answer is None else answer.owner)

        threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors
        for key in keys:
            lock = store.get(key)
            assert lock is not None
            assert seen[key] == [lock.owner] * 4, key

    def test_keys_are_independent(self, store_case: StoreCase) -> None:
        """Locks on different keys do not interfere, and keys compare case-sensitively."""
        store = store_case.store
        assert store.acquire("k:one", "owner-a", 30, META) is None
        assert store.acquire("k:two", "owner-b", 30, META) is None
        assert store.acquire("K:ONE", "owner-c", 30, META) is None
        assert store.release("k:one", "owner-a") is True
        two = store.get("k:two")
        assert two is not None and two.owner == "owner-b"
        upper = store.get("K:ONE")
        assert upper is not None and upper.owner == "owner-c"

    def test_get_missing_key(self, store_case: StoreCase) -> None:
        """get() of a key nobody holds is None."""
        assert store_case.store.get("k:nobody") is None

    def test_release_is_owner_checked_and_idempotent(self, store_case: StoreCase) -> None:
        """A stale owner cannot release; the holder can, once; then the key is free."""
        store = store_case.store
        assert store.acquire("k:rel", "owner-a", 30, META) is None
        assert store.release("k:rel", "owner-b") is False
        lock = store.get("k:rel")
        assert lock is not None and lock.owner == "owner-a"
        assert store.release("k:rel", "owner-a") is True
        assert store.release("k:rel", "owner-a") is False
        assert store.get("k:rel") is None
        assert store.acquire("k:rel", "owner-b", 30, META) is None

    def test_extend_keeps_owner_and_resets_ttl(self, store_case: StoreCase) -> None:
        """extend() by the holder resets the TTL and keeps the owner; a stale owner cannot."""
        store = store_case.store
        assert store.acquire("k:ext", "owner-a", 5, META) is None
        assert store.extend("k:ext", "owner-b", 100) is False
        lock = store.get("k:ext")
        assert lock is not None and lock.ttl <= 5.001
        assert store.extend("k:ext", "owner-a", 100) is True
        lock = store.get("k:ext")
        assert lock is not None
        assert lock.owner == "owner-a" and lock.task_name == "tests.add"
        assert 95 < lock.ttl <= 100.001
        assert store.extend("k:ext", "owner-a", 20) is True
        lock = store.get("k:ext")
        assert lock is not None and 15 < lock.ttl <= 20.001

    def test_extend_missing_key(self, store_case: StoreCase) -> None:
        """extend() of a key nobody holds fails and creates nothing."""
        store = store_case.store
        assert store.extend("k:ghost", "owner-a", 30) is False
        assert store.get("k:ghost") is None

    def test_take_over_returns_previous_holder(self, store_case: StoreCase) -> None:
        """take_over() returns the previous holder; the new owner holds; the old cannot release."""
        store = store_case.store
        assert store.acquire("k:take", "owner-a", 30, META) is None
        previous = store.take_over("k:take", "owner-b", 60, OTHER_META)
        assert previous is not None
        assert (previous.owner, previous.task_name, previous.policy) == (
            "owner-a", "tests.add", "success",
        )
        assert 25 < previous.ttl <= 30.001
        lock = store.get("k:take")
        assert lock is not None
        assert (lock.owner, lock.task_name, lock.policy) == ("owner-b", "tests.other", "finish")
        assert 55 < lock.ttl <= 60.001
        assert store.release("k:take", "owner-a") is False
        assert store.release("k:take", "owner-b") is True

    def test_take_over_free_key(self, store_case: StoreCase) -> None:
        """take_over() of a free key returns None and the owner holds it."""
        store = store_case.store
        assert store.take_over("k:tfree", "owner-a", 30, META) is None
        lock = store.get("k:tfree")
        assert lock is not None and lock.owner == "owner-a"
        holder = store.acquire("k:tfree", "owner-b", 30, META)
        assert holder is not None and holder.owner == "owner-a"

    def test_take_over_queued_leaves_a_started_holder(self, store_case: StoreCase) -> None:
        """take_over_queued() takes a free key or one whose holder has not started; a started
        holder is returned and keeps the key (stores without it: the three-trip fallback)."""
        store = store_case.store
        assert isinstance(store, QueuedTakeOver), store.name  # every store shipped
        assert store.take_over_queued("k:tq", "owner-a", 30, META) is None
        previous = store.take_over_queued("k:tq", "owner-b", 30, OTHER_META)
        assert previous is not None and previous.owner == "owner-a" and not previous.started
        assert (previous.task_id, previous.task_name) == ("id-a", "tests.add")
        lock = store.get("k:tq")
        assert lock is not None and (lock.owner, lock.task_id) == ("owner-b", "id-b")
        assert not lock.started and 25 < lock.ttl <= 30.001
        claim = store.claim("k:tq", "owner-b", release=False, ttl=None, meta=OTHER_META)
        assert claim.outcome is ClaimOutcome.OWNED
        running = store.take_over_queued("k:tq", "owner-c", 30, META)
        assert running is not None and running.owner == "owner-b" and running.started
        lock = store.get("k:tq")
        assert lock is not None and lock.owner == "owner-b" and lock.started
        assert store.release("k:tq", "owner-c") is False

    def test_take_over_queued_takes_an_expired_started_holder(
        self, store_case: StoreCase
    ) -> None:
        """A started holder past its TTL no longer holds the key: take_over_queued takes it."""
        store = store_case.store
        assert isinstance(store, QueuedTakeOver), store.name
        assert store.acquire("k:tqx", "owner-a", 1, {**META, "started": "1"}) is None
        wait_until_gone(store, "k:tqx")
        assert store.take_over_queued("k:tqx", "owner-b", 30, OTHER_META) is None
        lock = store.get("k:tqx")
        assert lock is not None and lock.owner == "owner-b" and not lock.started

    def test_take_over_queued_racing_the_start_check(self, store_case: StoreCase) -> None:
        """A take-over of a queued holder racing that holder's start check: exactly one wins.

        Either the holder started first (its claim is OWNED, the take-over
        returns it started and writes nothing) or the take-over came first
        (the claim finds the new holder): never a started holder whose key
        was taken, the double run ``cancel_running`` must never cause.
        """
        store = store_case.store
        assert isinstance(store, QueuedTakeOver), store.name
        for key in TQ_RACE_KEYS:
            assert store.acquire(key, f"q-{key}", 60, META) is None
        claims, taken = _start_race(store_case)
        started = {key for key, outcome in claims.items() if outcome == "owned"}
        assert set(claims) == set(taken) == set(TQ_RACE_KEYS)
        for key in TQ_RACE_KEYS:
            lock = store.get(key)
            assert lock is not None
            if key in started:
                assert taken[key] == (f"q-{key}", True), key
                assert (lock.owner, lock.started) == (f"q-{key}", True), key
            else:
                assert claims[key] == "held", (key, claims[key])
                assert taken[key] == (f"q-{key}", False), key
                assert (lock.owner, lock.started) == (f"t-{key}", False), key

    def test_take_over_revoking_refuses_the_displaced_owner(self, store_case: StoreCase) -> None:
        """take_over_revoking() takes the key and revokes its holder in one step: the holder's
        start is refused even once the new owner released the key; the new owner is not."""
        store = store_case.store
        if not isinstance(store, RevokingTakeOver):
            assert store.name in WITHOUT_REVOKING_TAKE_OVER, store.name
            return
        assert store.take_over_revoking("k:rvé", ODD_OWNER, 30, META, 60) is None
        previous = store.take_over_revoking("k:rvé", "owner-b", 60, OTHER_META, 60)
        assert previous is not None
        assert (previous.owner, previous.task_id, previous.started) == (ODD_OWNER, "id-a", False)
        lock = store.get("k:rvé")
        assert lock is not None and (lock.owner, lock.task_id) == ("owner-b", "id-b")
        assert not lock.started and 55 < lock.ttl <= 60.001
        # The same owner taking its own key again displaces nobody: no marker of itself.
        again = store.take_over_revoking("k:rvé", "owner-b", 60, OTHER_META, 60)
        assert again is not None and again.owner == "owner-b"
        claim = store.claim("k:rvé", "owner-b", release=True, ttl=None, meta=OTHER_META)
        assert claim.outcome is ClaimOutcome.OWNED
        assert store.get("k:rvé") is None
        for release in (False, True):
            claim = store.claim("k:rvé", ODD_OWNER, release=release, ttl=30, meta=META)
            assert claim.outcome is ClaimOutcome.REVOKED
        assert store.get("k:rvé") is None

    def test_take_over_revoking_marker_outlives_the_holder_or_a_longer_one(
        self, store_case: StoreCase
    ) -> None:
        """The displaced owner's marker lives the longer of the holder's remaining TTL and
        ``revoked_ttl``, and a longer marker already there is kept (as ``revoke``)."""
        store = store_case.store
        if not isinstance(store, RevokingTakeOver):
            assert store.name in WITHOUT_REVOKING_TAKE_OVER, store.name
            return
        # revoked_ttl of 1 ms: only the holder's remaining 30 s keeps the marker.
        assert store.acquire("k:rvt", "owner-a", 30, META) is None
        assert store.take_over_revoking("k:rvt", "owner-b", 30, OTHER_META, 0.001) is not None
        time.sleep(0.05)
        claim = store.claim("k:rvt", "owner-a", release=False, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.REVOKED
        # A 60 s marker outlives a take-over whose own marker would live 1 s.
        assert store.acquire("k:rvk", "owner-a", 1, {**META, "started": "1"}) is None
        assert store.revoke("k:rvk", "owner-a", 60) is RevokeOutcome.RUNNING
        assert store.take_over_revoking("k:rvk", "owner-b", 30, OTHER_META, 0.001) is not None
        time.sleep(1.2)
        claim = store.claim("k:rvk", "owner-a", release=False, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.REVOKED

    def test_take_over_revoking_queued_only_leaves_a_started_holder(
        self, store_case: StoreCase
    ) -> None:
        """With ``queued_only`` a started holder keeps the key and is not revoked; a queued
        holder is taken over and revoked, as ``take_over_queued`` then ``revoke``."""
        store = store_case.store
        if not isinstance(store, RevokingTakeOver):
            assert store.name in WITHOUT_REVOKING_TAKE_OVER, store.name
            return
        assert store.acquire("k:rvq", "owner-a", 30, META) is None
        claim = store.claim("k:rvq", "owner-a", release=False, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.OWNED
        running = store.take_over_revoking("k:rvq", "owner-b", 30, OTHER_META, 60, queued_only=True)
        assert running is not None and running.owner == "owner-a" and running.started
        lock = store.get("k:rvq")
        assert lock is not None and lock.owner == "owner-a" and lock.started
        # No marker: the running holder's own start check still passes.
        claim = store.claim("k:rvq", "owner-a", release=True, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.OWNED
        assert store.acquire("k:rvq", ODD_OWNER, 30, META) is None
        queued = store.take_over_revoking("k:rvq", "owner-b", 30, OTHER_META, 60, queued_only=True)
        assert queued is not None and queued.owner == ODD_OWNER and not queued.started
        lock = store.get("k:rvq")
        assert lock is not None and lock.owner == "owner-b" and not lock.started
        assert store.release("k:rvq", "owner-b") is True
        claim = store.claim("k:rvq", ODD_OWNER, release=False, ttl=30, meta=META)
        assert claim.outcome is ClaimOutcome.REVOKED
        assert store.get("k:rvq") is None

    def test_scan_lists_only_the_prefix(self, store_case: StoreCase) -> None:
        """scan(prefix) yields every live lock under the prefix and nothing else."""
        store = store_case.store
        for i in range(5):
            assert store.acquire(f"app:task:{i}", f"owner-{i}", 30, META) is None
        assert store.acquire("app:other:0", "owner-x", 30, META) is None
        assert store.acquire("zzz:task:0", "owner-y", 30, META) is None
        found = {lock.key: lock.owner for lock in store.scan("app:task:")}
        assert found == {f"app:task:{i}": f"owner-{i}" for i in range(5)}
        assert {lock.key for lock in store.scan("app:")} == {
            *(f"app:task:{i}" for i in range(5)), "app:other:0",
        }
        assert list(store.scan("nothing:")) == []

    def test_scan_treats_wildcards_literally(self, store_case: StoreCase) -> None:
        """Pattern characters in a prefix (% _ * ? [ \\ !) match only themselves."""
        store = store_case.store
        for key in ("a_b:1", "axb:1", "a%b:1", "a*b:1", "a?b:1", "a[b]:1", "a\\b:1", "a!b:1"):
            assert store.acquire(key, "owner-a", 30, META) is None
        for prefix in ("a_b", "a%b", "a*b", "a?b", "a[b]", "a\\b", "a!b"):
            assert [lock.key for lock in store.scan(prefix)] == [f"{prefix}:1"]

    def test_expired_lock_is_free(self, store_case: StoreCase) -> None:
        """A lock past its TTL is gone: not listed, extendable or releasable, and free to take."""
        store = store_case.store
        assert store.acquire("exp:short", "owner-a", 1, META) is None
        assert store.acquire("exp:long", "owner-a", 30, META) is None
        short = store.get("exp:short")
        assert short is not None and 0 < short.ttl <= 1.001
        assert {lock.key for lock in store.scan("exp:")} == {"exp:short", "exp:long"}
        waited = wait_until_gone(store, "exp:short")
        assert waited > 0.3
        assert [lock.key for lock in store.scan("exp:")] == ["exp:long"]
        assert store.extend("exp:short", "owner-a", 30) is False
        assert store.release("exp:short", "owner-a") is False
        assert store.take_over("exp:short", "owner-b", 30, META) is None
        assert store.release("exp:short", "owner-b") is True
        assert store.acquire("exp:short", "owner-c", 30, OTHER_META) is None
        lock = store.get("exp:short")
        assert lock is not None and (lock.owner, lock.policy) == ("owner-c", "finish")

    def test_counters(self, store_case: StoreCase) -> None:
        """Stores with CounterSupport add counters in batches and read them back per prefix."""
        store = store_case.store
        if not isinstance(store, CounterSupport):
            # A store without counters must not half-implement them.
            assert not hasattr(store, "add_counts") and not hasattr(store, "read_counts")
            return
        store.add_counts(
            "metrics", {("tests.add", "acquired"): 3, ("tests.add", "deduplicated"): 1}
        )
        store.add_counts("metrics", {("tests.add", "acquired"): 2, ("tests.other", "released"): 4})
        store.add_counts("metrics", {})
        assert store.read_counts("metrics") == {
            ("tests.add", "acquired"): 5,
            ("tests.add", "deduplicated"): 1,
            ("tests.other", "released"): 4,
        }

    # -- ownership: task id, start check, revoke ---------------------------

    def test_lock_reports_task_id_and_not_started(self, store_case: StoreCase) -> None:
        """A lock keeps the holder's task id apart from its owner token; it starts unstarted."""
        store = store_case.store
        assert store.acquire("o:tid", "token-a", 30, META) is None
        lock = store.get("o:tid")
        assert lock is not None
        assert (lock.owner, lock.task_id, lock.started) == ("token-a", "id-a", False)
        holder = store.acquire("o:tid", "token-b", 30, {**OTHER_META, "task_id": "id-a"})
        assert holder is not None and (holder.owner, holder.task_id) == ("token-a", "id-a")
        # Two tokens under one task id (deterministic ids) never release each other.
        assert store.release("o:tid", "token-b") is False
        assert store.release("o:tid", "id-a") is False
        assert store.release("o:tid", "token-a") is True
        previous = store.take_over("o:tid2", "token-a", 30, META)
        assert previous is None
        previous = store.take_over("o:tid2", "token-b", 30, {**META, "task_id": "id-a"})
        assert previous is not None and previous.owner == "token-a"
        lock = store.get("o:tid2")
        assert lock is not None and (lock.owner, lock.task_id, lock.started) == (
            "token-b", "id-a", False,
        )

    def test_acquire_started(self, store_case: StoreCase) -> None:
        """meta started=1 creates a lock that is already started."""
        store = store_case.store
        assert store.acquire("o:st", "token-a", 30, {**META, "started": "1"}) is None
        lock = store.get("o:st")
        assert lock is not None and lock.started is True

    def test_claim_owned_marks_started_and_keeps_ttl(self, store_case: StoreCase) -> None:
        """The holder's claim marks the lock started; the lock stays with its TTL."""
        store = store_case.store
        assert store.acquire("c:own", "token-a", 30, META) is None
        claim = store.claim("c:own", "token-a", release=False, ttl=99, meta=META)
        assert claim.outcome is ClaimOutcome.OWNED and claim.holder is None
        lock = store.get("c:own")
        assert lock is not None and lock.owner == "token-a" and lock.started is True
        assert 25 < lock.ttl <= 30.001
        assert store.extend("c:own", "token-a", 50) is True
        lock = store.get("c:own")
        assert lock is not None and lock.started is True and lock.task_id == "id-a"

    def test_claim_owned_release(self, store_case: StoreCase) -> None:
        """A claim with release deletes the holder's own lock in the same call."""
        store = store_case.store
        assert store.acquire("c:rel", "token-a", 30, META) is None
        claim = store.claim("c:rel", "token-a", release=True, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.OWNED
        assert store.get("c:rel") is None

    def test_claim_held_by_other(self, store_case: StoreCase) -> None:
        """A claim by another token reports the holder and changes nothing."""
        store = store_case.store
        assert store.acquire("c:held", "token-a", 30, META) is None
        for release in (False, True):
            claim = store.claim("c:held", "token-b", release=release, ttl=30, meta=OTHER_META)
            assert claim.outcome is ClaimOutcome.HELD
            assert claim.holder is not None
            assert (claim.holder.owner, claim.holder.task_id) == ("token-a", "id-a")
        lock = store.get("c:held")
        assert lock is not None and lock.owner == "token-a" and lock.started is False

    def test_claim_free(self, store_case: StoreCase) -> None:
        """On a free key a claim with a ttl takes it, started; without one it takes nothing."""
        store = store_case.store
        claim = store.claim("c:free", "token-a", release=False, ttl=30, meta=META)
        assert claim.outcome is ClaimOutcome.FREE
        lock = store.get("c:free")
        assert lock is not None
        assert (lock.owner, lock.task_id, lock.started, lock.policy) == (
            "token-a", "id-a", True, "success",
        )
        assert 25 < lock.ttl <= 30.001
        claim = store.claim("c:free2", "token-a", release=False, ttl=None, meta=META)
        assert claim.outcome is ClaimOutcome.FREE
        assert store.get("c:free2") is None
        claim = store.claim("c:free3", "token-a", release=True, ttl=30, meta=META)
        assert claim.outcome is ClaimOutcome.FREE
        assert store.get("c:free3") is None

    def test_revoke_unstarted_releases_and_blocks_start(self, store_case: StoreCase) -> None:
        """Revoking a queued holder frees the key at once, and its token can never start."""
        store = store_case.store
        assert store.acquire("r:q", "token-a", 30, META) is None
        assert store.revoke("r:q", "token-a", 60) is RevokeOutcome.RELEASED
        assert store.get("r:q") is None
        # A new run of the same key (same task id: a deterministic id) is unaffected.
        assert store.acquire("r:q", "token-b", 30, META) is None
        claim = store.claim("r:q", "token-a", release=False, ttl=30, meta=META)
        assert claim.outcome is ClaimOutcome.REVOKED
        lock = store.get("r:q")
        assert lock is not None and lock.owner == "token-b"
        assert store.claim("r:q", "token-b", release=False, ttl=30, meta=META).outcome is (
            ClaimOutcome.OWNED
        )
        assert store.release("r:q", "token-b") is True
        # Key free again: the revoked token still cannot start (nor take it).
        for release in (False, True):
            claim = store.claim("r:q", "token-a", release=release, ttl=30, meta=META)
            assert claim.outcome is ClaimOutcome.REVOKED
        assert store.get("r:q") is None

    def test_revoke_started_keeps_lock(self, store_case: StoreCase) -> None:
        """Revoking a running holder keeps its lock; a later claim by it is refused and frees."""
        store = store_case.store
        assert store.acquire("r:run", "token-a", 30, META) is None
        store.claim("r:run", "token-a", release=False, ttl=30, meta=META)
        assert store.revoke("r:run", "token-a", 60) is RevokeOutcome.RUNNING
        lock = store.get("r:run")
        assert lock is not None and lock.owner == "token-a"
        holder = store.acquire("r:run", "token-b", 30, META)
        assert holder is not None and holder.owner == "token-a"
        # A retry of the revoked run (same token) does not start again.
        claim = store.claim("r:run", "token-a", release=False, ttl=30, meta=META)
        assert claim.outcome is ClaimOutcome.REVOKED
        assert store.get("r:run") is None

    def test_revoke_not_held_and_unrevoke(self, store_case: StoreCase) -> None:
        """Revoking a token that holds nothing still blocks its start; unrevoke undoes that."""
        store = store_case.store
        assert store.acquire("r:other", "token-b", 30, META) is None
        assert store.revoke("r:other", "token-a", 60) is RevokeOutcome.NOT_HELD
        lock = store.get("r:other")
        assert lock is not None and lock.owner == "token-b"
        assert store.revoke("r:none", "token-a", 60) is RevokeOutcome.NOT_HELD
        assert store.claim("r:none", "token-a", release=False, ttl=None, meta=META).outcome is (
            ClaimOutcome.REVOKED
        )
        store.unrevoke("r:none", "token-a")
        store.unrevoke("r:none", "token-a")
        assert store.claim("r:none", "token-a", release=False, ttl=None, meta=META).outcome is (
            ClaimOutcome.FREE
        )
        # Markers are not locks: scan never lists them.
        assert [lock.key for lock in store.scan("r:")] == ["r:other"]

    def test_settle_clears_started(self, store_case: StoreCase) -> None:
        """settle() by the holder clears started (keeping or resetting the TTL); others cannot."""
        store = store_case.store
        assert store.acquire("s:set", "token-a", 30, META) is None
        store.claim("s:set", "token-a", release=False, ttl=30, meta=META)
        assert store.settle("s:set", "token-b") is False
        lock = store.get("s:set")
        assert lock is not None and lock.started is True
        assert store.settle("s:set", "token-a") is True
        lock = store.get("s:set")
        assert lock is not None and lock.started is False and 25 < lock.ttl <= 30.001
        assert (lock.owner, lock.task_id, lock.policy) == ("token-a", "id-a", "success")
        store.claim("s:set", "token-a", release=False, ttl=30, meta=META)
        assert store.settle("s:set", "token-a", 90) is True
        lock = store.get("s:set")
        assert lock is not None and lock.started is False and 85 < lock.ttl <= 90.001
        # A settled (queued again) holder is released at once by a revoke.
        assert store.revoke("s:set", "token-a", 60) is RevokeOutcome.RELEASED
        assert store.settle("s:set", "token-a") is False
        assert store.settle("s:none", "token-a", 30) is False
        assert store.get("s:none") is None

    def test_revoked_marker_expires(self, store_case: StoreCase) -> None:
        """A revoked marker lives its ttl, then the token may start again."""
        store = store_case.store
        assert store.revoke("r:exp", "token-a", 1) is RevokeOutcome.NOT_HELD
        assert store.claim("r:exp", "token-a", release=False, ttl=None, meta=META).outcome is (
            ClaimOutcome.REVOKED
        )
        deadline = time.monotonic() + 5
        while True:
            outcome = store.claim("r:exp", "token-a", release=False, ttl=None, meta=META).outcome
            if outcome is ClaimOutcome.FREE:
                break
            assert time.monotonic() < deadline, "revoked marker did not expire"
            time.sleep(0.1)

    # -- run records (``RunRecords``, native or built from the lock operations) --

    def test_run_first_copy_begins_and_claims(self, store_case: StoreCase) -> None:
        """The first copy takes the lease and gets the start claim's answer with it."""
        store = store_case.store
        assert store.acquire("run:a", "owner-a", 30, META) is None
        outcome, claim = records_of(store).claim_run(
            RunRef("run:a", "owner-a", "0.0", "copy-1"), 30, META, release=False, ttl=None
        )
        assert outcome is RunOutcome.BEGUN
        assert claim is not None and claim.outcome is ClaimOutcome.OWNED
        lock = store.get("run:a")
        assert lock is not None and lock.started

    def test_run_second_copy_while_running_touches_nothing(self, store_case: StoreCase) -> None:
        """Another copy of the same attempt finds the live lease: RUNNING, lock untouched."""
        store = store_case.store
        runs = records_of(store)
        assert store.acquire("run:b", "owner-a", 30, META) is None
        first = RunRef("run:b", "owner-a", "0.0", "copy-1")
        runs.claim_run(first, 30, META, release=False, ttl=None)
        store.settle("run:b", "owner-a")  # to see whether the copy marks it started again
        outcome, claim = runs.claim_run(
            RunRef("run:b", "owner-a", "0.0", "copy-2"), 30, META, release=True, ttl=None
        )
        assert (outcome, claim) == (RunOutcome.RUNNING, None)
        lock = store.get("run:b")
        assert lock is not None and lock.owner == "owner-a" and not lock.started

    def test_run_end_refuses_later_copies_and_applies_the_policy(
        self, store_case: StoreCase
    ) -> None:
        """end_run writes the done marker and releases; a later copy is DONE; scan sees neither."""
        store = store_case.store
        runs = records_of(store)
        assert store.acquire("run:c", "owner-a", 30, META) is None
        first = RunRef("run:c", "owner-a", "0.0", "copy-1")
        runs.claim_run(first, 30, META, release=False, ttl=None)
        assert runs.end_run(first, 30, META, release=True) is True
        assert store.get("run:c") is None
        outcome, claim = runs.claim_run(
            RunRef("run:c", "owner-a", "0.0", "copy-2"), 30, META, release=False, ttl=60
        )
        assert (outcome, claim) == (RunOutcome.DONE, None)
        assert store.get("run:c") is None  # the refused copy took nothing
        # The next attempt (a retry) is a run of its own.
        outcome, claim = runs.claim_run(
            RunRef("run:c", "owner-a", "1.0", "copy-3"), 30, META, release=False, ttl=None
        )
        assert outcome is RunOutcome.BEGUN
        assert [lock.key for lock in store.scan("run:")] == []

    def test_run_end_settles_or_leaves_the_lock(self, store_case: StoreCase) -> None:
        """release=False settles (not started, still held); None leaves the lock as it is."""
        store = store_case.store
        runs = records_of(store)
        for key, release in (("run:d", False), ("run:e", None)):
            assert store.acquire(key, "owner-a", 30, META) is None
            run = RunRef(key, "owner-a", "0.0", "copy-1")
            runs.claim_run(run, 30, META, release=False, ttl=None)
            assert runs.end_run(run, 30, META, release=release) is (release is False)
            lock = store.get(key)
            assert lock is not None and lock.owner == "owner-a"
            assert lock.started is (release is None)

    def test_run_abandoned_or_lapsed_lease_lets_a_copy_run(self, store_case: StoreCase) -> None:
        """A given-up lease frees the attempt at once; an unrenewed one when it lapses."""
        store = store_case.store
        runs = records_of(store)
        assert store.acquire("run:f", "owner-a", 30, META) is None
        dead = RunRef("run:f", "owner-a", "0.0", "copy-1")
        runs.claim_run(dead, 30, META, release=False, ttl=None)
        assert runs.abandon_run(RunRef("run:f", "owner-a", "0.0", "copy-2")) is False
        assert runs.abandon_run(dead) is True
        outcome, _ = runs.claim_run(
            RunRef("run:f", "owner-a", "0.0", "copy-2"), 1, META, release=False, ttl=None
        )
        assert outcome is RunOutcome.BEGUN
        deadline = time.monotonic() + 5
        while True:
            outcome, claim = runs.claim_run(
                RunRef("run:f", "owner-a", "0.0", "copy-3"), 30, META, release=False, ttl=None
            )
            if outcome is RunOutcome.BEGUN:
                break
            assert outcome is RunOutcome.RUNNING
            assert time.monotonic() < deadline, "the lease did not lapse"
            time.sleep(0.1)
        assert claim is not None and claim.outcome is ClaimOutcome.OWNED

    def test_run_renew_keeps_only_held_leases(self, store_case: StoreCase) -> None:
        """renew_runs counts and renews the leases their copies hold, and no others."""
        store = store_case.store
        runs = records_of(store)
        held = [RunRef(f"run:g{i}", "owner-a", "0.0", f"copy-{i}") for i in range(3)]
        for run in held:
            runs.claim_run(run, 2, META, release=False, ttl=None)
        stranger = RunRef("run:g0", "owner-a", "0.0", "copy-x")
        assert runs.renew_runs([*held, stranger], 30) == 3
        time.sleep(3.2)  # past the first lease (memcached counts whole seconds)
        outcome, _ = runs.claim_run(stranger, 30, META, release=False, ttl=None)
        assert outcome is RunOutcome.RUNNING

    def test_run_late_renew_or_abandon_keeps_the_done_marker(
        self, store_case: StoreCase
    ) -> None:
        """The main process may renew or give up a lease just after the run ended: no effect."""
        store = store_case.store
        runs = records_of(store)
        run = RunRef("run:i", "owner-a", "0.0", "copy-1")
        runs.claim_run(run, 30, META, release=False, ttl=60)
        runs.end_run(run, 30, META, release=True)
        assert runs.renew_runs([run], 1) == 0
        assert runs.abandon_run(run) is False
        time.sleep(2.2)  # past the renewal's 1 s, had it applied (memcached: whole seconds)
        outcome, claim = runs.claim_run(
            RunRef("run:i", "owner-a", "0.0", "copy-2"), 30, META, release=False, ttl=60
        )
        assert (outcome, claim) == (RunOutcome.DONE, None)

    def test_keep_runs_takes_back_a_lapsed_lease_and_gate(self, store_case: StoreCase) -> None:
        """A lease (and gate) that lapsed while nobody took it is taken back by its copy
        with ``retake``: a copy is RUNNING again and a follow-up WAITING."""
        store = store_case.store
        runs = records_of(store)
        run = RunRef("keep:a", "owner-a", "0.0", "copy-1", gated=True)
        assert runs.claim_run(run, 1, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        time.sleep(2.2)  # the lease and the gate lapse (memcached counts whole seconds)
        assert runs.keep_runs([run], 30, set()) == [False]  # not asked to: stays lapsed
        assert runs.peek_run(run) is None
        assert runs.keep_runs([run], 30, {"copy-1"}) == [True]
        assert runs.peek_run(run) is RunOutcome.BEGUN
        copy = RunRef("keep:a", "owner-a", "0.0", "copy-2", gated=True)
        assert runs.claim_run(copy, 30, META, release=False, ttl=30)[0] in (
            RunOutcome.RUNNING, RunOutcome.WAITING,
        )
        assert runs.peek_run(copy) is RunOutcome.RUNNING
        follow_up = RunRef("keep:a", "owner-b", "0.0", "copy-b", gated=True)
        assert runs.claim_run(follow_up, 30, META, release=False, ttl=30) == (
            RunOutcome.WAITING, None,
        )
        assert runs.keep_runs([run], 30, {"copy-1"}) == [True]  # held: renewed
        assert runs.end_run(run, 30, META, release=True) is True
        assert runs.peek_run(copy) is RunOutcome.DONE

    def test_keep_runs_never_takes_another_copys_lease_or_a_done_marker(
        self, store_case: StoreCase
    ) -> None:
        """Taking back is for an absent record only: a copy that took the attempt, or its
        done marker, stays; so does another run's gate."""
        store = store_case.store
        runs = records_of(store)
        stalled = RunRef("keep:b", "owner-a", "0.0", "copy-1", gated=True)
        assert runs.claim_run(stalled, 1, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        time.sleep(2.2)
        other = RunRef("keep:b", "owner-a", "0.0", "copy-2", gated=True)
        assert runs.claim_run(other, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        assert runs.keep_runs([stalled], 30, {"copy-1"}) == [False]
        assert runs.peek_run(stalled) is RunOutcome.RUNNING
        assert runs.peek_run(other) is RunOutcome.BEGUN
        assert runs.end_run(other, 30, META, release=True) is True
        assert runs.keep_runs([stalled], 30, {"copy-1"}) == [False]
        assert runs.peek_run(stalled) is RunOutcome.DONE
        # The key's gate was given up with the run: a follow-up takes it; the
        # stalled copy cannot take it back from the follow-up.
        follow_up = RunRef("keep:b", "owner-b", "0.0", "copy-b", gated=True)
        assert runs.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        assert runs.keep_runs([stalled, follow_up], 30, {"copy-1"}) == [False, True]
        peeked = RunRef("keep:b", "owner-c", "0.0", "copy-c", gated=True)
        assert runs.claim_run(peeked, 30, META, release=False, ttl=30) == (
            RunOutcome.WAITING, None,
        )
        assert runs.peek_run(RunRef("keep:none", "owner-a", "0.0", "copy-1")) is None

    def test_lease_token_names_the_copy_holding_the_lease(self, store_case: StoreCase) -> None:
        """The live lease's delivery token, for any copy of the attempt; none once the
        attempt is done; a copy inheriting that token takes the lease over, one copy only."""
        runs = records_of(store_case.store)
        first = RunRef("lease:a", "owner-a", "0.0", "dead-copy")
        assert runs.lease_token(first) is None
        assert runs.claim_run(first, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        copy = RunRef("lease:a", "owner-a", "0.0", "copy-2")
        assert runs.lease_token(copy) == "dead-copy"
        heir = RunRef("lease:a", "owner-a", "0.0", "copy-2", inherits="dead-copy")
        assert runs.claim_run(heir, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        other_heir = RunRef("lease:a", "owner-a", "0.0", "copy-3", inherits="dead-copy")
        assert runs.claim_run(other_heir, 30, META, release=False, ttl=30)[0] is (
            RunOutcome.RUNNING
        )
        assert runs.lease_token(first) == "copy-2"
        assert runs.end_run(heir, 30, META, release=True) is True
        assert runs.lease_token(first) is None

    def test_done_by_names_the_copy_that_ended_the_run_and_how(
        self, store_case: StoreCase
    ) -> None:
        """The done marker's delivery token and the body's outcome (``meta["outcome"]``),
        for any copy of the attempt; none while the run is live; ``""`` when not given.
        A copy with the ender's own token is still refused (never runs the attempt again)."""
        runs = records_of(store_case.store)
        first = RunRef("done:a", "owner-a", "0.0", "scope.123.ender")
        assert runs.done_by(first) is None
        assert runs.claim_run(first, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        assert runs.done_by(first) is None  # a lease, not a done marker
        assert runs.end_run(first, 30, {**META, "outcome": "success"}, release=True) is True
        copy = RunRef("done:a", "owner-a", "0.0", "copy-2")
        assert runs.done_by(copy) == ("scope.123.ender", "success")
        assert runs.claim_run(copy, 30, META, release=False, ttl=30) == (RunOutcome.DONE, None)
        assert runs.claim_run(first, 30, META, release=False, ttl=30) == (RunOutcome.DONE, None)
        plain = RunRef("done:b", "owner-b", "0.0", "ender-b")
        assert runs.claim_run(plain, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        runs.end_run(plain, 30, META, release=None)
        assert runs.done_by(plain) == ("ender-b", "")

    def test_run_revoked_owner_begins_but_is_refused(self, store_case: StoreCase) -> None:
        """The revoked marker is still consulted: the claim inside claim_run answers REVOKED."""
        store = store_case.store
        assert store.acquire("run:h", "owner-a", 30, META) is None
        assert store.revoke("run:h", "owner-a", 30) is RevokeOutcome.RELEASED
        outcome, claim = records_of(store).claim_run(
            RunRef("run:h", "owner-a", "0.0", "copy-1"), 30, META, release=False, ttl=60
        )
        assert outcome is RunOutcome.BEGUN
        assert claim is not None and claim.outcome is ClaimOutcome.REVOKED

    def test_an_inherited_lease_passes_to_one_copy_only(self, store_case: StoreCase) -> None:
        """A lease left by a claim that got no answer passes to the next copy's claim
        (``RunRef.inherits``), gate included; a second copy inheriting it is RUNNING,
        and nobody inherits a done marker."""
        store = store_case.store
        runs = records_of(store)
        for key, gated in (("run:j", False), ("gate:e", True)):
            assert store.acquire(key, "owner-a", 30, META) is None
            stalled = RunRef(key, "owner-a", "0.0", "copy-1", gated=gated)
            assert runs.claim_run(stalled, 30, META, release=False, ttl=None)[0] is (
                RunOutcome.BEGUN
            )
            store.settle(key, "owner-a")
            heir = RunRef(key, "owner-a", "0.0", "copy-2", gated=gated, inherits="copy-1")
            outcome, claim = runs.claim_run(heir, 30, META, release=False, ttl=None)
            assert outcome is RunOutcome.BEGUN and claim is not None
            assert claim.outcome is ClaimOutcome.OWNED
            twin = RunRef(key, "owner-a", "0.0", "copy-3", gated=gated, inherits="copy-1")
            outcome, claim = runs.claim_run(twin, 30, META, release=False, ttl=None)
            deferred = (RunOutcome.RUNNING, RunOutcome.WAITING) if gated else (RunOutcome.RUNNING,)
            assert outcome in deferred and claim is None
            assert runs.renew_runs([stalled], 30) == 0  # the stalled copy holds nothing
            assert runs.end_run(heir, 30, META, release=True) is True
            late = RunRef(key, "owner-a", "0.0", "copy-4", gated=gated, inherits="copy-2")
            assert runs.claim_run(late, 30, META, release=False, ttl=60) == (RunOutcome.DONE, None)
            assert store.get(key) is None

    # -- run gates (``RunRef.gated``: keep_last's one run of a key at a time) --

    def test_gated_runs_of_one_key_take_turns(self, store_case: StoreCase) -> None:
        """A gated run of another publish on the key waits (nothing written) until the
        running one ends; a copy of the running attempt is still told RUNNING."""
        store = store_case.store
        runs = records_of(store)
        assert store.acquire("gate:a", "owner-a", 30, META) is None
        first = RunRef("gate:a", "owner-a", "0.0", "copy-a", gated=True)
        outcome, claim = runs.claim_run(first, 30, META, release=False, ttl=None)
        assert outcome is RunOutcome.BEGUN and claim is not None
        assert claim.outcome is ClaimOutcome.OWNED
        store.take_over("gate:a", "owner-b", 30, META)  # the follow-up's publish
        follow_up = RunRef("gate:a", "owner-b", "0.0", "copy-b", gated=True)
        for _ in range(2):  # a look at a held gate takes nothing, however often
            assert runs.claim_run(follow_up, 30, META, release=False, ttl=None) == (
                RunOutcome.WAITING, None,
            )
            lock = store.get("gate:a")
            assert lock is not None and lock.owner == "owner-b" and not lock.started
        copy = RunRef("gate:a", "owner-a", "0.0", "copy-a2", gated=True)
        outcome, claim = runs.claim_run(copy, 30, META, release=False, ttl=None)
        # Deferred either way (a store keeping gates around its records sees the gate first).
        assert outcome in (RunOutcome.RUNNING, RunOutcome.WAITING) and claim is None
        # An ungated run of the key is not held back by the gate.
        plain = RunRef("gate:a", "owner-c", "0.0", "copy-c")
        assert runs.claim_run(plain, 30, META, release=False, ttl=None)[0] is RunOutcome.BEGUN
        assert runs.end_run(first, 30, META, release=True) is False  # owner-b holds the lock
        outcome, claim = runs.claim_run(follow_up, 30, META, release=False, ttl=None)
        assert outcome is RunOutcome.BEGUN and claim is not None
        assert claim.outcome is ClaimOutcome.OWNED
        lock = store.get("gate:a")
        assert lock is not None and lock.owner == "owner-b" and lock.started
        # Neither the gate nor the records are locks: listings never show them.
        assert [lock.key for lock in store.scan("gate:a")] == ["gate:a"]

    def test_a_gated_copy_that_does_not_begin_keeps_no_gate(self, store_case: StoreCase) -> None:
        """A copy told RUNNING or DONE leaves the gate to the run that holds it, or free."""
        store = store_case.store
        runs = records_of(store)
        first = RunRef("gate:b", "owner-a", "0.0", "copy-a", gated=True)
        assert runs.claim_run(first, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        copy = RunRef("gate:b", "owner-a", "0.0", "copy-a2", gated=True)
        deferred = (RunOutcome.RUNNING, RunOutcome.WAITING)
        assert runs.claim_run(copy, 30, META, release=False, ttl=30)[0] in deferred
        runs.end_run(first, 30, META, release=True)
        assert runs.claim_run(copy, 30, META, release=False, ttl=30)[0] is RunOutcome.DONE
        follow_up = RunRef("gate:b", "owner-b", "0.0", "copy-b", gated=True)
        outcome, claim = runs.claim_run(follow_up, 30, META, release=False, ttl=30)
        assert outcome is RunOutcome.BEGUN and claim is not None
        assert claim.outcome is ClaimOutcome.FREE

    def test_a_gate_is_renewed_with_its_lease_and_given_up_with_it(
        self, store_case: StoreCase
    ) -> None:
        """renew_runs keeps the gate past its first lease; abandon_run opens it at once."""
        store = store_case.store
        runs = records_of(store)
        first = RunRef("gate:c", "owner-a", "0.0", "copy-a", gated=True)
        assert runs.claim_run(first, 2, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        assert runs.renew_runs([first], 30) == 2  # the lease and the gate
        time.sleep(3.2)  # past the first lease (memcached counts whole seconds)
        follow_up = RunRef("gate:c", "owner-b", "0.0", "copy-b", gated=True)
        assert runs.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is (
            RunOutcome.WAITING
        )
        assert runs.abandon_run(first) is True
        assert runs.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is (
            RunOutcome.BEGUN
        )

    def test_an_unrenewed_gate_lapses_with_its_lease(self, store_case: StoreCase) -> None:
        """A run whose worker died unseen holds the gate one lease at most."""
        store = store_case.store
        runs = records_of(store)
        dead = RunRef("gate:d", "owner-a", "0.0", "copy-a", gated=True)
        assert runs.claim_run(dead, 1, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        follow_up = RunRef("gate:d", "owner-b", "0.0", "copy-b", gated=True)
        deadline = time.monotonic() + 5
        while True:
            outcome, _ = runs.claim_run(follow_up, 30, META, release=False, ttl=30)
            if outcome is RunOutcome.BEGUN:
                break
            assert outcome is RunOutcome.WAITING
            assert time.monotonic() < deadline, "the gate did not lapse"
            time.sleep(0.1)

    # -- the follow-up waiting at a gate is woken by the run's end (``gate_handoff``) --

    def test_a_run_s_end_hands_its_gate_to_the_follow_up_waiting_at_it(
        self, store_case: StoreCase
    ) -> None:
        """A follow-up listed at the gate a run holds is taken out by that run's end, byte
        for byte, the newest listing only, even after the gate was renewed; a copy that
        does not hold the gate, or an end nobody waits for, wakes nobody; an open gate
        lists nobody."""
        store = store_case.store
        runs = records_of(store)
        turns = gate_handoff(store)
        assert turns is not None, "every store wakes a keep_last follow-up"
        run = RunRef("gate:w", "owner-a", "0.0", "copy-a", gated=True)
        assert runs.claim_run(run, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        follow_up = RunRef("gate:w", "owner-b", "0.0", "copy-b", gated=True)
        assert runs.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is (
            RunOutcome.WAITING
        )
        payload = b"application/x-python-serialize;binary\n\x00\xff\x80 payload"
        assert turns.wait_at_gate(follow_up, b"an older follow-up", 30) is True
        assert turns.wait_at_gate(follow_up, payload, 30) is True  # the newer one replaces it
        assert turns.wait_at_gate(run, b"its own gate", 30) is False  # nobody else holds it
        assert runs.renew_runs([run], 30) == 2  # the lease and the gate: the waiter stays
        assert runs.keep_runs([run], 30, set()) == [True]
        stray = RunRef("gate:w", "owner-a", "0.0", "copy-a2", gated=True)
        assert turns.end_run_in_turn(stray, 30, META, release=None)[1] is None
        assert turns.end_run_in_turn(run, 30, META, release=None)[1] == payload
        assert turns.end_run_in_turn(run, 30, META, release=None)[1] is None  # taken once
        assert turns.wait_at_gate(follow_up, payload, 30) is False  # the gate is open
        assert runs.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is (
            RunOutcome.BEGUN
        )
        assert turns.end_run_in_turn(follow_up, 30, META, release=None)[1] is None
        plain = RunRef("gate:w2", "owner-c", "0.0", "copy-c")
        assert runs.claim_run(plain, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
        assert turns.end_run_in_turn(plain, 30, META, release=None) == (False, None)

    def test_a_listing_racing_the_end_is_woken_exactly_once(
        self, store_case: StoreCase
    ) -> None:
        """A run's end and a follow-up listing itself at its gate, started together, round
        after round: exactly one of them wakes the follow-up each time (the end takes it
        out, or the listing finds the gate open and the follow-up publishes itself), never
        both and never neither; and the gate is open after each round."""
        store = store_case.store
        runs = records_of(store)
        turns = gate_handoff(store)
        assert turns is not None
        for n in range(12):
            key = f"gate:race:{n}"
            run = RunRef(key, "owner-a", "0.0", f"copy-a{n}", gated=True)
            assert runs.claim_run(run, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
            follow_up = RunRef(key, "owner-b", "0.0", f"copy-b{n}", gated=True)
            woken = _race_end_and_listing(turns, run, follow_up, ending_late=bool(n % 2))
            assert woken == [b"follow-up"], (n, woken)
            outcome, _ = runs.claim_run(follow_up, 30, META, release=False, ttl=30)
            assert outcome is RunOutcome.BEGUN, (n, outcome)
            # Nothing is left listed at the gate: the follow-up's own end wakes nobody.
            assert turns.end_run_in_turn(follow_up, 30, META, release=None)[1] is None

    def test_concurrent_acquire_has_one_winner_per_key(self, store_case: StoreCase) -> None:
        """8 processes (threads for an in-process store) racing for 200 keys: one winner per key."""
        if store_case.shared_across_processes:
            seen = _race_in_processes(store_case.url)
        else:
            seen = _race_in_threads(store_case.url)
        assert len(seen) == RACE_WORKERS
        winners: dict[str, list[str]] = {key: [] for key in RACE_KEYS}
        for owner, saw in seen.items():
            assert set(saw) == set(RACE_KEYS)
            for key, holder in saw.items():
                if holder == owner:
                    winners[key].append(owner)
        wrong = {key: owners for key, owners in winners.items() if len(owners) != 1}
        assert not wrong, (
            f"{len(wrong)} keys without exactly one winner, e.g. "
            + "; ".join(
                f"{key}: won by {owners}, seen {sorted({saw[key] for saw in seen.values()})}"
                for key, owners in list(wrong.items())[:5]
            )
        )
        for key, (winner,) in winners.items():
            assert all(saw[key] == winner for saw in seen.values()), key
            lock = store_case.store.get(key)
            assert lock is not None and lock.owner == winner


def _stagger() -> None:
    """A random head start of up to 2 ms, so either side of the race wins some keys.

    (Only the mix of outcomes depends on it; the test's assertions hold for any.)
    """
    time.sleep(random.uniform(0, 0.002))


def _claim_all(store: LockStore, start: Callable[[], Any]) -> dict[str, Any]:
    """Start-check every queued holder of the take-over race: key → the outcome.

    ``start`` (a barrier shared with the taker) before each key: both sides
    send their command for the same key together.
    """
    seen: dict[str, Any] = {}
    for key in TQ_RACE_KEYS:
        start()
        _stagger()
        claim = store.claim(key, f"q-{key}", release=False, ttl=None, meta=META)
        seen[key] = claim.outcome.value
    return seen


def _take_all(store: LockStore, start: Callable[[], Any]) -> dict[str, Any]:
    """Take every key of the take-over race: key → (previous owner, whether it had started)."""
    assert isinstance(store, QueuedTakeOver)
    seen: dict[str, Any] = {}
    for key in TQ_RACE_KEYS:
        start()
        _stagger()
        previous = store.take_over_queued(key, f"t-{key}", 60, OTHER_META)
        seen[key] = None if previous is None else (previous.owner, previous.started)
    return seen


_RACERS = {"claim": _claim_all, "take": _take_all}


def _start_race_process(url: str, role: str, barrier: Any, results: Any) -> None:
    try:
        store = store_from_url(url)
        results.put((role, _RACERS[role](store, barrier.wait)))
    except BaseException as exc:
        results.put((role, repr(exc)))
        raise


def _start_race(case: StoreCase) -> tuple[dict[str, Any], dict[str, Any]]:
    """The start checks and the take-overs of ``TQ_RACE_KEYS``, in two processes
    (threads for an in-process store), from one barrier."""
    seen: dict[str, Any] = {}
    if case.shared_across_processes:
        context = multiprocessing.get_context("fork")
        barrier: Any = context.Barrier(2)
        results: Any = context.Queue()
        procs = [
            context.Process(target=_start_race_process, args=(case.url, role, barrier, results))
            for role in _RACERS
        ]
        for proc in procs:
            proc.start()
        try:
            for _ in procs:
                role, saw = results.get(timeout=RACE_WAIT)
                assert isinstance(saw, dict), f"{role} failed: {saw}"
                seen[role] = saw
        finally:
            for proc in procs:
                proc.join(30)
            results.close()
            results.join_thread()
        assert [proc.exitcode for proc in procs] == [0, 0]
    else:
        thread_barrier = threading.Barrier(2)
        threads = [
            threading.Thread(
                target=lambda role=role: seen.update(
                    {role: _RACERS[role](case.store, thread_barrier.wait)}
                )
            )
            for role in _RACERS
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    return seen["claim"], seen["take"]


def _race_in_processes(url: str) -> dict[str, dict[str, str]]:
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(RACE_WORKERS)
    results = context.Queue()
    procs = [
        context.Process(target=_race_process, args=(url, f"owner-{i}", barrier, results))
        for i in range(RACE_WORKERS)
    ]
    for proc in procs:
        proc.start()
    seen: dict[str, dict[str, str]] = {}
    try:
        for _ in procs:
            owner, saw = results.get(timeout=RACE_WAIT)
            assert isinstance(saw, dict), f"{owner} failed: {saw}"
            seen[owner] = saw
    finally:
        for proc in procs:
            proc.join(30)
        results.close()
        results.join_thread()
    assert [proc.exitcode for proc in procs] == [0] * RACE_WORKERS
    return seen


def _race_in_threads(url: str) -> dict[str, dict[str, str]]:
    barrier = threading.Barrier(RACE_WORKERS)
    results: queue.Queue[tuple[str, dict[str, str]]] = queue.Queue()

    def run(owner: str) -> None:
        results.put((owner, race(store_from_url(url), owner, barrier.wait)))

    threads = [
        threading.Thread(target=run, args=(f"owner-{i}",)) for i in range(RACE_WORKERS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return dict(results.get_nowait() for _ in threads)
