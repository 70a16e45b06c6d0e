"""The SQL store under contention: bursts of processes, lock waits, lost races.

Contention is not an outage: racing writers on the same new keys always get
one answer per key and never ``StoreUnavailable``; a wait the database
breaks (deadlock, lock wait timeout, "database is locked") is retried with
backoff, and when it goes on the store raises ``StoreContention``, which no
fallback treats as an outage. Real servers: MariaDB (also through the MySQL
code path), PostgreSQL and SQLite.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from celery_dedup import StoreUnavailable
from celery_dedup.exceptions import StoreContention
from celery_dedup.stores import sql, sql_dialects, store_from_url
from celery_dedup.stores.base import ClaimOutcome, RevokeOutcome
from celery_dedup.stores.sql import SQLStore
from tests.fixtures._store_case import StoreCase

META = {"task_name": "tests.add", "policy": "success", "task_id": "id-a"}

PROCESSES = 8
KEYS = [f"burst:{i:03d}" for i in range(200)]
#: Longer than any burst on a loaded machine: no key expires mid-race.
TTL = 3600

RACING_STORES = [
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mariadb"),
    pytest.param("mysql_path", marks=pytest.mark.mysql, id="mysql-path"),
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
]


@pytest.fixture
def mysql_path(store_mysql: StoreCase, monkeypatch: pytest.MonkeyPatch) -> StoreCase:
    """MariaDB through the MySQL code path (no RETURNING); forked children inherit it."""
    monkeypatch.setattr(sql_dialects, "_MariaDB", sql_dialects._MySQL)
    return store_mysql


@pytest.fixture(params=RACING_STORES)
def racing(request: pytest.FixtureRequest) -> SQLStore:
    """Each SQL store in turn, tables created and empty."""
    case: StoreCase = request.getfixturevalue(request.param)
    assert isinstance(case.store, SQLStore)
    case.store.create_tables()
    return case.store


class _Retries(logging.Handler):
    """Counts the store's "lost a race … trying again" debug records."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "lost a race" in record.getMessage():
            self.count += 1


def count_retries() -> _Retries:
    """In a racing process: start counting the lost races the store retries."""
    retries = _Retries()
    logger = logging.getLogger("celery_dedup")
    logger.addHandler(retries)
    logger.setLevel(logging.DEBUG)
    return retries


def _burst(url: str, operation: str, owner: str, barrier: Any, results: Any) -> None:
    """One racing process: ``operation`` on every key in order, as ``owner``.

    Reports key → holder seen (acquire) or previous owner (take-over), the
    errors raised by type, and how many lost races the store retried.
    """
    retries = count_retries()
    seen: dict[str, str | None] = {}
    errors: Counter[str] = Counter()
    try:
        store = store_from_url(url)
        store.get("warm-up")  # connect before the start line
        barrier.wait()
        for key in KEYS:
            try:
                if operation == "acquire":
                    holder = store.acquire(key, owner, TTL, META)
                    seen[key] = owner if holder is None else holder.owner
                else:
                    previous = store.take_over(key, owner, TTL, META)
                    seen[key] = None if previous is None else previous.owner
            except Exception as exc:  # counted, and the test fails on any
                errors[type(exc).__name__] += 1
        results.put((owner, seen, dict(errors), retries.count))
    except BaseException as exc:
        results.put((owner, repr(exc), {}, retries.count))
        raise


def run_burst(store: SQLStore, operation: str) -> tuple[dict[str, dict[str, str | None]], int]:
    """``PROCESSES`` processes run ``operation`` on every key at once, same order.

    Returns owner → what it saw, and the lost races retried in all. Fails on
    any error in any process.
    """
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    owners = [f"{operation}-{i}" for i in range(PROCESSES)]
    procs = [
        context.Process(target=_burst, args=("db+" + store.url, operation, o, barrier, results))
        for o in owners
    ]
    for proc in procs:
        proc.start()
    seen: dict[str, dict[str, str | None]] = {}
    errors: Counter[str] = Counter()
    retried = 0
    try:
        for _ in procs:
            owner, saw, raised, retries = results.get(timeout=300)
            assert isinstance(saw, dict), f"{owner} failed: {saw}"
            seen[owner] = saw
            errors.update(raised)
            retried += retries
    finally:
        for proc in procs:
            proc.join(60)
        results.close()
        results.join_thread()
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES
    assert errors == {}, f"errors under contention: {dict(errors)}"
    return seen, retried


def assert_no_broken_waits(store: SQLStore, retried: int) -> None:
    """On a server database, no wait was broken: no deadlock, no serialization failure.

    SQLite is exempt: it has no row locks, its busy handler is not fair
    (a waiter on a loaded machine can run out of its busy timeout while
    others take turns), and it answers "database is locked" at once where
    waiting could deadlock two statements; there a retry is the designed
    answer, and the test's answers per key prove the retries harmless.
    """
    if store.engine.dialect.name != "sqlite":
        assert retried == 0


