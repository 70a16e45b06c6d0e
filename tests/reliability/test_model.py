"""The checker on hand-made traces: each kind is found when certain, never when ambiguous."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from celery_dedup.coalesce import WAIT
from celery_dedup.debounce import owner_token

from .model import Call, Event, Kind, Revoke, Scan, Seen, SpanRecord, Trace, check, holdings
from .probe import waited_for

KEY = "celery-dedup:rel.work:" + "a" * 64
OTHER = "celery-dedup:rel.work:" + "b" * 64


def published(t0: float, tid: str, tok: str, until: str = "success", **kw: Any) -> Call:
    """A call that published ``tid`` with owner ``tok`` in [t0, t0 + 0.01]."""
    fields: dict[str, Any] = {"key": KEY, "unique_for": 10.0, **kw}
    return Call(
        until=until, t0=t0, t1=t0 + 0.01, outcome="published", task_id=tid, token=tok, **fields
    )


def suppressed(t0: float, holder: str, until: str = "success", key: str = KEY) -> Call:
    """A call suppressed in [t0, t0 + 0.01], naming ``holder``."""
    return Call(
        key=key, until=until, unique_for=10.0, t0=t0, t1=t0 + 0.01,
        outcome="deduplicated", task_id=holder,
    )


def run(
    tok: str, tid: str, t: float, seconds: float = 0.5, outcome: str = "success",
    retries: int = 0, countdown: float = 0.0, pid: int = 1,
) -> list[Event]:
    """prerun at t, body start, body end after ``seconds``, postrun."""
    state = {"success": "SUCCESS", "failure": "FAILURE", "retry": "RETRY"}[outcome]
    common: dict[str, Any] = {"token": tok, "task_id": tid, "retries": retries, "pid": pid}
    return [
        Event("prerun", t=t, **common),
        Event("start", t=t + 0.01, **common),
        Event("end", t=t + seconds, outcome=outcome, countdown=countdown, **common),
        Event("postrun", t=t + seconds + 0.01, outcome=state, **common),
    ]


def scan(t: float, *locks: tuple[str, str, float]) -> Scan:
    """A scan in [t, t + 0.01] that saw ``(owner, task_id, expires_at)`` locks on KEY."""
    return Scan(t, t + 0.01, tuple(Seen(KEY, owner, tid, exp) for owner, tid, exp in locks))


def kinds(trace: Trace) -> list[Kind]:
    return [finding.kind for finding in check(trace)]


def test_a_clean_lifecycle_has_no_finding() -> None:
    """Publish, suppressed duplicate, run, release, next publish: nothing to report."""
    trace = Trace(
        calls=[published(0.0, "A", "ta"), suppressed(0.5, "A"), published(2.0, "B", "tb")],
        events=[*run("ta", "A", 1.0), *run("tb", "B", 2.5)],
        scans=[scan(0.7, ("ta", "A", 10.0)), scan(1.8), scan(3.5)],
    )
    assert check(trace) == []


def test_a_publish_inside_the_holders_interval_is_a_duplicate() -> None:
    trace = Trace(
        calls=[published(0.0, "A", "ta"), published(0.5, "B", "tb")],
        events=[*run("ta", "A", 1.0), *run("tb", "B", 2.0)],
    )
    assert kinds(trace) == [Kind.DUPLICATE]


def test_overlapping_calls_are_judged_in_both_orders() -> None:
    """Overlapping publishes: whichever took the key second took it from a holder."""
    first = published(0.0, "A", "ta")
    second = replace(first, t0=0.005, t1=0.03, task_id="B", token="tb")
    events = [*run("ta", "A", 1.0), *run("tb", "B", 2.0)]
    assert kinds(Trace(calls=[first, second], events=events)) == [Kind.DUPLICATE]
    # A replacing call may have come second: no certain violation.
    replacing = replace(second, replace=True)
    skipped = Event("skipped", "ta", "A", 1.0, outcome="replaced")
    trace = Trace(calls=[first, replacing], events=[skipped, *run("tb", "B", 2.0)])
    assert check(trace) == []


def test_a_publish_after_the_ttl_is_allowed() -> None:
    trace = Trace(
        calls=[published(0.0, "A", "ta", unique_for=1.0), published(1.2, "B", "tb")],
        events=[*run("ta", "A", 0.2, seconds=3.0), *run("tb", "B", 1.5)],
    )
    assert check(trace) == []


def test_start_policy_ends_at_the_prerun() -> None:
    """A ``start`` lock may end once the claim may have run: after task_prerun."""
    trace = Trace(
        calls=[published(0.0, "A", "ta", until="start"), published(1.05, "B", "tb")],
        events=[*run("ta", "A", 1.0, seconds=2.0), *run("tb", "B", 1.5)],
    )
    assert check(trace) == []
    early = Trace(calls=[trace.calls[0], published(0.5, "B", "tb")], events=trace.events)
    assert kinds(early) == [Kind.DUPLICATE]


def test_replace_takes_over_but_the_replaced_message_must_not_run() -> None:
    replaced = Trace(
        calls=[published(0.0, "A", "ta"), published(0.5, "B", "tb", replace=True)],
        events=[*run("ta", "A", 1.0), *run("tb", "B", 2.0)],
    )
    assert kinds(replaced) == [Kind.DUPLICATE]
    assert "A (try 0) ran while B" in check(replaced)[0].detail
    # A's start claim may have come before the take-over: it may run.
    claimed_before = Trace(
        calls=replaced.calls,
        events=[*run("ta", "A", 0.3, seconds=1.0), *run("tb", "B", 2.0)],
    )
    assert check(claimed_before) == []


def test_a_redelivered_copy_retakes_a_key_its_replacement_released() -> None:
    """A's worker died mid-run, A's lock expired, B found the key free and ran;
    A's redelivered copy then takes the key again for its run: no leak."""
    calls = [
        published(0.0, "A", "ta", unique_for=1.5),
        published(3.0, "B", "tb", replace=True, unique_for=1.5),
    ]
    killed = [Event("prerun", "ta", "A", 0.2), Event("start", "ta", "A", 0.21)]
    seen = scan(3.6, ("ta", "A", 5.0))
    again = Trace(
        calls=calls, events=[*killed, *run("tb", "B", 3.1, 0.1), *run("ta", "A", 3.5)],
        scans=[seen],
    )
    assert check(again) == []
    # Without a start after B's call, A's lock had to be gone by B's publish.
    no_run = Trace(calls=calls, events=[*killed, *run("tb", "B", 3.1, 0.1)], scans=[seen])
    assert Kind.LEAK in kinds(no_run)


