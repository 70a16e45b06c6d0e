"""What Celery does with a message whose run the worker's main process ends.

When a pool child dies (a hard time limit killed it, or it was lost), the
worker's main process decides the message's fate: it fails, Celery puts it
back in its queue (``Reject(requeue=True)`` semantics), or Celery publishes
it again as a retry (``retry_on_worker_lost``). The run's lock and run
record must follow the same fate: a message put back or retried runs again,
under the lock its publish took, so its run must not be recorded as done
nor its lock released. The main process has to know the fate *before*
Celery stores the failure (a ``result.get()`` that returns means the lock
is already released), so the predicates below mirror
``celery.worker.request.Request.on_failure`` and ``on_timeout`` (Celery 5.7;
older versions lack the attributes, and read as their defaults).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from celery.app.task import Context

from .lifecycle import Outcome

__all__ = ["after_time_limit", "after_worker_lost", "as_running", "retries_worker_lost"]


def _acks_on_timeout(task: Any) -> bool:
    """``Task.acks_on_timeout``, falling back as ``Task.bind`` does (``True`` by default)."""
    for name in ("acks_on_timeout", "acks_on_failure_or_timeout"):
        value = getattr(task, name, None)
        if value is not None:
            return bool(value)
    return True


def after_time_limit(task: Any) -> Outcome:
    """The fate of a message a hard time limit killed: put back, or failed.

    ``acks_late`` without ``acks_on_timeout`` (or
    ``acks_on_failure_or_timeout=False``): Celery rejects the message with
    ``requeue=True``, so it runs again.
    """
    if getattr(task, "acks_late", False) and not _acks_on_timeout(task):
        return Outcome.REQUEUED
    return Outcome.FAILURE


def _retries_exhausted(task: Any, request: Any) -> bool:
    """``request`` is a message's request context, or its request dict."""
    max_retries = getattr(task, "max_retries", None)
    if isinstance(request, Mapping):
        retries = request.get("retries")
    else:
        retries = getattr(request, "retries", None)
    return max_retries is not None and int(retries or 0) >= max_retries


def retries_worker_lost(task: Any, request: Any) -> bool:
    """Whether Celery retries a message whose pool child was lost (``retry_on_worker_lost``)."""
    return bool(getattr(task, "retry_on_worker_lost", False)) and not _retries_exhausted(
        task, request
    )


def after_worker_lost(task: Any, request: Any) -> Outcome:
    """The fate of a message whose pool child was lost, when it is not retried.

    ``acks_late`` with ``reject_on_worker_lost``: put back (unless
    ``retry_on_worker_lost`` ran out of retries); otherwise failed.
    """
    exhausted = bool(getattr(task, "retry_on_worker_lost", False)) and _retries_exhausted(
        task, request
    )
    requeues = getattr(task, "acks_late", False) and getattr(task, "reject_on_worker_lost", False)
    return Outcome.REQUEUED if requeues and not exhausted else Outcome.FAILURE


@contextmanager
def as_running(task: Any, request: Any) -> Iterator[None]:
    """Run the block as if ``request`` were ``task``'s running request.

    Celery's ``retry_on_worker_lost`` publishes the retry from the worker's
    main process, where no task runs: inside this block the publish is the
    holder's own republish (``self.retry()``), which keeps the lock and is
    never taken for a duplicate of the lost run.
    """
    from celery import _state

    stack: Any = _state._task_stack  # type: ignore[attr-defined]  # (no public push)
    context = Context(
        dict(getattr(request, "request_dict", None) or {}),
        args=getattr(request, "args", None),
        kwargs=getattr(request, "kwargs", None),
        called_directly=False,
    )
    task.request_stack.push(context)
    stack.push(task)
    try:
        yield
    finally:
        stack.pop()
        task.request_stack.pop()