def deadlocks(store: SQLStore) -> int | None:
    """The server's deadlock counter (MariaDB/MySQL), or None elsewhere."""
    if store.engine.dialect.name != "mysql":
        return None
    with store.engine.connect() as conn:
        row = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'").one()
    return int(row[1])


def test_first_acquire_burst_has_one_winner_per_key(racing: SQLStore) -> None:
    """8 processes acquire the same 200 new keys in the same order at once.

    Every key has exactly one winner, every other process saw that winner,
    no call raised (no StoreUnavailable, no StoreContention), and the
    database broke no deadlock: the upsert shape cannot deadlock.
    """
    before = deadlocks(racing)
    seen, retried = run_burst(racing, "acquire")
    winners = {
        key: [owner for owner, saw in seen.items() if saw[key] == owner] for key in KEYS
    }
    assert {key: len(owners) for key, owners in winners.items()} == dict.fromkeys(KEYS, 1)
    for key, (winner,) in winners.items():
        assert {saw[key] for saw in seen.values()} == {winner}, key
        lock = racing.get(key)
        assert lock is not None and lock.owner == winner
    assert deadlocks(racing) == before
    assert_no_broken_waits(racing, retried)


def test_take_over_burst_is_one_chain_per_key(racing: SQLStore) -> None:
    """8 processes take over the same 200 new keys in the same order at once.

    Per key the answers form one chain: exactly one call found the key free,
    every other call was handed the holder it replaced, each owner was
    replaced at most once, and the last in the chain holds the key. No call
    raised, and the database broke no deadlock (0.1.0's locking read before
    the insert did, and ran out of retries).
    """
    before = deadlocks(racing)
    seen, retried = run_burst(racing, "take_over")
    owners = set(seen)
    for key in KEYS:
        previous = [saw[key] for saw in seen.values()]
        assert previous.count(None) == 1, key
        replaced = [owner for owner in previous if owner is not None]
        assert len(set(replaced)) == len(replaced) == PROCESSES - 1, key
        assert set(replaced) <= owners
        (last,) = owners - set(replaced)
        lock = racing.get(key)
        assert lock is not None and lock.owner == last, key
    assert deadlocks(racing) == before
    assert_no_broken_waits(racing, retried)


# -- the start check racing a revoke ------------------------------------------

PAIRS = 4
PAIR_KEYS = [f"pair:{i:03d}" for i in range(100)]


def _claim_or_revoke(
    url: str, role: str, pair: int, barrier: Any, results: Any
) -> None:
    retries = count_retries()
    try:
        store = store_from_url(url)
        store.get("warm-up")
        barrier.wait()
        answers: dict[str, str] = {}
        token = f"token-{pair}"
        for key in PAIR_KEYS:
            if role == "claim":
                claim = store.claim(f"{pair}:{key}", token, release=False, ttl=TTL, meta=META)
                answers[key] = claim.outcome.value
            else:
                answers[key] = store.revoke(f"{pair}:{key}", token, TTL).value
        results.put((role, pair, answers, retries.count))
    except BaseException as exc:
        results.put((role, pair, repr(exc), retries.count))
        raise


def race_claims_and_revokes(store: SQLStore) -> Counter[tuple[str, str]]:
    """For each key, one process claims a token while another revokes it.

    Counts the pairs of answers; fails on any error, any retried lost race (server databases)
    and any deadlock the database broke.
    """
    before = deadlocks(store)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2 * PAIRS)
    results = context.Queue()
    url = "db+" + store.url
    procs = [
        context.Process(target=_claim_or_revoke, args=(url, role, pair, barrier, results))
        for pair in range(PAIRS)
        for role in ("claim", "revoke")
    ]
    for proc in procs:
        proc.start()
    answers: dict[tuple[str, int], dict[str, str]] = {}
    retried = 0
    try:
        for _ in procs:
            role, pair, got, retries = results.get(timeout=300)
            assert isinstance(got, dict), f"{role} {pair} failed: {got}"
            answers[role, pair] = got
            retried += retries
    finally:
        for proc in procs:
            proc.join(60)
        results.close()
        results.join_thread()
    assert_no_broken_waits(store, retried)
    assert deadlocks(store) == before
    return Counter(
        (answers["claim", pair][key], answers["revoke", pair][key])
        for pair in range(PAIRS)
        for key in PAIR_KEYS
    )


def test_start_check_racing_a_revoke_of_a_queued_holder(racing: SQLStore) -> None:
    """A claim and a revoke of the same queued holder, at once: always one order or the other.

    Either the claim came first (OWNED, then RUNNING: the task runs and keeps
    its lock) or the revoke did (RELEASED, then REVOKED: it never runs and
    the key is free), never a mix; no deadlock (both lock the owner's
    marker first, then the key's row).
    """
    for pair in range(PAIRS):
        for key in PAIR_KEYS:
            assert racing.acquire(f"{pair}:{key}", f"token-{pair}", TTL, META) is None
    pairs = race_claims_and_revokes(racing)
    assert set(pairs) <= {("owned", "running"), ("revoked", "released")}, pairs
    held = sum(1 for pair in range(PAIRS) for key in PAIR_KEYS if racing.get(f"{pair}:{key}"))
    assert held == pairs["owned", "running"]