def test_a_keep_last_follow_up_must_not_run_beside_the_run_it_follows() -> None:
    """The follow-up takes the lock over while A runs; its body must wait for A's end."""
    calls = [
        published(0.0, "A", "ta", keep_last=True),
        published(0.5, "B", "tb", replace=True, keep_last=True),
    ]
    after = Trace(calls=calls, events=[*run("ta", "A", 0.2, seconds=1.0), *run("tb", "B", 1.5)])
    assert check(after) == []
    beside = Trace(calls=calls, events=[*run("ta", "A", 0.2, seconds=1.0), *run("tb", "B", 0.7)])
    assert kinds(beside) == [Kind.OVERLAP]
    assert "B started" in check(beside)[0].detail
    # Without keep_last (a replace), overlapping runs are not this check's business.
    plain = [replace(c, keep_last=False) for c in calls]
    assert check(Trace(calls=plain, events=beside.events)) == []


def test_a_follow_up_waiting_for_the_run_gate_keeps_its_lock_alive() -> None:
    """A gate deferral extends the follow-up's lock: seen past its first TTL, no leak."""
    call = published(
        0.0, "B", "tb", until="expiry", unique_for=1.0, replace=True, keep_last=True
    )
    wait = Event("skipped", "tb", "B", 0.5, outcome="deferred: the previous run of its key is "
                 "in progress", pid=2)
    seen = scan(1.2, ("tb", "B", 2.4))
    events = [Event("prerun", "tb", "B", 0.49, pid=2), wait,
              Event("postrun", "tb", "B", 0.51, outcome="IGNORED", pid=2), *run("tb", "B", 2.0)]
    assert check(Trace(calls=[call], events=events, scans=[seen])) == []
    plain = replace(call, keep_last=False)
    assert kinds(Trace(calls=[plain], events=events, scans=[seen])) == [Kind.LEAK]


def test_a_gate_deferral_extends_the_lock_by_its_doubled_countdown() -> None:
    """The third gate deferral of an attempt may wait four first steps (the backoff
    doubles): the lock it extends that far is no leak; one step further is."""
    call = published(
        0.0, "B", "tb", until="expiry", unique_for=1.0, replace=True, keep_last=True
    )
    reason = "deferred: the previous run of its key is in progress"
    waits = [Event("skipped", "tb", "B", t, outcome=reason, pid=2) for t in (0.5, 1.0, 2.0)]
    events = [*waits, *run("tb", "B", 8.0)]
    within = scan(2.5, ("tb", "B", 2.0 + 4 * WAIT + 1.0))
    assert check(Trace(calls=[call], events=events, scans=[within])) == []
    beyond = scan(2.5, ("tb", "B", 2.0 + 5 * WAIT + 1.0 + 0.5))
    assert kinds(Trace(calls=[call], events=events, scans=[beyond])) == [Kind.LEAK]


