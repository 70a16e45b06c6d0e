"""Worker-side lock handling: the start claim, release per outcome, revokes and retries.

Runs in pool children (the envelope around the body, ``envelope``) and in the worker's main
process (``task_revoked``, hard time limits, the ``dedup_terminate`` control
command). Ownership is the publish's owner token from the ``celery_dedup``
header, never the task id, so two runs sharing a task id (deterministic ids,
forged ids) never release or skip each other. Every release is
owner-checked and idempotent; store clients are per process (redis-py pools
reset themselves after a fork, the SQL store disposes its engine), so
nothing here shares a connection across a fork.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, NoReturn, cast

from celery import states
from celery.exceptions import Ignore, Retry, TimeLimitExceeded, WorkerLostError
from celery.signals import task_received, task_revoked
from celery.utils.imports import symbol_by_name
from celery.worker.control import control_command
from celery.worker.request import Request
from kombu.serialization import registry  # type: ignore[attr-defined]

from . import backoff, coalesce, handoff, incarnation, leases, lost_results, observed, requeue, runs
from .exceptions import MalformedHeader, StoreContention, StoreError, StoreUnavailable
from .fence import FENCE_FIELD
from .header import HEADER, MAX_TOKEN, LockHeader, new_token, read_header
from .identity import bound_queue, deterministic_task_id
from .lifecycle import DedupTaskLike, Held, Outcome, meta_for
from .options import DedupMode, Fallback
from .policy import KEEPS_ON_FAILURE, UniqueUntil, lock_ttl
from .signals import lock_acquired, lock_released, task_skipped
from .stores.base import (
    OUTCOME_FIELD,
    Claim,
    ClaimOutcome,
    Lock,
    LockMeta,
    LockStore,
    RunOutcome,
    RunRef,
)

__all__ = [
    "GUARD_PREFIX",
    "Held",
    "Outcome",
    "claim_at_start",
    "end_unclaimed",
    "finish",
    "release",
    "republish_as_holder",
]

logger = logging.getLogger("celery_dedup")

#: Owner tokens of locks the worker took for messages without a header.
GUARD_PREFIX = "guard:"

# Requests the worker's main process has received, by task id (several runs
# share an id under deterministic ids). A hard time limit calls on_failure in
# the main process, where task.request is empty; this is how that call finds
# the running message's header. Weak: no leak.
_received: dict[str, weakref.WeakSet[Any]] = {}

# Owner tokens whose body started in this thread (eager calls only): an eager
# publish that raises before its body ran releases the lock it took.
_eager = threading.local()


def short(key: str) -> str:
    """A key as logged: its digest's first 16 hex digits, never raw material."""
    return key.rsplit(":", 1)[-1][:16]


def release(
    task: DedupTaskLike,
    store: LockStore,
    key: str,
    owner: str,
    task_id: str,
    reason: str,
) -> bool:
    """Owner-checked release; a store outage is logged, never raised (the TTL bounds it)."""
    try:
        released = store.release(key, owner)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not release lock %s of %s[%s] (%s): "
            "released as soon as the store answers",
            short(key),
            task.name,
            task_id,
            exc,
        )
        runtime = task.dedup_config().runtime
        runtime.add_orphan(key, owner, runtime.settings.revoked_ttl)
        return False
    if released:
        _count_release(task, key, task_id, reason)
    return released


def _count_release(task: DedupTaskLike, key: str, task_id: str, reason: str) -> None:
    task.dedup_config().runtime.metrics.incr(task.name, "released")
    if lock_released.receivers:
        lock_released.send(sender=task, key=key, task_id=task_id, reason=reason)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "celery-dedup: released %s of %s[%s] (%s)", short(key), task.name, task_id, reason
        )


def republish_as_holder(
    task: DedupTaskLike,
    task_id: str,
    options: dict[str, Any],
    publish: Callable[[str, LockHeader], Any],
) -> Any:
    """A ``retry()``/``replace()`` by the holder: keep the lock, extend its TTL, publish.

    The TTL becomes the retry's delay plus ``unique_for``. If the lock
    expired meanwhile it is taken again; if another publish took it, the
    retry is published all the same (a retry is never dropped: its start
    claim then finds the other holder and skips, so the work runs once).
    """
    current = task.app.current_worker_task
    header = header_in(options.get("headers")) or (
        current.dedup_header(task_id)
        if current is not None and hasattr(current, "dedup_header")
        else None
    )
    if header is None or header.key is None:
        return publish(task_id, header or LockHeader())
    store = task.dedup_config().runtime.store
    if store is not None:
        owner = header.owner(task_id)
        ttl = lock_ttl(
            header.unique_for, countdown=options.get("countdown"), eta=options.get("eta")
        )
        try:
            # Queued again: not started, so a revoke meanwhile releases at once.
            # A replace-mode message that lost its lock may have been
            # replaced: its start claim decides, re-taking nothing here.
            if not store.settle(header.key, owner, ttl) and not header.replace:
                holder = store.acquire(
                    header.key, owner, ttl, meta_for(task, task_id, header.until)
                )
                if holder is not None and holder.owner != owner:
                    logger.warning(
                        "celery-dedup: %s[%s] retries after its lock %s passed to another task",
                        task.name,
                        task_id,
                        short(header.key),
                    )
        except StoreError as exc:
            logger.warning(
                "celery-dedup: could not extend lock %s on retry: %s", short(header.key), exc
            )
    return publish(task_id, header)


def _skip(task: DedupTaskLike, task_id: str, key: str, holder_id: str | None, reason: str) -> None:
    """End the task without running its body: IGNORED, or REVOKED for a revoked owner.

    No state is written under a task id another run shares (a deterministic
    id, or the holder's own id): it would overwrite that run's result.
    """
    logger.info(
        "celery-dedup: skipping %s[%s] (lock %s: %s)", task.name, task_id, short(key), reason
    )
    task.dedup_config().runtime.metrics.incr(task.name, "skipped")
    task_skipped.send(
        sender=task, key=key, task_id=task_id, existing_task_id=holder_id, reason=reason
    )
    request = task.request
    shared_id = task_id in (holder_id, deterministic_task_id(key))
    if not shared_id and (not request.is_eager or task.app.conf.task_store_eager_result):
        if reason == "revoked":
            task.backend.mark_as_revoked(task_id, "revoked by celery-dedup", request=request)
        else:
            task.update_state(
                task_id=task_id,
                state=states.IGNORED,
                meta={"skipped": reason, "deduplication_key": key, "holder": holder_id},
            )
    raise Ignore(f"celery-dedup: not run ({reason})")


def guard_header(
    task: DedupTaskLike,
    task_id: str,
    args: Any,
    kwargs: Any,
    queue: Any,
    serializer: str | None = None,
) -> LockHeader | None:
    """The header the worker runs a message without one under (``send_task``).

    The guard is a throttle: its lock lives ``unique_for`` from the first
    unannounced copy whatever the task's ``unique_until``, so copies that
    do not overlap in time (two beat instances firing the same slot) still
    run the work once. Its owner token is derived from the task id under a
    secret kept in the store, so a redelivery of the same message owns the
    lock it took and the main process can release it, while a message
    forging a header cannot guess it.
    """
    config = task.dedup_config()
    call = config.resolve({})
    try:
        key = task.dedup_key(args, kwargs, call, queue, serializer)
        token = guard_token(task, task_id)
    except Exception as exc:
        # Never drop a message for the guard's sake (an argument a key cannot
        # hold, a serializer's error, the store): it runs as a plain task would.
        logger.warning("celery-dedup: %s[%s] runs unguarded: %s", task.name, task_id, exc)
        return None
    if key is None:
        return None
    return LockHeader(key=key, until=UniqueUntil.EXPIRY, unique_for=config.unique_for, token=token)


