"""``runs.gate_handoff``: which object wakes a ``keep_last`` follow-up, and a failing opening.

The behaviour on every store is the store contract's
(``test_a_run_s_end_hands_its_gate_to_the_follow_up_waiting_at_it``); here,
what only ``GatedRuns`` decides: a store of one's own without ``GateWaiters``
leaves follow-ups to their backoff, and an opening whose waiter cannot be
taken still opens the gate.
"""

from __future__ import annotations

import logging

import pytest

from celery_dedup.exceptions import StoreRefused
from celery_dedup.runs import GatedRuns, gate_handoff, records_of
from celery_dedup.stores.base import RunOutcome, RunRef
from celery_dedup.stores.memory import MemoryStore

META = {"task_name": "tests.sync", "policy": "success", "task_id": "id-a"}


class NoWaiters(MemoryStore):
    """A store of one's own that keeps gates as locks and lists no waiters."""

    list_gate_waiter = None  # type: ignore[assignment]
    open_gate = None  # type: ignore[assignment]


class TableMissing(MemoryStore):
    """Lists waiters, but its opening fails (a Django DB store before its migration)."""

    def open_gate(self, gate: str, token: str) -> bytes | None:
        raise StoreRefused("no such table: celery_dedup_gate_wait", store="memory")


def test_a_store_without_gate_waiters_hands_no_gate_over() -> None:
    """Its gated runs still take turns (``GatedRuns``); the follow-up waits for its backoff."""
    store = NoWaiters()
    records = records_of(store)
    assert isinstance(records, GatedRuns) and records.waiters is None
    assert gate_handoff(store) is None
    assert isinstance(gate_handoff(MemoryStore()), GatedRuns)


def test_an_opening_that_cannot_take_its_waiter_still_opens_the_gate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The end is recorded and the gate released whatever became of the waiter (logged:
    it comes back with its backoff); the follow-up then takes the gate."""
    store = TableMissing()
    turns = gate_handoff(store)
    assert isinstance(turns, GatedRuns)
    run = RunRef("gate:m", "owner-a", "0.0", "copy-a", gated=True)
    assert turns.claim_run(run, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
    follow_up = RunRef("gate:m", "owner-b", "0.0", "copy-b", gated=True)
    assert turns.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is RunOutcome.WAITING
    assert turns.wait_at_gate(follow_up, b"follow-up", 30) is True
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        assert turns.end_run_in_turn(run, 30, META, release=True) == (True, None)
    assert "comes back with its backoff" in caplog.text
    assert turns.claim_run(follow_up, 30, META, release=False, ttl=30)[0] is RunOutcome.BEGUN