def test_a_suppression_after_the_release_is_stale() -> None:
    base: dict[str, Any] = {"events": run("ta", "A", 1.0)}
    stale = Trace(calls=[published(0.0, "A", "ta"), suppressed(2.0, "A")], **base)
    assert kinds(stale) == [Kind.STALE]
    # Within the margin of the postrun record: the release may be that late.
    close = Trace(calls=[published(0.0, "A", "ta"), suppressed(1.53, "A")], **base)
    assert check(close) == []
    unknown = Trace(calls=[published(0.0, "A", "ta"), suppressed(0.5, "Z")], **base)
    assert kinds(unknown) == [Kind.STALE]


def test_a_lock_seen_after_its_release_or_past_its_ttl_leaks() -> None:
    calls = [published(0.0, "A", "ta", unique_for=10.0)]
    released = Trace(calls=calls, events=run("ta", "A", 1.0), scans=[scan(2.0, ("ta", "A", 9.0))])
    assert kinds(released) == [Kind.LEAK]
    too_long = Trace(calls=calls, events=[], scans=[scan(0.5, ("ta", "A", 12.0))])
    assert kinds(too_long) == [Kind.LEAK, Kind.LOST]
    stranger = Trace(calls=calls, events=run("ta", "A", 1.0), scans=[scan(0.5, ("zz", "Z", 5.0))])
    assert Kind.LEAK in kinds(stranger)


def test_a_retry_extends_the_ttl_bound() -> None:
    """Retrying with a countdown extends the lock: seeing it later is no leak."""
    events = [
        *run("ta", "A", 0.2, seconds=0.1, outcome="retry", countdown=5.0),
        *run("ta", "A", 5.5, retries=1),
    ]
    trace = Trace(
        calls=[published(0.0, "A", "ta", unique_for=1.0)],
        events=events,
        scans=[scan(3.0, ("ta", "A", 6.0))],
    )
    assert check(trace) == []
    (holding,) = holdings(trace)
    # The retry's start claim may retake the key for unique_for more.
    assert holding.expires_by == pytest.approx(5.51 + 1.0)
    no_retry = Trace(calls=trace.calls, events=run("ta", "A", 0.2), scans=trace.scans)
    assert kinds(no_retry) == [Kind.LEAK]


def test_a_lock_that_had_to_be_held_but_is_absent_is_missing() -> None:
    throttle = Trace(
        calls=[published(0.0, "A", "ta", until="expiry")],
        events=run("ta", "A", 0.5),
        scans=[scan(3.0)],
    )
    assert kinds(throttle) == [Kind.MISSING]
    # success keeps its lock after a final failure; finish releases it.
    failed = run("ta", "A", 0.5, outcome="failure")
    kept = Trace(calls=[published(0.0, "A", "ta")], events=failed, scans=[scan(3.0)])
    assert kinds(kept) == [Kind.MISSING]
    done = Trace(
        calls=[published(0.0, "A", "ta", until="finish")], events=failed, scans=[scan(3.0)]
    )
    assert check(done) == []


def test_a_message_without_a_final_state_is_lost_unless_revoked() -> None:
    calls = [published(0.0, "A", "ta")]
    retried = run("ta", "A", 0.5, outcome="retry", countdown=1.0)
    assert kinds(Trace(calls=calls, events=retried)) == [Kind.LOST]
    revoke = Revoke(KEY, "A", 0.2, 0.21, "released")
    assert check(Trace(calls=calls, revokes=[revoke])) == []
    skipped = [Event("skipped", "ta", "A", 1.0, outcome="revoked")]
    assert check(Trace(calls=calls, events=skipped)) == []


def test_a_released_revoke_must_keep_the_body_from_running() -> None:
    revoke = Revoke(KEY, "A", 0.2, 0.21, "released")
    ran = Trace(calls=[published(0.0, "A", "ta")], revokes=[revoke], events=run("ta", "A", 1.0))
    assert kinds(ran) == [Kind.REVOKED_RAN]
    running = Revoke(KEY, "A", 0.2, 0.21, "running")
    trace = Trace(calls=[published(0.0, "A", "ta")], revokes=[running], events=run("ta", "A", 0.1))
    assert check(trace) == []


def test_a_revoke_lets_the_lock_go_early() -> None:
    """After a revoke, a new publish is no duplicate, and no longer lost."""
    revoke = Revoke(KEY, "A", 0.2, 0.21, "released")
    trace = Trace(
        calls=[published(0.0, "A", "ta"), published(0.3, "B", "tb")],
        revokes=[revoke],
        events=[*run("tb", "B", 0.5), Event("skipped", "ta", "A", 1.0, outcome="revoked")],
        scans=[scan(0.25)],
    )
    assert check(trace) == []


def test_a_try_run_again_after_it_completed_is_a_duplicate() -> None:
    once = run("ta", "A", 0.5, pid=1)
    again = [e for e in run("ta", "A", 2.0, pid=2) if e.kind != "prerun"]
    trace = Trace(calls=[published(0.0, "A", "ta")], events=[*once, *again])
    assert kinds(trace) == [Kind.DUPLICATE]
    # A run killed before its end may be delivered again.
    killed = [e for e in once if e.kind in ("prerun", "start")]
    redelivered = Trace(calls=[published(0.0, "A", "ta")], events=[*killed, *again])
    assert check(redelivered) == []