def guard_header_of(task: DedupTaskLike, request: Any) -> LockHeader | None:
    """``guard_header`` of a received message: its queue and serializer as delivered."""
    args = getattr(request, "args", None) or ()
    kwargs = getattr(request, "kwargs", None) or {}
    queue = delivered_queue(task, getattr(request, "delivery_info", None) or {}, args, kwargs)
    content_type = getattr(request, "content_type", None)
    serializer = registry.type_to_name.get(content_type) if content_type else None
    return guard_header(task, str(request.id), args, kwargs, queue, serializer)


def delivered_queue(
    task: DedupTaskLike, delivery_info: Mapping[str, Any], args: Any, kwargs: Any
) -> str:
    """The queue a message was routed to, from its exchange and routing key.

    Under Celery's default direct routing the routing key is the queue
    name; on a topic exchange it is not, so the queue is looked up among
    the app's queues, and failing that the call is routed as a producer
    would route it.
    """
    exchange = delivery_info.get("exchange") or ""
    routing_key = delivery_info.get("routing_key")
    bound = bound_queue(task.app.amqp.queues.values(), exchange, routing_key)
    if bound is not None:
        return bound
    if not exchange and routing_key:
        return str(routing_key)
    return task.routed_queue({}, args, kwargs)


#: The guard secret's record: outside the lock namespace, so never listed.
_SECRET_SUFFIX = "-secret:guard"
_SECRET_TTL = 10 * 365 * 24 * 3600.0
_secrets: dict[int, str] = {}


def guard_token(task: DedupTaskLike, task_id: str) -> str:
    """The owner token of the guard lock of ``task_id``: an HMAC under the store's secret."""
    runtime = task.dedup_config().runtime
    store = runtime.store
    if store is None:
        raise StoreUnavailable("no lock store", store="none")
    secret = _secrets.get(id(store))
    if secret is None:
        mine = new_token()
        holder = store.acquire(
            runtime.settings.key_prefix + _SECRET_SUFFIX,
            mine,
            _SECRET_TTL,
            {"task_name": "", "policy": UniqueUntil.EXPIRY.value, "task_id": ""},
        )
        secret = _secrets[id(store)] = mine if holder is None else holder.owner
    digest = hmac.new(secret.encode(), task_id.encode(), hashlib.sha256).hexdigest()
    return GUARD_PREFIX + digest[:32]


def claim_at_start(
    task: DedupTaskLike, task_id: str, args: Any, kwargs: Any, request: Any = None
) -> Held | None:
    """The start check: one round trip that confirms this message still owns its lock.

    Returns what the run holds (released at its end per policy), or ``None``
    when it holds nothing; raises ``Ignore`` (after recording the state) when
    the body must not run: another publish holds the key (replaced, or the
    lock expired and a newer call took it) or this publish was revoked.
    ``request`` is the running request (``task.request`` when not given).
    """
    if request is None:
        request = task.request
    store = task.dedup_config().runtime.store
    if store is None:
        return None
    header = header_of(request) if request.id == task_id else task.dedup_header(task_id)
    if header is None:
        if request.is_eager:
            return None  # task.apply() and eager canvas members: never went through a broker
        header = _guard_of_running(task, request, task_id, args, kwargs)
        if header is None:
            return None
    key = header.key
    if key is None:
        return None
    owner, until = header.owner(task_id), header.until
    if request.is_eager:
        # apply_async took this lock in this thread a moment ago: no claim needed.
        _eager_started().add(owner)
        if until is UniqueUntil.START:
            release(task, store, key, owner, task_id, "start")
            return None
        return Held(store, header, key, owner, task_id)
    return _claim(task, request, store, header, task_id, args, kwargs)


def _claim(
    task: DedupTaskLike,
    request: Any,
    store: LockStore,
    header: LockHeader,
    task_id: str,
    args: Any,
    kwargs: Any,
) -> Held:
    """The start claim proper (``claim_at_start`` past its early exits)."""
    key = header.key
    assert key is not None
    owner, until = header.owner(task_id), header.until
    guarded = owner.startswith(GUARD_PREFIX)
    release_now = until is UniqueUntil.START
    retake = guarded or until is UniqueUntil.SUCCESS or until is UniqueUntil.FINISH
    fenced = task.dedup_config().fence
    run = _run_of(request, header, owner, fenced)
    meta = meta_for(task, task_id, until)
    ttl = header.unique_for if retake else None
    try:
        if run is None and fenced:
            fencing = cast(Any, store)  # FencedClaims: checked with the task's options
            claim = fencing.claim(key, owner, release=release_now, ttl=ttl, meta=meta, fence=True)
        elif run is None:
            claim = store.claim(key, owner, release=release_now, ttl=ttl, meta=meta)
        else:
            claim = _claim_run(task, request, store, run, meta, release_now, ttl, args, kwargs)
    except StoreError as exc:
        return _claim_failed(task, request, header, owner, task_id, args, kwargs, exc, run)
    except (Ignore, Retry):
        raise
    except Exception as exc:
        # An answer that cannot be read (a store of one's own, a proxy that
        # mangles a reply) is a store that did not answer: the fallback
        # decides, never the task's fate.
        logger.exception("celery-dedup: the start claim of %s[%s] failed", task.name, task_id)
        unreadable = StoreUnavailable(f"an unreadable answer ({exc!r})", type(store).__name__)
        return _claim_failed(task, request, header, owner, task_id, args, kwargs, unreadable, run)
    held = Held(store, header, key, owner, task_id, run=run, released=release_now)
    if claim.fence is not None:
        setattr(request, FENCE_FIELD, claim.fence)
    if claim.outcome is not ClaimOutcome.OWNED:
        try:
            _not_owned(task, store, header, owner, task_id, claim, retake)
        except (Ignore, Retry):
            _end_quietly(task, held, None)  # this attempt ends here: its copies end too
            raise
    if release_now and claim.outcome is ClaimOutcome.OWNED:
        _count_release(task, key, task_id, "start")
    if guarded:
        _remember_guard(request, header)
    return held


def _run_of(request: Any, header: LockHeader, owner: str, fenced: bool) -> RunRef | None:
    """This copy's run: it has one when its worker gave it a delivery token.

    A ``keep_last`` message always has one (its run gate needs an owner):
    without a token from its worker, a token of its own.
    """
    key = header.key
    assert key is not None
    token = getattr(request, runs.DELIVERY_FIELD, None)
    if not token and not header.last:
        return None
    inherits = str(getattr(request, runs.INHERITED_FIELD, None) or "")
    token = str(token or new_token())
    attempt = runs.attempt_of(request)
    return RunRef(key, owner, attempt, token, header.last, inherits, fenced=fenced)


