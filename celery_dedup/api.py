"""Producer-side helpers: the key of a call, a lock's holder, release and revoke."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import current_app

from .exceptions import DedupError
from .identity import deterministic_task_id
from .options import pop_call_options
from .results import owner_of
from .runtime import runtime_for
from .signals import lock_released
from .stores.base import Lock, LockStore, RevokeOutcome

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

    Result = AsyncResult[Any]

    from .task import DedupTask

__all__ = ["dedup_key_for", "inspect_lock", "release", "revoke"]


def _store(app: Celery | None) -> tuple[Celery, LockStore]:
    app = app or current_app
    store = runtime_for(app).store
    if store is None:
        raise DedupError("this app has no lock store (set dedup_store)")
    return app, store


def dedup_key_for(
    task: DedupTask,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> str | None:
    """The lock key ``task.apply_async(args, kwargs, **options)`` would use.

    ``None`` when that call would take no lock (``identity="always_unique"``
    without a key, or ``unique_for=None``).
    """
    call_options = dict(options)
    given = pop_call_options(call_options)
    if "unique_for" in given and given["unique_for"] is None:
        return None
    call = task.dedup_config().resolve(given)
    queue = task.routed_queue(call_options, args, kwargs)
    return task.dedup_key(args, kwargs, call, queue, call_options.get("serializer"))


def inspect_lock(key: str, *, app: Celery | None = None) -> Lock | None:
    """The live lock at ``key`` (holder task id, task name, policy, expiry), or ``None``."""
    return _store(app)[1].get(key)


def release(
    target: Result | str,
    *,
    owner: str | None = None,
    force: bool = False,
    app: Celery | None = None,
) -> bool:
    """Release a lock, owner-checked. Returns whether a lock was deleted.

    ``target`` is a result returned by ``apply_async`` (the lock is released
    only while that task still holds it) or a key. With a bare key, pass
    ``owner=`` (the holder's task id or owner token) or ``force=True``
    (release whoever holds it now; still a compare-and-delete on that
    holder's token, so a newer holder is never freed by a stale call).
    """
    app, store = _store(app or getattr(target, "app", None))
    if isinstance(target, str):
        holder = store.get(target)
        if owner is None and not force:
            raise ValueError("release(key) needs owner= or force=True")
        if holder is None or (owner is not None and owner not in (holder.owner, holder.task_id)):
            return False
    else:
        key = getattr(target, "deduplication_key", None)
        holder = _lock_of(store, app, target.id, key, owner_of(target))
        if holder is None:
            return False
    released = store.release(holder.key, holder.owner)
    if released:
        _count_release(app, holder.key)
        lock_released.send(sender=None, key=holder.key, task_id=holder.task_id, reason="manual")
    return released


def revoke(
    result: Result | str,
    *,
    terminate: bool = False,
    signal: str | None = None,
    key: str | None = None,
    app: Celery | None = None,
) -> RevokeOutcome:
    """Revoke a task through its lock's owner token (and ``app.control``).

    The task's owner token is marked revoked in the store, so its message
    never runs its body after this returns, even if the revoke broadcast is
    lost or every worker restarts. What happens to the lock is returned:

    - ``RevokeOutcome.RELEASED``: the message had not started; the lock is
      free at once for a new call;
    - ``RevokeOutcome.RUNNING``: the task is running and keeps its lock
      until it ends (or is terminated, with ``terminate=True``);
    - ``RevokeOutcome.NOT_HELD``: the task holds no lock (finished, expired,
      or never locked).

    The owner token of the handle's publish is marked revoked in every
    case, even when its lock already expired, so a message still queued
    never runs. Revoking one run never affects a later run reusing its task
    id: Celery's revoke-by-id (which would discard every later message with
    that id for hours) is sent only for the publish that holds the key, or
    for a bare task id nothing else is known of, never for deterministic
    ids; ``terminate=True`` reaches the others through the
    ``dedup_terminate`` control command, matched on the owner token.
    """
    task_id = result if isinstance(result, str) else result.id
    app = app or getattr(result, "app", None) or current_app
    app, store = _store(app)
    key = key or getattr(result, "deduplication_key", None)
    owner = owner_of(result)
    lock = _lock_of(store, app, task_id, key, owner)
    outcome = RevokeOutcome.NOT_HELD
    revoked_ttl = runtime_for(app).settings.revoked_ttl
    if lock is not None:
        outcome = store.revoke(lock.key, lock.owner, max(lock.ttl, revoked_ttl))
        key, owner = lock.key, lock.owner
    elif owner is not None and key is not None:
        # The lock expired (or passed to a later call): the message may still
        # be queued, and the marker is all that stops it.
        store.revoke(key, owner, revoked_ttl)
    deterministic = key is not None and task_id == deterministic_task_id(key)
    # Celery's revoke-by-id discards every message with this id for hours: only
    # for the publish that holds the key, or a bare id nothing else is known of.
    if not deterministic and (lock is not None or owner is None):
        app.control.revoke(task_id, terminate=terminate, signal=signal or "SIGTERM")
    elif terminate and owner is not None:
        app.control.broadcast(
            "dedup_terminate", arguments={"token": owner, "signal": signal or "SIGTERM"}
        )
    if outcome is RevokeOutcome.RELEASED and lock is not None:
        _count_release(app, lock.key)
        lock_released.send(sender=None, key=lock.key, task_id=task_id, reason="revoked")
    return outcome


def _lock_of(
    store: LockStore, app: Celery, task_id: str, key: str | None, owner: str | None = None
) -> Lock | None:
    """The lock ``task_id`` holds: at ``key`` if known, else found by scanning (slow).

    With ``owner`` (the handle ``apply_async`` returned knows its publish's
    token) only that publish's lock matches, so an old handle never acts on
    a later run reusing its task id (deterministic ids).
    """
    if key is not None:
        locks: Iterable[Lock] = [lock] if (lock := store.get(key)) is not None else []
    else:
        locks = store.scan(runtime_for(app).settings.key_prefix + ":")
    for lock in locks:
        if lock.task_id == task_id and (owner is None or lock.owner == owner):
            return lock
    return None


def _count_release(app: Celery, key: str) -> None:
    """Count a manual release under the task name the key carries."""
    runtime = runtime_for(app)
    task_name = key.rsplit(":", 1)[0].removeprefix(runtime.settings.key_prefix + ":")
    runtime.metrics.incr(task_name, "released_manual")