def test_a_failed_publish_holds_nothing() -> None:
    """The lock of a publish that raised must be gone when the error surfaces."""
    failed = Call(KEY, "success", 10.0, 0.0, 0.2, "failed", "A", token="ta")
    assert check(Trace(calls=[failed, published(0.3, "B", "tb")], events=run("tb", "B", 1.0))) == []
    leaked = Trace(calls=[failed], scans=[scan(0.5, ("ta", "A", 9.0))])
    assert kinds(leaked) == [Kind.LEAK]
    # The broker enqueued it after all: its start claim retook the free key.
    late_run = run("ta", "A", 1.0, seconds=1.0)
    arrived = Trace(calls=[failed], events=late_run, scans=[scan(1.5, ("ta", "A", 11.0))])
    assert check(arrived) == []


def test_other_keys_never_interact() -> None:
    trace = Trace(
        calls=[published(0.0, "A", "ta"), published(0.5, "B", "tb", key=OTHER)],
        events=[*run("ta", "A", 1.0), *run("tb", "B", 1.0)],
    )
    assert check(trace) == []


def test_a_trace_survives_json() -> None:
    trace = Trace(
        calls=[published(0.0, "A", "ta"), suppressed(0.5, "A")],
        revokes=[Revoke(KEY, "A", 0.2, 0.21, "running")],
        events=run("ta", "A", 1.0),
        scans=[scan(0.7, ("ta", "A", 10.0))],
    )
    assert Trace.from_json(trace.to_json()) == trace


def test_a_start_lock_is_taken_again_by_a_retry() -> None:
    """``start`` releases at the claim, but a retry publish locks its queued retry."""
    events = [
        *run("ta", "A", 0.2, seconds=0.1, outcome="retry", countdown=1.0),
        *run("ta", "A", 1.5, retries=1),
    ]
    calls = [published(0.0, "A", "ta", until="start", unique_for=1.0)]
    trace = Trace(
        calls=[*calls, suppressed(0.9, "A", until="start")],
        events=events,
        scans=[scan(0.8, ("ta", "A", 2.3))],
    )
    assert check(trace) == []
    late = Trace(calls=[*calls, suppressed(2.0, "A", until="start")], events=events)
    assert kinds(late) == [Kind.STALE]


def test_a_message_dropped_without_a_cause_of_its_own_is_lost() -> None:
    """A worker discarding a message as revoked needs its revoke, expiry or replace."""
    dropped = Event("revoked", "tb", "A", 2.0, outcome="revoked")
    calls = [published(0.0, "A", "ta", expires_at=-1.0), published(1.0, "A", "tb")]
    expired = Event("revoked", "ta", "A", 0.5, outcome="expired")
    trace = Trace(calls=calls, events=[expired, dropped])
    assert kinds(trace) == [Kind.LOST]
    assert "discarded by a worker as revoked" in check(trace)[0].detail
    revoke = Revoke(KEY, "A", 1.5, 1.6, "released")
    revoked = Trace(calls=calls, events=[expired, dropped], revokes=[revoke])
    assert check(revoked) == []
    replaced = Trace(
        calls=[published(0.0, "A", "ta"), published(0.5, "B", "tb", replace=True)],
        events=[Event("revoked", "ta", "A", 1.0), *run("tb", "B", 1.2)],
    )
    assert check(replaced) == []


def test_a_revoke_that_released_a_queued_retry_forbids_only_later_tries() -> None:
    retried = run("ta", "A", 0.1, seconds=0.1, outcome="retry", countdown=1.0)
    revoke = Revoke(KEY, "A", 0.5, 0.51, "released")
    skipped = Event("skipped", "ta", "A", 1.3, retries=1, outcome="revoked")
    calls = [published(0.0, "A", "ta")]
    assert check(Trace(calls=calls, revokes=[revoke], events=[*retried, skipped])) == []
    ran = Trace(calls=calls, revokes=[revoke], events=[*retried, *run("ta", "A", 1.3, retries=1)])
    assert kinds(ran) == [Kind.REVOKED_RAN]


def test_ttl_slack_allows_a_coarse_store_to_keep_a_lock_longer() -> None:
    """memcached keeps a lock up to ~4 s past its TTL; the lower bound is not relaxed."""
    calls = [published(0.0, "A", "ta", until="expiry", unique_for=1.0)]
    late = Trace(calls=calls, events=run("ta", "A", 0.2), scans=[scan(3.0, ("ta", "A", 4.0))])
    assert kinds(late) == [Kind.LEAK]
    assert check(late, ttl_slack=4.0) == []
    early = Trace(calls=calls, events=run("ta", "A", 0.2), scans=[scan(0.5)])
    assert kinds(early) == [Kind.MISSING]
    assert [f.kind for f in check(early, ttl_slack=4.0)] == [Kind.MISSING]