def _claim_run(
    task: DedupTaskLike,
    request: Any,
    store: LockStore,
    run: RunRef,
    meta: Mapping[str, str],
    release_now: bool,
    ttl: float | None,
    args: Any,
    kwargs: Any,
) -> Claim:
    """Take this copy's running lease and its start claim; a copy of a running or
    completed attempt does not run (``Ignore``).
    """
    lease = task.dedup_config().runtime.settings.lease_ttl
    records = runs.records_of(store)
    outcome, claim = records.claim_run(
        run, runs.record_life(lease), meta, release=release_now, ttl=ttl
    )
    if outcome is RunOutcome.RUNNING:
        dead = _dead_lease(records, run)
        if dead is not None:
            # The run died with its worker process: this copy takes its lease
            # over at once (one copy only, atomically), not a record's life later.
            logger.info(
                "celery-dedup: %s[%s] takes over the lease of a run whose worker is gone",
                task.name,
                request.id,
            )
            run = replace(run, inherits=dead)
            outcome, claim = records.claim_run(
                run, runs.record_life(lease), meta, release=release_now, ttl=ttl
            )
    if outcome is RunOutcome.DONE:
        # The same publish ran to its end already: a copy the broker redelivered.
        # (Its result may have died with its worker: stored as ResultLost then.)
        lost_results.store_lost_result(task, str(request.id), records, run, request)
        _skip(task, request.id, run.key, request.id, "already ran")
    if outcome is RunOutcome.RUNNING:
        # A live lease is renewed every third of it: looking sooner is pointless.
        _defer(task, request, args, kwargs, run.key, "a copy of it is running", lease / 3.0)
    if outcome is RunOutcome.WAITING:
        _wait_for_gate(task, request, store, run, args, kwargs, lease)
    assert claim is not None
    return claim


def _dead_lease(records: Any, run: RunRef) -> str | None:
    """The token of the attempt's lease when the process renewing it is gone, else ``None``.

    One read more, on this path only (a copy finding its run's lease); a
    store that cannot say leaves the copy to wait for the lease to lapse.
    """
    try:
        token = records.lease_token(run)
    except StoreError:
        return None
    if not token or token == run.token or not incarnation.died(token):
        return None
    return str(token)


def _wait_for_gate(
    task: DedupTaskLike,
    request: Any,
    store: LockStore,
    run: RunRef,
    args: Any,
    kwargs: Any,
    lease: float,
) -> NoReturn:
    """``keep_last``: defer while the key's previous run is in progress (its gate is held).

    Deferred, never run beside it, never failed, never dropped: the message
    comes back after the deferral backoff (first step ``coalesce.WAIT``, at
    most a third of the lease) and tries again; its lock is kept alive for
    that countdown and ``unique_for`` more, so a newer call replaces this
    follow-up instead of finding the key free.
    """
    wait = deferral_countdown(task, request, coalesce.wait_for(lease))
    header = header_of(request)
    unique_for = header.unique_for if header is not None else 0.0
    coalesce.keep_waiting(store, run.key, run.owner, wait + unique_for)
    _wait_at_gate(task, request, store, run, args, kwargs, wait)
    reason = "the previous run of its key is in progress"
    _defer(task, request, args, kwargs, run.key, reason, countdown=wait)
    raise AssertionError("unreachable")  # _defer raises Ignore


def _wait_at_gate(
    task: DedupTaskLike,
    request: Any,
    store: LockStore,
    run: RunRef,
    args: Any,
    kwargs: Any,
    countdown: float,
) -> None:
    """List this follow-up at its key's gate (``runs.gate_handoff``): the run's end wakes it.

    Its deferred copy stays the safety net. A gate found open (the run
    ended since the claim) wakes it here; a store error leaves it to the
    backoff alone.
    """
    turns = runs.gate_handoff(store)
    if turns is None:
        return
    dedup_task: Any = task
    waiter = handoff.waiter_of(dedup_task, request, args, kwargs, countdown)
    if waiter is None:
        return
    try:
        listed = turns.wait_at_gate(run, waiter.payload, waiter.life)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: %s[%s] waits for its gate with the backoff alone: %s",
            task.name,
            request.id,
            exc,
        )
        return
    if not listed:
        handoff.wake(dedup_task, [waiter.payload])


def _claim_failed(
    task: DedupTaskLike,
    request: Any,
    header: LockHeader,
    owner: str,
    task_id: str,
    args: Any,
    kwargs: Any,
    exc: StoreError,
    run: RunRef | None,
) -> Held:
    """The start claim got no answer it can use: the fallback decides, nothing is lost.

    Contention, or ``dedup_fallback="closed"``: the message is published
    again for later (never failed without running). ``open``: the body runs
    unchecked and its end releases the lock per policy, owner-checked, as
    soon as the store answers again; except a ``keep_last`` message, which
    never runs without its run gate (it could run beside the run it follows).
    """
    runtime = task.dedup_config().runtime
    key = header.key
    assert key is not None
    closed = runtime.settings.fallback is Fallback.CLOSED or header.last
    if isinstance(exc, StoreContention) or closed:
        if run is not None:
            _abandon_run(task, runtime.store or _never(), run)
        reason = f"the store did not answer: {exc}"
        _defer(task, request, args, kwargs, key, reason, keep_token=True)
    logger.warning("celery-dedup: %s[%s] runs unchecked: %s", task.name, task_id, exc)
    return Held(
        runtime.store or _never(),
        header,
        key,
        owner,
        task_id,
        run=run,
        unchecked=True,
    )


def _never() -> LockStore:
    raise AssertionError("a claim was attempted without a store")


def deferral_countdown(task: DedupTaskLike, request: Any, base: float | None = None) -> float:
    """The countdown of this message's next deferral (``backoff``: exponential, jittered,
    capped, within the broker's ``visibility_timeout``); ``base`` is the reason's first step.
    """
    settings = task.dedup_config().runtime.settings
    return backoff.countdown(
        backoff.deferrals_of(request, runs.attempt_of(request)),
        base=backoff.BASE if base is None else base,
        visibility_timeout=settings.visibility_timeout,
    )


def _defer(
    task: DedupTaskLike,
    request: Any,
    args: Any,
    kwargs: Any,
    key: str,
    reason: str,
    base: float | None = None,
    *,
    countdown: float | None = None,
    keep_token: bool = False,
) -> None:
    """Publish this very message again for later, then end this copy without a state.

    The copy keeps its task id, header and options (Celery's
    ``signature_from_request``, as ``retry()`` builds them) but not its
    retry count: it is the same attempt. It comes back after the deferral
    backoff (``deferral_countdown``, from ``base``: a third of the lease for
    a copy waiting for a running one, a second for a store that did not
    answer, a full concurrency limit's own), or ``countdown`` when the
    caller drew it already; the new copy carries its deferral count
    (``backoff.FIELD``). No state is written: the id is the running copy's.
    With ``keep_token`` (a start claim the store did not answer: its lease
    may still land) it carries its delivery token for the copy that claims
    next to inherit (``RunRef.inherits``); never as that copy's own token:
    a copy of it the broker redelivers would own the same lease.
    """
    from celery.app.task import Task

    if countdown is None:
        countdown = deferral_countdown(task, request, base)
    attempt = runs.attempt_of(request)
    deferrals = backoff.deferrals_of(request, attempt) + 1
    logger.info(
        "celery-dedup: %s[%s] deferred by %.1fs (deferral %d, lock %s: %s)",
        task.name,
        request.id,
        countdown,
        deferrals,
        short(key),
        reason,
    )
    task.dedup_config().runtime.metrics.incr(task.name, "deferred")
    task_skipped.send(
        sender=task,
        key=key,
        task_id=request.id,
        existing_task_id=request.id,
        reason=f"deferred: {reason}",
    )
    options = deferred_options(task, request, args, kwargs, countdown, keep_token=keep_token)
    plain: Any = task  # the message as it was: Celery's own publish, no new lock
    Task.apply_async(plain, args, kwargs, **options)
    raise Ignore(f"celery-dedup: deferred ({reason})")


