"""The lock step: acquire the key, take it over (``replace``/``keep_last``) or cancel its
holder (``cancel_running``); its undo gives the key back, to the holder it was taken
from where there is one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import cancel, debounce, key_reuse, worker
from ..exceptions import StoreContention, StoreError
from ..header import NO_LOCK, LockHeader, new_token
from ..lifecycle import meta_for
from ..options import DedupMode, OnDuplicate, OnKeyReuse
from ..policy import KEEPS_ON_FAILURE, UniqueUntil, lock_ttl
from ..stores.base import Lock, LockMeta, LockStore, replace_holder
from . import duplicate
from .canvas import in_canvas, is_canvas, is_member
from .fallback import fall_back
from .state import Admission, Refusal

__all__ = ["LockPlan", "LockStep", "failed", "held", "owner_token", "restore", "taken"]

logger = logging.getLogger("celery_dedup")


@dataclass(frozen=True)
class LockPlan:
    """What the lock step writes for a call: decided before any round trip."""

    ttl: float
    until: UniqueUntil
    keep_last: bool
    replaces: bool
    cancels: bool
    max_wait: float | None
    window: float | None
    now: float
    owner: str
    meta: LockMeta

    @property
    def takes_over(self) -> bool:
        """A message a newer call may take the key from (it waits for that call's publish
        when it finds its lock gone: it may be given back)."""
        return self.replaces or self.cancels

    @property
    def acquires(self) -> bool:
        """The call only acquires (no take-over, no cancel): what ``RatedAcquire`` does."""
        return not self.takes_over


class LockStep:
    """Make the call's owner token the holder of its key, or refuse it as a duplicate."""

    def plan(self, adm: Admission) -> LockPlan:
        """The key's owner, TTL and record for this call (pure but for the clock)."""
        task, call, options, key = adm.task, adm.call, adm.options, adm.key
        assert call.unique_for is not None and key is not None
        # After the checks: a rate delay is part of the TTL.
        ttl = lock_ttl(call.unique_for, countdown=options.get("countdown"), eta=options.get("eta"))
        canvas_key = call.deduplication_key is not None and is_canvas(options)
        # A canvas has no single end its lock could be released at: a key
        # given to a chain or a group holds the canvas as one unit for unique_for.
        until = UniqueUntil.EXPIRY if canvas_key else call.unique_until
        # Members of one group or chord must never displace each other; an
        # observed call never displaces anyone (a held key is counted instead).
        policy = OnDuplicate.EXISTING if call.mode is DedupMode.OBSERVE else call.on_duplicate
        keep_last = policy is OnDuplicate.KEEP_LAST and not is_member(options)
        replaces = keep_last or (policy is OnDuplicate.REPLACE and not is_member(options))
        cancels = policy is OnDuplicate.CANCEL_RUNNING and not in_canvas(options)
        max_wait = call.debounce_max_wait if replaces and not keep_last else None
        # Only a lock a failure keeps has a cooldown to shorten it to.
        window = call.retry_window if until in KEEPS_ON_FAILURE and not canvas_key else None
        now = time.time()
        owner = (
            owner_token(adm)
            if max_wait is None
            # A replacing call is never judged for key reuse: the latest arguments win.
            else debounce.guess_owner(key, max_wait, now)
        )
        holder_id = str(options.get("group_id") or adm.task_id) if canvas_key else adm.task_id
        meta = meta_for(task, holder_id, until)
        return LockPlan(
            ttl, until, keep_last, replaces, cancels, max_wait, window, now, owner, meta
        )

    def enter(self, adm: Admission) -> Refusal | None:
        """Take the key (or go on unlocked per ``dedup_fallback``), or refuse: a holder."""
        task, call, options, key = adm.task, adm.call, adm.options, adm.key
        assert call.unique_for is not None and key is not None
        runtime = adm.config.runtime
        plan = self.plan(adm)
        owner, ttl, meta, max_wait = plan.owner, plan.ttl, plan.meta, plan.max_wait
        adm.notes["ttl"] = ttl
        capped = False
        holder: Lock | None = None
        store = adm.store
        try:
            if store is None:
                fall_back(adm, None)
                return None
            if plan.replaces:
                revoked_ttl = runtime.settings.revoked_ttl
                adm.previous = replace_holder(store, key, owner, ttl, meta, revoked_ttl)
                adm.locked = True
                if max_wait is not None:
                    owner, start = debounce.settle_owner(
                        store, key, owner, adm.previous, ttl, meta, plan.now, revoked_ttl
                    )
                    capped = debounce.cap_eta(
                        options, start, max_wait, floor=adm.notes.get("rate_place")
                    )
            elif plan.cancels:
                adm.cancelled = cancel.cancel_and_acquire(
                    task, store, key, owner, ttl, meta,
                    task_id=adm.task_id, wait=call.cancel_wait, signal=call.cancel_signal,
                )  # fmt: skip
                adm.locked = True
            else:
                holder = store.acquire(key, owner, ttl, meta)
        except StoreContention:
            raise  # the store answers: contention is never an outage
        except StoreError as exc:
            failed(adm, plan, owner, exc)
            return None
        if holder is not None and holder.owner != owner:
            # (A holder with this call's own token is this call's write, seen
            # again by a client that re-sent the command after losing its reply.)
            adm.header = NO_LOCK
            return _held(adm, holder, owner)
        taken(adm, plan, owner, capped)
        return None

    def undo(self, adm: Admission) -> None:
        """Give the key back: release it, or restore the holder it was taken from."""
        if adm.notes.pop("orphan", None) is not None:
            return  # nothing is published: the orphan sweeper releases a late write
        if not adm.locked or adm.store is None or adm.key is None:
            return
        store, key, owner = adm.store, adm.key, adm.header.owner(adm.task_id)
        adm.locked = False

        def release() -> None:
            if not adm.body_started:
                worker.release(adm.task, store, key, owner, adm.task_id, "publish_failed")

        previous = adm.previous or adm.cancelled
        if previous is None:
            release()
        else:
            restore(adm.task, store, key, previous, release)


