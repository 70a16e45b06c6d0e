"""Worker-side lock handling: release per policy, the start guard, revokes and retries.

Runs in pool children (``before_start``, ``on_success``, ``on_failure``) and
in the worker's main process (``task_revoked``, hard time limits). Every
release is owner-checked and idempotent; store clients are per process
(redis-py pools reset themselves after a fork, the SQL store disposes its
engine), so nothing here shares a connection across a fork.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from celery import states
from celery.exceptions import Ignore
from celery.signals import task_received, task_revoked

from .exceptions import StoreUnavailable
from .header import HEADER, LockHeader, read_header
from .policy import UniqueUntil, lock_ttl
from .signals import lock_acquired, lock_released, task_skipped
from .stores.base import LockStore

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["on_outcome", "on_start", "release", "republish_as_holder"]

logger = logging.getLogger("celery_dedup")

# Requests the worker's main process has received, by task id. A hard time
# limit calls on_failure in the main process, where task.request is empty;
# this is how that call finds the message's header. Weak: no leak.
_received: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def short(key: str) -> str:
    """A key as logged: its digest's first 16 hex digits, never raw material."""
    return key.rsplit(":", 1)[-1][:16]


def release(task: DedupTask, store: LockStore, key: str, task_id: str, reason: str) -> bool:
    """Owner-checked release; a store outage is logged, never raised (the TTL bounds it)."""
    try:
        released = store.release(key, task_id)
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
        task.dedup_config().runtime.metrics.incr(task.name, "released")
        lock_released.send(sender=task, key=key, task_id=task_id, reason=reason)
        logger.debug(
            "celery-dedup: released %s of %s[%s] (%s)", short(key), task.name, task_id, reason
        )
    return released


def republish_as_holder(
    task: DedupTask,
    task_id: str,
    options: dict[str, Any],
    publish: Callable[[str, LockHeader], Any],
) -> Any:
    """A ``retry()``/``replace()`` by the holder: keep the lock, extend its TTL, publish.

    The TTL becomes the retry's delay plus ``unique_for``. If the lock
    expired meanwhile it is taken again; if another task took it, the retry
    is published all the same (a retry is never dropped) and that is logged.
    """
    current = task.app.current_worker_task
    header = read_header(options.get("headers")) or (
        current.dedup_header(task_id)
        if current is not None and hasattr(current, "dedup_header")
        else None
    )
    if header is None or header.key is None:
        return publish(task_id, header or LockHeader())
    runtime = task.dedup_config().runtime
    store = runtime.store
    if store is not None:
        ttl = lock_ttl(
            header.unique_for, countdown=options.get("countdown"), eta=options.get("eta")
        )
        try:
            if not store.extend(header.key, task_id, ttl):
                holder = store.acquire(
                    header.key,
                    task_id,
                    ttl,
                    {"task_name": task.name, "policy": header.until.value},
                )
                if holder is not None and holder.owner != task_id:
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


def _skip(task: DedupTask, task_id: str, key: str, holder_id: str | None, reason: str) -> None:
    """End the task in state IGNORED without running its body."""
    logger.info(
        "celery-dedup: skipping %s[%s]: lock %s is held by another task (%s)",
        task.name,
        task_id,
        short(key),
        reason,
    )
    task.dedup_config().runtime.metrics.incr(task.name, "skipped")
    task_skipped.send(
        sender=task, key=key, task_id=task_id, existing_task_id=holder_id, reason=reason
    )
    if not task.request.is_eager or task.app.conf.task_store_eager_result:
        task.update_state(
            task_id=task_id,
            state=states.IGNORED,
            meta={"skipped": reason, "deduplication_key": key},
        )
    raise Ignore(f"celery-dedup: duplicate of a running task ({reason})")