def deferred_options(
    task: DedupTaskLike,
    request: Any,
    args: Any,
    kwargs: Any,
    countdown: float | None,
    *,
    keep_token: bool = False,
) -> dict[str, Any]:
    """The publish options of this message's deferred copy (``_defer``; a slot handoff).

    The same task id, header and options, without the delivery token, with
    the deferral count of this deferral; ``countdown`` ``None``: at once.
    """
    attempt = runs.attempt_of(request)
    deferrals = backoff.deferrals_of(request, attempt) + 1
    sig = task.signature_from_request(request, args, kwargs, countdown=countdown)
    options = dict(sig.options)
    if countdown is None:
        options.pop("countdown", None)
    headers = dict(options.get("headers") or {})
    header = header_of(request)
    if header is not None:
        headers[HEADER] = header.encode()
    headers.pop(runs.DELIVERY_FIELD, None)
    headers.pop(runs.INHERITED_FIELD, None)
    headers[backoff.FIELD] = backoff.mark(attempt, deferrals)
    called = handoff.called_at(request)
    if called is not None:  # the copy keeps the call's place in a slot's wait list
        headers[handoff.CALLED_FIELD] = called
    token = getattr(request, runs.DELIVERY_FIELD, None)
    if keep_token and token:
        # The store did not answer: the lease may still land (a stalled server
        # runs the command later). The copy that claims next inherits it.
        headers[runs.INHERITED_FIELD] = token
    options["headers"] = headers
    return options


def _done_ttl(task: DedupTaskLike, held: Held) -> float:
    settings = task.dedup_config().runtime.settings
    return runs.done_ttl_for(
        held.header.unique_for or settings.default_ttl,
        settings.lease_ttl,
        settings.visibility_timeout,
        settings.done_ttl,
    )


def _end_quietly(
    task: DedupTaskLike,
    held: Held,
    release: bool | None,
    *,
    persist: bool = False,
    outcome: Outcome | None = None,
) -> bool:
    """End this attempt's run (done marker) and release or settle its lock in one step.

    A store error is logged, never raised. With ``persist`` (the pool child
    ending a run whose claim landed) the end is handed to this process's
    lease keeper (``leases.pending_end``): it keeps the run's lease alive
    (taking it back if it lapsed) and records the end as soon as the store
    answers, so copies keep waiting and a done marker is never lost to a
    store that did not answer, while the body's result is stored at once.
    Otherwise a release that did not land is retried as soon as the store
    answers. ``outcome`` (how the body ended) is kept with the done marker
    where the store can (``lost_results``).
    """
    run = held.run
    assert run is not None
    done_ttl = _done_ttl(task, held)
    meta = meta_for(task, held.task_id, held.header.until)
    if outcome is not None:
        meta[OUTCOME_FIELD] = outcome.value

    def end() -> bool:
        return _record_end(task, held.store, run, done_ttl, meta, release)

    try:
        return end()
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not record the end of %s[%s] (lock %s): %s%s",
            task.name,
            held.task_id,
            short(held.key),
            exc,
            ": its lease is kept until it can" if persist and not held.unchecked else "",
        )
        if persist and not held.unchecked:
            # Never blocking the body's result: this process's lease keeper
            # renews (or takes back) the run's lease and retries the end each
            # pass until the store records it, so copies keep waiting.
            lease = task.dedup_config().runtime.settings.lease_ttl
            leases.pending_end(held.store, run, lease, end, done_ttl)
            return False
        if release:
            runtime = task.dedup_config().runtime
            runtime.add_orphan(held.key, held.owner, runtime.settings.revoked_ttl)
        return False


def _record_end(
    task: DedupTaskLike,
    store: LockStore,
    run: RunRef,
    done_ttl: float,
    meta: LockMeta,
    release: bool | None,
) -> bool:
    """Record the end of ``run`` (``RunRecords.end_run``); a gated run's end hands its
    gate to the follow-up waiting at it, whose message is published at once.

    Whichever process records the end (the pool child, the main process for
    a killed child, the lease keeper retrying an end the store did not
    answer) wakes the follow-up the end took out of the store.
    """
    turns = runs.gate_handoff(store) if run.gated else None
    if turns is not None:
        ended, payload = turns.end_run_in_turn(run, done_ttl, meta, release=release)
        if payload is not None:
            handoff.wake(task, [payload])  # type: ignore[arg-type]
        return ended
    return runs.records_of(store).end_run(run, done_ttl, meta, release=release)


def _abandon_run(task: DedupTaskLike, store: LockStore, run: RunRef) -> None:
    """Give this copy's lease up: the run did not complete, a copy may run now."""
    try:
        runs.records_of(store).abandon_run(run)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not give up the running lease of %s (lock %s): "
            "a copy waits for it to lapse: %s",
            task.name,
            short(run.key),
            exc,
        )


def _not_owned(
    task: DedupTaskLike,
    store: LockStore,
    header: LockHeader,
    owner: str,
    task_id: str,
    claim: Claim,
    retake: bool,
) -> None:
    """A start claim that did not find this message's own lock: skip, or count the retake."""
    key = header.key
    assert key is not None
    if header.replace and claim.outcome in (ClaimOutcome.REVOKED, ClaimOutcome.HELD):
        _defer_to_pending_replacement(task, store, key, owner, claim.holder)
    if claim.outcome is ClaimOutcome.REVOKED:
        _skip(task, task_id, key, None, "revoked")
    if claim.outcome is ClaimOutcome.HELD:
        holder = claim.holder
        if header.replace:
            reason = "replaced"
        elif owner.startswith(GUARD_PREFIX):
            reason = "unannounced duplicate"
        else:
            reason = "held by another publish"
        holder_id = holder.task_id if holder else None
        if not header.replace and _observes(task, header, owner):
            _observed_run(task, task_id, key, holder_id, reason)
            return  # observed: the body runs; the holder's lock stays the holder's
        _skip(task, task_id, key, holder_id, reason)
    if claim.outcome is ClaimOutcome.FREE and retake:
        task.dedup_config().runtime.metrics.incr(task.name, "acquired")
        lock_acquired.send(
            sender=task, key=key, task_id=task_id, ttl=header.unique_for, policy=header.until.value
        )


