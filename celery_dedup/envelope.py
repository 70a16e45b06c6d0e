"""The worker's envelope around a task body: slot, start claim, body, end per policy.

Celery's tracer calls ``task.__call__`` (whenever a class defines one) and
stores the result only after it returned, so the envelope wraps the
``__call__`` the task class resolves: the end of a run (done marker,
release per policy) lands **before** the result is stored, and a
``result.get()`` that returns means an identical call is accepted again.

A subclass that overrides ``__call__`` without calling ``super()`` (Flask's
documented ``FlaskTask.__call__`` runs ``self.run`` inside an app context;
celery-eternal's task class) would otherwise run its body outside the
envelope: no claim, no lease, no slot, no release. ``DedupTask.__init_subclass__``
therefore wraps every ``__call__`` a subclass resolves (``wrap_call``), and
the envelope is re-entrant: an override that does call ``super().__call__``
runs the envelope once, at the outermost call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, Retry

from . import cancel_window, slots, worker
from .lifecycle import Outcome

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["is_wrapped", "run", "wrap_call"]

#: marks a ``__call__`` that runs the envelope (``wrap_call``, ``DedupTask.__call__``)
MARK = "_dedup_envelope"
#: the request attribute telling a nested ``__call__`` that the envelope runs already
_INSIDE = "dedup_enveloped"


def is_wrapped(call: Any) -> bool:
    """Whether ``call`` (a class's resolved ``__call__``) runs the envelope."""
    return bool(getattr(call, MARK, False))


def wrap_call(call: Callable[..., Any]) -> Callable[..., Any]:
    """A ``__call__`` that runs ``call`` (an override's own) inside the envelope."""

    @functools.wraps(call)
    def enveloped(self: DedupTask, *args: Any, **kwargs: Any) -> Any:
        return run(self, functools.partial(call, self), args, kwargs)

    setattr(enveloped, MARK, True)
    return enveloped


def run(task: DedupTask, call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run ``call(*args, **kwargs)`` (the body, through whatever ``__call__`` the class
    has) inside this message's concurrency slot and start claim, ending the run
    per policy before the tracer stores its result.
    """
    request = task.request
    if request.called_directly or getattr(request, _INSIDE, False):
        return call(*args, **kwargs)
    setattr(request, _INSIDE, True)
    try:
        slot = slots.enter(task, request, args, kwargs)  # a full limit defers the message
        try:
            return _claimed(task, request, call, args, kwargs)
        finally:
            slots.leave(slot)
    finally:
        setattr(request, _INSIDE, False)


def _claimed(
    task: DedupTask, request: Any, call: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """The body under its start claim; the end of the run recorded per outcome."""
    held = worker.claim_at_start(task, str(request.id), args, kwargs, request)
    if held is None:
        return _body(call, args, kwargs)
    request.dedup_held = held  # seen by on_replace
    try:
        retval = _body(call, args, kwargs)
    except Retry:
        worker.finish(task, held, Outcome.RETRIED)  # the retry holds the lock
        raise
    except Ignore:
        worker.finish(task, held, Outcome.IGNORED)
        raise
    except Reject as exc:
        requeued = getattr(exc, "requeue", False)
        worker.finish(task, held, Outcome.REQUEUED if requeued else Outcome.REJECTED)
        raise
    except Exception:
        worker.finish(task, held, Outcome.FAILURE)
        raise
    except BaseException as exc:
        if _greenlet_killed(exc):
            worker.finish(task, held, _killed_outcome())
        raise
    worker.finish(task, held, Outcome.SUCCESS)
    return retval


def _body(call: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """The body itself; once it ended, a cancel signal no longer raises (``cancel_window``)."""
    try:
        return call(*args, **kwargs)
    finally:
        cancel_window.body_ended()


def _greenlet_killed(exc: BaseException) -> bool:
    """Whether ``exc`` is a gevent/eventlet pool killing this body's greenlet.

    Those pools terminate a task (a revoke with ``terminate=True``,
    ``cancel_running``) by raising ``GreenletExit`` in it: the body's
    ``finally`` blocks run, its ``except Exception`` blocks do not.
    """
    greenlet = sys.modules.get("greenlet")
    killed = getattr(greenlet, "GreenletExit", None)
    return killed is not None and isinstance(exc, killed)


def _killed_outcome() -> Outcome:
    """A killed greenlet: terminated by a revoke, or by the worker's cold shutdown.

    A shutdown puts the message back (``acks_late``) or loses it as Celery
    does: its lease is given up and its lock kept, never a done marker that
    would make the redelivered copy skip as "already ran".
    """
    from celery.worker import state as worker_state

    flags: tuple[Any, ...] = (worker_state.should_stop, worker_state.should_terminate)
    if any(flag is not None and flag is not False for flag in flags):  # (an exit code, 0 too)
        return Outcome.REQUEUED
    return Outcome.REVOKED
