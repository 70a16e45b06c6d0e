"""The worker side of ``concurrency_limit``: one slot per running body (see ``limits``).

A body takes a slot of its concurrency key before its start check (one
round trip), a thread of the process running it renews the slot's lease
every third of it, and the body gives it back when it ends (one round
trip). A message that finds the key full is deferred: the worker publishes
the very same message again with a jittered countdown. On a store that
hands slots over (``SlotHandoff``) it also waits in the key's wait list,
and the body that frees a slot publishes the oldest waiter at once
(``handoff``); the deferred copy is then the safety net.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import handoff
from .cadence import Cadence
from .exceptions import LimitsNotSupported, StoreError
from .header import LockHeader
from .lifecycle import Outcome
from .limits import concurrency_for, concurrency_store_key, key_text, limits_of, slots_of
from .options import Fallback
from .runs import record_life
from .stores.base import RunRecords, SlotHandoff, SlotSupport, slot_holder

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["Slot", "enter", "leave"]

logger = logging.getLogger("celery_dedup")


@dataclass(frozen=True)
class Slot:
    """A concurrency slot a running body holds."""

    store: SlotSupport
    key: str
    holder: str
    #: the slot's lease record life (``runs.record_life`` of the lease)
    ttl: float
    #: the ``concurrency_limit`` the slot was taken under (a callable's answer for
    #: this call): taking the slot back after a stall obeys it
    limit: int = 1
    #: the body's task when the store hands freed slots over (``handoff``): giving
    #: the slot back wakes the key's oldest waiters, their reservations lasting ``grace``
    task: DedupTask | None = None
    grace: float = 0.0


class _Keeper:
    """Renews the slots held in this process every third of their lease.

    The thread lives in the process that runs the bodies (a pool child):
    when that process dies, nothing renews its slots and they lapse.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, Slot] = {}
        self.thread: threading.Thread | None = None
        self.pid = 0
        self.interval = 20.0
        self.wake = threading.Event()
        # Every third of the lease: a slot's record lives two leases.
        self.cadence = Cadence(6.0)

    def add(self, slot: Slot) -> None:
        with self.lock:
            self.held[slot.holder] = slot
            self.interval = min(self.interval, max(self.cadence.period(slot.ttl), 0.05))
            alive = self.thread is not None and self.thread.is_alive()
            if not alive or self.pid != os.getpid():
                self.pid = os.getpid()
                self.thread = threading.Thread(
                    target=self.loop, name="celery-dedup-slots", daemon=True
                )
                self.thread.start()

    def remove(self, slot: Slot) -> None:
        with self.lock:
            self.held.pop(slot.holder, None)

    def loop(self) -> None:
        while not self.wake.wait(self.interval):
            self.renew(only_due=True)

    def renew(self, *, only_due: bool = False) -> int:
        """Renew the slots held in this process; ``only_due``: those whose third is up."""
        with self.lock:
            slots = list(self.held.values())
        groups: dict[tuple[int, float], tuple[SlotSupport, list[Slot]]] = {}
        for slot in slots:
            groups.setdefault((id(slot.store), slot.ttl), (slot.store, []))[1].append(slot)
        if only_due:
            due = self.cadence.due(groups, time.monotonic(), self.interval)
            groups = {group: held for group, held in groups.items() if group in due}
        renewed = 0
        for (_, ttl), (store, held) in groups.items():
            try:
                pairs = [(slot.key, slot.holder) for slot in held]
                count = store.renew_slots(pairs, ttl)
                if count < len(pairs):
                    count = sum(1 for slot in held if self.take_back(slot))
                renewed += count
            except Exception as exc:  # an outage: the next pass tries again
                logger.warning("celery-dedup: could not renew %d slots: %s", len(held), exc)
        return renewed

    def holds(self, slot: Slot) -> bool:
        with self.lock:
            return self.held.get(slot.holder) is slot

    def take_back(self, slot: Slot) -> bool:
        """Keep ``slot``, or take it back if it lapsed (a store stall) and the key has room.

        ``take_slot`` renews a slot its holder still holds and takes a free
        one under the limit; a lapsed slot another body took is logged (the
        key then runs one body over its limit until one ends). A body that
        ended meanwhile (``leave``) gets the slot given back again.
        """
        if not self.holds(slot):
            return False
        if slot.task is not None and isinstance(slot.store, SlotHandoff):
            # Within what the key's waiters leave: a reserved slot is in use.
            turn = slot.store.take_slot_in_turn(
                slot.key, slot.holder, slot.limit, slot.ttl, None, slot.grace
            )
            taken, in_use = turn.taken, turn.in_use
            handoff.wake(slot.task, turn.woken)
        else:
            taken, in_use = slot.store.take_slot(slot.key, slot.holder, slot.limit, slot.ttl)
        if taken and not self.holds(slot):
            _give(slot)  # its body ended meanwhile
            return False
        if not taken:
            logger.warning(
                "celery-dedup: a concurrency slot lapsed while the store did not answer and "
                "another body took it (%d running)",
                in_use,
            )
        return taken


_keeper = _Keeper()