def test_start_check_racing_a_revoke_on_a_free_key(racing: SQLStore) -> None:
    """A claim that may take a free key and a revoke of its token, at once.

    Either the claim came first (FREE: it took the key, started; then
    RUNNING) or the revoke did (NOT_HELD, then REVOKED, key left free). On
    PostgreSQL the two statements can also miss each other's write when
    they overlap (FREE with NOT_HELD, documented); the marker still blocks
    any later start of that token.
    """
    pairs = race_claims_and_revokes(racing)
    allowed = {("free", "running"), ("revoked", "not_held")}
    if racing.engine.dialect.name == "postgresql":
        allowed.add(("free", "not_held"))
    assert set(pairs) <= allowed, pairs
    for pair in range(PAIRS):
        for key in PAIR_KEYS:
            claim = racing.claim(
                f"{pair}:{key}", f"token-{pair}", release=False, ttl=TTL, meta=META
            )
            assert claim.outcome is ClaimOutcome.REVOKED


# -- waits the database breaks ------------------------------------------------

#: Per dialect: engine options making the store give up waiting for a row
#: lock quickly (MariaDB's least lock wait is one second).
SHORT_WAITS: dict[str, dict[str, Any]] = {
    "sqlite": {"connect_args": {"timeout": 0.1}},
    "postgresql": {"connect_args": {"options": "-c lock_timeout=100"}},
    "mysql": {"connect_args": {"init_command": "SET SESSION innodb_lock_wait_timeout = 1"}},
}


@contextmanager
def row_locked(store: SQLStore, key: str) -> Iterator[Callable[[], None]]:
    """Hold ``key``'s row (SQLite: the whole database) locked in another transaction.

    Yields a function that commits it early; it commits at the latest on exit.
    """
    dialect = store.engine.dialect.name
    conn = store.engine.connect()
    conn.exec_driver_sql({"sqlite": "BEGIN IMMEDIATE", "postgresql": "BEGIN"}.get(
        dialect, "START TRANSACTION"
    ))
    if dialect != "sqlite":
        conn.exec_driver_sql(
            "SELECT 1 FROM celery_dedup_sql_lock WHERE " + (
                "key" if dialect == "postgresql" else "`key`"
            ) + f" = '{key}' FOR UPDATE"
        )
    done = threading.Lock()

    def commit() -> None:
        with done:
            if not conn.closed:
                conn.exec_driver_sql("COMMIT")
                conn.close()

    try:
        yield commit
    finally:
        commit()


def tuned(store: SQLStore) -> SQLStore:
    """Another store on the same database, with short lock waits."""
    return SQLStore(store.url, engine_options=SHORT_WAITS[store.engine.dialect.name])


def test_wait_that_never_ends_raises_store_contention(
    racing: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row locked for longer than the retry budget: StoreContention, never StoreUnavailable.

    Each try waits for the lock until the database gives up (lock wait
    timeout, lock_timeout, "database is locked"); the store retries with
    backoff, then raises StoreContention, with the database error as cause.
    """
    monkeypatch.setattr(sql, "CONTENTION_BUDGET", 1.5)
    assert racing.acquire("k", "owner-a", 60, META) is None
    store = tuned(racing)
    try:
        store.get("k")
        with row_locked(racing, "k"):
            start = time.monotonic()
            with pytest.raises(StoreContention) as info:
                store.take_over("k", "owner-b", 60, META)
            assert time.monotonic() - start < 10
        assert not isinstance(info.value, StoreUnavailable)
        assert info.value.store == "sql" and "'k'" in str(info.value)
        assert sql_dialects.is_contention(info.value.__cause__ or Exception())
        lock = racing.get("k")
        assert lock is not None and lock.owner == "owner-a"
    finally:
        store.close()


def test_wait_that_ends_is_retried(racing: SQLStore, caplog: pytest.LogCaptureFixture) -> None:
    """A row lock held past one lock wait, then released: the retry succeeds."""
    assert racing.acquire("k", "owner-a", 60, META) is None
    store = tuned(racing)
    wait = 1.0 if racing.engine.dialect.name == "mysql" else 0.1
    try:
        store.get("k")
        with row_locked(racing, "k") as commit:
            timer = threading.Timer(wait * 2.5, commit)
            timer.start()
            with caplog.at_level(logging.DEBUG, logger="celery_dedup"):
                previous = store.take_over("k", "owner-b", 60, META)
            timer.join()
        assert previous is not None and previous.owner == "owner-a"
        assert any("lost a race on 'k'" in r.getMessage() for r in caplog.records)
        lock = racing.get("k")
        assert lock is not None and lock.owner == "owner-b"
        assert store.revoke("k", "owner-b", 60) is RevokeOutcome.RELEASED
    finally:
        store.close()
