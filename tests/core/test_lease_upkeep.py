"""The lease renewer of a worker's main process: taking leases back, pending ends (issue 30).

One renewal pass (``leases.renew_active``) at a time on a memory store
whose clock the test moves, so a lease lapses without waiting for it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_dedup import leases
from celery_dedup.exceptions import StoreUnavailable
from celery_dedup.runs import record_life, records_of
from celery_dedup.stores.base import RunOutcome, RunRef
from celery_dedup.stores.memory import MemoryStore

META = {"task_name": "t", "policy": "success", "task_id": "id-1"}
LEASE = 3.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> Iterator[MemoryStore]:
    yield MemoryStore(clock=clock)
    leases._pending.clear()
    leases._held.clear()


def test_a_pending_end_keeps_the_lease_until_the_end_lands(
    store: MemoryStore, clock: Clock
) -> None:
    """An end the store did not record is retried each pass; its lease is taken back
    meanwhile when it lapsed, so a copy is told RUNNING, then DONE once it lands."""
    records = records_of(store)
    run = RunRef("k:pending", "owner-a", "0.0", "copy-1")
    assert records.claim_run(run, record_life(LEASE), META, release=False, ttl=60)[0] is (
        RunOutcome.BEGUN
    )
    answers = iter([StoreUnavailable("stalled", store="memory"), None])

    def end() -> None:
        failure = next(answers)
        if failure is not None:
            raise failure
        records.end_run(run, 600, META, release=True)

    before = leases.pending_ends()  # (ends other tests' dead stores never took)
    leases.pending_end(store, run, LEASE, end)
    clock.now += record_life(LEASE) + 1  # the store stalled past the lease record's life
    assert records.peek_run(run) is None
    leases.renew_active()  # the end fails again; the lease is taken back
    assert leases.pending_ends() == before + 1
    copy = RunRef("k:pending", "owner-a", "0.0", "copy-2")
    assert records.claim_run(copy, record_life(LEASE), META, release=False, ttl=60) == (
        RunOutcome.RUNNING, None,
    )
    leases.renew_active()  # the end lands
    assert leases.pending_ends() == before
    assert records.peek_run(copy) is RunOutcome.DONE
    assert store.get("k:pending") is None  # released with the end

