"""``enqueue_many(per_item=True)``: many calls, each deduplicated, their locks in one round trip.

Admission as for one call (DESIGN "Admission"), every item at each step
before the next step starts:

1. resolve every item (options, route, key; ``DedupTask.prepare_call``):
   pure, so a bad item raises before anything is written;
2. in-call duplicates: an item whose key an earlier item of the call has
   follows that item (the first wins), without asking the store;
3. one ``acquire_many`` for the first item of every key that only needs a
   plain lock (``stores.base.BulkAcquire``: one round trip on Redis and
   PostgreSQL);
4. publish, in input order, the items that got their key; an item whose
   publish fails gives its key back at once and is reported ``failed``.

An item needing more than a plain lock (``rate_limit_per_key``, a
take-over: ``replace``, ``keep_last``, ``cancel_running``, a debounce;
``dedup_mode="observe"``, whose refused calls are published anyway) goes
through the normal single-call admission (``admission.admit``) in its
turn: correct, at its own round trips. So do canvases, group or chord
members, plain (non-``DedupTask``) tasks and calls taking no lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from celery.canvas import Signature

from . import otel
from .admission import Admission, admit, effects
from .admission.canvas import in_canvas, takes_over
from .admission.duplicate import answer as duplicate_answer
from .admission.lock import LockPlan, LockStep, failed, owner_token, taken
from .admission.publish import PublishStep
from .exceptions import (
    CancelTimeout,
    DeduplicationUnavailable,
    DuplicateTaskError,
    RateLimited,
    StoreContention,
    StoreError,
)
from .limits import limits_of
from .options import DedupMode
from .stores.base import Lock, LockStore, acquire_many
from .task import DedupTask

__all__ = ["BulkResult", "ItemOutcome", "ItemStatus", "enqueue_per_item"]

logger = logging.getLogger("celery_dedup")

#: refusals an item is reported with instead of raising them (nothing published, no lock)
_REFUSALS = (DuplicateTaskError, RateLimited, CancelTimeout, DeduplicationUnavailable)


class ItemStatus(str, Enum):
    """What became of one item of ``enqueue_many(per_item=True)``."""

    #: published: ``result`` is its ``AsyncResult`` (``deduplicated=False``)
    PUBLISHED = "published"
    #: its key was held (by an earlier item of the call, or another call):
    #: nothing published; ``result`` is the holder's ``DeduplicatedResult``
    DUPLICATE = "duplicate"
    #: refused (``on_duplicate="raise"``, ``on_key_reuse="raise"``, ``RateLimited``,
    #: ``CancelTimeout``, ``DeduplicationUnavailable`` on the single-call path):
    #: nothing published, nothing held; ``error`` says why
    REFUSED = "refused"
    #: its publish failed: its key was given back; ``error`` is the publish's
    FAILED = "failed"


@dataclass(frozen=True)
class ItemOutcome:
    """One item's outcome: its place in the input, status, handle and error."""

    index: int
    status: ItemStatus
    #: the published ``AsyncResult``, the holder's ``DeduplicatedResult``, or ``None``
    result: Any = None
    #: why the item was refused or failed
    error: BaseException | None = None


class BulkResult(tuple[ItemOutcome, ...]):
    """The outcomes of ``enqueue_many(per_item=True)``, one per signature, in input order."""

    __slots__ = ()

    @property
    def results(self) -> list[Any]:
        """Each item's handle (``None`` for a refused or failed item), in input order."""
        return [outcome.result for outcome in self]

    def with_status(self, status: ItemStatus | str) -> list[ItemOutcome]:
        """The outcomes of one status (``"published"``, ``"duplicate"``...)."""
        wanted = ItemStatus(status)
        return [outcome for outcome in self if outcome.status is wanted]


@dataclass
class _Item:
    """One signature on its way in."""

    index: int
    #: the call, resolved; ``None``: admitted by ``single`` alone
    adm: Admission | None = None
    #: the single-call path of an item that does not join the bulk round trip
    single: Callable[[], Any] | None = None
    plan: LockPlan | None = None
    #: the earlier item of the call with the same key
    first: _Item | None = None
    #: the store's answer for a bulk item: ``None`` when the key was taken
    holder: Lock | None = None
    outcome: ItemOutcome | None = None


def enqueue_per_item(signatures: Iterable[Signature], given: dict[str, Any]) -> BulkResult:
    """Admit each signature as its own call; the plain locks in one round trip per store.

    ``given``: call options applied to every item that does not set its own.
    """
    items = [_resolve(index, sig, given) for index, sig in enumerate(signatures)]
    _find_firsts(items)
    try:
        _acquire(items)
        for item in items:
            item.outcome = _settle(item)
    except BaseException:
        # Not the error of one publish (reported per item): an interrupt, or
        # a second store's refusal. No key stays held for a message never sent.
        for item in items:
            if item.outcome is None and item.plan is not None and item.adm is not None:
                LockStep().undo(item.adm)
        raise
    return BulkResult(item.outcome for item in items if item.outcome is not None)


