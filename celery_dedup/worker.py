"""Worker-side lock handling: the start claim, release per outcome, revokes and retries.

Runs in pool children (``DedupTask.__call__``) and in the worker's main
process (``task_revoked``, hard time limits, the ``dedup_terminate`` control
command). Ownership is the publish's owner token from the ``celery_dedup``
header, never the task id, so two runs sharing a task id (deterministic ids,
forged ids) never release or skip each other. Every release is
owner-checked and idempotent; store clients are per process (redis-py pools
reset themselves after a fork, the SQL store disposes its engine), so
nothing here shares a connection across a fork.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore
from celery.signals import task_received, task_revoked
from celery.worker.control import control_command

from .exceptions import StoreUnavailable
from .header import HEADER, LockHeader, read_header
from .policy import UniqueUntil, lock_ttl
from .signals import lock_acquired, lock_released, task_skipped
from .stores.base import ClaimOutcome, LockStore

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = [
    "GUARD_PREFIX",
    "Held",
    "Outcome",
    "claim_at_start",
    "finish",
    "release",
    "republish_as_holder",
]

logger = logging.getLogger("celery_dedup")

#: Owner tokens of locks the worker took for messages without a header.
GUARD_PREFIX = "guard:"

# Requests the worker's main process has received, by task id. A hard time
# limit calls on_failure in the main process, where task.request is empty;
# this is how that call finds the message's header. Weak: no leak.
_received: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

# Owner tokens whose body started in this thread (eager calls only): an eager
# publish that raises before its body ran releases the lock it took.
_eager = threading.local()


class Outcome(str, Enum):
    """How a run ended, as far as its lock is concerned."""

    SUCCESS = "success"
    FAILURE = "failure"
    #: ``raise Ignore()`` in the body, or ``replace()`` with a replacement
    #: that does not take the lock over: released like a success
    IGNORED = "ignored"
    #: ``raise Reject(requeue=False)``: released like a failure
    REJECTED = "rejected"
    #: revoked, expired or terminated by a revoke
    REVOKED = "revoked"

    def releases(self, until: UniqueUntil) -> bool:
        """Whether a lock under ``until`` is released when a run ends like this."""
        if self in (Outcome.SUCCESS, Outcome.IGNORED):
            return until.releases_on_success()
        if self in (Outcome.FAILURE, Outcome.REJECTED):
            return until.releases_on_failure()
        return until.releases_on_revoke()


@dataclass
class Held:
    """The lock a running message holds, from its start claim to its end."""

    store: LockStore
    header: LockHeader
    key: str
    owner: str
    task_id: str
    #: set when the lock passed to a replacement (``self.replace()``)
    handed_over: bool = False


def short(key: str) -> str:
    """A key as logged: its digest's first 16 hex digits, never raw material."""
    return key.rsplit(":", 1)[-1][:16]


def release(
    task: DedupTask, store: LockStore, key: str, owner: str, task_id: str, reason: str
) -> bool:
    """Owner-checked release; a store outage is logged, never raised (the TTL bounds it)."""
    try:
        released = store.release(key, owner)
    except StoreUnavailable as exc:
        logger.warning(
            "celery-dedup: could not release lock %s of %s[%s] (%s): it expires with its TTL",
            short(key),
            task.name,
            task_id,
            exc,
        )
        return False
    if released:
        _count_release(task, key, task_id, reason)
    return released


def _count_release(task: DedupTask, key: str, task_id: str, reason: str) -> None:
    task.dedup_config().runtime.metrics.incr(task.name, "released")
    lock_released.send(sender=task, key=key, task_id=task_id, reason=reason)
    logger.debug("celery-dedup: released %s of %s[%s] (%s)", short(key), task.name, task_id, reason)


def meta_for(task: DedupTask, task_id: str, until: UniqueUntil) -> dict[str, str]:
    """The metadata a lock of ``task`` is written with."""
    return {"task_name": task.name, "policy": until.value, "task_id": task_id}