def failed(adm: Admission, plan: LockPlan, owner: str, exc: StoreError) -> None:
    """The store did not answer the lock's write: go on per ``dedup_fallback``.

    The write may still land when the store answers again (a paused or
    slow server): the published message carries the owner token, so it
    owns and releases such a lock; if nothing is published, the lock is
    released as soon as the store answers.
    """
    assert adm.key is not None and adm.call.unique_for is not None
    adm.locked = False
    adm.notes["orphan"] = adm.config.runtime.add_orphan(adm.key, owner, plan.ttl)
    fall_back(adm, exc)  # (closed: the orphan's sweeper releases a late write)
    adm.header = LockHeader(
        adm.key, plan.until, adm.call.unique_for, plan.takes_over, owner, plan.keep_last,
        retry_window=plan.window, observe=adm.call.mode is DedupMode.OBSERVE,
    )  # fmt: skip


def taken(adm: Admission, plan: LockPlan, owner: str, capped: bool = False) -> None:
    """The call's owner holds the key: the header its message carries."""
    assert adm.key is not None and adm.call.unique_for is not None
    adm.header = LockHeader(
        adm.key, plan.until, adm.call.unique_for, plan.takes_over, owner, plan.keep_last,
        retry_window=plan.window, observe=adm.call.mode is DedupMode.OBSERVE,
    )  # fmt: skip
    adm.locked = True
    capped_policy = plan.max_wait is not None and capped
    adm.policy = "replace+max_wait" if capped_policy else adm.call.on_duplicate.value


def held(adm: Admission, holder: Lock, owner: str) -> Refusal:
    """The key is held by another publish: a duplicate refusal (no lock in the header)."""
    adm.header = NO_LOCK
    return _held(adm, holder, owner)


def owner_token(adm: Admission) -> str:
    """A new owner token; with the fingerprint of the arguments for a caller's key."""
    call = adm.call
    if call.deduplication_key is None or call.on_key_reuse is OnKeyReuse.IGNORE:
        return new_token()
    serializer = str(adm.options.get("serializer") or adm.config.serializer)
    return key_reuse.token(
        key_reuse.fingerprint(adm.config.binder, adm.args, adm.kwargs, serializer)
    )


def _held(adm: Admission, holder: Lock, owner: str) -> Refusal:
    """The key is held by another publish: a duplicate (unless the canvas rules let it in)."""

    def let_in() -> None:
        # Published without a lock: a canvas counts on it (``canvas.keeps_duplicate``).
        adm.header = NO_LOCK

    return Refusal(
        "duplicate",
        lambda: duplicate.answer(adm, holder, owner),
        let_in,
        holder=holder,
    )


def restore(
    task: Any, store: LockStore, key: str, previous: Lock, release: Callable[[], Any]
) -> None:
    """A replacing (or cancelling) call was refused or failed: give the key back to ``previous``.

    The previous holder's revoked marker goes first, then ``release``
    frees this call's lock, then the key is taken for the previous
    holder: a start claim landing in between finds it held (and waits) or
    free and unrevoked (and runs), never revoked with the key free.
    """
    try:
        store.unrevoke(key, previous.owner)
    except StoreError as exc:
        _not_restored(task, previous, exc)
        release()
        return
    release()
    try:
        meta = {
            "task_name": previous.task_name,
            "policy": previous.policy,
            "task_id": previous.task_id,
            "started": "1" if previous.started else "",
        }
        holder = store.acquire(key, previous.owner, max(previous.ttl, 1.0), meta)
    except StoreError as exc:
        _not_restored(task, previous, exc)
        return
    if holder is not None:
        # Another call took the free key first: its message runs the work.
        logger.info(
            "celery-dedup: %s[%s] was replaced by a failed publish and then by %s",
            task.name,
            previous.task_id,
            holder.task_id,
        )


def _not_restored(task: Any, previous: Lock, exc: StoreError) -> None:
    logger.warning(
        "celery-dedup: could not restore the lock of %s[%s] after a failed replace: %s",
        task.name,
        previous.task_id,
        exc,
    )
