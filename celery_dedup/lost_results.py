"""A result lost with its worker: stored as an honest failure by the copy that finds it.

A run's end is recorded (its done marker) before Celery's tracer stores the
task's result, sends ``task_postrun`` and, with ``acks_late``, acknowledges
the message. A worker killed whole in that instant leaves a done run with no
result: the broker redelivers the message and the copy finds the run done.
It must not run the body again (a payment is not charged twice), yet
storing nothing leaves the caller's ``get()`` waiting for ever.

So a copy that finds its run done, in that one case, stores a ``FAILURE``
with ``ResultLost`` under the task id, through Celery's own backend API. It
does so only when all of these hold, asked in this order (the cheap ones
first, each on this rare path only):

* the task stores results (no ``ignore_result``) under an id no later
  publish reuses (not a deterministic id: that id may be a newer run's);
* the done marker says the body ended for good (``"success"`` or
  ``"failure"``): a retry's own message stores the final state, a skipped
  or revoked run has none to store (one store read: ``RunRecords.done_by``);
* the process that ended the run is known dead (``incarnation.died``): a
  live one, or one on another machine, is about to store the result itself;
* the result backend holds no ready state for the task id (one backend
  read): a stored result is never overwritten.

``link_error`` callbacks are not called: the body may have succeeded.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states

from . import incarnation
from .exceptions import ResultLost, StoreError
from .identity import deterministic_task_id
from .lifecycle import DedupTaskLike, Outcome
from .stores.base import RunRecords, RunRef

__all__ = ["store_lost_result"]

logger = logging.getLogger("celery_dedup")

#: How a body ended for good: its caller waits for that result.
_FINAL = frozenset({Outcome.SUCCESS.value, Outcome.FAILURE.value})


def store_lost_result(
    task: DedupTaskLike, task_id: str, records: RunRecords, run: RunRef, request: Any
) -> bool:
    """A copy found its run done: store ``ResultLost`` if that run's result was lost.

    ``request`` is the copy's request context (Celery's ``mark_as_failure``
    reads a chord from it). Whether a state was stored. Never raises: a
    store or backend that does not answer leaves things as they were.
    """
    task_any: Any = task
    if task_any.ignore_result or getattr(request, "ignore_result", False):
        return False
    if run.key == "" or task_id == deterministic_task_id(run.key):
        return False
    try:
        done = records.done_by(run)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not read the done marker of %s[%s]: %s", task.name, task_id, exc
        )
        return False
    except Exception:  # an unreadable answer: never the copy's fate (it must not run)
        logger.exception(
            "celery-dedup: could not read the done marker of %s[%s]", task.name, task_id
        )
        return False
    if done is None:
        return False
    token, outcome = done
    if outcome not in _FINAL or not incarnation.died(token):
        return False
    backend = task_any.backend
    try:
        if backend.get_state(task_id) in states.READY_STATES:
            return False
        lost = ResultLost(task.name, task_id, outcome)
        backend.mark_as_failure(task_id, lost, request=request, call_errbacks=False)
    except Exception:
        logger.exception(
            "celery-dedup: could not store the lost result of %s[%s]", task.name, task_id
        )
        return False
    logger.warning(
        "celery-dedup: %s[%s] ran to its end (%s) but its worker died before its result "
        "was stored: stored as FAILURE (ResultLost); not run again",
        task.name,
        task_id,
        outcome,
    )
    return True
