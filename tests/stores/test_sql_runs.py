"""Run records kept natively by the SQL store: round trips, statement shapes, races.

The behaviour itself (BEGUN/RUNNING/DONE, the claim inside, renew, abandon)
is the store contract's ``test_run_*``, run on every dialect by
``test_conformance.py``; this module proves what only the SQL store
promises: PostgreSQL answers ``claim_run`` and ``end_run`` in one statement
each, the other dialects in the statements ``docs/stores/sql.md`` lists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from celery_dedup.runs import GatedRuns, records_of
from celery_dedup.stores import sql_dialects
from celery_dedup.stores.base import (
    DONE_POLICY,
    ClaimOutcome,
    RunOutcome,
    RunRecords,
    RunRef,
)
from celery_dedup.stores.sql import SQLStore, lock_table
from tests.fixtures._store_case import StoreCase
from tests.fixtures.mysql import MySQLServer
from tests.fixtures.sql_stores import sql_case
from tests.stores.test_sql import Recorder, driver_statements, is_mariadb, statements

META = {"task_name": "tests.add", "policy": "success", "task_id": "id-a"}

SQL_STORES = [
    pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
]


@pytest.fixture(params=SQL_STORES)
def runs_store(request: pytest.FixtureRequest) -> SQLStore:
    """Each SQL store in turn, tables created and empty."""
    case: StoreCase = request.getfixturevalue(request.param)
    assert isinstance(case.store, SQLStore)
    case.store.create_tables()
    return case.store


@pytest.fixture(params=["sqlalchemy", "driver"])
def recorder(request: pytest.FixtureRequest) -> Recorder:
    """Statements recorded through SQLAlchemy (a listener) or at the driver (none)."""
    return statements if request.param == "sqlalchemy" else driver_statements


@pytest.fixture
def mysql_path_store(
    mysql_server: MySQLServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[SQLStore]:
    """MariaDB through the MySQL code path (no RETURNING)."""
    monkeypatch.setattr(sql_dialects, "_MariaDB", sql_dialects._MySQL)
    for case in sql_case(f"db+{mysql_server.url('pymysql')}"):
        assert isinstance(case.store, SQLStore)
        case.store.create_tables()
        assert type(case.store._dialect) is sql_dialects._MySQL
        yield case.store


def sent_by(
    recorder: Recorder, store: SQLStore, operation: Callable[[], Any]
) -> tuple[Any, list[str]]:
    """The result of ``operation`` and the statements it sent."""
    with recorder(store) as sent:
        result = operation()
    return result, list(sent)


def verbs(sent: list[str]) -> list[str]:
    """Each statement's first word."""
    return [statement.split()[0].upper() for statement in sent]


def lock_rows(store: SQLStore) -> int:
    """Rows in the lock table, live or expired (locks and run records)."""
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(lock_table)).scalar_one())


def test_sql_store_keeps_run_records_itself(runs_store: SQLStore) -> None:
    """Every dialect implements ``RunRecords``: no generic two-step records. PostgreSQL
    keeps keep_last's run gates in them too; elsewhere the gate is a lock around them."""
    assert isinstance(runs_store, RunRecords)
    records = records_of(runs_store)
    if runs_store.run_gates:
        assert records is runs_store
    else:
        assert isinstance(records, GatedRuns) and records.records is runs_store


