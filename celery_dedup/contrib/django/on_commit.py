"""Transaction-scoped coalescing of ``delay_on_commit`` / ``apply_async_on_commit``.

Inside ``transaction.atomic()`` (the default database, as Celery's
``DjangoTask``; ``apply_async_on_commit(..., using=alias)`` for another), a
call registers one ``on_commit`` hook per lock key: a later call with the
same key (the key its lock would use) is folded into the pending one. On
commit the hook calls ``apply_async`` once: one store round trip, one
message. A rollback discards the hook: nothing is locked or published.

Savepoints need no bookkeeping of ours. Django drops the hooks registered
inside a savepoint that rolls back; a folded call was made inside every
savepoint its pending hook was registered in that is still open, so a
rollback that drops the hook also undoes the folded call's own part of the
transaction. The index of pending hooks is rebuilt from the connection's
hook list whenever Django replaced that list (a savepoint rollback, the
commit or rollback of the outer block).

Which pending call wins:

- ``on_duplicate="replace"``: the latest. A call folds into the pending
  one only when their delivered arguments are the same; otherwise it gets
  its own hook, and on commit each replaces the previous as usual.
- otherwise the first. A caller-given ``deduplication_key`` pending with
  different arguments is judged by ``on_key_reuse`` at the call
  (``KeyReuseError`` is raised there, before anything is registered).

At commit the publish follows the worker-side rules (``admission.canvas``):
its caller got ``None`` long ago and an exception would abort the commit's
later hooks, so no refusal raises there: a call over its rate waits for its
place in the window, a duplicate under ``on_duplicate="raise"`` answers the
holder's handle.

A call that takes no lock (``unique_for=None``, ``identity="always_unique"``
without a key) is never folded, nor is a call under ``dedup_mode="observe"``
(at commit each is published; a duplicate is counted, not folded). Outside
``atomic()`` the call is left to ``transaction.on_commit``: made at once
under autocommit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from celery.utils import uuid
from django.db import transaction

from ... import events
from ...admission.canvas import from_commit_hook
from ...key_reuse import differ, fingerprint, report
from ...options import DedupMode, OnDuplicate, ResolvedOptions, pop_call_options

__all__ = ["on_commit"]

#: the policy a folded call's ``task-deduplicated`` event names
POLICY: Final = "on_commit"

#: the attribute of a connection holding ``[hook list, its length, {key: pending call}]``
_INDEX: Final = "_celery_dedup_on_commit"


class _Pending:
    """One registered ``on_commit`` hook: the call that publishes for its key."""

    __slots__ = ("args", "fingerprint", "key", "kwargs", "options", "ran", "result", "task")

    def __init__(
        self,
        task: Any,
        key: str,
        fingerprint: str | None,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: Mapping[str, Any],
    ) -> None:
        self.task = task
        self.key = key
        self.fingerprint = fingerprint
        self.args = args
        self.kwargs = kwargs
        self.options = options
        #: what the commit's ``apply_async`` returned (the folded calls' events name it)
        self.result: Any = None
        #: whether the hook ran: it takes no more calls, even while it is still
        #: in the connection's list (``captureOnCommitCallbacks(execute=True)``
        #: in a ``TestCase`` runs the hooks without ending the transaction)
        self.ran = False

    def __call__(self) -> None:
        self.ran = True
        with from_commit_hook():
            self.result = self.task.apply_async(self.args, self.kwargs, **self.options)


def on_commit(
    task: Any,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any],
    using: str | None = None,
) -> None:
    """``task.apply_async(args, kwargs, **options)`` once the transaction commits, folded.

    ``using`` names the database whose transaction is waited for (default:
    the default database, as ``transaction.on_commit``). Returns ``None``
    (as Celery's ``delay_on_commit``): nothing is published before the
    commit, so there is no task id to hand out yet.
    """
    connection = transaction.get_connection(using)
    if not connection.in_atomic_block:
        # Django runs it at once (autocommit) or refuses (manual transactions).
        connection.on_commit(lambda: task.apply_async(args, kwargs, **options))
        return
    config = task.dedup_config()
    call_options = dict(options)
    given = pop_call_options(call_options, task.name)
    call: ResolvedOptions = config.resolve(given)
    key: str | None = None
    if given.get("unique_for", ...) is not None:
        queue = task.routed_queue(call_options, args, kwargs)
        key = task.dedup_key(args, kwargs, call, queue, call_options.get("serializer"))
    if key is None or call.mode is DedupMode.OBSERVE:
        # Observed, nothing is folded: at commit each call is published, a duplicate counted.
        connection.on_commit(lambda: _publish(task, args, kwargs, options))
        return
    serializer = str(options.get("serializer") or config.serializer)
    mine = fingerprint(config.binder, args, kwargs, serializer)
    index = _index(connection)
    pending = index.get(key)
    if pending is not None and pending.ran:
        pending = None
    if pending is not None:
        if call.on_duplicate is not OnDuplicate.REPLACE:
            if call.deduplication_key is not None and differ(mine, pending.fingerprint):
                report(task, call.on_key_reuse, key, "", None)
            _fold(task, connection, pending, args, kwargs)
            return
        if mine is not None and mine == pending.fingerprint:
            _fold(task, connection, pending, args, kwargs)
            return
    hook = _Pending(task, key, mine, args, kwargs, dict(options))
    connection.on_commit(hook)
    index[key] = hook
    _remember(connection, index)


def _publish(
    task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, options: Any
) -> None:
    with from_commit_hook():
        task.apply_async(args, kwargs, **options)


def _fold(
    task: Any,
    connection: Any,
    pending: _Pending,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> None:
    runtime = task.dedup_config().runtime
    runtime.metrics.incr(task.name, "coalesced")
    if runtime.settings.send_events:
        # A hook of its own, after the pending one: Django drops it with the
        # folded call when the savepoint it was made in rolls back.
        connection.on_commit(lambda: _report_fold(task, pending, args, kwargs))


def _report_fold(
    task: Any,
    pending: _Pending,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> None:
    """The folded call's ``task-deduplicated`` event, once its transaction committed."""
    holder = getattr(pending.result, "id", None)
    if holder is None:
        return
    events.send_deduplicated(
        task.app,
        task_name=task.name,
        duplicate_id=uuid(),
        holder_id=str(holder),
        args=args,
        kwargs=kwargs,
        policy=POLICY,
        result=f"coalesced on commit into {holder} ({POLICY})",
    )


def _index(connection: Any) -> dict[str, _Pending]:
    """``{key: the latest pending hook}`` of the connection's current transaction.

    Django replaces ``run_on_commit`` (never edits it in place) when a
    savepoint rolls back and when the outer block ends, so a cached index
    is valid while the list is the same object and has not shrunk.
    """
    hooks = connection.run_on_commit
    cached = getattr(connection, _INDEX, None)
    if cached is not None and cached[0] is hooks and cached[1] <= len(hooks):
        index: dict[str, _Pending] = cached[2]
        return index
    index = {}
    for entry in hooks:
        hook = entry[1]
        if isinstance(hook, _Pending):
            index[hook.key] = hook
    _remember(connection, index)
    return index


def _remember(connection: Any, index: dict[str, _Pending]) -> None:
    hooks = connection.run_on_commit
    setattr(connection, _INDEX, [hooks, len(hooks), index])
