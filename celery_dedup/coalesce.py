"""``on_duplicate="keep_last"``: one run in progress per key, plus one queued follow-up.

The producer side is ``replace``'s take-over: a call takes the key over
and marks the previous owner revoked (one round trip on a
``RevokingTakeOver`` store, two elsewhere). A queued holder that had not started never
runs; a holder whose run is in progress runs to its end (its
owner-checked release no longer finds its lock, and only copies of it,
should its worker die, are refused), and the new message is its
*follow-up*. Every later call replaces the follow-up while it waits, so
the one that eventually runs carries the latest call's arguments.

What keeps a follow-up from running beside the run in progress is the
key's **run gate**, kept with the run records (``runs``, ``RunRef.gated``):
every ``keep_last`` run holds it from its start to its end, in the same
store calls as its running lease and done marker, owned by its delivery
token and renewed with its lease by the worker's main process. A message
that finds the gate held is deferred (published again a second later, as
a copy waiting for a running copy is, its lock kept alive meanwhile:
``keep_waiting``); a run whose worker dies gives the gate up when its pool
child is seen to die, or lets it lapse within one lease.

A call whose queued message is replaced is covered by the replacing
call's run: the replacing call leaves a *link* in the result backend (a
result stored under ``LINK_PREFIX`` + the replaced id, holding the
replacing id), and the ``CoalescedResult`` every ``keep_last`` call returns
follows the links from a ``REVOKED`` message to the run that covered it.

This module holds the follow-up's wait and the links: the take-over is
``DedupTask``'s, the gate the run records', the deferral the worker's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from celery import states
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult, EagerResult

from .exceptions import StoreError
from .stores.base import Lock, LockStore

__all__ = [
    "LINK_PREFIX",
    "WAIT",
    "CoalescedResult",
    "following",
    "keep_waiting",
    "link_replacement",
    "linked",
    "replacement_of",
    "wait_for",
]

logger = logging.getLogger("celery_dedup")


#: Seconds a follow-up waits between two looks at the gate (at most a third
#: of the lease): how late, at most, it starts after the run it follows.
WAIT = 1.0


def wait_for(lease: float) -> float:
    """How long a message that found the gate held waits before it looks again."""
    return min(WAIT, lease / 3.0)


def keep_waiting(store: LockStore, key: str, owner: str, ttl: float) -> None:
    """Keep a waiting follow-up's lock alive for ``ttl`` seconds (owner-checked, best effort).

    Its lock would otherwise expire while it waits for a long run, and a
    newer call would find the key free and run before it.
    """
    try:
        store.extend(key, owner, ttl)
    except StoreError as exc:
        logger.warning("celery-dedup: could not extend a waiting keep_last lock: %s", exc)


#: The result-backend id prefix of a "replaced by" link (a result of its own).
LINK_PREFIX = "celery-dedup-replaced-by-"


def link_replacement(backend: Any, replaced_id: str, replacing_id: str) -> None:
    """Record that ``replacing_id``'s run covers the call of ``replaced_id`` (best effort).

    Written before the replacing message is published, so a handle of the
    replaced call that finds it ``REVOKED`` always finds the link too.
    """
    if replaced_id == replacing_id:
        return
    try:
        backend.store_result(LINK_PREFIX + replaced_id, replacing_id, states.SUCCESS)
    except Exception as exc:  # no result backend, or it failed: the handle just ends REVOKED
        logger.warning(
            "celery-dedup: could not record that %s replaces %s: %s",
            replacing_id,
            replaced_id,
            exc,
        )


@contextmanager
def linked(backend: Any, previous: Lock | None, replacing_id: str) -> Iterator[None]:
    """Link a replaced queued message to the call replacing it around that call's publish.

    The link is written first (a replaced call's handle that finds its
    message ``REVOKED`` always finds it), and removed again if publishing
    raises (the previous holder then gets its key back and runs).
    """
    if previous is None or previous.started or previous.task_id == replacing_id:
        yield
        return
    link_replacement(backend, previous.task_id, replacing_id)
    try:
        yield
    except BaseException:
        with suppress(Exception):
            backend.forget(LINK_PREFIX + previous.task_id)
        raise


def replacement_of(backend: Any, task_id: str) -> str | None:
    """The id of the call that replaced ``task_id`` under ``keep_last``, if one did."""
    try:
        meta = backend.get_task_meta(LINK_PREFIX + task_id)
    except Exception:
        return None
    found = meta.get("result") if meta.get("status") == states.SUCCESS else None
    return found if isinstance(found, str) else None


if TYPE_CHECKING:
    _AsyncResult = AsyncResult[Any]
else:
    _AsyncResult = AsyncResult


class CoalescedResult(_AsyncResult):
    """The handle of a ``keep_last`` call: ``get()`` returns the result of the run that
    covered the call.

    That is the call's own run, or, when its message was replaced before it
    started, the run of the call that replaced it (followed to the last
    replacement). ``state`` and ``result`` stay those of the call's own
    message (``REVOKED`` when it was replaced). ``timeout`` bounds the whole
    wait.
    """

    def get(  # type: ignore[override]
        self, timeout: float | None = None, propagate: bool = True, **kwargs: Any
    ) -> Any:
        """Wait for the run that covered this call and return its result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        current: AsyncResult[Any] = self
        while True:
            # A replaced message may still be waiting to be skipped (or be
            # retried until its replacement starts): follow the link at once,
            # unless the message ran to its end after all (a lock its failed
            # run kept, then taken over: its own result is the answer).
            own: str = current.state
            replacing = None
            if own not in (states.SUCCESS, states.FAILURE):
                replacing = replacement_of(self.backend, str(current.id))
            if replacing is not None:
                current = AsyncResult(replacing, app=self.app, backend=self.backend)
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                value = AsyncResult.get(current, timeout=left, propagate=propagate, **kwargs)
            except TaskRevokedError:
                replacing = replacement_of(self.backend, str(current.id))
                if replacing is None:
                    raise
            else:
                state: str = current.state
                if propagate or state != states.REVOKED:
                    return value
                replacing = replacement_of(self.backend, str(current.id))
                if replacing is None:
                    return value
            current = AsyncResult(replacing, app=self.app, backend=self.backend)


def following(result: Any) -> Any:
    """A published ``keep_last`` call's handle as a ``CoalescedResult`` (others unchanged)."""
    if isinstance(result, EagerResult) or not isinstance(result, AsyncResult):
        return result  # an eager call ran already: nothing replaces it
    return CoalescedResult(result.id, backend=result.backend, app=result.app)