def _observes(task: DedupTaskLike, header: LockHeader, owner: str) -> bool:
    """Whether a run that finds its key held runs anyway (``dedup_mode="observe"``).

    Said by the call that published it (its header); a message without
    one (``send_task``, guarded) asks its task's mode (attribute or app setting).
    """
    if header.observe:
        return True
    return owner.startswith(GUARD_PREFIX) and task.dedup_config().mode is DedupMode.OBSERVE


def _observed_run(
    task: DedupTaskLike, task_id: str, key: str, holder_id: str | None, reason: str
) -> None:
    """Count a run enforcing would have skipped: it runs (``would_deduplicate``)."""
    logger.info(
        "celery-dedup: %s[%s] runs although another publish holds its key (lock %s: %s; "
        "dedup_mode='observe')", task.name, task_id, short(key), reason,
    )  # fmt: skip
    observed.report(
        task, task.dedup_config().runtime, key=key, counted_key=key, task_id=task_id,
        holder_id=holder_id, would="deduplicate", policy=reason, args=task.request.args,
        kwargs=task.request.kwargs,
    )  # fmt: skip


def header_of(request: Any) -> LockHeader | None:
    """The ``celery_dedup`` header of a running request (a pool child's ``task.request``).

    ``None`` for a header that cannot be decoded too (the worker's main
    process logged it when the message arrived and put the guard's in its place).
    """
    return header_in(getattr(request, "headers", None)) or header_in(
        {HEADER: getattr(request, HEADER, None)}
    )


def header_in(headers: Any) -> LockHeader | None:
    """``read_header`` that never raises: a malformed header reads as none (logged at DEBUG).

    For the worker's hooks after the message's arrival, where the main
    process already logged a malformed header once (``screen_header``).
    """
    try:
        return read_header(headers)
    except MalformedHeader as exc:
        logger.debug("celery-dedup: ignoring a malformed header: %s", exc)
        return None


def _guard_of_running(
    task: DedupTaskLike, request: Any, task_id: str, args: Any, kwargs: Any
) -> LockHeader | None:
    """The guard of a running message without a header; ``None`` (runs unguarded) on any error."""
    try:
        queue = delivered_queue(task, request.delivery_info or {}, args, kwargs)
    except Exception as exc:  # a router's error on odd arguments: never the message's end
        logger.warning("celery-dedup: %s[%s] runs unguarded: %s", task.name, task_id, exc)
        return None
    return guard_header(task, task_id, args, kwargs, queue)


def _defer_to_pending_replacement(
    task: DedupTaskLike, store: LockStore, key: str, owner: str, holder: Lock | None
) -> None:
    """A replaced message whose replacement has not started yet waits for it.

    The replacing call's publish may still fail, in which case it gives the
    lock back to this message: skipping now would lose the work. So this
    message is retried shortly (same owner token) until the replacement
    starts (then it is skipped) or the lock comes back (then it runs).
    """
    try:
        holder = holder or store.get(key)
    except StoreError:
        return
    if holder is None or holder.started:
        return
    if holder.owner == owner:
        # The replacing publish failed and gave the key back meanwhile: this
        # message owns it again, so it comes back to claim it (never skipped).
        _come_back(task, 0)
    retries = int(task.request.retries or 0)
    logger.info(
        "celery-dedup: %s[%s] waits for its replacement %s to start (lock %s)",
        task.name,
        task.request.id,
        holder.task_id,
        short(key),
    )
    vt = task.dedup_config().runtime.settings.visibility_timeout
    _come_back(task, backoff.within_visibility(min(0.5 * 2**retries, 30.0), vt))


def _come_back(task: DedupTaskLike, countdown: float) -> NoReturn:
    """Publish this message's retry, then end this one without writing a state.

    Celery stores RETRY only after the retry's message is published: a revoke
    of this id landing in between discards that message (REVOKED), and the
    late RETRY would stand for ever over it. So the retry is published and
    this run ends with ``Ignore``, as a skip does.
    """
    max_retries = int(task.request.retries or 0) + 1
    if task.request.is_eager:
        raise task.retry(countdown=countdown, max_retries=max_retries)
    task.retry(countdown=countdown, max_retries=max_retries, throw=False)
    raise Ignore("celery-dedup: comes back for its lock")


def _remember_guard(request: Any, header: LockHeader) -> None:
    """Put the guard's header on the request so hooks of this run find it."""
    headers = request.headers
    if isinstance(headers, dict):
        headers[HEADER] = header.encode()
    else:
        request.headers = {HEADER: header.encode()}


def finish(task: DedupTaskLike, held: Held, outcome: Outcome) -> None:
    """Apply the policy when the run ends, before the result is stored.

    The attempt's done marker is written first, in the same store call (a
    copy arriving from now on is acknowledged without running; a requeued
    message's lease is given up instead). Then the lock is released when
    the policy says so; otherwise the kept lock is settled (marked not
    started: nothing runs under it any more, so a revoke frees it at once).
    A lock handed to a replacement, or released at start, is left alone. A
    store error never changes the run's outcome: a release that did not
    land is retried as soon as the store answers. A ``keep_last`` run's
    gate opens in the same call, once the lock is released or settled: the
    key's next run starts only then.
    """
    action: bool | None = None
    if not (held.handed_over or held.released or outcome is Outcome.RETRIED):
        action = outcome.releases(held.header.until)
        if held.unchecked and held.header.until is UniqueUntil.START:
            # The start claim could not release it: that release is owed now.
            action = outcome is not Outcome.REQUEUED
    window = cooldown(held.header, outcome) if action is False else None
    if held.run is not None and outcome is not Outcome.REQUEUED:
        if window is not None:
            # The done marker first (copies must not run), then the kept lock
            # shortened to the cooldown: a new call is accepted once it passed.
            _end_quietly(task, held, None, persist=True, outcome=outcome)
            _settle(task, held.store, held.key, held.owner, held.task_id, window)
        elif _end_quietly(task, held, action, persist=True, outcome=outcome) and action:
            _count_release(task, held.key, held.task_id, outcome.value)
        return
    if held.run is not None:
        _abandon_run(task, held.store, held.run)  # requeued: the message must run again
    if action:
        release(task, held.store, held.key, held.owner, held.task_id, outcome.value)
    elif action is False:
        _settle(task, held.store, held.key, held.owner, held.task_id, window)


def cooldown(header: LockHeader, outcome: Outcome) -> float | None:
    """The seconds a kept lock stays held after this outcome (``retry_window``), or ``None``.

    Only a final failure of a ``"success"`` or ``"expiry"`` run has one (a
    ``Reject(requeue=False)`` too: ended like a failure); a retry is not a
    final failure, and a success follows the policy (``"success"`` releases,
    ``"expiry"`` keeps the lock for the rest of its ``unique_for``).
    """
    if header.retry_window is None or header.until not in KEEPS_ON_FAILURE:
        return None
    return header.retry_window if outcome in (Outcome.FAILURE, Outcome.REJECTED) else None


def end_unclaimed(task: DedupTaskLike, request: Any, outcome: Outcome) -> None:
    """A message that ends before its start claim: its lock follows the policy all the same.

    (Its concurrency key could not be computed, say: the task fails without
    its body.) Owner-checked; a guard lock (``send_task``) is only taken by
    the start claim, so there is none yet.
    """
    header = header_of(request)
    store = task.dedup_config().runtime.store
    if header is None or header.key is None or store is None:
        return
    if (header.token or "").startswith(GUARD_PREFIX):
        return
    task_id = str(request.id)
    window = cooldown(header, outcome)
    if window is not None:
        _settle(task, store, header.key, header.owner(task_id), task_id, window)
    elif outcome.releases(header.until):
        release(task, store, header.key, header.owner(task_id), task_id, outcome.value)