def copy(tok: str, tid: str, t: float, reason: str, pid: int = 2) -> list[Event]:
    """A redelivered copy refused by its run record: prerun, skip, IGNORED postrun."""
    common: dict[str, Any] = {"token": tok, "task_id": tid, "pid": pid}
    return [
        Event("prerun", t=t, **common),
        Event("skipped", t=t + 0.01, outcome=reason, **common),
        Event("postrun", t=t + 0.02, outcome="IGNORED", **common),
    ]


def test_redelivered_copies_refused_by_their_run_record_end_nothing() -> None:
    """A copy deferred before the body starts, and one skipped after a failure, end nothing.

    Under ``success`` a failed run keeps its lock for its TTL: the copies'
    IGNORED postruns must not be taken for the message's end (a lock seen
    afterwards is no leak, a body starting after the deferral no duplicate).
    """
    trace = Trace(
        calls=[published(0.0, "A", "ta")],
        events=sorted(
            [
                *copy("ta", "A", 0.9, "deferred: a copy of it is running"),
                *run("ta", "A", 1.0, outcome="failure"),
                *copy("ta", "A", 2.0, "already ran"),
            ],
            key=lambda e: e.t,
        ),
        scans=[scan(3.0, ("ta", "A", 10.0))],
    )
    assert check(trace) == []


def test_a_copy_that_runs_the_body_again_is_still_a_duplicate() -> None:
    """Only refused copies are set aside: a second body run after the first ended is reported."""
    trace = Trace(
        calls=[published(0.0, "A", "ta")],
        events=[*run("ta", "A", 1.0), *run("ta", "A", 3.0, pid=2)],
    )
    assert Kind.DUPLICATE in kinds(trace)


# -- cancel_running and capped debounce ----------------------------------------


def cancelling(t0: float, tid: str, tok: str, seconds: float = 0.01, **kw: Any) -> Call:
    """A ``cancel_running`` call in [t0, t0 + seconds] (it waited for a running holder)."""
    call = published(t0, tid, tok, replace=True, cancel=True, seq=tid, **kw)
    return replace(call, t1=t0 + seconds)


def capped(t0: float, tid: str, tok: str, countdown: float = 1.0, **kw: Any) -> Call:
    """A ``replace`` call with a ``countdown`` capped by ``debounce_max_wait=1``."""
    return published(t0, tid, tok, replace=True, max_wait=1.0, countdown=countdown, seq=tid, **kw)


def seq_run(tok: str, tid: str, t: float, seq: str = "", **kw: Any) -> list[Event]:
    """``run`` with the body's records naming the call ``seq`` (``tid`` by default)."""
    return [
        replace(e, seq=seq or tid) if e.kind in ("start", "end") else e
        for e in run(tok, tid, t, **kw)
    ]


def interrupted(tok: str, tid: str, t: float, cut: float, end: float) -> list[Event]:
    """A run started at ``t``, terminated at ``cut`` (worker: revoked), cleaned up by ``end``."""
    common: dict[str, Any] = {"token": tok, "task_id": tid, "pid": 1}
    return [
        Event("prerun", t=t, **common),
        Event("start", t=t + 0.01, seq=tid, **common),
        Event("revoked", t=cut, outcome="revoked", **{**common, "pid": 9}),
        Event("end", t=end, outcome="interrupted", seq=tid, **common),
        Event("postrun", t=end + 0.01, outcome="FAILURE", **common),
    ]


def test_a_cancelled_run_ends_beside_the_run_of_its_canceller() -> None:
    """B cancels A's running body; B's run starts while A's cleanup still runs: allowed."""
    trace = Trace(
        calls=[cancelling(0.0, "A", "ta"), cancelling(1.2, "B", "tb", seconds=0.2)],
        events=sorted(
            [*interrupted("ta", "A", 1.0, cut=1.3, end=1.6), *seq_run("tb", "B", 1.5)],
            key=lambda e: e.t,
        ),
        scans=[scan(1.25, ("ta", "A", 10.0)), scan(1.45, ("tb", "B", 11.4))],
    )
    assert check(trace) == []


def test_an_overlap_of_cancel_running_runs_is_reported_outside_the_cleanup() -> None:
    """A run beside one nobody interrupted, or one interrupted only after it started."""
    calls = [cancelling(0.0, "A", "ta"), cancelling(1.2, "B", "tb", seconds=0.2)]
    beside = Trace(
        calls=calls, events=[*seq_run("ta", "A", 1.0, seconds=1.0), *seq_run("tb", "B", 1.5)]
    )
    assert kinds(beside) == [Kind.CANCEL_OVERLAP]
    # B's run started long before A's worker terminated it (for C).
    before = Trace(
        calls=[calls[0], calls[1], cancelling(2.3, "C", "tc", seconds=0.2)],
        events=[
            *interrupted("ta", "A", 1.0, cut=2.5, end=2.6),
            *seq_run("tb", "B", 1.5, seconds=1.0),
            *seq_run("tc", "C", 2.7),
        ],
    )
    assert kinds(before) == [Kind.CANCEL_OVERLAP]


