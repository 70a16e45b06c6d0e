"""The lock lifecycle model and its checker.

A run is recorded as a ``Trace``: what each producer saw around every
``apply_async`` (``Call``) and ``celery_dedup.revoke`` (``Revoke``), what the
workers wrote from inside each message (``Event``: signals and the task body),
and periodic scans of the store (``Scan``). Every timestamp is ``time.time()``
on one machine, the clock Redis expires keys by.

From the trace the checker derives, for every published message (a
*holding*: one owner token, kept across its retries), two instants:

- ``must_hold_until`` (``L``): the earliest moment its policy, its TTL, a
  replacing call or a revoke allows its lock to end. The lock is certainly
  held from the end of its ``apply_async`` until ``L``.
- ``gone_by`` (``U``): the latest moment its lock can still exist, from its
  maximal TTL (including retry extensions and start-claim retakes) and the
  events after which the policy says it is released.

Every bound is taken on the safe side of each recorded instant (a producer's
``t0`` precedes the acquire, a body's start record follows the start claim, a
``task_postrun`` record follows the release, a body's end record precedes it),
plus a margin, so a finding is certain: it cannot be explained by the
unknown order of events inside the recorded intervals.

Two policies are judged by what their runs did rather than by their lock
alone. ``cancel_running``: a run terminated by a later call (its body's end
record says ``interrupted``) is cancelled, never a run that did the work;
every call's work is done by a run of its own message that ended, or handed
on to a later call of the key that took it over (or to a ``CancelTimeout``
its caller saw); two runs of the key overlap only while a run cancelled by
such a call ends. Capped debounce (``replace`` with ``debounce_max_wait``):
the same hand-on rule, and a run of the key starts at most
``debounce_max_wait`` (plus ``CAP_SLACK`` for the workers' scheduling)
after the first call of its burst. A capped call may take the key twice
(under a guessed owner token, then under the one naming its burst's start):
a scan during the call may see the guessed token.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from itertools import pairwise

from celery_dedup import backoff
from celery_dedup.coalesce import WAIT
from celery_dedup.debounce import token_start

__all__ = [
    "CAP_SLACK",
    "FINAL_STATES",
    "MARGIN",
    "Call",
    "Event",
    "Finding",
    "Holding",
    "Kind",
    "Revoke",
    "Scan",
    "Seen",
    "SpanRecord",
    "Trace",
    "check",
    "summary",
    "unfinished",
]

#: Seconds added on the safe side of every comparison (millisecond TTLs,
#: the time between taking a timestamp and the operation it brackets).
MARGIN = 0.05

INF = math.inf

#: Seconds a capped debounce's run may start past its cap: the ETA is
#: honoured by a worker with a free pool slot, behind a running run of the
#: key (a ``replace`` waits for it) and a retry's countdown.
CAP_SLACK = 2.0

#: Seconds by which a cancelled run's termination record (``task_revoked``,
#: written just after the worker released its lock) may follow the start of
#: the run that took the freed key: that run's call waited for the release,
#: then acquired, published, and its message was delivered and claimed.
CUT_SLACK = 0.5

#: ``task_postrun`` states after which a message never runs again.
FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "IGNORED", "REJECTED", "REVOKED"})


class Kind(str, Enum):
    """What a finding is."""

    #: a publish or an execution inside another holder's certain interval, or
    #: one message's body run again after it completed
    DUPLICATE = "duplicate"
    #: a call suppressed by a holder that had certainly released
    STALE = "stale suppression"
    #: a lock seen after its holder certainly released it, or living past its TTL
    LEAK = "leak"
    #: a lock absent while its holder certainly had to hold it
    MISSING = "missing lock"
    #: a published message that never reached a final state and was not revoked
    LOST = "lost message"
    #: the body of a message whose revoke released its lock ran anyway
    REVOKED_RAN = "revoked ran"
    #: two ``keep_last`` runs of one key overlapped (a follow-up ran beside its run)
    OVERLAP = "overlapping keep_last runs"
    #: a ``cancel_running`` or capped debounce call whose work no run did: its
    #: own message did not run to its end and no later call took it over
    UNCOVERED = "uncovered call"
    #: two runs of a ``cancel_running`` key overlapped, beyond a cancelled run ending
    CANCEL_OVERLAP = "overlapping cancel_running runs"
    #: a capped debounce's burst ran later than ``debounce_max_wait`` after its first call
    LATE = "late capped debounce"
    #: one try of a message was delivered to workers more often than the bound
    #: allows (``check(max_receptions=)``): its copies multiplied
    RECEPTIONS = "too many receptions"
    #: a message sent with a malformed header did not run exactly once (``check(malformed=)``)
    MALFORMED = "malformed header mishandled"
    #: a run's fencing token not greater than that of a run of its key that
    #: started before this run's start claim began
    FENCE = "fence not growing"
    #: a run started while as many runs of its key as the ``concurrency_limit``
    #: its call drew were certainly running
    SLOTS = "concurrency limit exceeded"
    #: a call ``dedup_mode="observe"`` published anyway whose message never ran to its end
    OBSERVED = "observed call not run"
    #: an OpenTelemetry span of a traced process that disagrees with what was recorded: a
    #: traced call or skip without its span, or a span claiming what did not happen
    SPAN = "span disagrees"


@dataclass(frozen=True)
class Call:
    """One ``apply_async`` as its producer saw it."""

    key: str
    #: ``unique_until`` of the call
    until: str
    unique_for: float
    #: just before ``apply_async`` was called
    t0: float
    #: just after it returned or raised
    t1: float
    #: ``published``, ``deduplicated``, ``raised`` (``DuplicateTaskError``),
    #: ``observed`` (``dedup_mode="observe"``: published anyway, without a lock),
    #: ``cancel_timeout`` (``CancelTimeout``: nothing published, no lock) or
    #: ``failed`` (any other error: the lock must have been rolled back)
    outcome: str
    #: the published message's id, or the holder's id for a suppressed call
    task_id: str
    #: the owner token the call published (``published`` and ``failed``)
    token: str = ""
    #: the call could take the lock over (``replace``, ``keep_last``, ``cancel_running``)
    replace: bool = False
    #: ``on_duplicate="keep_last"``: its runs never overlap another keep_last run
    keep_last: bool = False
    #: ``on_duplicate="cancel_running"``: it cancels the holder, running or not
    cancel: bool = False
    #: ``replace`` with ``debounce_max_wait``: the cap, in seconds
    max_wait: float | None = None
    countdown: float = 0.0
    #: the message's ``expires`` as epoch seconds
    expires_at: float | None = None
    #: the call's name, carried by its arguments to the runs (``Event.seq``)
    seq: str = ""
    #: ``retry_window``: a final failure keeps the lock this long from its end
    retry_window: float | None = None
    #: ``dedup_mode="observe"``: its run goes on when another publish holds the key
    observe: bool = False
    #: made by ``enqueue_many(per_item=True)`` (t0, t1: the whole bulk call's)
    bulk: bool = False
    #: made in a process whose OpenTelemetry Celery instrumentation was on (``check_spans``)
    traced: bool = False


@dataclass(frozen=True)
class Revoke:
    """One ``celery_dedup.revoke(result)`` as its caller saw it."""

    key: str
    task_id: str
    t0: float
    t1: float
    #: the ``RevokeOutcome`` value returned
    outcome: str


@dataclass(frozen=True)
class Event:
    """A record written on a worker.

    ``kind`` is ``received`` (``task_received``, in the worker's main
    process: one delivery of the message), ``prerun`` (``task_prerun``: before the start claim),
    ``start`` (first line of the body: after the claim), ``end`` (last line
    of the body: before the release; ``outcome`` is ``success``, ``failure``,
    ``retry`` or ``interrupted``: terminated by a ``cancel_running`` call),
    ``postrun`` (``task_postrun``: after the release; ``outcome`` is the
    state), ``skipped`` (``task_skipped``) or ``revoked`` (``task_revoked``,
    recorded after celery-dedup's own receiver released).
    """

    kind: str
    token: str
    task_id: str
    t: float
    retries: int = 0
    outcome: str = ""
    #: the retry's countdown, on an ``end`` with outcome ``retry``
    countdown: float = 0.0
    pid: int = 0
    #: the ``seq`` of the call whose arguments the body ran with (``start``, ``end``)
    seq: str = ""
    #: the run's fencing token (``fence=True`` tasks; ``start``, ``end``), else 0
    fence: int = 0
    #: the ``concurrency_limit`` the run's call drew (``start``), else 0 (none)
    slots: int = 0
    #: recorded in a process whose OpenTelemetry Celery instrumentation was on
    traced: bool = False


@dataclass(frozen=True)
class Seen:
    """A lock as a scan saw it."""

    key: str
    owner: str
    task_id: str
    expires_at: float


@dataclass(frozen=True)
class Scan:
    """A store scan started at ``t0`` and finished at ``t1``."""

    t0: float
    t1: float
    locks: tuple[Seen, ...]


@dataclass(frozen=True)
class SpanRecord:
    """A finished OpenTelemetry span of a traced process that carries celery-dedup's decision.

    ``name`` is the instrumentation's (``apply_async/<task>``, ``run/<task>``);
    ``attributes`` and each event's are the ``celery_dedup.*`` ones, without
    the prefix.
    """

    name: str
    #: the Celery message the span is about (``""``: a span of celery-dedup's own)
    message_id: str
    pid: int
    t: float
    attributes: dict[str, object] = field(default_factory=dict)
    #: ``{"name": ..., "attributes": {...}}`` per span event
    events: list[dict[str, object]] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        return str(self.attributes.get("outcome", ""))


@dataclass
class Trace:
    """Everything recorded during one run."""

    calls: list[Call] = field(default_factory=list)
    revokes: list[Revoke] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    scans: list[Scan] = field(default_factory=list)
    spans: list[SpanRecord] = field(default_factory=list)

    def to_json(self) -> str:
        """The trace as JSON (kept next to a failing run's logs)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Trace:
        """Read a trace written by ``to_json``."""
        raw = json.loads(text)
        return cls(
            calls=[Call(**c) for c in raw["calls"]],
            revokes=[Revoke(**r) for r in raw["revokes"]],
            events=[Event(**e) for e in raw["events"]],
            scans=[
                Scan(s["t0"], s["t1"], tuple(Seen(**seen) for seen in s["locks"]))
                for s in raw["scans"]
            ],
            spans=[SpanRecord(**span) for span in raw.get("spans", [])],
        )


@dataclass(frozen=True)
class Finding:
    """A certain violation of a guarantee."""

    kind: Kind
    key: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail} (key …{self.key[-12:]})"


@dataclass
class Holding:
    """One published message's lock, from its publish to its final state."""

    call: Call
    events: list[Event] = field(default_factory=list)
    #: earliest moment the lock may end (see the module docstring)
    must_hold_until: float = INF
    #: latest moment the lock may still exist
    gone_by: float = INF
    #: latest moment the lock may expire by its TTL
    expires_by: float = INF

    @property
    def token(self) -> str:
        return self.call.token

    @property
    def key(self) -> str:
        return self.call.key

    def of(self, *kinds: str) -> list[Event]:
        """This holding's events of the given kinds, in time order."""
        return [e for e in self.events if e.kind in kinds]

    def first(self, kind: str, outcomes: Iterable[str] | None = None) -> float:
        """When the first event of ``kind`` (with one of ``outcomes``) was recorded."""
        wanted = None if outcomes is None else set(outcomes)
        times = [e.t for e in self.of(kind) if wanted is None or e.outcome in wanted]
        return min(times, default=INF)

    def finished(self) -> bool:
        """Whether the message reached a state after which it never runs."""
        return any(
            e.kind in ("skipped", "revoked")
            or (e.kind == "postrun" and e.outcome in FINAL_STATES)
            for e in self.events
        )


#: The ``task_skipped`` reason of a ``keep_last`` message waiting for the run gate.
GATE_WAIT = "deferred: the previous run of its key"

#: ``task_skipped`` reasons of a redelivered copy that ran nothing and
#: touched no lock: another copy of the same attempt ran or is running.
COPY_REASONS: tuple[str, ...] = ("already ran", "deferred")


def gate_waits(events: Sequence[Event]) -> list[tuple[float, float]]:
    """When a ``keep_last`` message waited for its key's run gate, each with the longest
    countdown that deferral may have drawn.

    The countdown doubles with each deferral of the attempt (``backoff``, from
    ``coalesce.WAIT`` at most); the deferrals its copies logged before it
    bound how many its header counted.
    """
    waits: list[tuple[float, float]] = []
    deferred = 0
    for e in events:
        if e.kind == "skipped" and e.outcome.startswith("deferred"):
            if e.outcome.startswith(GATE_WAIT):
                waits.append((e.t, min(backoff.CAP, WAIT * backoff.FACTOR**deferred)))
            deferred += 1
    return waits


def without_copies(events: list[Event]) -> list[Event]:
    """A message's events without those of its redelivered copies.

    A copy refused by its run record (``already ran``, or ``deferred``
    while another copy runs) records a ``prerun``, the skip and an
    ``IGNORED`` ``postrun`` in one process, and neither runs the body nor
    touches the lock: it is not the message ending.
    """
    dropped: set[int] = set()
    for i, event in enumerate(events):
        if event.kind != "skipped" or not event.outcome.startswith(COPY_REASONS):
            continue
        dropped.add(i)
        before = [
            j for j in range(i) if events[j].kind == "prerun" and events[j].pid == event.pid
        ]
        if before:
            dropped.add(before[-1])
        after = [
            j
            for j in range(i + 1, len(events))
            if events[j].kind == "postrun" and events[j].pid == event.pid
        ]
        if after:
            dropped.add(after[0])
    return [e for i, e in enumerate(events) if i not in dropped]


class _Checker:
    def __init__(self, trace: Trace, margin: float, ttl_slack: float = 0.0) -> None:
        self.trace = trace
        self.m = margin
        self.ttl_slack = ttl_slack
        self.findings: list[Finding] = []
        #: holdings published while another had to hold the key: their own
        #: interval proves nothing (the store may never have locked them)
        self.intruders: set[str] = set()
        by_token: dict[str, list[Event]] = defaultdict(list)
        for event in sorted(trace.events, key=lambda e: e.t):
            by_token[event.token].append(event)
        #: when each ``keep_last`` message waited for its key's run gate (a
        #: deferral ``without_copies`` drops, but one that extends the lock)
        #: with the longest countdown that deferral may have drawn (``gate_wait``)
        self.gate_waits: dict[str, list[tuple[float, float]]] = {
            token: gate_waits(events) for token, events in by_token.items()
        }
        for token, events in by_token.items():
            by_token[token] = without_copies(events)
        self.holdings = [
            Holding(call, by_token.get(call.token, []))
            for call in trace.calls
            if call.outcome in ("published", "failed") and call.token
        ]
        self.by_key: dict[str, list[Holding]] = defaultdict(list)
        for holding in self.holdings:
            self.by_key[holding.key].append(holding)
        self.by_token = {h.token: h for h in self.holdings}
        self.revokes_of: dict[tuple[str, str], list[Revoke]] = defaultdict(list)
        for revoke in trace.revokes:
            self.revokes_of[(revoke.key, revoke.task_id)].append(revoke)
        self.calls_of: dict[str, list[Call]] = defaultdict(list)
        for call in sorted(trace.calls, key=lambda c: c.t0):
            self.calls_of[call.key].append(call)
        for holding in self.holdings:
            self._bound(holding)

    def report(self, kind: Kind, key: str, detail: str) -> None:
        self.findings.append(Finding(kind, key, detail))

    # -- bounds -------------------------------------------------------------

    def _bound(self, h: Holding) -> None:
        call = h.call
        if call.outcome == "failed" and not h.events:
            # The publish raised: the lock was rolled back before the error.
            h.must_hold_until, h.gone_by, h.expires_by = -INF, call.t1, call.t1
            return
        ttl = call.unique_for + call.countdown
        h.expires_by = self._expires_by(h, ttl)
        h.gone_by = min(h.expires_by, self._released_by(h))
        if call.outcome == "failed":
            # Rolled back, yet the broker enqueued it after all: it holds only
            # what its start claim may retake, never certainly.
            h.must_hold_until = -INF
        else:
            h.must_hold_until = min(call.t0 + ttl, self._earliest_release(h))

    def _earliest_release(self, h: Holding) -> float:
        """The first moment anything may end ``h``'s lock besides its TTL."""
        call, until = h.call, h.call.until
        earliest = INF
        if until == "start":
            earliest = h.first("prerun")
        elif until == "success":
            earliest = h.first("end", ["success"])
        elif until == "finish":
            earliest = h.first("end", ["success", "failure"])
        if call.retry_window is not None:
            # A failure's cooldown starts after its body ended (recorded first).
            ended = h.first("end", ["failure", "interrupted"])
            earliest = min(earliest, ended + call.retry_window)
        if until != "expiry":
            if call.expires_at is not None:
                earliest = min(earliest, max(call.t0, call.expires_at))
            if h.of("revoked"):
                # Dropped by a worker, which releases; whether the drop was
                # right is judged on its own (lost messages).
                earliest = call.t0
        # A revoke by task id reaches every run sharing that id (deterministic ids).
        for revoke in self.revokes_of.get((call.key, call.task_id), []):
            if revoke.t1 > call.t0:
                earliest = min(earliest, max(call.t0, revoke.t0))
        for other in self.by_key[call.key]:
            if other is not h and other.call.replace and other.call.t1 > call.t0:
                earliest = min(earliest, max(call.t0, other.call.t0))
        for timeout in self.calls_of[call.key]:
            # A cancel that timed out revoked the holder and may have terminated it.
            if timeout.outcome == "cancel_timeout" and timeout.t1 > call.t0:
                earliest = min(earliest, max(call.t0, timeout.t0))
        return earliest

    def _expires_by(self, h: Holding, ttl: float) -> float:
        """The latest expiry: the first TTL, a retry's extension, a start claim's retake."""
        call = h.call
        latest = call.t1 + ttl + self.ttl_slack
        postruns = {e.retries: e.t for e in h.of("postrun")}
        body_retries = {e.retries for e in h.of("end") if e.outcome == "retry"}
        if any(e.outcome == "RETRY" and e.retries not in body_retries for e in h.of("postrun")):
            # Retried before its body ran (a replaced message waiting for its
            # replacement): the retry's delay is not recorded.
            return INF
        for end in h.of("end"):
            if end.outcome == "retry":
                # The retry extends before its attempt's task_postrun is recorded.
                extended = postruns.get(end.retries, INF)
                extension = end.countdown + call.unique_for + self.ttl_slack
                latest = max(latest, extended + extension)
        if call.until in ("success", "finish"):
            for start in h.of("start"):
                latest = max(latest, start.t + call.unique_for + self.ttl_slack)
        if call.retry_window is not None:
            # A failure's cooldown may outlast the TTL it replaced (settled before postrun).
            for failed in h.of("postrun"):
                if failed.outcome == "FAILURE":
                    latest = max(latest, failed.t + call.retry_window + self.ttl_slack)
        if call.keep_last:
            # A follow-up waiting for the run gate keeps its lock alive meanwhile.
            for waited, countdown in self.gate_waits.get(h.token, []):
                latest = max(latest, waited + countdown + call.unique_for + self.ttl_slack)
        return latest

    def _released_by(self, h: Holding) -> float:
        """The latest moment the policy (or a skip, revoke, replace) has removed the lock."""
        call, until = h.call, h.call.until
        latest = INF
        if until == "start":
            # A retry publish takes the lock again: only the last try's claim ends it.
            last_tries = {e.retries for e in h.of("end") if e.outcome != "retry"}
            latest = min((e.t for e in h.of("start") if e.retries in last_tries), default=INF)
        elif until == "success":
            latest = h.first("postrun", ["SUCCESS"])
        elif until == "finish":
            latest = h.first("postrun", ["SUCCESS", "FAILURE"])
        if call.retry_window is not None:
            # A final failure's lock lives its cooldown, set before task_postrun.
            failed = h.first("postrun", ["FAILURE"])
            latest = min(latest, failed + call.retry_window + self.ttl_slack)
        # A skipped start claim found another holder or deleted the revoked lock.
        latest = min(latest, h.first("skipped"))
        if until != "expiry":
            latest = min(latest, h.first("revoked"))
        for revoke in self.revokes_of.get((call.key, call.task_id), []):
            if revoke.outcome == "released" and self._revoked_holding(revoke) is h:
                latest = min(latest, revoke.t1)
        for other in self.by_key[call.key]:
            if other is not h and other.call.replace and other.call.t0 > call.t1:
                # A retry published after the replace began may take the
                # key again (free once the replacement released): that
                # hold is the retry's, not ended by this replace.
                retook = any(e.outcome == "retry" and e.t > other.call.t0 for e in h.of("end"))
                # A keep_last follow-up whose lock expired before it could keep it
                # alive, or a copy of a ``success``/``finish`` message redelivered
                # after its worker died and its lock expired, was not revoked by
                # a later call that found the key free: its start claim takes
                # the key again (once the replacement released it).
                retakes = call.keep_last or until in ("success", "finish")
                retook = retook or (
                    retakes and any(e.t > other.call.t0 for e in h.of("start"))
                )
                if not retook:
                    latest = min(latest, other.call.t1)
        return latest

    def _revoked_holding(self, revoke: Revoke) -> Holding | None:
        """The one holding a ``released`` revoke can have released, if only one can."""
        candidates = [
            h
            for h in self.by_key[revoke.key]
            if h.call.task_id == revoke.task_id
            and h.call.outcome == "published"
            and h.call.t0 < revoke.t1
        ]
        if len(candidates) == 1:
            return candidates[0]
        # Several runs share the id: only one whose lock could still exist.
        alive = [h for h in candidates if self._provisional_gone_by(h) + self.m >= revoke.t0]
        return alive[0] if len(alive) == 1 else None

    def _provisional_gone_by(self, h: Holding) -> float:
        call = h.call
        return self._expires_by(h, call.unique_for + call.countdown)

    # -- checks -------------------------------------------------------------

    def certain(self, h: Holding) -> tuple[float, float]:
        """The interval in which ``h`` certainly holds its lock (empty for an intruder)."""
        if h.token in self.intruders:
            return INF, -INF
        return h.call.t1 + self.m, h.must_hold_until - self.m

    def check_publishes(self) -> None:
        """Two publishes that both took the key while the other had to hold it.

        Ordered calls: the later one acquired inside the earlier one's
        interval. Overlapping calls (order unknown): both orders are
        violations when each call ended before the other's lock could end.
        A replacing call may take over, so it is only reported when it came
        first and a plain call published inside its interval.
        """
        for holdings in self.by_key.values():
            published = [h for h in holdings if h.call.outcome == "published"]
            for i, old in enumerate(published):
                for new in published[i + 1 :]:
                    self._check_pair(*sorted((old, new), key=lambda h: h.call.t0))

    def _check_pair(self, old: Holding, new: Holding) -> None:
        if old.token in self.intruders or new.token in self.intruders:
            return
        ordered = new.call.t0 >= old.call.t1 + self.m
        if ordered:
            if new.call.replace or new.call.t1 > old.must_hold_until - self.m:
                return
            self.intruders.add(new.token)
            detail = f"{new.call.t0 - old.call.t1:.3f}s after {old.call.task_id} was published"
        else:
            if old.call.replace or new.call.replace:
                return
            if max(old.call.t1, new.call.t1) + self.m > min(
                old.must_hold_until, new.must_hold_until
            ):
                return
            self.intruders.update((old.token, new.token))
            detail = f"at the same time as {old.call.task_id}"
        self.report(
            Kind.DUPLICATE,
            new.key,
            f"{new.call.task_id} was published while {old.call.task_id} had to hold the "
            f"lock ({detail})",
        )

    def check_executions(self) -> None:
        for holdings in self.by_key.values():
            for runner in holdings:
                # An observing message runs whoever holds its key (``check_observed``).
                observed = self._runs(runner) if not runner.call.observe else []
                for start_event, prerun in observed:
                    for old in holdings:
                        begin, end = self.certain(old)
                        if old is not runner and begin <= prerun and start_event.t <= end:
                            self.report(
                                Kind.DUPLICATE,
                                runner.key,
                                f"{runner.call.task_id} (try {start_event.retries}) ran "
                                f"while {old.call.task_id} had to hold the lock",
                            )
                self._check_reruns(runner)

    def _runs(self, h: Holding) -> list[tuple[Event, float]]:
        """Each body start with the latest ``task_prerun`` before it (claim in between)."""
        runs = []
        for start in h.of("start"):
            preruns = [
                e.t for e in h.of("prerun") if e.retries == start.retries and e.t <= start.t
            ]
            if preruns:
                runs.append((start, max(preruns)))
        return runs

    def _check_reruns(self, h: Holding) -> None:
        """One try of one message started again after a run of it completed.

        A run killed mid-body (no end record) may be redelivered; a run that
        reached its last line must never be repeated, nor overlapped.
        """
        starts: dict[int, list[Event]] = defaultdict(list)
        for start in h.of("start"):
            starts[start.retries].append(start)
        for retries, runs in starts.items():
            for first, second in pairwise(runs):
                if self._completed(h, first, runs):
                    self.report(
                        Kind.DUPLICATE,
                        h.key,
                        f"{h.call.task_id} try {retries} started again (pid {second.pid}) "
                        f"after pid {first.pid} ran it to its end",
                    )

    @staticmethod
    def _completed(h: Holding, run: Event, runs: Sequence[Event]) -> bool:
        """Whether ``run`` wrote its end record (before the same child's next start)."""
        later = [r.t for r in runs if r.pid == run.pid and r.t > run.t]
        until = min(later, default=INF)
        return any(
            e.retries == run.retries and e.pid == run.pid and run.t <= e.t < until
            for e in h.of("end")
        )

    def check_coalesced(self) -> None:
        """``keep_last``: no two runs of one key overlap, whoever holds the lock.

        A run is its body's start record to its end record (the run gate is
        taken before the first and given up after the last); a run killed
        before its end record is left out (its gate lapses, unrecorded).
        """
        for holdings in self.by_key.values():
            spans = sorted(
                (start.t, end.t, h.call.task_id)
                for h in holdings
                if h.call.keep_last
                for start, end in self._spans(h)
            )
            latest_end, latest_id = -INF, ""
            for begin, end, task_id in spans:
                if begin + self.m < latest_end:
                    self.report(
                        Kind.OVERLAP,
                        holdings[0].key,
                        f"{task_id} started {latest_end - begin:.3f}s before "
                        f"{latest_id}'s run ended",
                    )
                if end > latest_end:
                    latest_end, latest_id = end, task_id

    @staticmethod
    def _spans(h: Holding) -> list[tuple[Event, Event]]:
        """Each body start of ``h`` with the end record its run wrote (same try, same pid)."""
        spans = []
        ends = h.of("end")
        for start in h.of("start"):
            mine = [
                e for e in ends if e.retries == start.retries and e.pid == start.pid
                and e.t >= start.t
            ]
            if mine:
                spans.append((start, min(mine, key=lambda e: e.t)))
        return spans

    def check_suppressions(self) -> None:
        for call in self.trace.calls:
            if call.outcome not in ("deduplicated", "raised"):
                continue
            holders = [
                h
                for h in self.by_key.get(call.key, [])
                if h.call.task_id == call.task_id
            ]
            if not any(h.call.t0 < call.t1 for h in holders):
                self.report(
                    Kind.STALE,
                    call.key,
                    f"suppressed by {call.task_id}, which no earlier call published",
                )
            elif all(h.gone_by + self.m < call.t0 for h in holders):
                late = call.t0 - max(h.gone_by for h in holders)
                self.report(
                    Kind.STALE,
                    call.key,
                    f"suppressed by {call.task_id} {late:.3f}s after it released",
                )

    def check_scans(self) -> None:
        for scan in self.trace.scans:
            seen = {lock.owner: lock for lock in scan.locks}
            for lock in scan.locks:
                self._check_seen(scan, lock)
            for h in self.holdings:
                start, end = self.certain(h)
                if start <= scan.t0 and scan.t1 <= end and h.token not in seen:
                    self.report(
                        Kind.MISSING,
                        h.key,
                        f"{h.call.task_id} ({h.call.until}) had to hold the lock during a "
                        f"scan {scan.t0 - h.call.t1:.3f}s after its publish",
                    )

    def _check_seen(self, scan: Scan, lock: Seen) -> None:
        h = self.by_token.get(lock.owner)
        if h is None:
            # guard locks, and a worker's start probe (celery_dedup.startup), own no message
            if not lock.owner.startswith(("guard:", "probe:")) and not self._guessed(scan, lock):
                self.report(Kind.LEAK, lock.key, f"lock of {lock.task_id} has an unknown owner")
            return
        if h.gone_by + self.m < scan.t0:
            self.report(
                Kind.LEAK,
                lock.key,
                f"lock of {h.call.task_id} ({h.call.until}, {h.call.outcome}) seen "
                f"{scan.t0 - h.gone_by:.3f}s after it had to be gone",
            )
            return
        # The scan read the TTL somewhere in [t0, t1]: the lock lives at least this long.
        expires_no_earlier = scan.t0 + (lock.expires_at - scan.t1)
        if expires_no_earlier > h.expires_by + self.m:
            self.report(
                Kind.LEAK,
                lock.key,
                f"lock of {h.call.task_id} lives {expires_no_earlier - h.expires_by:.3f}s "
                "past its TTL",
            )

    def _guessed(self, scan: Scan, lock: Seen) -> bool:
        """A capped call's guessed token, seen while that call could still hold it."""
        return token_start(lock.owner) is not None and any(
            call.max_wait is not None and call.t0 <= scan.t1 and scan.t0 <= call.t1
            for call in self.calls_of[lock.key]
        )

    def check_covered(self) -> None:
        """Every ``cancel_running`` or capped call's work is done, or handed on.

        Done: its own message's body ran to its end (success or failure,
        not interrupted) with its arguments. Handed on: a later call of the
        key published over it (that call's own work is judged the same
        way), a revoke or a ``CancelTimeout`` of the key came after it, or
        it carried ``expires``.
        """
        for key, calls in self.calls_of.items():
            for call in calls:
                judged = call.cancel or call.max_wait is not None
                if not judged or call.outcome not in ("published", "deduplicated"):
                    continue
                if self._done(call) or self._handed_on(call, calls):
                    continue
                runs = self.by_token.get(call.token)
                ends = sorted({e.outcome for e in runs.of("end")}) if runs else []
                self.report(
                    Kind.UNCOVERED,
                    key,
                    f"{call.seq or call.task_id} ({call.outcome}; its runs ended: "
                    f"{', '.join(ends) or 'none'}) was neither run to its end nor "
                    "taken over by a later call",
                )

    def _done(self, call: Call) -> bool:
        h = self.by_token.get(call.token) if call.outcome == "published" else None
        return h is not None and any(
            e.outcome in ("success", "failure") and (not call.seq or e.seq == call.seq)
            for e in h.of("end")
        )

    def _handed_on(self, call: Call, calls: Sequence[Call]) -> bool:
        if call.expires_at is not None:
            return True
        if any(r.key == call.key and r.t1 > call.t0 for r in self.trace.revokes):
            return True
        return any(
            other is not call
            and other.t1 > call.t0
            and (
                other.outcome == "cancel_timeout"
                or (other.outcome == "published" and other.replace)
            )
            for other in calls
        )

    def check_cancel_overlaps(self) -> None:
        """Two runs of a ``cancel_running`` key overlap only while a cancelled one ends.

        The earlier run must have been interrupted, by a cancelling call
        made after it started and before the later run started, and its
        worker must have terminated it (``revoked``) before the later run
        started (give or take ``CUT_SLACK``). Also
        allowed: the earlier run's lock was gone by its policy
        (``unique_until="start"``) or could have expired before the later
        run's call.
        """
        for key, holdings in self.by_key.items():
            cancels = [c for c in self.calls_of[key] if c.cancel]
            if not cancels:
                continue
            spans = sorted(
                ((start, end, h) for h in holdings for start, end in self._spans(h)),
                key=lambda span: span[0].t,
            )
            for i, (start, end, h) in enumerate(spans):
                for later_start, _, later in spans[i + 1 :]:
                    if later_start.t + self.m >= end.t or later is h:
                        continue
                    if self._overlap_allowed(start, end, h, later_start, later, cancels):
                        continue
                    self.report(
                        Kind.CANCEL_OVERLAP,
                        key,
                        f"{later.call.seq or later.call.task_id} started "
                        f"{end.t - later_start.t:.3f}s before the run of "
                        f"{h.call.seq or h.call.task_id} ended ({end.outcome})",
                    )

    def _overlap_allowed(
        self,
        start: Event,
        end: Event,
        h: Holding,
        later_start: Event,
        later: Holding,
        cancels: Sequence[Call],
    ) -> bool:
        if h.call.until == "start":
            return True
        if later.call.t0 + self.m >= h.call.t0 + h.call.unique_for + h.call.countdown:
            return True
        cut = h.first("revoked")
        return (
            end.outcome == "interrupted"
            and cut - CUT_SLACK <= later_start.t
            and any(c.t1 > start.t and c.t0 < later_start.t for c in cancels)
        )

    def check_fences(self) -> None:
        """Each fenced run's token is greater than that of every run of its key that
        started (its ``start`` event, after its claim) before this run's claim
        began (the ``prerun`` before its ``start``): no two runs share a token.
        """
        key_of = {h.token: h.key for h in self.holdings}
        starts: dict[str, list[Event]] = defaultdict(list)
        preruns: dict[tuple[str, int], list[float]] = defaultdict(list)
        for event in sorted(self.trace.events, key=lambda e: e.t):
            if event.kind == "start" and event.fence and event.token in key_of:
                starts[key_of[event.token]].append(event)
            elif event.kind == "prerun":
                preruns[(event.token, event.pid)].append(event.t)
        for key, runs in starts.items():
            seen: dict[int, Event] = {}
            for run in runs:
                if run.fence in seen:
                    self.report(Kind.FENCE, key, f"two runs got fence {run.fence}")
                seen[run.fence] = run
                own = preruns[(run.token, run.pid)]  # the pool process's own prerun
                claimed = max((t for t in own if t <= run.t), default=run.t)
                for earlier in runs:
                    if earlier.t + self.m < claimed and earlier.fence >= run.fence:
                        self.report(
                            Kind.FENCE,
                            key,
                            f"{run.seq or run.task_id} got fence {run.fence}, not above "
                            f"{earlier.fence} of {earlier.seq or earlier.task_id} that "
                            f"started {claimed - earlier.t:.3f}s before its claim",
                        )

    def check_slots(self) -> None:
        """A run whose call drew a ``concurrency_limit`` of ``L`` started while fewer
        than ``L`` runs of its key certainly ran (started before it and ended after it,
        by more than the margin). A body records its start after taking its slot and
        its end before giving it back, so runs that overlap here held slots together.
        """
        for key, holdings in self.by_key.items():
            spans = [span for h in holdings for span in self._spans(h)]
            for start, _ in spans:
                if not start.slots:
                    continue
                running = [
                    other for other, end in spans
                    if other is not start and other.t + self.m < start.t
                    and end.t > start.t + self.m
                ]  # fmt: skip
                if len(running) >= start.slots:
                    self.report(
                        Kind.SLOTS,
                        key,
                        f"{start.seq or start.task_id} started under a limit of "
                        f"{start.slots} while {len(running)} runs of its key ran",
                    )

    def check_capped(self) -> None:
        """A capped debounce's burst runs within ``debounce_max_wait`` of its first call.

        A burst's first call is taken as late as the trace allows: the first
        call after the key's last run start (or revoke, drop, skip, or
        other policy's call) before the judged call, at that call's end.
        Reported when a run of the key started after the deadline and none
        started between that point and the deadline, unless a revoke of the
        key came in between (it may have dropped the burst's run).
        """
        for key, calls in self.calls_of.items():
            starts = sorted(e.t for h in self.by_key[key] for e in h.of("start"))
            stops = [
                e.t
                for h in self.by_key[key]
                for e in h.events
                if e.kind in ("start", "skipped", "revoked")
            ]
            revokes = [r for r in self.trace.revokes if r.key == key]
            stops += [r.t1 for r in revokes]
            stops += [c.t1 for c in calls if c.max_wait is None]
            stops += [c.t0 + c.unique_for + c.countdown for c in calls if c.outcome == "published"]
            judged: set[float] = set()
            for call in calls:
                if call.max_wait is None or call.outcome not in ("published", "deduplicated"):
                    continue
                if call.expires_at is not None:
                    continue
                boundary = max((t for t in stops if t < call.t0), default=-INF)
                burst = [c for c in calls if boundary < c.t0 <= call.t0]
                first = min(c.t1 for c in burst)
                if first in judged:
                    continue
                judged.add(first)
                cap = max(c.max_wait or 0.0 for c in burst)
                deadline = first + cap + CAP_SLACK
                if any(boundary < t <= deadline for t in starts):
                    continue
                if any(r.t1 >= first and r.t0 <= deadline for r in revokes):
                    continue  # a revoke may have dropped the burst's run
                late = [t for t in starts if t > deadline]
                if late:
                    self.report(
                        Kind.LATE,
                        key,
                        f"the burst of {call.seq or call.task_id} (first call at "
                        f"{first:.3f}, cap {cap:g}s) ran first {late[0] - first:.3f}s after it",
                    )

    def check_revokes(self) -> None:
        for revoke in self.trace.revokes:
            if revoke.outcome != "released":
                continue
            h = self._revoked_holding(revoke)
            if h is None:
                continue
            # Released: no try had started; any later start claim must find the marker.
            late = [start for start, prerun in self._runs(h) if prerun >= revoke.t1 + self.m]
            if late:
                self.report(
                    Kind.REVOKED_RAN,
                    h.key,
                    f"{h.call.task_id} try {late[0].retries} ran {late[0].t - revoke.t1:.3f}s "
                    "after its revoke released its lock",
                )

    def check_receptions(self, bound: int) -> None:
        """No try of a message is delivered more than ``bound`` times (its copies stay bounded)."""
        received: dict[tuple[str, int], list[Event]] = defaultdict(list)
        for event in self.trace.events:
            if event.kind == "received":
                received[(event.token, event.retries)].append(event)
        keys = {h.token: h.key for h in self.holdings}
        for (token, retries), events in sorted(received.items()):
            if len(events) > bound:
                self.report(
                    Kind.RECEPTIONS,
                    keys.get(token, token),
                    f"{events[0].task_id} try {retries} was received {len(events)} times "
                    f"(at most {bound})",
                )

    def check_malformed(self, task_ids: Sequence[str]) -> None:
        """Each message sent with a malformed header ran once (its guard), to its end."""
        for task_id in task_ids:
            events = [e for e in self.trace.events if e.task_id == task_id]
            starts = [e for e in events if e.kind == "start"]
            ends = [e for e in events if e.kind == "postrun" and e.outcome in FINAL_STATES]
            if len(starts) != 1 or not ends:
                self.report(
                    Kind.MALFORMED,
                    task_id,
                    f"{task_id} started {len(starts)} times, final records {len(ends)}",
                )

    def check_observed(self) -> None:
        """Every call ``dedup_mode="observe"`` published anyway ran, to a final state.

        Unless it was revoked or carried ``expires``: then nothing must run.
        (It carries no lock, so a copy the broker redelivered may run again,
        as without celery-dedup: only "it ran" is judged.)
        """
        for observed in unfinished_observed(self.trace):
            kinds = sorted({e.kind for e in observed.events})
            self.report(
                Kind.OBSERVED,
                observed.key,
                f"{observed.call.task_id} was published anyway (observe) but never ran to its "
                f"end (records: {', '.join(kinds) or 'none'})",
            )

    def check_spans(self) -> None:
        """Spans of traced processes agree with the calls and skips recorded.

        A traced call that published, was observed or was answered as a
        duplicate has its span: a publish span of its message saying
        ``published`` (or ``deferred``; an observed one with ``would``), or
        a ``duplicate`` span naming its holder, under the digest of its key.
        A skip recorded by a traced worker has its ``celery_dedup.skipped``
        or ``celery_dedup.deferred`` event, with the same reason, on the run
        span of its message in the same process. And no span claims what
        did not happen: a ``published`` span names a message a call
        published (or a worker published again), a ``duplicate`` span a
        call answered as a duplicate of that holder, a skip event a skip
        recorded.
        """
        by_call: dict[tuple[str, str, str], list[SpanRecord]] = defaultdict(list)
        skip_events: dict[tuple[str, str, int], int] = defaultdict(int)
        for span in self.trace.spans:
            if span.name.startswith("apply_async/"):
                kind = "duplicate" if span.outcome == "duplicate" else "publish"
                named = span.attributes.get("holder_id") if kind == "duplicate" else None
                ident = str(named or span.message_id)
                by_call[kind, ident, str(span.attributes.get("key_digest", ""))].append(span)
            for event in span.events:
                attributes = event.get("attributes")
                reason = attributes.get("reason") if isinstance(attributes, dict) else None
                skip_events[span.message_id, str(reason), span.pid] += 1
                wanted = "deferred" if str(reason).startswith("deferred") else "skipped"
                if event.get("name") != f"celery_dedup.{wanted}":
                    self.report(Kind.SPAN, "", f"run span of {span.message_id}: event "
                                f"{event.get('name')} for reason {reason!r}")  # fmt: skip
        used: set[int] = set()
        for call in self.trace.calls:
            outcomes = SPAN_OUTCOMES.get(call.outcome)
            # (an untraced process's call has no span: it may not take a traced one's)
            if outcomes is None or not call.traced:
                continue
            kind = "duplicate" if "duplicate" in outcomes else "publish"
            # A call's span ends during the call: calls of one holder (its duplicates,
            # a deterministic id published again) are told apart by when.
            spans = [
                s for s in by_call.get((kind, call.task_id, digest(call.key)), [])
                if id(s) not in used and s.outcome in outcomes
                and (call.outcome != "observed" or "would" in s.attributes)
                and call.t0 - SPAN_CLOCK <= s.t <= call.t1 + SPAN_CLOCK
            ]  # fmt: skip
            if spans:
                used.add(id(spans[0]))
            else:
                self.report(Kind.SPAN, call.key, f"{call.outcome} call {call.task_id} "
                            f"({call.seq}) has no span saying so")  # fmt: skip
        messages = {e.task_id for e in self.trace.events}
        # A call that raised (the broker, its rate, the store) is recorded ``failed``.
        raised = {digest(c.key) for c in self.trace.calls if c.outcome == "failed"}
        for span in self.trace.spans:
            if not span.name.startswith("apply_async/") or id(span) in used:
                continue
            republished = span.outcome in ("published", "deferred") and (
                span.message_id in messages
            )
            refused = span.outcome in ("failed", "refused", "unavailable") and (
                span.attributes.get("key_digest") in raised
            )
            if span.outcome and not (republished or refused):
                self.report(Kind.SPAN, "", f"{span.name} says {span.outcome} of "
                            f"{span.message_id or span.attributes.get('holder_id')}: "
                            "no call recorded that")  # fmt: skip
        # A run span is exported when its run ends (task_postrun): a skip whose
        # process was killed before that (the crash soak) has no span to judge.
        last_end: dict[tuple[str, int], float] = {}
        for e in self.trace.events:
            if e.kind == "postrun":
                last_end[e.task_id, e.pid] = max(e.t, last_end.get((e.task_id, e.pid), -INF))
        skips: dict[tuple[str, str, int], int] = defaultdict(int)
        exported: dict[tuple[str, str, int], int] = defaultdict(int)
        for e in self.trace.events:
            if e.kind == "skipped":
                skips[e.task_id, e.outcome, e.pid] += 1
                if last_end.get((e.task_id, e.pid), -INF) >= e.t:
                    exported[e.task_id, e.outcome, e.pid] += 1
        for (task_id, reason, pid), n in skip_events.items():
            if n > skips.get((task_id, reason, pid), 0):
                self.report(Kind.SPAN, "", f"run span of {task_id} says skipped ({reason}) "
                            f"{n} times in pid {pid}: no such skip recorded")  # fmt: skip
        for e in self.trace.events:
            if e.kind == "skipped" and e.traced:
                found = skip_events.get((e.task_id, e.outcome, e.pid), 0)
                if found < exported[e.task_id, e.outcome, e.pid]:
                    self.report(Kind.SPAN, "", f"skip of {e.task_id} ({e.outcome}) in pid "
                                f"{e.pid} has no span event saying so")  # fmt: skip
                    exported[e.task_id, e.outcome, e.pid] = found  # (reported once)

    def check_lost(self) -> None:
        """Never finished and not revoked; or dropped by a worker for no reason of its own."""
        for h in self.holdings:
            if h.call.outcome != "published":
                continue
            if h.finished():
                self._check_dropped(h)
                continue
            if self.revokes_of.get((h.key, h.call.task_id)):
                continue
            kinds = sorted({e.kind for e in h.events})
            self.report(
                Kind.LOST,
                h.key,
                f"{h.call.task_id} (records: {', '.join(kinds) or 'none'}) never finished",
            )


    def _check_dropped(self, h: Holding) -> None:
        """A message the worker discarded as revoked must have been revoked or expired.

        Its own revoke, its own ``expires``, or a replacing call with another
        task id (whose broadcast revokes the replaced id) explain a drop;
        anything else (an id revoked for an earlier run) loses the work.
        """
        drops = [e for e in h.of("revoked") if not h.of("start")]
        if not drops:
            return
        t = drops[0].t
        call = h.call
        if any(r.t0 < t for r in self.revokes_of.get((h.key, call.task_id), [])):
            return
        if call.expires_at is not None and call.expires_at < t + self.m:
            return
        if any(
            o.call.replace and o.call.task_id != call.task_id and o.call.t0 < t
            for o in self.by_key[h.key]
            if o is not h
        ):
            return
        self.report(
            Kind.LOST,
            h.key,
            f"{call.task_id} was discarded by a worker as {drops[0].outcome} "
            f"{t - call.t1:.3f}s after its publish, without a revoke or expiry of its own",
        )

#: how far a span's end may lie outside its call's ``t0``..``t1`` (both read from the
#: process's clock; rounding only)
SPAN_CLOCK = 0.002
#: a span's outcome for each call outcome of a traced producer (``check_spans``)
SPAN_OUTCOMES: Mapping[str, frozenset[str]] = {
    "published": frozenset({"published", "deferred"}),
    "observed": frozenset({"published", "deferred"}),
    "deduplicated": frozenset({"duplicate"}),
    "raised": frozenset({"duplicate"}),
}


def digest(key: str) -> str:
    """A key as spans name it (``celery_dedup.otel.digest``)."""
    return key.rsplit(":", 1)[-1]


def check(
    trace: Trace,
    margin: float = MARGIN,
    ttl_slack: float = 0.0,
    *,
    max_receptions: int | None = None,
    malformed: Sequence[str] = (),
) -> list[Finding]:
    """Every certain violation in ``trace`` (an empty list when none).

    ``ttl_slack``: how long past its TTL the store may keep a lock (memcached
    counts whole seconds and documents up to 4 s); the TTL lower bound is
    never relaxed. ``max_receptions``: the most deliveries one try of a
    message may have (``None``: not judged, as when countdowns outlast the
    broker's visibility timeout on purpose). ``malformed``: ids of messages
    sent with a malformed header, each to a key of its own: each must run
    exactly once, to its end.
    """
    checker = _Checker(trace, margin, ttl_slack)
    if max_receptions is not None:
        checker.check_receptions(max_receptions)
    checker.check_malformed(malformed)
    checker.check_publishes()
    checker.check_executions()
    checker.check_coalesced()
    checker.check_cancel_overlaps()
    checker.check_fences()
    checker.check_slots()
    checker.check_covered()
    checker.check_capped()
    checker.check_suppressions()
    checker.check_observed()
    checker.check_spans()
    checker.check_scans()
    checker.check_revokes()
    checker.check_lost()
    return checker.findings


def summary(findings: Sequence[Finding], limit: int = 20) -> str:
    """Counts per kind and the first findings, for an assertion message."""
    counts: Mapping[Kind, int] = {
        kind: sum(1 for f in findings if f.kind is kind) for kind in Kind
    }
    head = ", ".join(f"{kind.value}: {n}" for kind, n in counts.items())
    lines = [head, *(str(f) for f in findings[:limit])]
    if len(findings) > limit:
        lines.append(f"… and {len(findings) - limit} more")
    return "\n".join(lines)


def unfinished(trace: Trace) -> list[Holding]:
    """Published messages with no final record yet (revoked ones may never get one).

    A revoke excuses only the publishes it could have hit: made before it
    ended. Calls of one key may share a task id (``replace``,
    ``cancel_running``), so an older publish's revoke must not excuse a
    later one, still retrying, from the wait.
    """
    revoked: dict[tuple[str, str], float] = {}
    for r in trace.revokes:
        revoked[(r.key, r.task_id)] = max(r.t1, revoked.get((r.key, r.task_id), -INF))
    return [
        h
        for h in holdings(trace)
        if h.call.outcome == "published"
        and not h.finished()
        and revoked.get((h.key, h.call.task_id), -INF) < h.call.t0
    ]


def unfinished_observed(trace: Trace) -> list[Holding]:
    """Calls published anyway under observe that have not run to a final state yet,
    each as a lock-less holding with its message's events (revoked ones and ones
    with ``expires`` excepted: nothing of theirs must run)."""
    revoked = {r.task_id for r in trace.revokes}
    events: dict[str, list[Event]] = defaultdict(list)
    for event in trace.events:
        events[event.task_id].append(event)
    left = []
    for call in trace.calls:
        if call.outcome != "observed" or call.expires_at is not None or call.task_id in revoked:
            continue
        mine = events.get(call.task_id, [])
        started = any(e.kind == "start" for e in mine)
        final = any(e.kind == "postrun" and e.outcome in FINAL_STATES for e in mine)
        if not (started and final):
            left.append(Holding(call=call, events=mine))
    return left


def holdings(trace: Trace, margin: float = MARGIN) -> list[Holding]:
    """The holdings of ``trace`` with their bounds (for tests and diagnosis)."""
    return _Checker(trace, margin).holdings