def _eager_started() -> set[str]:
    started: set[str] | None = getattr(_eager, "started", None)
    if started is None:
        started = _eager.started = set()
    return started


def eager_body_started(owner: str) -> bool:
    """Whether an eager call's body claimed ``owner``'s lock (and forget it)."""
    started = _eager_started()
    found = owner in started
    started.discard(owner)
    return found


# -- the worker's main process ---------------------------------------------


def _received_request(task_id: str) -> Any:
    """The request of ``task_id`` this (main) process runs, or last received."""
    requests = list(_received.get(task_id) or ())
    running = [r for r in requests if getattr(r, "time_start", None)]
    return (running or requests or [None])[-1]


def header_from_main_process(task_id: str) -> LockHeader | None:
    """The header of a request this (main) process received, if it is still alive."""
    request = _received_request(task_id)
    if request is None:
        return None
    return header_in(request.request_dict)


def release_from_main_process(
    task: DedupTaskLike, task_id: str, args: Any, kwargs: Any, outcome: Outcome
) -> None:
    """A hard time limit of a request received by a ``task_received`` receiver.

    Only for a task whose ``Request`` class is not a ``DedupRequest`` (which
    releases by itself, before the failure is stored). A message Celery
    puts back in its queue keeps its lock (``requeue.after_time_limit``).
    """
    request = _received_request(task_id)
    if request is not None:
        if outcome is Outcome.FAILURE:
            outcome = requeue.after_time_limit(task)
        release_killed_run(task, request, outcome)


def release_killed_run(task: DedupTaskLike, request: Any, outcome: Outcome) -> None:
    """The pool child running ``request`` is gone: end its run from the main process.

    ``outcome`` is what Celery does with the message (``requeue``):

    * ``FAILURE`` (or ``REVOKED``): the attempt ended; its done marker is
      written (its copies must not run) and its lock released per policy.
      A guard lock (``send_task``) is released too: the run it throttled
      was killed.
    * ``RETRIED``: Celery published the retry (holding the lock): the
      attempt ended, its lock is the retry's.
    * ``REQUEUED``: the message goes back to its queue and must run again:
      its lease is given up (the requeued copy runs at once, not "already
      ran") and its lock kept for it, marked not started.
    """
    header = header_in(request.request_dict) or guard_header_of(task, request)
    store = task.dedup_config().runtime.store
    if header is None or header.key is None or store is None:
        return
    task_id = str(request.id)
    owner = header.owner(task_id)
    found = leases.lease_of(request)
    if outcome is Outcome.REQUEUED:
        if found is not None:
            _abandon_run(task, found[0], found[1])
        _settle(task, store, header.key, owner, task_id)
        return
    releases = _killed_run_releases(header, outcome)
    if found is not None:
        # The attempt ended (killed by a time limit or a revoke): its copies must not run.
        held = Held(store, header, header.key, owner, task_id, run=found[1])
        if not _end_from_main_process(task, held, found[2], releases):
            return  # the renewer records the end (and releases) once the store answers
    if releases:
        release(task, store, header.key, owner, task_id, outcome.value)
    elif (window := cooldown(header, outcome)) is not None:
        _settle(task, store, header.key, owner, task_id, window)


def _settle(
    task: DedupTaskLike,
    store: LockStore,
    key: str,
    owner: str,
    task_id: str,
    ttl: float | None = None,
) -> None:
    """Mark a kept lock not started (nothing runs under it now), its TTL reset to ``ttl``
    when given (a failure's cooldown); a store error is logged (the lock's own TTL bounds it)."""
    try:
        store.settle(key, owner, ttl)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not settle lock %s of %s[%s]: %s",
            short(key),
            task.name,
            task_id,
            exc,
        )


def _end_from_main_process(task: DedupTaskLike, held: Held, lease: float, releases: bool) -> bool:
    """Record the end of a killed run from the main process, never waiting here.

    When the store does not answer, the end is handed to the lease renewer
    (``leases.pending_end``): the run's lease is kept until the end lands,
    then the lock is released per policy. Whether the end landed now.
    """
    run = held.run
    assert run is not None
    meta = meta_for(task, held.task_id, held.header.until)
    done_ttl = _done_ttl(task, held)
    try:
        _record_end(task, held.store, run, done_ttl, meta, None)
        return True
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not record the end of %s[%s] (lock %s): %s: "
            "its lease is kept until it can",
            task.name,
            held.task_id,
            short(held.key),
            exc,
        )

    def end() -> None:
        _record_end(task, held.store, run, done_ttl, meta, None)
        if releases:
            held.store.release(held.key, held.owner)

    leases.pending_end(held.store, run, lease, end, done_ttl)
    return False


def _killed_run_releases(header: LockHeader, outcome: Outcome) -> bool:
    """Whether a run that ended in the main process's view releases its lock.

    Per policy; a guard lock (``send_task``) always when the message's
    run is over (failed or revoked): the run it throttled was killed.
    """
    if outcome.releases(header.until):
        return True
    guarded = (header.token or "").startswith(GUARD_PREFIX)
    return guarded and outcome in (Outcome.FAILURE, Outcome.REVOKED)


def _give_delivery_token(task: DedupTaskLike, request: Any) -> None:
    """Give a received message its delivery token and keep its running lease alive.

    The token travels with the request to the pool child (its run record's
    owner); this process renews the lease while the request is active.
    """
    request_dict = request.request_dict
    header = header_in(request_dict)
    if header is None or header.key is None:
        return
    try:
        runtime = task.dedup_config().runtime
        store = runtime.store
    except Exception as exc:  # the start claim reports the store's configuration error
        logger.debug("celery-dedup: no run record for %s[%s]: %s", task.name, request.id, exc)
        return
    if store is None:
        return
    # Every delivery has a token of its own, even one of a message that
    # inherits a lease (``RunRef.inherits``): the broker may deliver it twice.
    # (A message an earlier version deferred carries the token to inherit as its own.)
    kept = request_dict.get(runs.DELIVERY_FIELD)
    if kept and not request_dict.get(runs.INHERITED_FIELD):
        request_dict[runs.INHERITED_FIELD] = kept
    token = request_dict[runs.DELIVERY_FIELD] = incarnation.new_delivery_token()
    owner = header.owner(str(request.id))
    run = RunRef(header.key, owner, runs.attempt_of(request_dict), token, header.last)
    leases.remember(request, store, run, runtime.settings.lease_ttl)


def receive(task: DedupTaskLike, request: Any) -> None:
    """The worker's main process received a message of ``task``: prepare it; never raises.

    The header is screened (``screen_header``), a message without one gets
    its guard, and its delivery token. Any error here is logged and the
    message goes on as plain Celery would handle it (its start claim runs
    in the pool child, whatever failed here): nothing a message carries
    and no store answer may reach Celery's consumer loop, which would stop
    the worker (and every restarted worker, on the same restored message).
    """
    try:
        screen_header(task, request)
        _guard_unannounced(task, request)  # one dict lookup for a message with the header
        _give_delivery_token(task, request)
    except Exception:
        logger.exception(
            "celery-dedup: could not prepare %s[%s]; it is handled by its start claim alone",
            getattr(task, "name", "?"),
            getattr(request, "id", "?"),
        )