@pytest.mark.postgres
def test_claim_run_and_end_run_are_one_statement_on_postgres(
    store_postgres: StoreCase, recorder: Recorder
) -> None:
    """On PostgreSQL every answer of claim_run and end_run costs one statement; so do
    abandon_run and renew_runs (for all runs at once)."""
    store = store_postgres.store
    assert isinstance(store, SQLStore)
    assert store.acquire("mine", "owner-a", 30, META) is None
    assert store.acquire("theirs", "owner-b", 30, META) is None
    first = RunRef("mine", "owner-a", "0.0", "copy-1")

    def one(operation: Callable[[], Any]) -> Any:
        result, sent = sent_by(recorder, store, operation)
        assert len(sent) == 1, sent
        return result

    outcome, claim = one(lambda: store.claim_run(first, 30, META, release=False, ttl=None))
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.outcome is ClaimOutcome.OWNED
    lock = store.get("mine")
    assert lock is not None and lock.started

    second = RunRef("mine", "owner-a", "0.0", "copy-2")
    assert one(lambda: store.claim_run(second, 30, META, release=False, ttl=None)) == (
        RunOutcome.RUNNING, None,
    )

    outcome, claim = one(
        lambda: store.claim_run(
            RunRef("free", "owner-c", "0.0", "copy-1"), 30, META, release=False, ttl=30
        )
    )
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.outcome is ClaimOutcome.FREE
    taken = store.get("free")
    assert taken is not None and taken.owner == "owner-c" and taken.started

    outcome, claim = one(
        lambda: store.claim_run(
            RunRef("theirs", "owner-c", "0.0", "copy-1"), 30, META, release=False, ttl=30
        )
    )
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.outcome is ClaimOutcome.HELD
    assert claim.holder is not None and claim.holder.owner == "owner-b"

    assert one(lambda: store.end_run(first, 60, META, release=True)) is True
    assert store.get("mine") is None
    assert one(
        lambda: store.claim_run(
            RunRef("mine", "owner-a", "0.0", "copy-3"), 30, META, release=False, ttl=30
        )
    ) == (RunOutcome.DONE, None)
    assert store.get("mine") is None

    settled = RunRef("free", "owner-c", "0.0", "copy-1")
    assert one(lambda: store.end_run(settled, 60, META, release=False)) is True
    lock = store.get("free")
    assert lock is not None and not lock.started
    assert one(lambda: store.end_run(settled, 60, META, release=None)) is False

    leases = [RunRef(f"many:{i}", "owner-a", "0.0", f"copy-{i}") for i in range(50)]
    for run in leases:
        store.claim_run(run, 30, META, release=False, ttl=None)
    assert one(lambda: store.renew_runs(leases, 60)) == 50
    assert one(lambda: store.abandon_run(leases[0])) is True

    # keep_last: the run gate rides on the same statements.
    assert store.acquire("last", "owner-a", 30, META) is None
    running = RunRef("last", "owner-a", "0.0", "copy-1", gated=True)
    outcome, claim = one(lambda: store.claim_run(running, 30, META, release=False, ttl=30))
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.outcome is ClaimOutcome.OWNED
    store.take_over("last", "owner-b", 30, META)
    follow_up = RunRef("last", "owner-b", "0.0", "copy-2", gated=True)
    assert one(lambda: store.claim_run(follow_up, 30, META, release=False, ttl=30)) == (
        RunOutcome.WAITING, None,
    )
    assert one(lambda: store.renew_runs([running], 60)) == 2  # the lease and the gate
    assert one(lambda: store.end_run(running, 60, META, release=True)) is False
    outcome, claim = one(lambda: store.claim_run(follow_up, 30, META, release=False, ttl=30))
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.outcome is ClaimOutcome.OWNED
    assert one(lambda: store.abandon_run(follow_up)) is True


@pytest.mark.parametrize(
    "runs_store",
    [
        pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
    ],
    indirect=True,
)
def test_run_statement_shapes_elsewhere(runs_store: SQLStore, recorder: Recorder) -> None:
    """SQLite and MariaDB: claim_run is the lease's upsert then the one-statement claim;
    end_run the done marker's upsert then the lock's DELETE or UPDATE. MariaDB commits
    each statement (round trips), SQLite both in one transaction (one sync of the file)."""
    store = runs_store
    sqlite = store.engine.dialect.name == "sqlite"
    assert sqlite or is_mariadb(store)

    def txn(steps: list[str]) -> list[str]:
        return ["BEGIN", *steps, "COMMIT"] if sqlite else steps

    assert store.acquire("k", "owner-a", 30, META) is None
    first = RunRef("k", "owner-a", "0.0", "copy-1")
    answer, sent = sent_by(
        recorder, store, lambda: store.claim_run(first, 30, META, release=False, ttl=None)
    )
    assert answer[0] is RunOutcome.BEGUN and answer[1].outcome is ClaimOutcome.OWNED
    assert verbs(sent) == txn(["INSERT", "UPDATE"])
    answer, sent = sent_by(
        recorder,
        store,
        lambda: store.claim_run(
            RunRef("k", "owner-a", "0.0", "copy-2"), 30, META, release=False, ttl=None
        ),
    )
    assert answer == (RunOutcome.RUNNING, None)
    # SQLite reads the other copy's record in process (no round trip).
    assert verbs(sent) == (txn(["INSERT", "SELECT"]) if sqlite else ["INSERT"])
    for release, last in ((False, ["UPDATE"]), (None, []), (True, ["DELETE"])):
        answer, sent = sent_by(
            recorder, store, lambda release=release: store.end_run(first, 60, META, release=release)
        )
        assert answer is (release is not None)
        assert verbs(sent) == (txn(["INSERT", *last]) if last else ["INSERT"])
    answer, sent = sent_by(recorder, store, lambda: store.abandon_run(first))
    assert answer is False  # a done marker is no lease
    assert verbs(sent) == ["DELETE"]
    answer, sent = sent_by(recorder, store, lambda: store.renew_runs([first], 30))
    assert answer == 0
    assert verbs(sent) == ["UPDATE"]