# -- 1. resolve --------------------------------------------------------------


def _resolve(index: int, sig: Signature, given: dict[str, Any]) -> _Item:
    """The item's call, resolved as ``sig.apply_async()`` would resolve it."""
    if not isinstance(sig, Signature):
        raise TypeError(f"enqueue_many: item {index} is not a signature: {sig!r}")
    task = _dedup_task(sig)
    options = {**given, **sig.options}
    if task is None or in_canvas(options) or _own_apply_async(task):
        # A canvas, a plain or unknown task, a group or chord member, a subclass
        # with its own apply_async (the compat shims): its own path (``given``
        # only where a DedupTask reads it: Celery would publish it as message
        # properties).
        extra = {name: value for name, value in given.items() if name not in sig.options}
        if task is None:
            extra = {}
        return _Item(index, single=lambda: sig.apply_async(**extra))
    call = {
        name: options.pop(name, None)
        for name in ("task_id", "producer", "link", "link_error", "shadow")
    }
    prepared = task.prepare_call(
        tuple(sig.args), dict(sig.kwargs), call["task_id"], call["producer"], call["link"],
        call["link_error"], call["shadow"], options,
    )  # fmt: skip
    if not isinstance(prepared, Admission):
        return _Item(index, single=prepared)
    if _needs_more_than_a_lock(prepared):
        return _Item(index, adm=prepared, single=lambda: admit(prepared))
    return _Item(index, adm=prepared, plan=LockStep().plan(prepared))


def _dedup_task(sig: Signature) -> Any:
    """The ``DedupTask`` a one-task signature calls, else ``None`` (a canvas, another
    task class, a task this app does not know: ``sig.apply_async`` sends it by name)."""
    if sig.subtask_type is not None:
        return None
    try:
        task = sig.type
    except KeyError:
        return None
    return task if hasattr(task, "prepare_call") else None


def _own_apply_async(task: Any) -> bool:
    """A ``DedupTask`` subclass overriding ``apply_async``: only it knows what it adds."""
    return type(task).apply_async is not DedupTask.apply_async


def _needs_more_than_a_lock(adm: Admission) -> bool:
    """A rate window, a take-over, no store, or ``dedup_mode="observe"`` (a refused
    call is published anyway and counted): the single-call admission's steps."""
    limits = limits_of(adm.task)
    return (
        adm.store is None
        or adm.call.mode is DedupMode.OBSERVE
        or (limits is not None and limits.rate is not None)
        or takes_over(adm.call.on_duplicate, adm.options)
    )


# -- 2. in-call duplicates ---------------------------------------------------


def _find_firsts(items: Sequence[_Item]) -> None:
    """Point every item whose key an earlier item has at that item (the first wins)."""
    seen: dict[str, _Item] = {}
    for item in items:
        adm = item.adm
        if adm is None or adm.key is None or adm.call.mode is DedupMode.OBSERVE:
            continue  # (an observing item is admitted, or counted, on its own)
        key = adm.key
        first = seen.setdefault(key, item)
        if first is not item:
            item.first = first
            item.plan = None
            item.single = None


# -- 3. the round trip -------------------------------------------------------


def _acquire(items: Sequence[_Item]) -> None:
    """One ``acquire_many`` per store for the plain first items."""
    by_store: dict[int, tuple[LockStore, list[_Item]]] = {}
    for item in items:
        if item.plan is not None and item.adm is not None and item.adm.store is not None:
            entry = by_store.setdefault(id(item.adm.store), (item.adm.store, []))
            entry[1].append(item)
    for store, batch in by_store.values():
        requests = [
            (item.adm.key, item.plan.owner, item.plan.ttl, item.plan.meta)
            for item in batch
            if item.adm is not None and item.adm.key is not None and item.plan is not None
        ]
        try:
            answers = acquire_many(store, requests)
        except StoreContention:
            raise  # the store answers: contention is never an outage
        except StoreError as exc:
            _fall_back(batch, exc)
            continue
        for item, holder in zip(batch, answers, strict=True):
            assert item.plan is not None
            # A holder with the item's own token: its write, seen again by a re-sent command.
            item.holder = None if holder is not None and holder.owner == item.plan.owner else holder
            if item.holder is None:
                assert item.adm is not None
                taken(item.adm, item.plan, item.plan.owner)