def enter(task: DedupTask, request: Any, args: Any, kwargs: Any) -> Slot | None:
    """Take a concurrency slot for this body, or defer the message (``Ignore``).

    Returns the slot to give back with ``leave`` (``None``: no limit, an
    eager call, or a store outage under ``dedup_fallback="open"``).
    """
    limits = limits_of(task)
    if limits is None or limits.concurrency is None or request.is_eager:
        return None
    from . import worker

    runtime = task.dedup_config().runtime
    store = slots_of(task, runtime.store)
    header = worker.header_of(request)
    try:
        text = key_text(
            task,
            limits,
            limits.concurrency_key,
            "concurrency_key",
            args,
            kwargs,
            _default_key(task, request, header, args, kwargs),
        )
        # The limit the key has for this call, evaluated with the key.
        limit = concurrency_for(task, limits, args, kwargs)
        # The holder records it (what ``celery dedup limits`` shows).
        holder = slot_holder(str(request.id), os.urandom(8).hex(), limit)
    except Exception:
        # The task fails without its body (a template the arguments cannot
        # fill, a key or limit callable that raised or answered badly): its
        # lock follows the policy.
        worker.end_unclaimed(task, request, Outcome.FAILURE)
        raise
    key = concurrency_store_key(runtime.settings.key_prefix, task.name, text)
    lease = runtime.settings.lease_ttl
    ttl = record_life(lease)
    # The deferral backoff grows from the limit's own first step.
    base = limits.backoff if limits.backoff is not None else lease / 3.0
    turns = store if isinstance(store, SlotHandoff) else None
    countdown: float | None = None
    try:
        if turns is None:
            taken, in_use = store.take_slot(key, holder, limit, ttl)
        else:
            countdown = worker.deferral_countdown(task, request, base)
            waiter = None
            if _may_wait(runtime.store, header):
                waiter = handoff.waiter_of(task, request, args, kwargs, countdown)
            # The store lists the waiter with this limit: a slot is handed to
            # it only while fewer than ``limit`` are in use.
            turn = turns.take_slot_in_turn(key, holder, limit, ttl, waiter, base)
            taken, in_use = turn.taken, turn.in_use
            handoff.wake(task, turn.woken)
    except LimitsNotSupported as exc:  # a store of a kind that keeps none (a SQL dialect)
        raise LimitsNotSupported(task.name, "concurrency_limit", exc.store) from None
    except StoreError as exc:
        if runtime.settings.fallback is Fallback.CLOSED:
            reason = f"the store did not answer: {exc}"
            worker._defer(task, request, args, kwargs, key, reason)
        logger.warning("celery-dedup: %s[%s] runs without its slot: %s", task.name, request.id, exc)
        return None
    if not taken:
        worker._defer(
            task,
            request,
            args,
            kwargs,
            key,
            f"concurrency limit {limit} reached ({in_use} running)",
            base,
            countdown=countdown,
        )
    woke = task if turns is not None else None
    slot = Slot(store, key, holder, ttl, limit, woke, base)
    _keeper.add(slot)
    return slot


def _may_wait(lock_store: object, header: LockHeader | None) -> bool:
    """Whether this message may wait in the key's wait list (``handoff``).

    A woken message runs as a second copy beside its parked one: only a
    message whose run is recorded (a lock in its header, a store keeping
    run records) has the copy that comes second dropped without running.
    Any other message takes only a slot the waiters leave free, and waits
    with its backoff alone.
    """
    if header is None or header.key is None:
        return False
    return isinstance(lock_store, RunRecords)


def _default_key(
    task: DedupTask, request: Any, header: LockHeader | None, args: Any, kwargs: Any
) -> str | None:
    """The deduplication key the default concurrency key is, as the message's lock has it.

    A message published without a lock (a canvas member whose key was held,
    a ``unique_for=None`` call) carries no key: the task's identity computes
    it from the delivered call (as for a message without the header), so it
    shares its slots with the holder's run. ``None``: the task has no key
    for the call (``identity="always_unique"``).
    """
    if header is not None and header.key is not None:
        return header.key
    from . import worker

    queue = worker.delivered_queue(task, request.delivery_info or {}, args, kwargs)
    try:
        return task.dedup_key(args, kwargs, task.dedup_config().resolve({}), queue)
    except Exception as exc:  # (a send_task call no key can hold): the task as a whole
        logger.debug("celery-dedup: %s[%s] has no key: %s", task.name, request.id, exc)
        return None


def leave(slot: Slot | None) -> None:
    """Give the slot back (a store outage leaves it to lapse with its lease)."""
    if slot is None:
        return
    _keeper.remove(slot)
    try:
        _give(slot)
    except StoreError as exc:
        logger.warning("celery-dedup: could not give a slot back (it lapses): %s", exc)


def _give(slot: Slot) -> None:
    """Give the slot back; on a ``SlotHandoff`` store, wake the waiters it frees room for."""
    if slot.task is not None and isinstance(slot.store, SlotHandoff):
        woken = slot.store.give_slot_in_turn(slot.key, slot.holder, slot.limit, slot.grace)
        handoff.wake(slot.task, woken)
    else:
        slot.store.give_slot(slot.key, slot.holder)
