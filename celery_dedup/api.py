"""Producer-side helpers: the key of a call, a lock's holder, release and revoke."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from celery import current_app

from .exceptions import DedupError
from .options import pop_call_options
from .runtime import runtime_for
from .signals import lock_released
from .stores.base import Lock, LockStore

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
    return task.dedup_key(args, kwargs, call, call_options.get("queue"))


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

    ``target`` is a result returned by ``apply_async`` (its id is the owner)
    or a key. With a bare key, pass ``owner=`` or ``force=True`` (release
    whoever holds it now; still a compare-and-delete on that holder).
    """
    app, store = _store(app)
    if isinstance(target, str):
        key = target
        if owner is None:
            if not force:
                raise ValueError("release(key) needs owner= or force=True")
            holder = store.get(key)
            if holder is None:
                return False
            owner = holder.owner
    else:
        found = getattr(target, "deduplication_key", None) or _key_of_owner(store, app, target.id)
        if found is None:
            return False
        key, owner = found, owner or target.id
    released = store.release(key, owner)
    if released:
        _count_release(app, key)
        lock_released.send(sender=None, key=key, task_id=owner, reason="manual")
    return released


def revoke(
    result: Result | str,
    *,
    terminate: bool = False,
    signal: str | None = None,
    key: str | None = None,
    app: Celery | None = None,
) -> bool:
    """Revoke a task through ``app.control`` and release its lock at once.

    A revoked task still in the broker (or waiting for its ETA) would only
    release its lock when a worker reaches it; this releases it now,
    owner-checked, so new calls are not blocked. Returns whether a lock was
    released.
    """
    task_id = result if isinstance(result, str) else result.id
    app = app or getattr(result, "app", None) or current_app
    app.control.revoke(task_id, terminate=terminate, signal=signal or "SIGTERM")
    key = key or getattr(result, "deduplication_key", None)
    _, store = _store(app)
    key = key or _key_of_owner(store, app, task_id)
    if key is None:
        return False
    released = store.release(key, task_id)
    if released:
        _count_release(app, key)
        lock_released.send(sender=None, key=key, task_id=task_id, reason="revoked")
    return released


def _key_of_owner(store: LockStore, app: Celery, task_id: str) -> str | None:
    """Find the key a task id holds by scanning (slow path: prefer passing the key)."""
    prefix = runtime_for(app).settings.key_prefix + ":"
    return next((lock.key for lock in store.scan(prefix) if lock.owner == task_id), None)


def _count_release(app: Celery, key: str) -> None:
    """Count a manual release under the task name the key carries."""
    runtime = runtime_for(app)
    task_name = key.rsplit(":", 1)[0].removeprefix(runtime.settings.key_prefix + ":")
    runtime.metrics.incr(task_name, "released")