def screen_header(task: DedupTaskLike, request: Any) -> None:
    """Drop a ``celery_dedup`` header that cannot be decoded, and hostile run fields.

    Logged once per received message (ERROR, with the task, its id and
    what was wrong); the message is then handled as one without a header:
    its guard computes its key (``_guard_unannounced``), so a forged header
    can neither stop the worker nor bypass deduplication. Every later hook
    of the message reads the request as screened here.
    """
    request_dict = request.request_dict
    if request_dict.get(HEADER) is not None:
        try:
            LockHeader.decode(request_dict[HEADER])
        except MalformedHeader as exc:
            logger.error(
                "celery-dedup: %s[%s] carries a malformed header (%s); handled as a "
                "message without one (its guard decides)",
                task.name,
                request.id,
                exc,
            )
            del request_dict[HEADER]
    for field in (runs.DELIVERY_FIELD, runs.INHERITED_FIELD):
        value = request_dict.get(field)
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_TOKEN):
            logger.error(
                "celery-dedup: %s[%s] carries a malformed %s field; ignored",
                task.name,
                request.id,
                field,
            )
            del request_dict[field]


def _guard_unannounced(task: DedupTaskLike, request: Any) -> None:
    """Give a message without the header (``send_task``) its guard header.

    Computed in the main process, where the message's routing and content
    type are known; it travels with the request to the pool child.
    """
    request_dict = request.request_dict
    if not isinstance(request_dict.get(HEADER), Mapping):
        header = guard_header_of(task, request)
        if header is not None:
            request_dict[HEADER] = header.encode()


class DedupRequest(Request):
    """The worker's request of a ``DedupTask`` message (``DedupTask.Request``).

    Per message it costs one dict lookup: only a message without the header
    gets work here (its guard). On a hard time limit it releases the lock
    per policy before Celery stores the failure, so a ``result.get()`` that
    returns means the lock is already released, as for any other ending.
    """

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        task: Any = self.task
        if hasattr(task, "dedup_config"):
            receive(task, self)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        """The pool reports a hard time limit here first, then calls ``on_timeout``.

        A run whose pool child died ends here, before Celery records its
        fate: a message Celery puts back or retries keeps its lock and runs
        again, a failed one releases per policy.
        """
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # (an ExceptionWithTraceback from the pool)
        if isinstance(exc, TimeLimitExceeded):
            if not return_ok or requeue.after_time_limit(self.task) is Outcome.REQUEUED:
                # (Put back: before Celery requeues it, so the copy finds no lease.)
                self._release_killed_run()
        elif isinstance(exc, WorkerLostError) or (
            # (billiard 4.3+ reports a lost child's exit so: Celery takes it as lost)
            isinstance(exc, (SystemExit, KeyboardInterrupt)) and not self._cancelled()
        ):
            _contained(self._end_lost_run)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """A hard time limit killed the pool child: end its run, then let Celery record it."""
        if not soft:
            self._release_killed_run()
        super().on_timeout(soft, timeout)

    def _cancelled(self) -> bool:
        return bool(getattr(self, "_already_cancelled", False)) or bool(
            getattr(self, "_already_revoked", False)
        )

    def _message_context(self) -> Any:
        """The message's request context (Celery's ``Request._context``)."""
        return getattr(self, "_context", None) or self.request_dict

    def _announce_revoked(
        self, reason: str, terminated: bool, signum: Any, expired: bool
    ) -> None:
        """A dropped copy of a live or completed run is acknowledged quietly.

        Celery would store ``REVOKED`` under the task id the run shares (its
        caller's ``get()`` would raise ``TaskRevokedError`` while the body
        runs, or over its result) and announce the revoke.
        """
        if not terminated and _contained_answer(self._copy_of_a_run):
            from celery.worker import state as worker_state

            # Celery's task_ready would also forget the live run's entry (by id).
            if worker_state.requests.get(self.id) is self:
                del worker_state.requests[self.id]
            for requests in ("active_requests", "reserved_requests", "scheduled_requests"):
                getattr(worker_state, requests).discard(self)
            logger.info(
                "celery-dedup: dropped a copy of %s[%s] (%s): its run is live or done",
                self.task.name,
                self.id,
                reason,
            )
            self.acknowledge()
            self._already_revoked = True
            self._dedup_copy_dropped = True
            return
        super()._announce_revoked(reason, terminated, signum, expired)  # type: ignore[misc]

    def _copy_of_a_run(self) -> bool:
        task: Any = self.task
        if not hasattr(task, "dedup_config"):
            return False
        header = header_in(self.request_dict)
        if header is None or header.key is None:
            return False
        try:
            store = task.dedup_config().runtime.store
        except Exception:  # the start claim reports the store's configuration error
            return False
        return store is not None and copy_of_a_run(task, store, self, header) is True

    def _release_killed_run(self) -> None:
        from celery.worker import state as worker_state

        task: Any = self.task
        if not hasattr(task, "dedup_config"):
            return
        outcome = requeue.after_time_limit(task)
        if outcome is Outcome.FAILURE and getattr(worker_state, "should_terminate", None):
            return  # a cold shutdown records nothing either
        if not getattr(self, "_dedup_released", False):
            self._dedup_released = True
            _contained(release_killed_run, task, self, outcome)

    def _end_lost_run(self) -> None:
        """The pool child was lost: unless Celery retries it, end the run as Celery will."""
        task: Any = self.task
        if not hasattr(task, "dedup_config") or getattr(self, "_dedup_released", False):
            return
        context = self._message_context()
        if requeue.retries_worker_lost(task, context):
            abandon_lost_run(self)  # ``_retry_worker_lost`` ends the attempt
            return
        self._dedup_released = True
        _contained(release_killed_run, task, self, requeue.after_worker_lost(task, context))

    def _retry_worker_lost(self, exc: Any, exc_info: Any) -> bool:
        """``retry_on_worker_lost``: the retry is the holder's own republish (it keeps the lock).

        Celery publishes it from this (main) process, where no task runs;
        it would otherwise be taken for a duplicate of the lost run and
        never published. If it could not be sent, Celery puts the message
        back or fails it: the run ends the same way.
        """
        task: Any = self.task
        retry: Any = super()._retry_worker_lost  # type: ignore[misc]  # (Celery 5.7)
        if not hasattr(task, "dedup_config"):
            return bool(retry(exc, exc_info))
        with requeue.as_running(task, self):
            retried = bool(retry(exc, exc_info))
        self._dedup_released = True
        context = self._message_context()
        outcome = Outcome.RETRIED if retried else requeue.after_worker_lost(task, context)
        _contained(release_killed_run, task, self, outcome)
        return retried


def _contained_answer(question: Callable[[], bool]) -> bool:
    """``question()`` asked inside Celery's consumer: an error answers ``False`` (logged)."""
    try:
        return question()
    except Exception:
        logger.exception("celery-dedup: %s failed", getattr(question, "__name__", question))
        return False


