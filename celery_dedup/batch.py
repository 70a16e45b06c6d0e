"""``enqueue_many``: publish a group under one batch-level lock (or each item deduplicated:
``per_item=True``, ``celery_dedup.bulk``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from celery import current_app, group
from celery.canvas import Signature
from celery.result import GroupResult

from .bulk import BulkResult, enqueue_per_item
from .exceptions import DuplicateTaskError, InvalidOptionError, StoreContention, StoreError
from .header import new_token
from .identity import caller_key_material, lock_key
from .options import OnDuplicate, validate_choice, validate_key, validate_positive_seconds
from .policy import UniqueUntil
from .runtime import runtime_for
from .signals import lock_acquired, task_deduplicated

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["BATCH_TASK_NAME", "enqueue_many"]

#: the task-name part of batch lock keys
BATCH_TASK_NAME = "celery_dedup.batch"


@overload
def enqueue_many(
    signatures: Iterable[Signature],
    *,
    deduplication_key: str,
    unique_for: float | None = None,
    on_duplicate: OnDuplicate | str | None = None,
    app: Celery | None = None,
    per_item: Literal[False] = False,
) -> GroupResult: ...


@overload
def enqueue_many(
    signatures: Iterable[Signature],
    *,
    unique_for: float | None = None,
    on_duplicate: OnDuplicate | str | None = None,
    app: Celery | None = None,
    per_item: Literal[True],
) -> BulkResult: ...


def enqueue_many(
    signatures: Iterable[Signature],
    *,
    deduplication_key: str | None = None,
    unique_for: float | None = None,
    on_duplicate: OnDuplicate | str | None = None,
    app: Celery | None = None,
    per_item: bool = False,
) -> GroupResult | BulkResult:
    """Publish ``signatures`` as one group, once per ``deduplication_key``; or, with
    ``per_item=True``, each signature as its own deduplicated call.

    The batch lock is released only by its TTL (``unique_for``, default
    ``dedup_default_ttl``). When the key is held, ``on_duplicate="existing"``
    returns the holder's ``GroupResult`` (``.deduplicated`` is True) and
    ``"raise"`` raises ``DuplicateTaskError``. Members are not deduplicated
    against each other.

    ``per_item=True`` (no ``deduplication_key``): every item is a call of
    its own, keyed as ``apply_async`` keys it, and the locks of all items
    that need only a lock are taken in one store round trip (Redis,
    PostgreSQL); items of the call with the same key: the first wins.
    Returns a ``BulkResult``: one ``ItemOutcome`` per signature, in input
    order (published, duplicate, refused or failed). ``unique_for`` and
    ``on_duplicate`` then apply to the ``DedupTask`` items that do not set
    their own; each item uses its own task's app (``app`` is not read).
    """
    if per_item:
        if deduplication_key is not None:
            raise InvalidOptionError(
                "deduplication_key", deduplication_key,
                "no batch key with per_item=True (each item is keyed as its own call)",
            )  # fmt: skip
        given: dict[str, Any] = {}
        if unique_for is not None:
            given["unique_for"] = validate_positive_seconds(unique_for, "unique_for")
        if on_duplicate is not None:
            given["on_duplicate"] = validate_choice(OnDuplicate, on_duplicate, "on_duplicate")
        return enqueue_per_item(signatures, given)
    if deduplication_key is None:
        raise InvalidOptionError("deduplication_key", None, "a non-empty string")
    return _enqueue_group(
        list(signatures),
        deduplication_key,
        unique_for,
        OnDuplicate.EXISTING if on_duplicate is None else on_duplicate,
        app,
    )


def _enqueue_group(
    sigs: list[Signature],
    deduplication_key: str,
    unique_for: float | None,
    on_duplicate: OnDuplicate | str,
    app: Celery | None,
) -> GroupResult:
    """The group under one batch lock (``enqueue_many`` without ``per_item``)."""
    app = app or (sigs[0].app if sigs else None) or current_app
    runtime = runtime_for(app)
    key_text = validate_key(deduplication_key)
    if key_text is None:
        raise InvalidOptionError("deduplication_key", deduplication_key, "a non-empty string")
    ttl = (
        runtime.settings.default_ttl
        if unique_for is None
        else validate_positive_seconds(unique_for, "unique_for")
    )
    mode = validate_choice(OnDuplicate, on_duplicate, "on_duplicate")
    if mode in (OnDuplicate.REPLACE, OnDuplicate.CANCEL_RUNNING, OnDuplicate.KEEP_LAST):
        raise ValueError(f"enqueue_many does not support on_duplicate={mode.value!r}")
    key = lock_key(runtime.settings.key_prefix, BATCH_TASK_NAME, caller_key_material(key_text))
    batch = group(sigs, app=app)
    frozen = cast(GroupResult, batch.freeze())
    group_id = str(frozen.id)
    owner = new_token()
    # Saved before the lock is taken: a duplicate that finds the lock always
    # restores the real members, never an empty group.
    _save(frozen)
    store = runtime.store
    holder = None
    if store is None:
        runtime.fall_back(BATCH_TASK_NAME, None)
    else:
        meta = {
            "task_name": BATCH_TASK_NAME,
            "policy": UniqueUntil.EXPIRY.value,
            "task_id": group_id,
        }
        try:
            holder = store.acquire(key, owner, ttl, meta)
        except StoreContention:
            raise  # the store answers: contention is never an outage
        except StoreError as exc:
            runtime.fall_back(BATCH_TASK_NAME, exc)
            store = None
    if holder is not None and holder.owner == owner:
        holder = None  # this call's own write, seen again by a re-sent command
    if holder is not None:
        runtime.metrics.incr(BATCH_TASK_NAME, "deduplicated")
        task_deduplicated.send(
            sender=None,
            key=key,
            existing_task_id=holder.task_id,
            duplicate_id=group_id,
            args=None,
            kwargs=None,
            ttl=holder.ttl,
        )
        if mode is OnDuplicate.RAISE:
            raise DuplicateTaskError(
                task_name=BATCH_TASK_NAME, key=key, existing_task_id=holder.task_id, ttl=holder.ttl
            )
        return _mark(_restore(app, holder.task_id), deduplicated=True, key=key)
    if store is not None:
        runtime.metrics.incr(BATCH_TASK_NAME, "acquired")
        lock_acquired.send(sender=None, key=key, task_id=group_id, ttl=ttl, policy="expiry")
    try:
        result = cast(GroupResult, batch.apply_async())
    except BaseException:
        if store is not None:
            store.release(key, owner)
        raise
    return _mark(result, deduplicated=False, key=key)


def _mark(result: GroupResult, *, deduplicated: bool, key: str) -> GroupResult:
    # GroupResult has no slots: tag it like DedupTask tags AsyncResult.
    setattr(result, "deduplicated", deduplicated)  # noqa: B010
    setattr(result, "deduplication_key", key)  # noqa: B010
    return result


def _save(result: GroupResult) -> None:
    # No group storage (rpc://) or no result backend at all.
    with contextlib.suppress(NotImplementedError, AttributeError):
        result.save()


def _restore(app: Any, group_id: str) -> GroupResult:
    try:
        restored = app.GroupResult.restore(group_id, app=app)
    except NotImplementedError:
        restored = None
    if restored is None:
        restored = app.GroupResult(group_id, [])
    return cast(GroupResult, restored)