def on_start(task: DedupTask, task_id: str, args: Any, kwargs: Any) -> None:
    """``before_start``: guard messages that bypassed ``apply_async``; release ``start`` locks."""
    header = task.dedup_header(task_id)
    runtime = task.dedup_config().runtime
    store = runtime.store
    if store is None:
        return
    if header is None:
        header = _guard_unannounced(task, store, task_id, args, kwargs)
        if header is None:
            return
    elif header.replace and header.key is not None:
        try:
            holder = store.get(header.key)
        except StoreUnavailable:
            holder = None
        if holder is not None and holder.owner != task_id:
            _skip(task, task_id, header.key, holder.owner, "replaced")
    if header.key is not None and header.until is UniqueUntil.START:
        release(task, store, header.key, task_id, "start")


def _guard_unannounced(
    task: DedupTask, store: LockStore, task_id: str, args: Any, kwargs: Any
) -> LockHeader | None:
    """A message with no ``celery_dedup`` header (``send_task``, ``celery call``).

    The worker takes the lock itself, owned by this task id; if another task
    holds it, the body is skipped. Returns the header the task now runs under.
    """
    config = task.dedup_config()
    call = config.resolve({})
    queue = (task.request.delivery_info or {}).get("routing_key")
    try:
        key = task.dedup_key(args, kwargs, call, queue)
    except (TypeError, ValueError) as exc:
        logger.warning("celery-dedup: %s[%s] runs unguarded: %s", task.name, task_id, exc)
        return None
    if key is None:
        return None
    header = LockHeader(key=key, until=call.unique_until, unique_for=config.unique_for)
    ttl = config.unique_for
    meta = {"task_name": task.name, "policy": call.unique_until.value}
    try:
        holder = store.acquire(key, task_id, ttl, meta)
    except StoreUnavailable as exc:
        logger.warning("celery-dedup: %s[%s] runs unguarded: %s", task.name, task_id, exc)
        return None
    if holder is not None and holder.owner != task_id:
        _skip(task, task_id, key, holder.owner, "unannounced duplicate")
    if holder is None:
        config.runtime.metrics.incr(task.name, "acquired")
        lock_acquired.send(
            sender=task, key=key, task_id=task_id, ttl=ttl, policy=call.unique_until.value
        )
    # Remember it for the release hooks of this same request.
    headers = task.request.headers
    if isinstance(headers, dict):
        headers[HEADER] = header.encode()
    else:
        task.request.headers = {HEADER: header.encode()}
    return header


def on_outcome(task: DedupTask, task_id: str, *, succeeded: bool) -> None:
    """``on_success``/``on_failure``: release when the policy says so."""
    header = task.dedup_header(task_id)
    if header is None or header.key is None:
        return
    if succeeded and header.until.releases_on_success():
        reason = "success"
    elif not succeeded and header.until.releases_on_failure():
        reason = "failure"
    else:
        return
    store = task.dedup_config().runtime.store
    if store is not None:
        release(task, store, header.key, task_id, reason)


def header_from_main_process(task_id: str) -> LockHeader | None:
    """The header of a request this (main) process received, if it is still alive."""
    request = _received.get(task_id)
    if request is None:
        return None
    return read_header(request.request_dict)


@task_received.connect(weak=False)
def _remember_request(sender: Any = None, request: Any = None, **_: Any) -> None:
    task = getattr(request, "task", None)
    if request is not None and hasattr(task, "dedup_config"):
        _received[request.id] = request


@task_revoked.connect(weak=False)
def _release_revoked(
    sender: Any = None, request: Any = None, expired: bool = False, **_: Any
) -> None:
    """A revoked or expired message releases its lock (except ``expiry``)."""
    if request is None or not hasattr(sender, "dedup_config"):
        return
    raw: Mapping[str, Any] = request.headers or {}
    header = read_header(raw) or read_header({HEADER: getattr(request, HEADER, None)})
    if header is None or header.key is None or not header.until.releases_on_revoke():
        return
    store = sender.dedup_config().runtime.store
    if store is not None:
        release(sender, store, header.key, request.id, "expired" if expired else "revoked")