@pytest.mark.mysql
def test_run_statement_shapes_on_mysql(mysql_path_store: SQLStore) -> None:
    """MySQL (no RETURNING) reads the record back after the lease's upsert."""
    store = mysql_path_store
    assert store.acquire("k", "owner-a", 30, META) is None
    first = RunRef("k", "owner-a", "0.0", "copy-1")
    answer, sent = sent_by(
        statements, store, lambda: store.claim_run(first, 30, META, release=False, ttl=None)
    )
    assert answer[0] is RunOutcome.BEGUN and answer[1].outcome is ClaimOutcome.OWNED
    assert verbs(sent) == ["INSERT", "SELECT", "UPDATE"]
    assert "RETURNING" not in sent[0].upper()
    answer, sent = sent_by(
        statements,
        store,
        lambda: store.claim_run(
            RunRef("k", "owner-a", "0.0", "copy-2"), 30, META, release=False, ttl=None
        ),
    )
    assert answer == (RunOutcome.RUNNING, None)
    assert verbs(sent) == ["INSERT", "SELECT"]
    answer, sent = sent_by(statements, store, lambda: store.end_run(first, 60, META, release=True))
    assert answer is True
    assert verbs(sent) == ["INSERT", "DELETE"]


def test_done_marker_survives_a_late_renew_or_abandon(runs_store: SQLStore) -> None:
    """The worker's lease upkeep may still list a copy whose run just ended: renewing or
    abandoning it neither shortens nor drops the done marker, so a late copy stays refused."""
    store = runs_store
    assert store.acquire("late", "owner-a", 30, META) is None
    first = RunRef("late", "owner-a", "0.0", "copy-1")
    store.claim_run(first, 1, META, release=False, ttl=None)
    assert store.end_run(first, 30, META, release=True) is True
    assert store.renew_runs([first], 1) == 0
    assert store.abandon_run(first) is False
    time.sleep(1.5)  # past the lease a renew would have set
    late = RunRef("late", "owner-a", "0.0", "copy-2")
    assert store.claim_run(late, 30, META, release=False, ttl=30) == (RunOutcome.DONE, None)
    assert store.get("late") is None


def test_run_records_expire_and_are_reaped(runs_store: SQLStore) -> None:
    """Run records are rows of the lock table: never listed under a lock prefix, reaped
    once expired."""
    store = runs_store
    assert store.acquire("reap:k", "owner-a", 30, META) is None
    run = RunRef("reap:k", "owner-a", "0.0", "copy-1")
    store.claim_run(run, 30, META, release=False, ttl=None)
    store.end_run(run, 0.3, META, release=None)
    assert lock_rows(store) == 2
    assert [lock.key for lock in store.scan("reap:")] == ["reap:k"]
    deadline = time.monotonic() + 5
    while store.purge_expired() == 0:
        assert time.monotonic() < deadline, "the done marker did not expire"
        time.sleep(0.1)
    assert lock_rows(store) == 1
    outcome, claim = store.claim_run(
        RunRef("reap:k", "owner-a", "0.0", "copy-2"), 30, META, release=True, ttl=None
    )
    assert outcome is RunOutcome.BEGUN and claim is not None
    assert claim.outcome is ClaimOutcome.OWNED


def test_renew_runs_in_batches(runs_store: SQLStore, recorder: Recorder) -> None:
    """renew_runs renews exactly the live leases held, ``batch`` runs per UPDATE."""
    store = runs_store
    held = [RunRef(f"batch:{i}", "owner-a", "0.0", f"copy-{i}") for i in range(250)]
    for run in held:
        store.claim_run(run, 30, META, release=False, ttl=None)
    strangers = [RunRef(run.key, run.owner, run.attempt, "stranger") for run in held[:10]]
    store.end_run(held[0], 60, META, release=None)  # a done marker is not renewed
    count, sent = sent_by(
        recorder, store, lambda: store.renew_runs([*held, *strangers], 60, batch=100)
    )
    assert count == 249
    assert verbs(sent) == ["UPDATE"] * 3
    assert sent_by(recorder, store, lambda: store.renew_runs([], 60)) == (0, [])


