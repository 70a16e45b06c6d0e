"""``on_duplicate="cancel_running"``: cancel the key's holder, wait for the key, take it.

The new call never takes the key from a running holder: it asks the holder
to stop and takes the key only once the holder's worker freed it, exactly as
for any revoke or termination. So a cancelled run and its replacement never
hold the key together, and the old run's end (owner-checked) can never free
the new holder's lock.

- A **queued** holder (not started) is taken over and its owner token
  refused at start: one round trip on a ``RevokingTakeOver`` store (as
  ``replace``), two on another ``QueuedTakeOver`` store, else a revoke (its
  lock deleted) and an acquire. If the
  new call's publish fails, the key goes back to it (``DedupTask._restore``).
- A **running** holder is revoked in the store (its lock is kept while it
  runs) and terminated with ``cancel_signal`` through the ``dedup_terminate``
  control command, matched on its owner token. The worker announces the
  termination and releases the lock (``task_revoked``); the call polls the
  key until it is free, re-sending the command every second (a command sent
  while the worker had not yet accepted the message finds no running request).
- A holder still there after ``cancel_wait`` seconds: ``CancelTimeout``;
  nothing was published and the call holds no lock (never a double run,
  never a silent drop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from .exceptions import CancelOwnRunError, CancelTimeout
from .identity import deterministic_task_id
from .lifecycle import DedupTaskLike
from .signals import holder_cancelled
from .stores.base import (
    Lock,
    LockStore,
    QueuedTakeOver,
    RevokeOutcome,
    replace_holder,
    revoking_take_over,
)
from .worker import header_of

__all__ = ["POLICY", "cancel_and_acquire", "dismiss", "drop_message", "in_canvas"]

logger = logging.getLogger("celery_dedup")

#: the policy name signals and logs report
POLICY = "cancel_running"

#: seconds between two looks at the key while a cancelled run ends
_POLL = 0.05
_MAX_POLL = 0.5
#: seconds between two terminate commands to the same run
_RESEND = 1.0


def in_canvas(options: Mapping[str, Any]) -> bool:
    """A group or chord member, or a chain step: cancelling would cut its canvas.

    Such a call takes the usual path instead (a held key: published without
    a lock where the canvas needs it, else the holder's result).
    """
    return bool(options.get("group_id") or options.get("chord") or options.get("chain") is not None)


def cancel_and_acquire(
    task: DedupTaskLike,
    store: LockStore,
    key: str,
    owner: str,
    ttl: float,
    meta: Mapping[str, str],
    *,
    task_id: str,
    wait: float,
    signal: str,
) -> Lock | None:
    """Take ``key`` for ``owner``, cancelling whoever holds it.

    Returns the queued holder the key was taken from (revoked: its start is
    refused), for the caller to restore if its publish fails and to dismiss
    (``dismiss``) once it succeeded; ``None`` when the key was free or its
    holder was a running one that ended. One round trip on a free key, and
    over a queued holder on a ``RevokingTakeOver`` store (two on another
    ``QueuedTakeOver`` store), as ``replace``.
    Raises ``CancelTimeout`` when the key is still held ``wait`` seconds
    after the first cancel.
    """
    runtime = task.dedup_config().runtime
    deadline = time.monotonic() + wait
    terminated_at: dict[str, float] = {}
    pause = _POLL
    while True:
        revoked_ttl = runtime.settings.revoked_ttl
        if revoking_take_over(store) is not None or isinstance(store, QueuedTakeOver):
            # A queued holder is taken over and refused its start (its marker).
            holder = replace_holder(store, key, owner, ttl, meta, revoked_ttl, queued_only=True)
            if holder is None:
                return None
            if not holder.started:
                return holder
        else:
            holder = store.acquire(key, owner, ttl, meta)
            if holder is None or holder.owner == owner:
                return None
        if holder.started and _is_own_run(task, key, holder):
            raise CancelOwnRunError(task.name, key, holder.task_id)
        running = holder.started
        if not running or holder.owner not in terminated_at:
            # Queued: the lock goes at once. Running: its copies are refused.
            outcome = store.revoke(key, holder.owner, max(holder.ttl, revoked_ttl))
            if outcome is RevokeOutcome.RELEASED:
                taken = store.acquire(key, owner, ttl, meta)
                if taken is None or taken.owner == owner:
                    return holder
                # Another call took the freed key: the holder stays cancelled
                # (this call's publish covers its work); cancel the new one.
                dismiss(task, key, task_id, holder)
                continue
            running = outcome is RevokeOutcome.RUNNING
        now = time.monotonic()
        if running and now - terminated_at.get(holder.owner, -_RESEND) >= _RESEND:
            if holder.owner not in terminated_at:
                runtime.metrics.incr(task.name, "cancelled")
                _announce(task, key, task_id, holder, running=True, signal=signal)
            terminated_at[holder.owner] = now
            _terminate(task, holder, signal)
        if now >= deadline:
            raise CancelTimeout(task.name, key, holder.task_id, wait)
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(pause * 2, _MAX_POLL)


def _is_own_run(task: DedupTaskLike, key: str, holder: Lock) -> bool:
    """Whether the running ``holder`` is the worker task making this call.

    It would revoke and terminate itself, then wait for its own end.
    """
    current = task.app.current_worker_task
    if current is None:
        return False
    request = current.request
    header = header_of(request)
    return (
        header is not None
        and header.key == key
        and header.owner(str(request.id)) == holder.owner
    )


def dismiss(task: DedupTaskLike, key: str, task_id: str, holder: Lock) -> None:
    """The new call published over the revoked queued ``holder``: report it, drop its message."""
    task.dedup_config().runtime.metrics.incr(task.name, "cancelled")
    _announce(task, key, task_id, holder, running=False, signal=None)
    drop_message(task, key, holder.task_id, task_id, "cancelled")


def _announce(
    task: DedupTaskLike,
    key: str,
    task_id: str,
    holder: Lock,
    *,
    running: bool,
    signal: str | None,
) -> None:
    logger.info(
        "celery-dedup: %s[%s] %s by a cancel_running call (%s)",
        task.name,
        holder.task_id,
        "terminated" if running else "revoked",
        task_id,
    )
    if holder_cancelled.receivers:
        holder_cancelled.send(
            sender=task,
            key=key,
            task_id=task_id,
            cancelled_task_id=holder.task_id,
            running=running,
            terminate_signal=signal,
            policy=POLICY,
        )


def drop_message(task: DedupTaskLike, key: str, superseded_id: str, new_id: str, why: str) -> None:
    """Tell workers to drop a superseded queued message (saves work; its start claim
    refuses it anyway).

    Never when both calls share one id, nor for ``key``'s deterministic id:
    workers remember a revoked id for hours and would discard the new
    message, or the next call that publishes under that id. ``why`` names
    the superseded task in the warning a failed broadcast logs
    ("replaced", "cancelled").
    """
    if superseded_id in (new_id, deterministic_task_id(key)):
        return
    try:
        task.app.control.revoke(superseded_id)
    except Exception:
        logger.warning(
            "celery-dedup: could not broadcast revoke of a %s task", why, exc_info=True
        )


def _terminate(task: DedupTaskLike, holder: Lock, signal: str) -> None:
    """Ask the worker running ``holder`` to terminate it (matched on its owner token)."""
    try:
        task.app.control.broadcast(
            "dedup_terminate", arguments={"token": holder.owner, "signal": signal}
        )
    except Exception:
        logger.warning(
            "celery-dedup: could not broadcast terminate of a cancelled task", exc_info=True
        )