def republish_as_holder(
    task: DedupTask,
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
    header = read_header(options.get("headers")) or (
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
            if not store.extend(header.key, owner, ttl):
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
        except StoreUnavailable as exc:
            logger.warning(
                "celery-dedup: could not extend lock %s on retry: %s", short(header.key), exc
            )
    return publish(task_id, header)


def _skip(
    task: DedupTask, task_id: str, key: str, holder_id: str | None, reason: str
) -> None:
    """End the task without running its body: IGNORED, or REVOKED for a revoked owner."""
    logger.info(
        "celery-dedup: skipping %s[%s] (lock %s: %s)", task.name, task_id, short(key), reason
    )
    task.dedup_config().runtime.metrics.incr(task.name, "skipped")
    task_skipped.send(
        sender=task, key=key, task_id=task_id, existing_task_id=holder_id, reason=reason
    )
    request = task.request
    if not request.is_eager or task.app.conf.task_store_eager_result:
        if reason == "revoked":
            task.backend.mark_as_revoked(task_id, "revoked by celery-dedup", request=request)
        else:
            from celery import states

            task.update_state(
                task_id=task_id,
                state=states.IGNORED,
                meta={"skipped": reason, "deduplication_key": key, "holder": holder_id},
            )
    raise Ignore(f"celery-dedup: not run ({reason})")


def guard_header(
    task: DedupTask, task_id: str, args: Any, kwargs: Any, routing_key: Any
) -> LockHeader | None:
    """The header the worker runs a message without one under (``send_task``).

    The guard is a throttle: its lock lives ``unique_for`` from the first
    unannounced copy whatever the task's ``unique_until``, so copies that
    do not overlap in time (two beat instances firing the same slot) still
    run the work once. Its owner is derived from the task id, so a
    redelivery of the same message owns the lock it took, and the main
    process can release it.
    """
    config = task.dedup_config()
    call = config.resolve({})
    try:
        key = task.dedup_key(args, kwargs, call, routing_key)
    except (TypeError, ValueError) as exc:
        logger.warning("celery-dedup: %s[%s] runs unguarded: %s", task.name, task_id, exc)
        return None
    if key is None:
        return None
    return LockHeader(
        key=key,
        until=UniqueUntil.EXPIRY,
        unique_for=config.unique_for,
        token=GUARD_PREFIX + task_id,
    )


def claim_at_start(task: DedupTask, task_id: str, args: Any, kwargs: Any) -> Held | None:
    """The start check: one round trip that confirms this message still owns its lock.

    Returns what the run holds (released at its end per policy), or ``None``
    when it holds nothing; raises ``Ignore`` (after recording the state) when
    the body must not run: another publish holds the key (replaced, or the
    lock expired and a newer call took it) or this publish was revoked.
    """
    request = task.request
    store = task.dedup_config().runtime.store
    if store is None:
        return None
    header = task.dedup_header(task_id)
    if header is None:
        if request.is_eager:
            return None  # task.apply() and eager canvas members: never went through a broker
        routing_key = (request.delivery_info or {}).get("routing_key")
        header = guard_header(task, task_id, args, kwargs, routing_key)
        if header is None:
            return None
    if header.key is None:
        return None
    key, owner, until = header.key, header.owner(task_id), header.until
    if request.is_eager:
        # apply_async took this lock in this thread a moment ago: no claim needed.
        _eager_started().add(owner)
        if until is UniqueUntil.START:
            release(task, store, key, owner, task_id, "start")
            return None
        return Held(store, header, key, owner, task_id)
    guarded = owner.startswith(GUARD_PREFIX)
    release_now = until is UniqueUntil.START
    retake = guarded or until in (UniqueUntil.SUCCESS, UniqueUntil.FINISH)
    try:
        claim = store.claim(
            key,
            owner,
            release=release_now,
            ttl=header.unique_for if retake else None,
            meta=meta_for(task, task_id, until),
        )
    except StoreUnavailable as exc:
        # The message exists: running it unlocked loses nothing (fallback "open").
        logger.warning("celery-dedup: %s[%s] runs unchecked: %s", task.name, task_id, exc)
        return None
    if claim.outcome is ClaimOutcome.REVOKED:
        _skip(task, task_id, key, None, "revoked")
    if claim.outcome is ClaimOutcome.HELD:
        holder = claim.holder
        reason = "unannounced duplicate" if guarded else "held by another publish"
        if header.replace:
            reason = "replaced"
        _skip(task, task_id, key, holder.task_id if holder else None, reason)
    if claim.outcome is ClaimOutcome.FREE and retake:
        task.dedup_config().runtime.metrics.incr(task.name, "acquired")
        lock_acquired.send(
            sender=task, key=key, task_id=task_id, ttl=header.unique_for, policy=until.value
        )
    if release_now:
        if claim.outcome is ClaimOutcome.OWNED:
            _count_release(task, key, task_id, "start")
        return None
    if guarded:
        _remember_guard(request, header)
    return Held(store, header, key, owner, task_id)


def _remember_guard(request: Any, header: LockHeader) -> None:
    """Put the guard's header on the request so hooks of this run find it."""
    headers = request.headers
    if isinstance(headers, dict):
        headers[HEADER] = header.encode()
    else:
        request.headers = {HEADER: header.encode()}


def finish(task: DedupTask, held: Held, outcome: Outcome) -> None:
    """Release what the run holds when its policy says so (before the result is stored)."""
    if not held.handed_over and outcome.releases(held.header.until):
        release(task, held.store, held.key, held.owner, held.task_id, outcome.value)


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


def header_from_main_process(task_id: str) -> LockHeader | None:
    """The header of a request this (main) process received, if it is still alive."""
    request = _received.get(task_id)
    if request is None:
        return None
    return read_header(request.request_dict)


def release_from_main_process(
    task: DedupTask, task_id: str, args: Any, kwargs: Any, outcome: Outcome
) -> None:
    """A hard time limit: the pool child is gone; release per policy from here."""
    request = _received.get(task_id)
    header = header_from_main_process(task_id)
    if header is None and request is not None:
        routing_key = (request.delivery_info or {}).get("routing_key")
        header = guard_header(task, task_id, args, kwargs, routing_key)
    store = task.dedup_config().runtime.store
    if header is None or header.key is None or store is None:
        return
    if outcome.releases(header.until):
        release(task, store, header.key, header.owner(task_id), task_id, outcome.value)


@task_received.connect(weak=False)
def _remember_request(sender: Any = None, request: Any = None, **_: Any) -> None:
    task = getattr(request, "task", None)
    if request is not None and hasattr(task, "dedup_config"):
        _received[request.id] = request


@task_revoked.connect(weak=False)
def _release_revoked(
    sender: Any = None, request: Any = None, expired: bool = False, **_: Any
) -> None:
    """A revoked, expired or terminated message releases its lock (except ``expiry``)."""
    if request is None or not hasattr(sender, "dedup_config"):
        return
    raw: Mapping[str, Any] = request.headers or {}
    header = read_header(raw) or read_header({HEADER: getattr(request, HEADER, None)})
    if header is None:
        routing_key = (getattr(request, "delivery_info", None) or {}).get("routing_key")
        header = guard_header(sender, request.id, request.args, request.kwargs, routing_key)
    if header is None or header.key is None or not header.until.releases_on_revoke():
        return
    store = sender.dedup_config().runtime.store
    if store is not None:
        reason = "expired" if expired else "revoked"
        release(sender, store, header.key, header.owner(request.id), request.id, reason)


def _request_token(request: Any) -> str:
    header = read_header(getattr(request, "request_dict", None))
    if header is not None and header.token:
        return header.token
    return GUARD_PREFIX + str(request.id)


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
