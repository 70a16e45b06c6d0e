"""The lock store protocol every backend implements.

A store keeps one record per key: the owner (a random token generated for
each publish, never shown to duplicate callers), the holder's task id, a
little metadata, whether the holder's message has started, and an expiry.
Beside the locks it keeps short-lived *revoked markers*: one per revoked
owner token, consulted by the worker's start check. Every operation is a
single round trip and atomic on the server (memcached and generic caches:
see their modules), and every record carries a TTL.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, cast, runtime_checkable

from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from ..exceptions import (
    DedupError,
    StoreContention,
    StoreError,
    StorePermissionDenied,
    StoreRefused,
    StoreUnavailable,
)

__all__ = [
    "DONE_POLICY",
    "FENCE_TTL",
    "OUTCOME_FIELD",
    "PASS_THROUGH",
    "RECORD_POLICIES",
    "REVOKED_POLICY",
    "REVOKED_PREFIX",
    "RUNNING_POLICY",
    "AcquireItem",
    "BulkAcquire",
    "Claim",
    "ClaimOutcome",
    "Classify",
    "CounterSupport",
    "Durability",
    "DurabilityReport",
    "FencedClaims",
    "GateHandoff",
    "GateWaiters",
    "LimitListing",
    "Lock",
    "LockMeta",
    "LockStore",
    "QueuedTakeOver",
    "RateAnswer",
    "RateRelease",
    "RateSupport",
    "RateWindow",
    "RatedAcquire",
    "RatedLock",
    "RevokeOutcome",
    "RevokingTakeOver",
    "RunOutcome",
    "RunRecords",
    "RunRef",
    "SlotHandoff",
    "SlotSupport",
    "SlotTurn",
    "SlotUsage",
    "SlotWaiter",
    "acquire_many",
    "gate_record_key",
    "issues_fences",
    "os_error_kind",
    "rated_acquire",
    "refused_unless_passed",
    "replace_holder",
    "revoked_marker_key",
    "revoking_take_over",
    "run_record_key",
    "server_answer",
    "slot_holder",
    "slot_limit_of",
    "store_error",
    "store_errors",
    "translate",
    "unavailable",
    "unavailable_on",
]

#: Metadata saved with a lock: ``{"task_name": ..., "policy": ..., "task_id": ...}``.
#: ``task_id`` is the holder's Celery task id (metadata, never an ownership
#: proof); a store that finds none reports the owner as the task id (0.1.0
#: locks, whose owner was the task id).
LockMeta = Mapping[str, str]

#: The ``policy`` a store writes on a revoked marker record (stores that keep
#: markers beside locks, e.g. in the same SQL table, filter them out by it).
REVOKED_POLICY = "revoked"

#: The ``policy`` of a run record whose run is in progress (its lease).
RUNNING_POLICY = "run-live"

#: The ``policy`` of a run record whose run completed (the done marker).
DONE_POLICY = "run-done"

#: The ``LockMeta`` field ``RunRecords.end_run`` is given the body's outcome in
#: (``"success"``, ``"failure"``...), kept with the done marker (``done_by``).
OUTCOME_FIELD = "outcome"

#: Records that share a store with locks but are not locks: listings,
#: reapers of locks and the admin leave them out.
RECORD_POLICIES = frozenset({REVOKED_POLICY, RUNNING_POLICY, DONE_POLICY})


#: The namespace of ``revoked_marker_key`` (SQL builds the same key in a statement).
REVOKED_PREFIX = "celery-dedup-revoked:"


def revoked_marker_key(key: str, owner: str) -> str:
    """The store key of the revoked marker of ``owner`` on ``key``.

    A fixed-length digest under its own namespace: it never matches a lock
    key prefix, so ``scan`` never sees it. (Redis derives its own marker key
    in the lock's hash slot instead.)
    """
    digest = hashlib.sha256(f"{key}\x00{owner}".encode()).hexdigest()
    return f"{REVOKED_PREFIX}{digest}"


def run_record_key(key: str, owner: str, attempt: str) -> str:
    """The store key of the run record of one attempt of ``owner``'s publish on ``key``.

    Like ``revoked_marker_key``: a fixed-length digest under a namespace of
    its own, never under a lock prefix, so ``scan`` never sees it.
    """
    digest = hashlib.sha256(f"{key}\x00{owner}\x00{attempt}".encode()).hexdigest()
    return f"celery-dedup-run:{digest}"


#: Seconds a key's fence counter lives after the last fence it issued. A
#: fence is never below the store's clock in microseconds, so a counter
#: that lapsed starts again above every fence it issued (unless the store's
#: clock went back meanwhile).
FENCE_TTL = 7 * 86400.0


def gate_record_key(key: str) -> str:
    """The store key of ``key``'s run gate: shared by every publish on the key.

    A run record of no publish (``run_record_key`` with an empty owner): the
    same namespace, never under a lock prefix.
    """
    return run_record_key(key, "", "keep_last")


class ClaimOutcome(str, Enum):
    """What the worker's start check found (``LockStore.claim``)."""

    #: ``owner`` holds the key: marked started, or deleted when ``release``
    OWNED = "owned"
    #: another owner holds the key (``Claim.holder``)
    HELD = "held"
    #: ``owner`` was revoked (a marker exists); its lock, if any, was deleted
    REVOKED = "revoked"
    #: nobody held the key; it was taken for ``owner`` when a ``ttl`` was given
    FREE = "free"


@dataclass(frozen=True)
class Claim:
    """The answer of ``LockStore.claim``."""

    outcome: ClaimOutcome
    #: the other holder, for ``HELD``
    holder: Lock | None = None
    #: the run's fencing token, for ``OWNED`` and ``FREE`` when asked for
    #: (``FencedClaims``), else ``None``
    fence: int | None = None


class RevokeOutcome(str, Enum):
    """What ``LockStore.revoke`` did to the owner's lock."""

    #: ``owner`` held the key and had not started: the lock was deleted
    RELEASED = "released"
    #: ``owner`` holds the key and its message has started: the lock was kept
    RUNNING = "running"
    #: ``owner`` does not hold the key (free, expired or another owner's)
    NOT_HELD = "not_held"


@dataclass(frozen=True)
class Lock:
    """A held lock as a store reports it."""

    key: str
    #: the owner token (secret to the holder's message)
    owner: str
    task_name: str
    acquired_at: float
    expires_at: float
    policy: str
    #: the holder's Celery task id (metadata: duplicates are given this)
    task_id: str = ""
    #: whether the holder's message passed its start check (it is running)
    started: bool = False

    @property
    def ttl(self) -> float:
        """Seconds left before the lock expires (never negative)."""
        return max(0.0, self.expires_at - time.time())

    def without_owner(self) -> Lock:
        """This lock with its owner token blanked: what a duplicate caller may see."""
        # dataclasses.replace re-runs the frozen __init__ field by field: a
        # copy of the instance dict is several times cheaper on this hot path.
        copy = object.__new__(Lock)
        copy.__dict__.update(self.__dict__, owner="")
        return copy


@runtime_checkable
class LockStore(Protocol):
    """**Protocol:** an owner-checked TTL lock store.

    Each method is one round trip to the server and atomic there.
    """

    #: A short name used in logs and ``StoreUnavailable`` (``"redis"``, ``"sql"``).
    name: str

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take ``key`` for ``owner`` for ``ttl`` seconds if it is free or expired.

        The new lock is not started (``started=False``) unless
        ``meta["started"] == "1"``. Returns ``None`` when the lock was taken,
        else the current holder, in the same round trip.
        """

    def release(self, key: str, owner: str) -> bool:
        """Delete ``key`` only if ``owner`` holds it (compare-and-delete).

        Returns whether it was deleted. Idempotent: a second call returns False.
        """

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Set the TTL of ``key`` to ``ttl`` seconds from now if ``owner`` holds it.

        Every other field (task id, started) is kept.
        """

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder of ``key`` unconditionally (not started).

        Returns the previous live holder, or ``None`` if the key was free.
        """

    def claim(
        self, key: str, owner: str, *, release: bool, ttl: float | None, meta: LockMeta
    ) -> Claim:
        """The worker's start check, atomically, in one round trip.

        In this order: if a revoked marker of ``owner`` on ``key`` exists,
        delete ``key`` if ``owner`` holds it and answer ``REVOKED``; else if
        ``owner`` holds ``key``, delete it when ``release`` or mark it
        started, and answer ``OWNED``; else if another owner holds it, answer
        ``HELD`` with that holder; else (free or expired) take it for
        ``owner`` for ``ttl`` seconds, already started, with ``meta`` when
        ``ttl`` is given and ``release`` is false, and answer ``FREE``.
        """

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Revoke ``owner`` atomically, in one round trip.

        Writes a revoked marker of ``owner`` on ``key`` living ``ttl``
        seconds (``claim`` consults it), and deletes ``key`` if ``owner``
        holds it and has not started (``RELEASED``); a started holder keeps
        its lock (``RUNNING``); else ``NOT_HELD``.
        """

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Mark ``owner``'s lock not started (its run ended, or went back to the queue).

        Owner-checked, one round trip; the TTL is kept, or set to ``ttl``
        seconds from now when given. Returns whether ``owner`` holds ``key``.
        """

    def unrevoke(self, key: str, owner: str) -> None:
        """Delete the revoked marker of ``owner`` on ``key`` (undo a revoke whose cause failed)."""

    def get(self, key: str) -> Lock | None:
        """Return the live lock at ``key``, or ``None``."""

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Yield every live lock whose key starts with ``prefix``."""


class RunOutcome(str, Enum):
    """What ``RunRecords.claim_run`` found for an attempt."""

    #: no other copy of the attempt runs or ran: this copy holds the lease
    BEGUN = "begun"
    #: another copy of the attempt is running (its lease is live)
    RUNNING = "running"
    #: another copy of the attempt completed (its done marker is live)
    DONE = "done"
    #: the run is gated (``RunRef.gated``) and another run holds its key's gate
    WAITING = "waiting"


@dataclass(frozen=True)
class RunRef:
    """One copy of one attempt of a publish: whose run record it is."""

    key: str
    owner: str
    #: the attempt (``retries.replacement depth``): copies share it
    attempt: str
    #: this copy's delivery token: owns the lease
    token: str
    #: whether the run holds its key's run gate from its start to its end
    #: (``on_duplicate="keep_last"``: one run of the key at a time, whatever
    #: publish it belongs to); the gate is owned by ``token`` as the lease is
    gated: bool = False
    #: the delivery token of an earlier delivery of this message whose start
    #: claim got no answer (it may land later), or ``""``: a lease or gate it
    #: holds passes to this copy, and so to one copy only
    inherits: str = ""
    #: whether the start claim issues the run a fencing token (``FencedClaims``)
    fenced: bool = False

    @property
    def record(self) -> str:
        """The store key of the attempt's run record (stores without a layout of their own)."""
        return run_record_key(self.key, self.owner, self.attempt)

    @property
    def gate(self) -> str:
        """The store key of the key's run gate (stores without a layout of their own)."""
        return gate_record_key(self.key)


@runtime_checkable
class RunRecords(Protocol):
    """**Protocol:** a store that keeps run records beside its locks natively.

    One round trip per call, atomic on the server. A store without it gets
    run records built from its lock operations (two round trips at start
    and at the end instead of one).

    A store that sets ``run_gates = True`` also keeps the run gate of a
    ``RunRef.gated`` run in the same calls: ``claim_run`` answers
    ``WAITING`` (nothing written) while another token holds it, else takes
    it with the lease; ``end_run`` and ``abandon_run`` give it up and
    ``renew_runs`` renews it, owner-checked. Without it the gate is kept with
    the store's lock operations around these calls (``runs.records_of``).
    """

    def claim_run(
        self,
        run: RunRef,
        lease: float,
        meta: LockMeta,
        *,
        release: bool,
        ttl: float | None,
    ) -> tuple[RunOutcome, Claim | None]:
        """Take the attempt's lease, then the start claim (``claim``), in one step.

        When another copy's lease or done marker is live, answers
        ``RUNNING`` or ``DONE`` and leaves the lock untouched (``None``).
        A lease (or gate) of ``run.inherits`` is taken over as if it were
        this copy's own: by one copy only, as any lease.
        """

    def end_run(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> bool:
        """Replace the lease by the done marker, then release the lock (``True``),
        settle it (``False``) or leave it (``None``). Returns whether the owner
        held the lock it released or settled. ``meta["outcome"]`` (how the body
        ended, if given) is kept with the marker where the store can
        (``done_by``).
        """

    def abandon_run(self, run: RunRef) -> bool:
        """Delete the lease if ``run``'s copy holds it (the run did not complete)."""

    def renew_runs(self, runs: Sequence[RunRef], lease: float) -> int:
        """Set the lease of each run its copy holds (and the gate of a gated run its
        copy holds) to ``lease`` seconds; how many records it set."""

    def keep_runs(
        self, runs: Sequence[RunRef], lease: float, retake: Collection[str]
    ) -> list[bool]:
        """Renew each run's lease (and gate) like ``renew_runs``; for a run whose
        delivery token is in ``retake``, also take its lease (and gate) back
        when nobody holds it (it lapsed while the store did not answer).

        Never over another copy's lease, another run's gate or a done marker.
        Answers, per run, whether its copy holds its lease now.
        """

    def peek_run(self, run: RunRef) -> RunOutcome | None:
        """What the attempt's run record holds, read only: ``BEGUN`` (``run``'s
        own copy holds the lease), ``RUNNING`` (another copy's lease), ``DONE``
        (its done marker), or ``None`` (no live record)."""

    def lease_token(self, run: RunRef) -> str | None:
        """The delivery token holding the attempt's lease, read only (``None``: no
        live lease: none, or a done marker). One round trip."""

    def done_by(self, run: RunRef) -> tuple[str, str] | None:
        """The attempt's done marker, read only: the delivery token of the copy that
        ended the run and how its body ended (``LockMeta["outcome"]`` given to
        ``end_run``, ``""`` when not recorded), or ``None`` (no done marker).
        One round trip."""


@runtime_checkable
class GateHandoff(Protocol):
    """**Protocol:** a ``RunRecords`` store (``run_gates``) that wakes a ``keep_last``
    follow-up when the run it waits for ends.

    A key's run gate has at most one waiter: the follow-up that found it
    held (a newer one replaces it). Its payload (the message to publish, as
    ``handoff.waiter_of`` writes it) is kept beside the gate with a TTL; the
    run's end, opening the gate in its one round trip, takes it back for
    the ending worker to publish at once.
    """

    def wait_at_gate(self, run: RunRef, payload: bytes, life: float) -> bool:
        """List ``payload`` as the gate's waiter for ``life`` seconds while another
        run holds ``run``'s gate (one round trip); ``False``: the gate is open
        (nothing listed: the caller publishes the payload itself)."""

    def end_run_in_turn(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> tuple[bool, bytes | None]:
        """``RunRecords.end_run`` in the same round trip, with the payload of the gate's
        waiter when the end opened ``run``'s gate and one was listed (taken out)."""


@runtime_checkable
class GateWaiters(Protocol):
    """**Protocol:** a store whose ``keep_last`` run gates are plain locks (``runs.GatedRuns``)
    and that lists the follow-up waiting at one, so the run's end wakes it.

    What ``GateHandoff`` does inside a native store's run records, beside
    its lock operations: a gate (a lock at ``RunRef.gate``) has at most one
    waiter, the follow-up that found it held (a newer one replaces it), whose
    payload (``handoff.waiter_of``) is kept beside the gate with a TTL.
    Both calls are atomic on the store, so a run's end and a follow-up
    listing itself never miss each other: the listing lands while the gate
    is held (the opening takes it) or finds it open (the follow-up publishes
    itself). Opening a gate with no waiter costs what ``release`` costs.
    """

    def list_gate_waiter(self, gate: str, token: str, payload: bytes, life: float) -> bool:
        """List ``payload`` as the waiter of the lock ``gate`` for ``life`` seconds while an
        owner other than ``token`` holds it; ``False``: nobody else holds it (nothing
        listed: the caller publishes the payload itself)."""

    def open_gate(self, gate: str, token: str) -> bytes | None:
        """Release ``gate`` if ``token`` holds it and, unless another owner holds it, take
        its waiter out, in one atomic step: the waiter's payload, or ``None``.

        Exactly one caller ever gets a listed payload.
        """


@runtime_checkable
class FencedClaims(Protocol):
    """**Protocol:** a store that issues fencing tokens in its start claims.

    Its ``claim`` takes ``fence=True`` and its ``claim_run`` honours
    ``RunRef.fenced``: an answer of ``OWNED`` or ``FREE`` (the body runs)
    then carries ``Claim.fence``, taken from the key's fence counter **in
    the same round trip**: ``max(counter + 1, the store's clock in
    microseconds)``, written back with ``FENCE_TTL``. Every fence of a key
    is greater than every fence issued before it, whatever run, copy or
    publish it went to.

    A store class that issues them on some backends only (the SQL store:
    PostgreSQL) says so per instance with a ``fences`` attribute
    (``issues_fences``).
    """

    def fence_of(self, key: str) -> int | None:
        """The last fence issued for ``key``, or ``None`` (none, or its counter lapsed)."""


def issues_fences(store: object) -> bool:
    """Whether ``store`` issues fencing tokens: a ``FencedClaims`` store, unless its
    ``fences`` says its backend does not (the SQL store: PostgreSQL only)."""
    return isinstance(store, FencedClaims) and bool(getattr(store, "fences", True))


@runtime_checkable
class QueuedTakeOver(Protocol):
    """**Protocol:** a store that can take a key over from a holder that has not started.

    ``on_duplicate="cancel_running"`` then cancels a queued holder in two
    round trips (this take-over and the revoke marker), as ``replace`` does,
    or one with ``RevokingTakeOver``; a store without it revokes the holder,
    then acquires (three).
    """

    def take_over_queued(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder of ``key`` (not started) unless a started holder holds it.

        One round trip, atomic. Returns the previous live holder, or ``None``
        if the key was free; a started holder is returned and keeps the key.
        """


@runtime_checkable
class RevokingTakeOver(Protocol):
    """**Protocol:** a store whose take-over writes the displaced owner's revoked marker itself.

    ``replace`` and ``keep_last`` on a held key, and ``cancel_running`` over
    a queued holder, then cost one round trip instead of two (a
    ``take_over`` and a ``revoke``).
    """

    def take_over_revoking(
        self,
        key: str,
        owner: str,
        ttl: float,
        meta: LockMeta,
        revoked_ttl: float,
        *,
        queued_only: bool = False,
    ) -> Lock | None:
        """``take_over`` (``take_over_queued`` if ``queued_only``), and revoke the displaced owner.

        When the key was taken from another live owner, writes that owner's
        revoked marker (as ``revoke`` does) living the longer of the
        holder's remaining TTL and ``revoked_ttl`` seconds (a longer marker
        is kept). A started holder that keeps the key (``queued_only``) is
        returned and nothing is written. One round trip, atomic; a command
        re-sent after a lost reply answers what the first one did.
        Returns the previous live holder, or ``None`` if the key was free.
        """


#: Whether a store class has ``RevokingTakeOver``, decided once per class
#: (a protocol ``isinstance`` walks every member on each call).
_REVOKING: dict[type, bool] = {}


def revoking_take_over(store: LockStore) -> RevokingTakeOver | None:
    """``store`` when it takes keys over and revokes in one step (``RevokingTakeOver``)."""
    revoking = _REVOKING.get(type(store))
    if revoking is None:
        revoking = _REVOKING[type(store)] = isinstance(store, RevokingTakeOver)
    return cast(RevokingTakeOver, store) if revoking else None


def replace_holder(
    store: LockStore,
    key: str,
    owner: str,
    ttl: float,
    meta: LockMeta,
    revoked_ttl: float,
    *,
    queued_only: bool = False,
) -> Lock | None:
    """Make ``owner`` the holder of ``key`` and mark the displaced owner revoked.

    One round trip on a ``RevokingTakeOver`` store, else a take-over and a
    revoke. The marker lives the displaced lock's remaining TTL, at least
    ``revoked_ttl``. Returns the displaced holder, or ``None`` when the key
    was free or already ``owner``'s (a re-sent command's own write). With
    ``queued_only`` (the store must have ``QueuedTakeOver`` or
    ``RevokingTakeOver``) a started holder keeps the key: it is returned,
    not revoked.
    """
    revoking = revoking_take_over(store)
    if revoking is not None:
        previous = revoking.take_over_revoking(
            key, owner, ttl, meta, revoked_ttl, queued_only=queued_only
        )
        return None if previous is None or previous.owner == owner else previous
    if queued_only:
        previous = cast(QueuedTakeOver, store).take_over_queued(key, owner, ttl, meta)
    else:
        previous = store.take_over(key, owner, ttl, meta)
    if previous is None or previous.owner == owner:
        return None
    if not (queued_only and previous.started):
        store.revoke(key, previous.owner, max(previous.ttl, revoked_ttl))
    return previous


@runtime_checkable
class CounterSupport(Protocol):
    """**Protocol:** a store that can keep shared metric counters.

    Counters are per ``(task_name, event)`` and are added in batches, so
    keeping them never costs a round trip per enqueue.
    """

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """Add ``counts`` to the stored counters in one round trip."""

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Return every stored counter under ``prefix``."""


@dataclass(frozen=True)
class Durability:
    """What a store's server says about keeping keys until their TTL ends.

    ``None`` in a field means "could not be told" (``error`` says why).
    """

    #: the server's eviction policy under memory pressure (Redis' ``maxmemory-policy``)
    eviction_policy: str | None
    #: the server's memory limit in bytes (``0``: none)
    maxmemory: int | None
    #: whether keys survive a restart of the server (RDB snapshots or the AOF)
    persistent: bool | None
    #: why the server could not be asked (a refused ``CONFIG GET``, an outage)
    error: str | None = None


@runtime_checkable
class DurabilityReport(Protocol):
    """**Protocol:** a store whose server can say whether it keeps keys until their TTL.

    Read by the settings lint (``celery_dedup.lint``) at worker start and by
    ``celery dedup check``, never on a call's path.
    """

    def durability(self) -> Durability:
        """Ask the server (one round trip); never raises: errors go to ``error``."""


@runtime_checkable
class SlotSupport(Protocol):
    """**Protocol:** a store that keeps concurrency slots (``concurrency_limit``).

    A slot key holds at most ``limit`` holders, each a lease that lapses
    ``ttl`` seconds after it was taken or last renewed (a crashed holder's
    slot comes back by itself). One round trip per call, atomic on the
    server, and every key it writes carries a TTL.
    """

    def take_slot(self, key: str, holder: str, limit: int, ttl: float) -> tuple[bool, int]:
        """Take one of ``limit`` slots of ``key`` for ``holder`` for ``ttl`` seconds.

        Lapsed leases are dropped first. A holder that already holds a slot
        keeps it (its lease is renewed). Returns whether ``holder`` holds a
        slot now, and how many slots of ``key`` are in use after the call.
        """

    def give_slot(self, key: str, holder: str) -> bool:
        """Give ``holder``'s slot of ``key`` back; whether it held one (idempotent)."""

    def renew_slots(self, slots: Sequence[tuple[str, str]], ttl: float) -> int:
        """Renew the lease of each ``(key, holder)`` still held to ``ttl`` seconds; how many."""

    def slots_in_use(self, key: str) -> int:
        """How many live leases ``key`` has."""


@dataclass(frozen=True)
class SlotWaiter:
    """A message waiting for a slot of a full concurrency key (``SlotHandoff``)."""

    #: the waiting message's task id (one entry per id: its copies share it)
    id: str
    #: its place in the wait list, in seconds (its call time): the oldest goes first;
    #: a waiter already listed keeps the place it had
    order: float
    #: the message to publish when a slot is reserved for it (opaque to the store)
    payload: bytes
    #: seconds the entry lives unless the waiter registers again
    life: float


@dataclass(frozen=True)
class SlotTurn:
    """The answer of ``SlotHandoff.take_slot_in_turn``."""

    #: whether the holder holds a slot now
    taken: bool
    #: slots in use after the call (reservations included)
    in_use: int
    #: the payloads of the waiters a slot was reserved for, oldest first
    woken: tuple[bytes, ...] = ()


@runtime_checkable
class SlotHandoff(Protocol):
    """**Protocol:** a ``SlotSupport`` store that hands a freed slot to the oldest waiter.

    Beside a key's holders the store keeps its wait list (waiter id, place,
    payload, expiry) and its reservations (waiter id -> expiry, each one a
    slot in use). Every call drops lapsed holders, reservations and waiters
    first, and ends with the dispatch: while a slot is free and a waiter
    waits, the oldest waiter gets a reservation and its payload is returned
    for the caller to publish. One round trip per call, atomic on the
    server; every key it writes carries a TTL.
    """

    def take_slot_in_turn(
        self,
        key: str,
        holder: str,
        limit: int,
        ttl: float,
        waiter: SlotWaiter | None,
        grace: float,
    ) -> SlotTurn:
        """Take a slot for ``holder`` in turn, or wait for one as ``waiter``.

        A holder that holds a slot keeps it (renewed). A reservation for
        ``waiter.id`` is taken as the slot. Otherwise ``waiter`` is listed
        (or refreshed, keeping its place) and takes a free slot only when
        no waiter listed before it is left unserved; without a ``waiter``
        the holder takes a slot the waiters leave free. Reservations made
        by the dispatch lapse after ``grace`` seconds.
        """

    def give_slot_in_turn(
        self, key: str, holder: str, limit: int, grace: float
    ) -> tuple[bytes, ...]:
        """Give ``holder``'s slot back and dispatch: the payloads of the waiters woken."""


@dataclass(frozen=True)
class RateAnswer:
    """The answer of ``RateSupport.hit_rate``."""

    #: whether the publish is admitted (now, or after ``wait`` when delayed)
    admitted: bool
    #: seconds until the admitted publish may run (``0``: now), or, when
    #: refused, until the window has room again
    wait: float
    #: how many publishes the window holds after the call
    count: int
    #: the task id of the most recent admitted publish ("" when none)
    last: str = ""
    #: the window member this publish was counted under, when admitted: what
    #: ``RateRelease.forget_rate`` takes back out (one per publish, even when
    #: publishes share a task id)
    entry: str = ""


@runtime_checkable
class RateSupport(Protocol):
    """**Protocol:** a store that counts publishes per rate key (``rate_limit_per_key``).

    A sliding window: at most ``limit`` admitted publishes in any
    ``period`` seconds. One round trip per call, atomic on the server, on
    the server's clock; every key it writes carries a TTL.
    """

    def hit_rate(
        self, key: str, member: str, limit: int, period: float, *, delay: bool
    ) -> RateAnswer:
        """Count the publish ``member`` (a task id) on ``key`` if the window has room.

        Each call is one publish: calls sharing a task id (``deterministic_id``)
        take one place each.

        With ``delay``, a full window admits it anyway at the earliest time
        the window has room (``wait`` seconds from now), reserving that
        place, so delayed publishes never exceed the limit either.
        """

    def rate_window(self, key: str, limit: int, period: float) -> RateAnswer:
        """The window of ``key`` as it is (nothing counted): its count, its last
        member and (``wait``) when it has room again under ``limit``.
        """


@runtime_checkable
class RateRelease(Protocol):
    """**Protocol:** a store that can take a counted publish back out of its window.

    The undo of ``RateSupport.hit_rate``: a call refused or failed after
    its publish was counted (its lock was held, its publish raised) leaves
    no entry behind. A store without it keeps the entry until the period
    ends (the window then counts a publish that never happened).
    """

    def forget_rate(self, key: str, member: str) -> bool:
        """Remove ``member`` (a ``RateAnswer.entry``) from the window of ``key``; whether
        it was there.

        One round trip, atomic; idempotent.
        """


@dataclass(frozen=True)
class RatedLock:
    """The answer of ``RatedAcquire.acquire_rated``: exactly one of three outcomes.

    * acquired: ``rate`` admitted (its ``entry`` counted) and the lock taken;
    * held: ``holder`` holds the key, nothing counted, nothing written;
    * refused: ``rate`` not admitted (the window is full), the key free and
      nothing written.
    """

    #: the publish's place in the window (``None`` when the key is held)
    rate: RateAnswer | None
    #: the live holder of the key (another owner), when held
    holder: Lock | None = None

    @property
    def acquired(self) -> bool:
        """The call was counted and holds the key."""
        return self.holder is None and self.rate is not None and self.rate.admitted


@runtime_checkable
class RatedAcquire(Protocol):
    """**Protocol:** a store that counts a publish and takes its lock in one operation.

    What ``RateSupport.hit_rate`` followed by ``LockStore.acquire`` do,
    checks before effects, atomically in one round trip: a held key answers
    the holder without counting the call; a free key counts the call in
    its window and takes the lock only when the window has room (or, with
    ``delay``, at its reserved place, the lock then living ``unique_for``
    past that place). A store without it costs the two round trips (and a
    third, the entry's undo, for a duplicate).
    """

    def acquire_rated(
        self,
        key: str,
        owner: str,
        ttl: float,
        meta: LockMeta,
        rate_key: str,
        member: str,
        limit: int,
        period: float,
        *,
        delay: bool,
        unique_for: float,
    ) -> RatedLock | None:
        """Count ``member`` (a task id, as ``hit_rate``) and lock in one round trip.

        ``None`` (nothing sent) when this store cannot for these keys (a
        cluster whose two keys are in different hash slots): the caller then
        takes the two steps.

        The lock lives ``max(ttl, unique_for + wait)`` where ``wait`` is the
        reserved place's delay. A command re-sent after a lost reply (the key
        held by ``owner``) answers acquired without counting again.
        """


#: One item of ``BulkAcquire.acquire_many``: what ``LockStore.acquire`` takes.
AcquireItem = tuple[str, str, float, LockMeta]


@runtime_checkable
class BulkAcquire(Protocol):
    """**Protocol:** a store that acquires many keys in one round trip.

    What ``LockStore.acquire`` does for each item, in one operation:
    each key is taken if free or expired, else its holder is answered.
    Each key is atomic on its own (an item never waits for another); the
    items are not one transaction (a key taken stays taken whatever the
    others answered). ``enqueue_many(per_item=True)`` uses it; a store
    without it costs one round trip per item (``acquire_many``).
    """

    def acquire_many(self, items: Sequence[AcquireItem]) -> list[Lock | None]:
        """Acquire every ``(key, owner, ttl, meta)``; the answers in the items' order.

        ``None`` where the key was taken, else its holder. The keys must be
        distinct (``ValueError`` otherwise). One round trip on Redis and
        PostgreSQL (Redis Cluster: one per hash slot).
        """


def acquire_many(store: LockStore, items: Sequence[AcquireItem]) -> list[Lock | None]:
    """``store.acquire_many`` where the store has it, else one ``acquire`` per item."""
    if len({item[0] for item in items}) != len(items):
        raise ValueError("acquire_many: the keys of one call must be distinct")
    if not items:
        return []
    if isinstance(store, BulkAcquire):
        return store.acquire_many(items)
    answers: list[Lock | None] = []
    try:
        for key, owner, ttl, meta in items:
            answers.append(store.acquire(key, owner, ttl, meta))
    except BaseException:
        # No item is answered: give back the keys taken so far.
        for (key, owner, _, _), holder in zip(items, answers, strict=False):
            if holder is None:
                with contextlib.suppress(StoreError):
                    store.release(key, owner)
        raise
    return answers


#: Whether a store class has ``RatedAcquire``, decided once per class.
_RATED: dict[type, bool] = {}


def rated_acquire(store: object) -> RatedAcquire | None:
    """``store`` when it counts and locks in one operation (``RatedAcquire``)."""
    rated = _RATED.get(type(store))
    if rated is None:
        rated = _RATED[type(store)] = isinstance(store, RatedAcquire)
    return cast(RatedAcquire, store) if rated else None


@dataclass(frozen=True)
class SlotUsage:
    """One live concurrency key as ``LimitListing.list_slots`` finds it."""

    #: the store key (``<prefix>-slots:<task name>:<digest>``)
    key: str
    #: how many live leases it has
    in_use: int
    #: the ``concurrency_limit`` the newest live lease was taken under (its
    #: holder's ``~<limit>`` suffix: ``slot_limit_of``; ``None``: not recorded)
    limit: int | None = None


def slot_holder(run_id: str, nonce: str, limit: int) -> str:
    """A slot's holder: the run's id, a nonce (a holder is one delivery), and the
    ``concurrency_limit`` the slot is taken under (shown by the listings)."""
    return f"{run_id}:{nonce}~{limit}"


def slot_limit_of(holder: str) -> int | None:
    """The limit a holder's slot was taken under (``None``: a holder of an earlier version)."""
    _, sep, limit = holder.rpartition("~")
    return int(limit) if sep and limit.isdigit() else None


@dataclass(frozen=True)
class RateWindow:
    """One live rate key as ``LimitListing.list_rates`` finds it."""

    #: the store key (``<prefix>-rate:<task name>:<digest>``)
    key: str
    #: seconds since each entry was admitted, on the store's clock (negative:
    #: a place a delayed publish reserved ahead), newest first
    ages: tuple[float, ...]
    #: the task id of the newest entry ("" when none)
    last: str = ""
    #: ``(limit, period in seconds)`` the newest entry was admitted under
    #: (``None``: an entry of an earlier version, which does not record it)
    rate: tuple[int, float] | None = None


@runtime_checkable
class LimitListing(Protocol):
    """**Protocol:** a store that can list its live slot and rate keys (the operator views).

    Read by ``celery dedup limits`` and the Django admin, never on a call's
    path. The store keys name the task and a digest of the limit key's
    text, never the text itself.
    """

    def list_slots(self, prefix: str) -> list[SlotUsage]:
        """Every slot key starting with ``prefix`` that has a live lease."""

    def list_rates(self, prefix: str) -> list[RateWindow]:
        """Every rate key starting with ``prefix`` that holds entries (the key's TTL bounds
        them; the caller counts those inside the task's period).
        """


#: Decides what a driver exception means: the ``StoreError`` class to raise
#: for it, or ``None`` when it is no driver error (it then passes unchanged).
Classify = Callable[[BaseException], type[StoreError] | None]

#: Exceptions that are never a store's answer: our own errors, bad arguments
#: (programming errors) and Celery's time limits, raised inside whatever the
#: worker was doing. A classifier that falls back on "any other exception is
#: the store refusing" leaves these alone.
PASS_THROUGH: tuple[type[BaseException], ...] = (
    DedupError,
    TypeError,
    ValueError,
    AttributeError,
    LookupError,
    AssertionError,
    NotImplementedError,
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
)

_TEMPLATES: dict[type[StoreError], str] = {
    StoreUnavailable: "lock store {where} is unavailable: {answer}",
    StoreContention: "lock store {where} stayed contended: {answer}",
    StoreRefused: "lock store {where} refused the operation: {answer}",
    StorePermissionDenied: "lock store {where} denied permission: {answer}",
}


def server_answer(exc: BaseException) -> str:
    """The driver error ``exc`` as text: its class and the server's answer, code first.

    redis-py strips the error code (``READONLY``, ``NOPERM``...) off the
    messages it maps to a class and keeps it in ``status_code``: it is put
    back, as it is the part of the answer a reader searches for.
    """
    text = str(exc)
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code and not text.startswith(code):
        text = f"{code} {text}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def store_error(
    kind: type[StoreError], exc: BaseException, store: str, where: str, answer: str | None = None
) -> StoreError:
    """The ``kind`` of ``StoreError`` that stands for the driver error ``exc``.

    Its message names the store (``where``: its label) and the server's
    answer; ``store`` is the store's short name.
    """
    template = _TEMPLATES.get(kind, "lock store {where} failed: {answer}")
    text = server_answer(exc) if answer is None else answer
    return kind(template.format(where=where, answer=text), store=store)


def translate(
    exc: BaseException,
    classify: Classify,
    store: str,
    where: str,
    answer: Callable[[BaseException], str] = server_answer,
) -> BaseException:
    """What to raise for ``exc``: a ``StoreError``, or ``exc`` itself when it is none of ours.

    A ``StoreError`` (already translated) and every ``DedupError`` pass
    unchanged, as does anything ``classify`` does not recognise.
    """
    if isinstance(exc, DedupError):
        return exc
    kind = classify(exc)
    if kind is None:
        return exc
    return store_error(kind, exc, store, where, answer(exc))


@contextmanager
def store_errors(
    classify: Classify,
    store: str,
    describe: Callable[[], str] | None = None,
    answer: Callable[[BaseException], str] = server_answer,
) -> Iterator[None]:
    """The one boundary a store's driver errors cross: each becomes a ``StoreError``.

    ``classify`` (one per store) maps a driver exception to
    ``StoreUnavailable`` (cannot reach), ``StoreContention``,
    ``StoreRefused`` (the server answered with an error: read-only, full,
    busy...) or ``StorePermissionDenied``; a driver exception it does not
    know must still be ``StoreRefused``, so none ever leaks. Our own errors
    and programming errors (``PASS_THROUGH``) cross unchanged. ``describe``
    gives the store's label for the message (default: ``store``), ``answer``
    the server's answer in it.
    """
    try:
        yield
    except Exception as exc:
        error = translate(exc, classify, store, describe() if describe else store, answer)
        if error is exc:
            raise
        raise error from exc


def refused_unless_passed(exc: BaseException) -> type[StoreError] | None:
    """``StoreRefused`` for any exception but ``PASS_THROUGH``: the last rule of a classifier.

    For stores that cannot know their driver's exception classes (a Django
    cache backend of any kind).
    """
    if isinstance(exc, PASS_THROUGH) or not isinstance(exc, Exception):
        return None
    return StoreRefused


def os_error_kind(exc: OSError) -> type[StoreError]:
    """What a local ``OSError`` means: a full or read-only disk is refused, rights denied."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return StoreRefused
    if exc.errno in (errno.EACCES, errno.EPERM) and not isinstance(exc, ConnectionError):
        return StorePermissionDenied
    return StoreUnavailable


@contextmanager
def unavailable_on(
    errors: tuple[type[BaseException], ...],
    store: str,
    describe: Callable[[], str] | None = None,
) -> Iterator[None]:
    """Translate the driver's "cannot reach the server" errors into ``StoreUnavailable``.

    The narrow form of ``store_errors`` (every other exception passes
    unchanged); kept for callers outside the stores.
    """

    def classify(exc: BaseException) -> type[StoreError] | None:
        return StoreUnavailable if isinstance(exc, errors) else None

    with store_errors(classify, store, describe):
        yield


def unavailable(exc: BaseException, store: str, where: str) -> StoreUnavailable:
    """The ``StoreUnavailable`` that stands for the driver error ``exc``."""
    error = store_error(StoreUnavailable, exc, store, where)
    assert isinstance(error, StoreUnavailable)
    return error