def test_a_cancelled_call_must_be_covered_by_a_later_call() -> None:
    """A's run was terminated; nothing came after it: A's work was lost."""
    trace = Trace(
        calls=[cancelling(0.0, "A", "ta")],
        events=interrupted("ta", "A", 1.0, cut=1.3, end=1.35),
    )
    assert kinds(trace) == [Kind.UNCOVERED]
    # The canceller's own run covers A, unless that run was terminated in turn.
    canceller = cancelling(1.2, "B", "tb", seconds=0.2)
    covered = Trace(
        calls=[trace.calls[0], canceller],
        events=[*trace.events, *seq_run("tb", "B", 1.5)],
    )
    assert check(covered) == []
    cut_too = Trace(
        calls=[trace.calls[0], canceller],
        events=[*trace.events, *interrupted("tb", "B", 1.5, cut=1.7, end=1.75)],
    )
    assert kinds(cut_too) == [Kind.UNCOVERED]


def test_a_cancel_timeout_is_a_refusal_and_lets_the_holders_lock_go() -> None:
    """Nothing published, no lock; the terminated holder's lock may be gone early (no missing
    lock) and its work was refused to a caller (not uncovered)."""
    timeout = replace(
        cancelling(1.2, "", "", seconds=5.0), outcome="cancel_timeout", token="", task_id=""
    )
    trace = Trace(
        calls=[cancelling(0.0, "A", "ta"), timeout],
        events=interrupted("ta", "A", 1.0, cut=1.3, end=1.35),
        scans=[scan(2.0)],
    )
    assert check(trace) == []


def test_a_capped_debounce_runs_its_last_call_within_the_cap() -> None:
    """Two calls, one run with the last one's arguments, on time; late or wrong: reported."""
    calls = [capped(0.0, "A", "ta"), capped(0.3, "B", "tb")]
    replaced = [
        Event("prerun", "ta", "A", 1.0, pid=2),
        Event("skipped", "ta", "A", 1.01, outcome="replaced", pid=2),
        Event("postrun", "ta", "A", 1.02, outcome="IGNORED", pid=2),
    ]
    on_time = Trace(calls=calls, events=[*replaced, *seq_run("tb", "B", 1.2)])
    assert check(on_time) == []
    late = Trace(calls=calls, events=[*replaced, *seq_run("tb", "B", 6.0)])
    assert kinds(late) == [Kind.LATE]
    # A revoke during the burst may have dropped its run: nothing certain.
    dropped = replace(late, revokes=[Revoke(KEY, "B", 0.5, 0.51, "not_held")])
    assert check(dropped) == []
    wrong_args = Trace(calls=calls, events=[*replaced, *seq_run("tb", "B", 1.2, seq="A")])
    assert kinds(wrong_args) == [Kind.UNCOVERED]


def test_a_capped_calls_guessed_token_is_seen_only_during_the_call() -> None:
    """The re-keyed take-over: a lock under a burst token nobody published, seen while a
    capped call ran, is its guess; seen at any other time, a leak."""
    guess = owner_token(0.0)
    call = replace(capped(0.0, "A", "ta"), t1=0.2)
    during = Trace(
        calls=[call],
        events=seq_run("ta", "A", 1.2),
        scans=[scan(0.1, (guess, "A", 10.0))],
    )
    assert check(during) == []
    after = replace(during, scans=[scan(3.0, (guess, "A", 10.0))])
    assert kinds(after) == [Kind.LEAK]


def fenced(events: list[Event], fence: int) -> list[Event]:
    """``events`` (a ``run``) with ``fence`` on its body's events."""
    return [replace(e, fence=fence) if e.kind in ("start", "end") else e for e in events]


def test_growing_fences_have_no_finding() -> None:
    """Each run of the key started after the one before it: greater tokens, nothing to report."""
    trace = Trace(
        calls=[published(0.0, "A", "ta"), published(2.0, "B", "tb")],
        events=[*fenced(run("ta", "A", 1.0), 5), *fenced(run("tb", "B", 2.5), 9)],
    )
    assert check(trace) == []


@pytest.mark.parametrize("later", [5, 4])
def test_a_fence_not_above_an_earlier_runs_is_reported(later: int) -> None:
    """A run whose claim began after another run of its key started needs a greater token."""
    trace = Trace(
        calls=[published(0.0, "A", "ta"), published(2.0, "B", "tb")],
        events=[*fenced(run("ta", "A", 1.0), 5), *fenced(run("tb", "B", 2.5), later)],
    )
    assert Kind.FENCE in kinds(trace)


