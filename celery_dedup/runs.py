"""Run records: one publish, one run, whatever the broker redelivers.

Every copy of one publish carries the same owner token, so the lock alone
cannot tell a redelivered copy (Redis/SQS ``visibility_timeout``, a message
waiting for its ETA or in a prefetch buffer) from the copy that is running
or already ran. Each *attempt* of a publish (its retry count and
replacement depth: a ``self.retry()`` is a new attempt) therefore gets a
run record in the lock store, beside its lock:

* a **running lease**, taken by the copy whose body starts, owned by that
  copy's *delivery token* (a fresh token per received message) and kept
  alive by the worker's main process (``leases``) while the body runs. A
  copy that finds a live lease is deferred, not run; a crashed run's lease
  lapses (or is given up when the worker sees its child die), and a copy
  then runs.
* a **done marker**, written when the attempt ends, before its lock is
  released: a copy that finds it is acknowledged without running. It lives
  ``done_ttl`` seconds.

A store with ``RunRecords`` keeps them natively (one round trip at start,
one at the end); any other store keeps them as plain TTL locks under their
own namespace (``run_record_key``), with the operations it already makes
atomic (``StoreRuns``: two round trips at start and two at the end).

A ``keep_last`` run is *gated* (``RunRef.gated``): it also holds its key's
run gate, a record shared by every publish on the key, from its start to
its end, so a follow-up never runs beside the run it follows. A store that
keeps gates natively (``run_gates``) does so in the same round trips; on
any other the gate is a TTL lock taken before and given up after them
(``GatedRuns``: one round trip more at each end).

The follow-up waiting at a gate is woken when the run it waits for ends
(``gate_handoff``): by the store's run records (``GateHandoff``), or, on a
store keeping the gate as a lock, by ``GatedRuns`` on the store's
``GateWaiters``: the gate's release takes the waiter out in the same call.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from functools import partial
from typing import Any, cast

from . import backoff
from .exceptions import StoreError
from .stores.base import (
    DONE_POLICY,
    OUTCOME_FIELD,
    RUNNING_POLICY,
    Claim,
    GateHandoff,
    GateWaiters,
    LockMeta,
    LockStore,
    RunOutcome,
    RunRecords,
    RunRef,
)

__all__ = [
    "DELIVERY_FIELD",
    "INHERITED_FIELD",
    "OUTCOME_FIELD",
    "GatedRuns",
    "StoreRuns",
    "attempt_of",
    "done_ttl_for",
    "gate_handoff",
    "keep_record",
    "record_life",
    "records_of",
]

#: The field a worker adds to a received message's request: its delivery token.
DELIVERY_FIELD = "dedup_delivery"

#: The header of a message deferred because its start claim got no answer:
#: the delivery token that claim was made with (``RunRef.inherits``).
INHERITED_FIELD = "dedup_inherited"

#: Appended to the delivery token to own a done marker (``StoreRuns``).
DONE_SUFFIX = "!done"


def attempt_of(request: Any) -> str:
    """An attempt's name: its retry count and replacement depth (copies share both).

    ``request`` is a task's request context or a received message's request dict.
    """
    get = request.get if isinstance(request, Mapping) else partial(getattr, request)
    return f"{get('retries', None) or 0}.{get('replaced_task_nesting', None) or 0}"


logger = logging.getLogger("celery_dedup")

#: Whether a store class keeps run records natively, decided once per class
#: (a protocol ``isinstance`` walks every member on each call).
_NATIVE: dict[type, bool] = {}
#: Whether a store class lists gate waiters (``GateWaiters``), decided once per class.
_WAITERS: dict[type, bool] = {}


def records_of(store: LockStore) -> RunRecords:
    """The run records of ``store``: its own, or built from its lock operations.

    Run gates ride on them when the store keeps them natively, else
    ``GatedRuns`` adds them.
    """
    native = _NATIVE.get(type(store))
    if native is None:
        native = _NATIVE[type(store)] = isinstance(store, RunRecords)
    records = cast(RunRecords, store) if native else StoreRuns(store)
    if native and getattr(store, "run_gates", False):
        return records
    return GatedRuns(records, store)


def gate_handoff(store: LockStore) -> GateHandoff | None:
    """What wakes the ``keep_last`` follow-up waiting at a gate of ``store`` when the
    run it waits for ends: the store's own run records (``run_gates`` and
    ``GateHandoff``), its ``GatedRuns`` when the store lists gate waiters
    (``GateWaiters``), or ``None`` (the follow-up waits with its backoff alone).
    """
    records = records_of(store)
    if isinstance(records, GatedRuns):
        return records if records.waiters is not None else None
    return cast(GateHandoff, records) if isinstance(records, GateHandoff) else None


def _gate_waiters(store: LockStore) -> GateWaiters | None:
    listing = _WAITERS.get(type(store))
    if listing is None:
        listing = _WAITERS[type(store)] = isinstance(store, GateWaiters)
    return cast(GateWaiters, store) if listing else None


def _record_meta(meta: LockMeta, policy: str) -> Mapping[str, str]:
    return {
        "task_name": meta.get("task_name", ""),
        "policy": policy,
        "task_id": meta.get("task_id", ""),
    }


class StoreRuns:
    """Run records kept as TTL locks of any ``LockStore`` (``run_record_key``).

    The lease is a lock owned by the delivery token (policy
    ``RUNNING_POLICY``); the done marker replaces it (``DONE_POLICY``).
    """

    def __init__(self, store: LockStore) -> None:
        self.store = store

    def claim_run(
        self,
        run: RunRef,
        lease: float,
        meta: LockMeta,
        *,
        release: bool,
        ttl: float | None,
    ) -> tuple[RunOutcome, Claim | None]:
        """Take the lease (one round trip), then the start claim (another).

        An inherited lease is given up first (one round trip more).
        """
        if run.inherits:
            self.store.release(run.record, run.inherits)
        holder = self.store.acquire(
            run.record, run.token, lease, _record_meta(meta, RUNNING_POLICY)
        )
        if holder is not None and holder.owner != run.token:
            done = holder.policy == DONE_POLICY
            return (RunOutcome.DONE if done else RunOutcome.RUNNING), None
        if run.fenced:
            fenced = cast(Any, self.store)  # FencedClaims: checked with the task's options
            claim = fenced.claim(
                run.key, run.owner, release=release, ttl=ttl, meta=meta, fence=True
            )
        else:
            claim = self.store.claim(run.key, run.owner, release=release, ttl=ttl, meta=meta)
        return RunOutcome.BEGUN, claim

    def end_run(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> bool:
        """Write the done marker (one round trip), then release or settle (another).

        The marker is owned by ``token + DONE_SUFFIX`` (and the body's
        outcome, ``done_by``), not by the token: a
        renewal or a give-up of the lease that lands after the end (the
        worker's main process races the pool child) can neither shorten nor
        delete it.
        """
        done_meta = _record_meta(meta, DONE_POLICY)
        done_owner = run.token + DONE_SUFFIX + meta.get(OUTCOME_FIELD, "")
        self.store.take_over(run.record, done_owner, done_ttl, done_meta)
        if release is None:
            return False
        if release:
            return self.store.release(run.key, run.owner)
        return self.store.settle(run.key, run.owner)

    def abandon_run(self, run: RunRef) -> bool:
        """Delete the lease if this copy holds it."""
        return self.store.release(run.record, run.token)

    def renew_runs(self, runs: Sequence[RunRef], lease: float) -> int:
        """One ``extend`` per run."""
        return sum(1 for run in runs if self.store.extend(run.record, run.token, lease))

    def keep_runs(
        self, runs: Sequence[RunRef], lease: float, retake: Collection[str]
    ) -> list[bool]:
        """One ``extend`` per run; a lease to take back that is not held: an ``acquire``."""
        return [
            keep_record(self.store, run.record, run.token, lease, run.token in retake)
            for run in runs
        ]

    def peek_run(self, run: RunRef) -> RunOutcome | None:
        """One ``get`` of the run record."""
        holder = self.store.get(run.record)
        if holder is None:
            return None
        if holder.policy == DONE_POLICY:
            return RunOutcome.DONE
        return RunOutcome.BEGUN if holder.owner == run.token else RunOutcome.RUNNING

    def lease_token(self, run: RunRef) -> str | None:
        """One ``get`` of the run record: its owner, unless it is a done marker."""
        holder = self.store.get(run.record)
        return None if holder is None or holder.policy == DONE_POLICY else holder.owner

    def done_by(self, run: RunRef) -> tuple[str, str] | None:
        """One ``get`` of the run record: its done marker's token and outcome."""
        holder = self.store.get(run.record)
        if holder is None or holder.policy != DONE_POLICY:
            return None
        token, _, outcome = holder.owner.partition(DONE_SUFFIX)
        return token, outcome


class GatedRuns:
    """Run records whose gated runs also hold their key's run gate as a TTL lock.

    For stores that do not keep gates in their run-record operations: the
    gate (``RunRef.gate``, owned by the delivery token) is taken before the
    lease and given up after the end, one round trip each. On a store that
    lists gate waiters (``GateWaiters``) it is also a ``GateHandoff``: the
    follow-up lists itself at the gate, and the gate's release at the run's
    end (``open_gate``, the same one call) takes it out to be woken.
    """

    def __init__(self, records: RunRecords, store: LockStore) -> None:
        self.records = records
        self.store = store
        #: the store's gate waiters, when it lists them
        self.waiters = _gate_waiters(store)

    def claim_run(
        self,
        run: RunRef,
        lease: float,
        meta: LockMeta,
        *,
        release: bool,
        ttl: float | None,
    ) -> tuple[RunOutcome, Claim | None]:
        """Take the gate (a gated run), then the lease and the start claim.

        A run that does not begin gives the gate back at once.
        """
        if not run.gated:
            return self.records.claim_run(run, lease, meta, release=release, ttl=ttl)
        if run.inherits:
            self.store.release(run.gate, run.inherits)
        holder = self.store.acquire(run.gate, run.token, lease, _record_meta(meta, RUNNING_POLICY))
        if holder is not None and holder.owner != run.token:
            return RunOutcome.WAITING, None
        outcome, claim = self.records.claim_run(run, lease, meta, release=release, ttl=ttl)
        if outcome is not RunOutcome.BEGUN:
            self.store.release(run.gate, run.token)
        return outcome, claim

    def end_run(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> bool:
        """End the run, then open its gate (even when the end raised: the run is over)."""
        try:
            return self.records.end_run(run, done_ttl, meta, release=release)
        finally:
            if run.gated:
                self.store.release(run.gate, run.token)

    def end_run_in_turn(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> tuple[bool, bytes | None]:
        """End the run, then open its gate and take out the follow-up waiting at it
        (``GateHandoff``; the opening costs what the gate's release costs).

        An end that raised only releases the gate (as ``end_run``): its
        waiter is taken by the end's retry, or waits for its backoff.
        """
        if not run.gated or self.waiters is None:
            return self.end_run(run, done_ttl, meta, release=release), None
        try:
            ended = self.records.end_run(run, done_ttl, meta, release=release)
        except BaseException:
            self.store.release(run.gate, run.token)
            raise
        return ended, self._open_gate(run, self.waiters)

    def _open_gate(self, run: RunRef, waiters: GateWaiters) -> bytes | None:
        try:
            return waiters.open_gate(run.gate, run.token)
        except StoreError as exc:
            # The gate opens whatever became of its waiter (its backoff brings it).
            logger.warning(
                "celery-dedup: could not take the follow-up waiting at the run gate of "
                "lock %s (it comes back with its backoff): %s",
                run.key,
                exc,
            )
            self.store.release(run.gate, run.token)
            return None

    def wait_at_gate(self, run: RunRef, payload: bytes, life: float) -> bool:
        """List the follow-up at the gate another run holds (``GateWaiters``); ``False``:
        the gate is open (nothing listed), or the store lists no waiters."""
        if self.waiters is None:
            return False
        return self.waiters.list_gate_waiter(run.gate, run.token, payload, life)

    def abandon_run(self, run: RunRef) -> bool:
        """Give the lease up, then the gate."""
        try:
            return self.records.abandon_run(run)
        finally:
            if run.gated:
                self.store.release(run.gate, run.token)

    def renew_runs(self, runs: Sequence[RunRef], lease: float) -> int:
        """Renew the leases, then each gated run's gate (one ``extend`` each)."""
        renewed = self.records.renew_runs(runs, lease)
        gates = (run for run in runs if run.gated)
        return renewed + sum(1 for run in gates if self.store.extend(run.gate, run.token, lease))

    def keep_runs(
        self, runs: Sequence[RunRef], lease: float, retake: Collection[str]
    ) -> list[bool]:
        """Keep the leases, then the gate of each gated run that holds its lease."""
        kept = self.records.keep_runs(runs, lease, retake)
        for run, held in zip(runs, kept, strict=True):
            if run.gated and held:
                keep_record(self.store, run.gate, run.token, lease, run.token in retake)
        return kept

    def peek_run(self, run: RunRef) -> RunOutcome | None:
        """The run record's answer (the gate says nothing of one attempt)."""
        return self.records.peek_run(run)

    def lease_token(self, run: RunRef) -> str | None:
        """The run record's answer."""
        return self.records.lease_token(run)

    def done_by(self, run: RunRef) -> tuple[str, str] | None:
        """The run record's answer."""
        return self.records.done_by(run)


def keep_record(store: LockStore, record: str, token: str, lease: float, retake: bool) -> bool:
    """Renew the lease (or gate) ``token`` holds at ``record`` for ``lease`` seconds;
    with ``retake``, take it back when nobody holds it. Whether ``token`` holds it now.

    One ``extend`` while held; an ``acquire`` more to take it back (atomic: a
    copy that took the record meanwhile keeps it).
    """
    if store.extend(record, token, lease):
        return True
    if not retake:
        return False
    meta = {"task_name": "", "policy": RUNNING_POLICY, "task_id": ""}
    holder = store.acquire(record, token, lease, meta)
    return holder is None


#: A lease record outlives the lease it keeps by one more lease (``record_life``).
LEASE_GRACE = 1.0


def record_life(lease: float) -> float:
    """How long a running lease (or gate) record lives past its last renewal.

    The worker renews it every third of ``lease``; a copy treats the run
    as dead only once the record is gone, a full lease period after the
    lease itself lapsed: the renewer has that long to take back a lease
    that lapsed while the store did not answer (``keep_runs``).
    """
    return lease * (1.0 + LEASE_GRACE)


def done_ttl_for(
    unique_for: float, lease: float, visibility_timeout: float, given: float | None
) -> float:
    """How long a done marker refuses late copies.

    ``dedup_done_ttl`` when set; else ``unique_for`` plus the transport's
    ``visibility_timeout`` (a copy restored after the run comes at most one
    visibility timeout after it was last seen). Never less than the lease,
    nor than the life of a copy the worker itself parked (``backoff.copy_life``
    of the longest deferral countdown): a deferred message's parked copy
    outlives the run of its woken twin (a slot's or a gate's handoff) or of
    the copy it waited for, and must still find the marker.
    """
    parked = backoff.copy_life(backoff.longest_countdown(visibility_timeout))
    if given is not None:
        return max(given, lease, parked)
    return max(unique_for + visibility_timeout, lease, parked)
