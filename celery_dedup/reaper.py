"""Release locks whose holder already ended in a state that should have freed them.

A worker that is SIGKILLed (or loses its store connection) after the
result backend recorded the task's end never releases its lock; the TTL
would. The reaper asks the result backend and releases, owner-checked,
every lock whose holder finished in a state its policy releases on:
``SUCCESS`` for ``success``/``finish``, ``FAILURE`` for ``finish``,
``REVOKED`` for everything but ``expiry``.

A result belongs to a task id, not to a run: with ``deterministic_id`` every
run of a key shares one id, so a stored SUCCESS may be an earlier run's.
Locks held under a deterministic id are therefore never reaped (their TTL
frees them); every other lock is reaped only if its holder's message
started (a queued holder has no result of its own yet, whatever is stored
under its id) and for a result stored after the lock was taken, and
always through its owner token.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import states

from .identity import deterministic_task_id
from .policy import UniqueUntil
from .runtime import runtime_for
from .signals import lock_released
from .stores.base import Lock

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["REAP_TASK_NAME", "reap", "register_reaper", "result_of_this_run", "should_release"]

logger = logging.getLogger("celery_dedup")

#: the name of the task ``register_reaper`` adds to an app
REAP_TASK_NAME = "celery_dedup.reap"


def should_release(lock: Lock, state: str) -> bool:
    """Whether a holder that ended in ``state`` should have released ``lock``."""
    try:
        policy = UniqueUntil(lock.policy)
    except ValueError:
        return False
    if state == states.SUCCESS:
        return policy.releases_on_success()
    if state == states.FAILURE:
        return policy.releases_on_failure()
    if state == states.REVOKED:
        return policy.releases_on_revoke()
    return False


def result_of_this_run(date_done: Any, lock: Lock) -> bool:
    """Whether a result stored at ``date_done`` belongs to the run holding ``lock``.

    A result belongs to a task id, not a run: an older run of a reused id
    (``deterministic_id``) must not pass for this one, so deterministic ids
    never count, and others only for a result newer than the lock.
    """
    if lock.task_id == deterministic_task_id(lock.key):
        return False
    if isinstance(date_done, str):
        date_done = datetime.fromisoformat(date_done)
    if not isinstance(date_done, datetime):
        return False
    if date_done.tzinfo is None:
        date_done = date_done.replace(tzinfo=timezone.utc)
    return bool(date_done.timestamp() >= lock.acquired_at)


def reap(app: Celery, *, task_name: str | None = None) -> list[Lock]:
    """Release the locks of finished holders; return the locks released.

    One result-backend read per live lock: a maintenance job, not a hot path.
    """
    runtime = runtime_for(app)
    store = runtime.store
    if store is None:
        return []
    prefix = f"{runtime.settings.key_prefix}:{task_name + ':' if task_name else ''}"
    released: list[Lock] = []
    for lock in list(store.scan(prefix)):
        if not lock.started:
            continue
        result = app.AsyncResult(lock.task_id)
        state = result.state
        if not should_release(lock, state) or not result_of_this_run(result.date_done, lock):
            continue
        if store.release(lock.key, lock.owner):
            released.append(lock)
            runtime.metrics.incr(lock.task_name, "released_manual")
            lock_released.send(sender=None, key=lock.key, task_id=lock.task_id, reason="reaped")
            logger.info(
                "celery-dedup: reaped lock %s of %s[%s] (%s)",
                lock.key.rsplit(":", 1)[-1][:16], lock.task_name, lock.task_id, state,
            )
    return released


def register_reaper(app: Celery) -> Any:
    """Add the ``celery_dedup.reap`` task to ``app``, to run from ``beat_schedule``.

    ::

        register_reaper(app)
        app.conf.beat_schedule = {
            "dedup-reap": {"task": "celery_dedup.reap", "schedule": 300.0},
        }
    """

    @app.task(name=REAP_TASK_NAME, shared=False)
    def reap_locks() -> int:
        return len(reap(app))

    return reap_locks