def test_runs_claiming_together_may_get_their_tokens_in_either_order() -> None:
    """Two runs of a key started in the same instant (within the margin): no order is judged."""
    trace = Trace(
        calls=[published(0.0, "A", "ta"), published(0.0, "B", "tb", until="start")],
        events=[*fenced(run("ta", "A", 1.0), 9), *fenced(run("tb", "B", 1.0, pid=2), 5)],
    )
    assert Kind.FENCE not in kinds(trace)


def limited(events: list[Event], slots: int) -> list[Event]:
    """``events`` (a ``run``) whose call drew a ``concurrency_limit`` of ``slots``."""
    return [replace(e, slots=slots) if e.kind == "start" else e for e in events]


@pytest.mark.parametrize(("slots", "found"), [(1, True), (2, False)])
def test_a_run_started_beside_as_many_as_its_limit_is_reported(slots: int, found: bool) -> None:
    """Under ``"start"`` two runs of a key may overlap; a run whose call drew a limit of 1
    may not start while another certainly runs, one that drew 2 may."""
    trace = Trace(
        calls=[published(0.0, "A", "ta", until="start"), published(1.5, "B", "tb", until="start")],
        events=[*run("ta", "A", 1.0, seconds=2.0), *limited(run("tb", "B", 2.0, pid=2), slots)],
    )
    assert (Kind.SLOTS in kinds(trace)) is found


def test_a_run_after_the_other_ended_is_within_its_limit() -> None:
    trace = Trace(
        calls=[published(0.0, "A", "ta", until="start"), published(1.5, "B", "tb", until="start")],
        events=[*run("ta", "A", 1.0), *limited(run("tb", "B", 2.0, pid=2), 1)],
    )
    assert Kind.SLOTS not in kinds(trace)


def observed(t0: float, tid: str) -> Call:
    """A call ``dedup_mode="observe"`` published anyway (no lock) in [t0, t0 + 0.01]."""
    return Call(
        key=KEY, until="success", unique_for=10.0, t0=t0, t1=t0 + 0.01,
        outcome="observed", task_id=tid, observe=True,
    )


def test_an_observed_call_runs_beside_the_holder() -> None:
    """Published anyway while A holds the key: its run (under no lock) is no duplicate."""
    trace = Trace(
        calls=[published(0.0, "A", "ta", observe=True), observed(0.5, "B")],
        events=[*run("ta", "A", 1.0), *run("guard:B", "B", 1.1)],
    )
    assert check(trace) == []


def test_an_observed_call_that_never_ran_is_reported() -> None:
    """Published anyway, its message must run to its end (unless revoked)."""
    trace = Trace(
        calls=[published(0.0, "A", "ta", observe=True), observed(0.5, "B")],
        events=[*run("ta", "A", 1.0)],
    )
    assert kinds(trace) == [Kind.OBSERVED]
    revoked = replace(trace, revokes=[Revoke(KEY, "B", 0.6, 0.61, "revoked")])
    assert check(revoked) == []


def test_a_drain_waits_for_an_observed_call_until_it_ran_to_its_end() -> None:
    """A drain (``probe.waited_for``) waits for a call observe published anyway as for a
    published one: until its message ran to a final state, not only until it started."""
    trace = Trace(
        calls=[published(0.0, "A", "ta", observe=True), observed(0.5, "B")],
        events=[*run("ta", "A", 1.0)],
    )
    assert [h.call.task_id for h in waited_for(trace)] == ["B"]
    ran = replace(trace, events=[*trace.events, *run("guard:B", "B", 1.1)])
    assert waited_for(ran) == []


def test_an_observing_message_may_run_while_a_newer_call_holds_its_key() -> None:
    """Its lock lapsed and B took the key: the worker runs A anyway (observe), not a duplicate;
    without observe the same trace is one."""
    a = published(0.0, "A", "ta", unique_for=0.5, observe=True)
    b = published(1.0, "B", "tb", observe=True)
    events = [*run("tb", "B", 1.2, seconds=2.0), *run("ta", "A", 1.5)]
    assert check(Trace(calls=[a, b], events=events)) == []
    enforced = [replace(a, observe=False), replace(b, observe=False)]
    assert Kind.DUPLICATE in kinds(Trace(calls=enforced, events=events))


def span(
    name: str, message: str, outcome: str, pid: int = 1, t: float = 0.005, **attributes: Any
) -> SpanRecord:
    """A recorded span of a traced process saying ``outcome`` about ``message``, ended at ``t``
    (within a call made at 0.0, as ``published`` and ``suppressed`` make them)."""
    return SpanRecord(
        name=name, message_id=message, pid=pid, t=t,
        attributes={"outcome": outcome, "key_digest": KEY.rsplit(":", 1)[-1], **attributes},
    )  # fmt: skip