def test_racing_copies_begin_once(runs_store: SQLStore) -> None:
    """8 copies of one attempt claiming at once: exactly one begins, the others see it
    RUNNING; once it ends, every further copy is DONE."""
    store = runs_store
    for attempt in range(10):
        key = f"race:{attempt}"
        assert store.acquire(key, "owner-a", 30, META) is None
        barrier = threading.Barrier(8)
        answers: list[Any] = []

        def copy(
            token: str,
            key: str = key,
            barrier: threading.Barrier = barrier,
            answers: list[Any] = answers,
        ) -> None:
            barrier.wait()
            run = RunRef(key, "owner-a", "0.0", token)
            answers.append((token, store.claim_run(run, 30, META, release=False, ttl=None)))

        threads = [threading.Thread(target=copy, args=(f"copy-{i}",)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        begun = [token for token, (outcome, _) in answers if outcome is RunOutcome.BEGUN]
        assert len(answers) == 8 and len(begun) == 1, answers
        assert {outcome for _, (outcome, _) in answers} == {RunOutcome.BEGUN, RunOutcome.RUNNING}
        winner = RunRef(key, "owner-a", "0.0", begun[0])
        assert store.end_run(winner, 60, META, release=True) is True
        late = store.claim_run(
            RunRef(key, "owner-a", "0.0", "late"), 30, META, release=False, ttl=30
        )
        assert late == (RunOutcome.DONE, None)
        assert store.get(key) is None


def test_done_policy_is_what_the_record_says(runs_store: SQLStore) -> None:
    """The done marker is a row of policy ``DONE_POLICY`` owned by the copy's delivery token."""
    store = runs_store
    run = RunRef("policy:k", "owner-a", "0.0", "copy-1")
    store.claim_run(run, 30, META, release=False, ttl=None)
    store.end_run(run, 60, META, release=None)
    with store.engine.connect() as conn:
        row = conn.execute(
            select(lock_table.c.owner, lock_table.c.policy, lock_table.c.started).where(
                lock_table.c.key == run.record
            )
        ).one()
    assert (row.owner, row.policy, bool(row.started)) == ("copy-1", DONE_POLICY, False)


@pytest.mark.parametrize("store_fixture", [
    pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
])
def test_a_gate_lock_opens_in_one_statement_when_nobody_waits(
    store_fixture: str, request: pytest.FixtureRequest, recorder: Recorder
) -> None:
    """MySQL/MariaDB and SQLite (the gate a lock row): the end of a gated run that opens
    its gate and takes its waiter (``end_run_in_turn``) sends what the end without a
    handoff sends when nobody waits (the gate's release is the one DELETE that opens it
    and finds nobody listed); a listed follow-up costs the opening a short transaction."""
    case: StoreCase = request.getfixturevalue(store_fixture)
    store = case.store
    assert isinstance(store, SQLStore)
    records = records_of(store)
    assert isinstance(records, GatedRuns) and records.waiters is store
    plain = RunRef("gate:plain", "owner-a", "0.0", "copy-a", gated=True)
    handed = RunRef("gate:handed", "owner-a", "0.0", "copy-b", gated=True)
    for run in (plain, handed):
        assert records.claim_run(run, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
    with recorder(store) as sent:
        records.end_run(plain, 30, META, release=True)
    without_handoff = list(sent)
    with recorder(store) as sent:
        assert records.end_run_in_turn(handed, 30, META, release=True) == (True, None)
    assert len(sent) == len(without_handoff), (sent, without_handoff)
    # A listed follow-up: the flag makes the one DELETE miss, and a transaction takes it.
    run = RunRef("gate:listed", "owner-a", "0.0", "copy-c", gated=True)
    assert records.claim_run(run, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
    follow_up = RunRef("gate:listed", "owner-b", "0.0", "copy-d", gated=True)
    assert records.wait_at_gate(follow_up, b"follow-up", 30) is True
    with recorder(store) as sent:
        assert records.end_run_in_turn(run, 30, META, release=True) == (True, b"follow-up")
    assert any(statement.strip().upper().startswith(("BEGIN", "START")) for statement in sent)