def _contained(hook: Callable[..., None], *args: Any) -> None:
    """Run a main-process hook of a killed run; its error is logged, never raised.

    These run inside Celery's pool callbacks: an exception there would stop
    the worker. The lock is then left to its TTL (and the reaper).
    """
    try:
        hook(*args)
    except Exception:
        logger.exception("celery-dedup: %s failed; the lock is left to its TTL", hook.__name__)


def abandon_lost_run(request: Any) -> None:
    """The pool child running ``request`` died (``WorkerLostError``): give its lease up.

    The child is gone, so its run cannot still be alive: a copy (the
    message requeued by ``task_reject_on_worker_lost``, or redelivered)
    may run at once instead of waiting for the lease to lapse.
    """
    found = leases.lease_of(request)
    task: Any = getattr(request, "task", None)
    if found is not None and hasattr(task, "dedup_config"):
        # (A keep_last gate too: the key's next run may start now.)
        leases.forget(found[1])  # never taken back: the run is gone
        _abandon_run(task, found[0], found[1])


def _remember_request(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_received`` for a task whose ``Request`` class is not a ``DedupRequest``."""
    task: Any = getattr(request, "task", None)
    if isinstance(request, DedupRequest) or not hasattr(task, "dedup_config"):
        return
    if len(_received) > 1000:
        for task_id in [k for k, v in _received.items() if not v]:
            del _received[task_id]
    _received.setdefault(request.id, weakref.WeakSet()).add(request)
    receive(task, request)


def prepare_strategy(task: DedupTaskLike) -> None:
    """Called as the worker builds ``task``'s strategy (``DedupTask.start_strategy``).

    A ``DedupTask`` keeps the default ``DedupRequest``, and then the worker
    does nothing per received message for it. A task with a ``Request``
    class of its own gets the same work done by a ``task_received``
    receiver, connected only then (a receiver costs every message of every task).
    """
    request_class = symbol_by_name(task.Request)
    if not (isinstance(request_class, type) and issubclass(request_class, DedupRequest)):
        task_received.connect(_remember_request, weak=False, dispatch_uid="celery_dedup.received")


@task_revoked.connect(weak=False)
def _release_revoked(
    sender: Any = None,
    request: Any = None,
    expired: bool = False,
    terminated: bool = False,
    **_: Any,
) -> None:
    """A revoked, expired or terminated message releases its lock (except ``expiry``).

    Not a dropped copy of a run that is live or completed: the lock is that run's.
    """
    if request is None or not hasattr(sender, "dedup_config"):
        return
    try:
        _release_revoked_request(sender, request, expired, terminated)
    except Exception:  # a receiver's error must not hide the revoke from Celery's own work
        logger.exception(
            "celery-dedup: could not release the lock of revoked %s[%s]",
            getattr(sender, "name", "?"),
            getattr(request, "id", "?"),
        )


def _release_revoked_request(
    sender: Any, request: Any, expired: bool, terminated: bool
) -> None:
    """``_release_revoked`` proper."""
    header = header_of(request)
    if header is None:
        header = guard_header_of(sender, request)
    if header is None or header.key is None:
        return
    if request.id == deterministic_task_id(header.key):
        # Celery remembers an expired (or revoked) id for hours and would
        # silently discard every later run of this key, which reuses it.
        from celery.worker import state as worker_state

        worker_state.revoked.discard(request.id)
    if not _killed_run_releases(header, Outcome.REVOKED):
        return
    store = sender.dedup_config().runtime.store
    if store is None:
        return
    if not terminated:
        copy = copy_of_a_run(sender, store, request, header)
        if copy is not False:
            # A copy never acts for the run: its lock stays the run's. (Unknown:
            # the store did not answer; the lock's TTL bounds it.)
            return
    reason = "expired" if expired else "revoked"
    release(sender, store, header.key, header.owner(request.id), request.id, reason)


def copy_of_a_run(
    task: DedupTaskLike, store: LockStore, request: Any, header: LockHeader
) -> bool | None:
    """Whether a message the worker drops (revoked, expired) is a copy of a run of
    its publish that is live or completed (``None``: the store did not answer).

    A copy (deferred, or delivered again) shares its run's task id and owner
    token; the run's record says whether that run is live or done. The
    worker's own active requests whose run began (its lease was seen held)
    are asked first (no round trip): an active request that is only being
    deferred is no live run, and its copies end as Celery ends them. Nor is
    a run whose lease is held by a process known to be dead (one read more,
    on this path only).
    """
    assert header.key is not None
    task_id = str(request.id)
    owner = header.owner(task_id)
    # (A worker Request keeps its retry count in its request dict only.)
    attempt = runs.attempt_of(getattr(request, "request_dict", None) or request)
    from celery.worker import state as worker_state

    for active in list(worker_state.active_requests):
        found = leases.lease_of(active)
        if (
            active is not request
            and getattr(active, "time_start", None)
            and found is not None
            and found[1].owner == owner
            and found[1].attempt == attempt
            and found[1].token != getattr(request, runs.DELIVERY_FIELD, None)
            and leases.began(found[1])
        ):
            return True
    token = str(getattr(request, runs.DELIVERY_FIELD, None) or "")
    run = RunRef(header.key, owner, attempt, token, header.last)
    records = runs.records_of(store)
    try:
        outcome = records.peek_run(run)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: %s[%s] was dropped; whether a copy of it runs is unknown "
            "(lock %s kept until its TTL): %s",
            task.name,
            task_id,
            short(header.key),
            exc,
        )
        return None
    if outcome is RunOutcome.RUNNING and _dead_lease(records, run) is not None:
        # The run died with its worker (a lease nobody renews): this copy is
        # the message's last, and ends as Celery ends a dropped message.
        return False
    if outcome is RunOutcome.DONE:
        # Dropped quietly: a result that died with the run's worker is stored now.
        context = getattr(request, "_context", None) or request
        lost_results.store_lost_result(task, task_id, records, run, context)
    return outcome in (RunOutcome.RUNNING, RunOutcome.DONE)


def _request_token(request: Any) -> str | None:
    header = header_in(getattr(request, "request_dict", None))
    if header is not None and header.token:
        return header.token
    task: Any = getattr(request, "task", None)
    if not hasattr(task, "dedup_config"):
        return None
    try:
        return guard_token(task, str(request.id))
    except Exception:  # a store error: this request cannot be the one asked for
        return None


@control_command(
    args=[("token", str), ("signal", str)],
    signature="<token> [signal]",
)
def dedup_terminate(state: Any, token: str, signal: str | None = None, **_: Any) -> Any:
    """Terminate the running task whose lock is owned by ``token``.

    ``celery_dedup.revoke(..., terminate=True)`` uses it instead of
    Celery's revoke-by-id, which would also discard every later run that
    reuses the id (deterministic ids) for as long as workers remember it.
    """
    from celery.worker import state as worker_state

    terminated = []
    for request in list(worker_state.active_requests):
        if _request_token(request) == token:
            request.terminate(state.consumer.pool, signal=signal or "SIGTERM")
            terminated.append(request.id)
    return {"ok": f"terminated {', '.join(terminated)}" if terminated else "no such task"}