def skip_span(message: str, reason: str, pid: int = 1) -> SpanRecord:
    """A worker's run span of ``message`` carrying a skip event."""
    event = "celery_dedup.deferred" if reason.startswith("deferred") else "celery_dedup.skipped"
    record = span("run/rel.work", message, event.rsplit(".", 1)[-1], pid, reason=reason)
    return replace(record, events=[{"name": event, "attributes": {"reason": reason}}])


def test_spans_that_agree_with_the_trace_have_no_finding() -> None:
    """A traced publish, its traced duplicate and a traced skip, each with its span."""
    first = published(0.0, "A", "ta", traced=True)
    again = replace(suppressed(0.1, "A"), traced=True)
    skipped = Event("skipped", "guard:C", "C", 0.3, outcome="held by another publish",
                    pid=1, traced=True)  # fmt: skip
    trace = Trace(
        calls=[first, again],
        events=[*run("ta", "A", 1.0), skipped],
        spans=[
            span("apply_async/rel.work", "A", "published"),
            span("apply_async/rel.work", "", "duplicate", t=0.105, holder_id="A"),
            skip_span("C", "held by another publish"),
        ],
    )
    assert Kind.SPAN not in kinds(trace)


def test_each_traced_call_takes_the_span_made_during_it() -> None:
    """Calls answered alike (duplicates of one holder, one deterministic id published
    twice) take the span that ended during each; an untraced process's call takes none."""
    first = published(0.0, "A", "ta", traced=True)
    again = published(1.0, "A", "tb", traced=True)  # (the same id, published again)
    untraced, traced = suppressed(0.5, "A"), replace(suppressed(0.6, "A"), traced=True)
    trace = Trace(
        calls=[first, untraced, again, traced],
        events=[*run("ta", "A", 0.2, 0.1), *run("tb", "A", 1.2, 0.1)],
        spans=[
            span("apply_async/rel.work", "A", "published"),
            span("apply_async/rel.work", "A", "published", t=1.005),
            span("apply_async/rel.work", "", "duplicate", t=0.605, holder_id="A"),
        ],
    )
    assert Kind.SPAN not in kinds(trace)
    late = replace(trace, spans=[*trace.spans[:2], replace(trace.spans[2], t=0.505)])
    assert Kind.SPAN in kinds(late)  # the traced call's span is not the untraced call's


@pytest.mark.parametrize("disagreement", ["says duplicate", "no span", "other reason",
                                          "skip never happened", "published a refusal",
                                          "skip without its span"])
def test_a_disagreeing_span_is_found(disagreement: str) -> None:
    """A span that says another outcome, a traced call or skip without one, a span
    claiming a skip or a publish nobody recorded: each is a finding."""
    first = published(0.0, "A", "ta", traced=True)
    skipped = Event("skipped", "guard:C", "C", 0.3, outcome="held by another publish",
                    pid=1, traced=True)  # fmt: skip
    calls, events = [first], [*run("ta", "A", 1.0), skipped]
    spans = [span("apply_async/rel.work", "A", "published"),
             skip_span("C", "held by another publish")]  # fmt: skip
    if disagreement == "says duplicate":
        spans[0] = span("apply_async/rel.work", "A", "duplicate", holder_id="A")
    elif disagreement == "no span":
        spans = spans[1:]
    elif disagreement == "other reason":
        spans[1] = skip_span("C", "already ran")
    elif disagreement == "skip never happened":
        spans.append(skip_span("D", "revoked"))
    elif disagreement == "skip without its span":  # its run ended: the span was exported
        events.append(Event("postrun", "guard:C", "C", 0.35, outcome="IGNORED", pid=1,
                            traced=True))  # fmt: skip
        spans = spans[:1]
    else:  # a span says published of a message no call published (it was refused)
        spans.append(span("apply_async/rel.work", "E", "published"))
    findings = [f for f in check(Trace(calls=calls, events=events, spans=spans))
                if f.kind is Kind.SPAN]  # fmt: skip
    assert findings, disagreement


def test_a_skip_in_a_process_killed_before_its_run_ended_needs_no_span() -> None:
    """A run span is exported when the run ends: a traced skip with no ``postrun``
    after it in its process (killed there, the crash soak) is not judged."""
    first = published(0.0, "A", "ta", traced=True)
    skipped = Event("skipped", "guard:C", "C", 0.3, outcome="revoked", pid=1, traced=True)
    trace = Trace(calls=[first], events=[*run("ta", "A", 1.0), skipped],
                  spans=[span("apply_async/rel.work", "A", "published")])  # fmt: skip
    assert Kind.SPAN not in kinds(trace)
    ended = Event("postrun", "guard:C", "C", 0.35, outcome="IGNORED", pid=1, traced=True)
    trace.events.append(ended)
    assert Kind.SPAN in kinds(trace)