def _fall_back(batch: Sequence[_Item], exc: StoreError) -> None:
    """The store did not answer: every item of it goes on per ``dedup_fallback``.

    Under ``"closed"`` every item's late-landing write is remembered for
    the sweeper before ``DeduplicationUnavailable`` is raised: nothing is
    published.
    """
    refusal: DeduplicationUnavailable | None = None
    for item in batch:
        assert item.adm is not None and item.plan is not None
        try:
            failed(item.adm, item.plan, item.plan.owner, exc)
        except DeduplicationUnavailable as error:
            refusal = refusal or error
    if refusal is not None:
        raise refusal


# -- 4. publish, in input order ----------------------------------------------


def _settle(item: _Item) -> ItemOutcome:
    if item.first is not None:
        return _follow(item, item.first)
    if item.plan is None:
        return _single(item)
    adm = item.adm
    assert adm is not None
    if item.holder is not None:
        return _duplicate(item.index, adm, item.holder, item.plan.owner)
    try:
        PublishStep().enter(adm)
    except Exception as exc:
        LockStep().undo(adm)  # a failed publish gives its key back
        logger.warning(
            "celery-dedup: enqueue_many item %d (%s) was not published: %r",
            item.index, adm.task.name, exc,
        )  # fmt: skip
        return ItemOutcome(item.index, ItemStatus.FAILED, error=exc)
    return ItemOutcome(item.index, ItemStatus.PUBLISHED, effects.apply(adm))


def _single(item: _Item) -> ItemOutcome:
    """An item the single-call path admits (its own round trips)."""
    assert item.single is not None
    try:
        result = item.single()
    except _REFUSALS as exc:
        return ItemOutcome(item.index, ItemStatus.REFUSED, error=exc)
    except Exception as exc:
        logger.warning("celery-dedup: enqueue_many item %d was not published: %r", item.index, exc)
        return ItemOutcome(item.index, ItemStatus.FAILED, error=exc)
    if getattr(result, "deduplicated", None) is True:
        return ItemOutcome(item.index, ItemStatus.DUPLICATE, result)
    return ItemOutcome(item.index, ItemStatus.PUBLISHED, result)


def _duplicate(index: int, adm: Admission, holder: Lock, owner: str) -> ItemOutcome:
    """A held key: reported as any duplicate call (signal, metric, event)."""
    try:
        result = duplicate_answer(adm, holder, owner)
    except _REFUSALS as exc:
        return ItemOutcome(index, ItemStatus.REFUSED, error=exc)
    return ItemOutcome(index, ItemStatus.DUPLICATE, result)


def _follow(item: _Item, first: _Item) -> ItemOutcome:
    """An item whose key an earlier item of the call has: that item's outcome decides.

    Published: a duplicate of it. A duplicate: of the same holder. Refused
    or failed: the same (the work under that key was not published).
    """
    adm, done = item.adm, first.outcome
    assert adm is not None and done is not None
    if done.status in (ItemStatus.REFUSED, ItemStatus.FAILED):
        _traced_follower(adm, done.error)
        return ItemOutcome(item.index, done.status, error=done.error)
    holder = _holder_of(first, done)
    return _duplicate(item.index, adm, holder, owner_token(adm))


def _traced_follower(adm: Admission, error: BaseException | None) -> None:
    """An item reported with its first item's refusal says so on a span of its own (``otel``):
    every call of a bulk call has its decision on the trace."""
    if isinstance(error, DuplicateTaskError):
        otel.decided(adm, "duplicate", holder_id=error.existing_task_id)
    elif isinstance(error, RateLimited):
        otel.decided(adm, "refused", retry_after=round(error.retry_after, 3))
    elif isinstance(error, DeduplicationUnavailable):
        otel.decided(adm, "unavailable")
    elif error is not None:
        otel.decided(adm, "failed", error=type(error).__name__)


def _holder_of(first: _Item, done: ItemOutcome) -> Lock:
    """The lock the first item of a key holds, or the holder it was told of."""
    if first.holder is not None:
        return first.holder
    lock = getattr(done.result, "lock", None)
    if done.status is ItemStatus.DUPLICATE and isinstance(lock, Lock):
        return lock
    adm = first.adm
    assert adm is not None and adm.key is not None
    now = time.time()
    ttl = float(adm.notes.get("ttl") or adm.call.unique_for or 0.0)
    return Lock(
        key=adm.key,
        owner=adm.header.owner(adm.task_id),
        task_name=adm.task.name,
        acquired_at=now,
        expires_at=now + ttl,
        policy=adm.header.until.value,
        task_id=str(getattr(done.result, "id", adm.task_id)),
    )
