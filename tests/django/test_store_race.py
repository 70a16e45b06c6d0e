"""Contention is not an outage: bursts of first acquires and take-overs on new keys.

8 processes race for 200 keys nobody held, on PostgreSQL, MariaDB (both of
its paths) and SQLite. Every call must answer (zero ``StoreUnavailable``:
deadlocks, serialization failures and duplicate-key races are retried inside
the store), and the answers must be those of some serial order: one winner
per key for acquires, one chain of holders per key for take-overs.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from celery_dedup.contrib.django import managers
from celery_dedup.exceptions import StoreUnavailable
from celery_dedup.stores import store_from_url
from tests.django.test_django_store import maria_alias, store_django_maria
from tests.fixtures._store_case import StoreCase

__all__ = ["maria_alias", "store_django_maria"]

PROCESSES = 8
KEYS = [f"burst:{i:03d}" for i in range(200)]
#: Longer than any burst on a loaded machine: no key expires mid-race.
TTL = 3600
META = {"task_name": "tests.burst", "policy": "success", "task_id": "id-burst"}
#: what a process saw for one key: the holder (acquire), or the previous holder ("" = free)
Seen = dict[str, str]


def _burst(url: str, owner: str, operation: str, barrier: Any, results: Any) -> None:
    """One racing process: its own store from the URL, every key once, all in one order.

    The same order for every process keeps all 8 on the same new key at once.
    """
    try:
        store = store_from_url(url)
        seen: Seen = {}
        unavailable = 0
        barrier.wait()
        for key in KEYS:
            try:
                if operation == "acquire":
                    holder = store.acquire(key, owner, TTL, META)
                    seen[key] = owner if holder is None else holder.owner
                else:
                    previous = store.take_over(key, owner, TTL, META)
                    seen[key] = "" if previous is None else previous.owner
            except StoreUnavailable:
                unavailable += 1
        results.put((owner, seen, unavailable))
    except BaseException as exc:
        results.put((owner, repr(exc), -1))
        raise


def _race(url: str, operations: list[str]) -> dict[str, tuple[str, Seen]]:
    """Run one process per operation; owner → (operation, what it saw)."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(len(operations))
    results = context.Queue()
    procs = [
        context.Process(target=_burst, args=(url, f"owner-{i}", op, barrier, results))
        for i, op in enumerate(operations)
    ]
    for proc in procs:
        proc.start()
    seen: dict[str, tuple[str, Seen]] = {}
    try:
        for _ in procs:
            owner, saw, unavailable = results.get(timeout=240)
            assert isinstance(saw, dict), f"{owner} failed: {saw}"
            assert unavailable == 0, f"{owner}: {unavailable} calls raised StoreUnavailable"
            seen[owner] = (operations[int(owner.rsplit("-", 1)[1])], saw)
    finally:
        for proc in procs:
            proc.join(30)
        results.close()
        results.join_thread()
    assert [proc.exitcode for proc in procs] == [0] * len(procs)
    return seen


def _check_serial(seen: dict[str, tuple[str, Seen]], final: Callable[[str], str]) -> None:
    """Per key: the answers are those of one serial order of the calls.

    Exactly one call found the key free (an acquire that won, or a take-over
    that saw no previous holder); every holder but the last was reported as
    the previous holder by exactly one take-over; acquires that lost saw one
    of the holders.
    """
    for key in KEYS:
        holders: Counter[str] = Counter()
        previous: Counter[str] = Counter()
        free = 0
        lost: list[str] = []
        for owner, (operation, saw) in seen.items():
            if operation == "take_over":
                holders[owner] += 1
                if saw[key]:
                    previous[saw[key]] += 1
                else:
                    free += 1
            elif saw[key] == owner:
                holders[owner] += 1
                free += 1
            else:
                lost.append(saw[key])
        last = final(key)
        assert free == 1, (key, free)
        assert previous == holders - Counter([last]), key
        assert set(lost) <= set(holders), key


class Bursts:
    """The bursts, for a ``store_case`` fixture."""

    def test_first_acquire_burst_has_one_winner_per_key(self, store_case: StoreCase) -> None:
        """8 processes acquire 200 new keys: one winner per key, every loser sees it."""
        seen = _race(store_case.url, ["acquire"] * PROCESSES)

        def holder(key: str) -> str:
            lock = store_case.store.get(key)
            assert lock is not None
            return lock.owner

        _check_serial(seen, holder)
        for key in KEYS:
            assert len({saw[key] for _, saw in seen.values()}) == 1, key

    def test_take_over_burst_is_one_chain_per_key(self, store_case: StoreCase) -> None:
        """8 processes take over 200 new keys: each key's holders form one chain, none lost."""
        seen = _race(store_case.url, ["take_over"] * PROCESSES)

        def holder(key: str) -> str:
            lock = store_case.store.get(key)
            assert lock is not None and lock.started is False
            return lock.owner

        _check_serial(seen, holder)

    def test_mixed_burst_is_serial(self, store_case: StoreCase) -> None:
        """4 processes acquire while 4 take over the same new keys: still one serial order."""
        seen = _race(store_case.url, ["acquire", "take_over"] * (PROCESSES // 2))

        def holder(key: str) -> str:
            lock = store_case.store.get(key)
            assert lock is not None
            return lock.owner

        _check_serial(seen, holder)


class TestPostgres(Bursts):
    """PostgreSQL: ``ON CONFLICT`` upserts and ``FOR UPDATE`` transactions."""

    @pytest.fixture
    def store_case(self, store_django_postgres: StoreCase) -> StoreCase:
        """The PostgreSQL case."""
        return store_django_postgres


class TestMariaDB(Bursts):
    """MariaDB: ``INSERT … ON DUPLICATE KEY UPDATE … RETURNING``."""

    @pytest.fixture
    def store_case(self, store_django_maria: StoreCase) -> StoreCase:
        """The MariaDB case."""
        return store_django_maria


class TestMySQLPath(Bursts):
    """MySQL's path (upsert, then read the row, in one transaction), on MariaDB."""

    @pytest.fixture
    def store_case(
        self, store_django_maria: StoreCase, monkeypatch: pytest.MonkeyPatch
    ) -> StoreCase:
        """The MariaDB case without ``RETURNING``."""
        monkeypatch.setattr(managers, "_has_upsert_returning", lambda connection: False)
        return store_django_maria


class TestSQLite(Bursts):
    """SQLite: one writer at a time (``BEGIN IMMEDIATE``), busy waits retried."""

    @pytest.fixture
    def store_case(self, store_django_sqlite: StoreCase) -> StoreCase:
        """The SQLite case."""
        return store_django_sqlite
