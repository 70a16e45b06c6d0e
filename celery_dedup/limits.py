"""Per-key limits: how many bodies run at once, how many publishes per period.

Two task options, each with a key of its own (a ``str.format`` template over
the call's bound arguments such as ``"{user}"``, a callable taking the
call's arguments, or by default the deduplication key):

* ``concurrency_limit=N`` (``concurrency_key=``): at most ``N`` bodies with
  the same key run at once across every worker. A message over the limit
  is **deferred**: the worker publishes the very same message again with a
  countdown (a third of the slot lease, jittered between half and all of
  it: ``concurrency_backoff=`` overrides it) and acknowledges this copy,
  so no pool slot waits and nothing is lost or failed. A slot is a lease
  (``dedup_lease_ttl``) renewed every third of it by the process running
  the body, so a killed worker's slot comes back within one lease.
* ``rate_limit_per_key="10/m"`` (``/s``, ``/m``, ``/h``, ``/d``; ``rate_key=``):
  at most that many publishes per key in any sliding window of the
  period, counted on the store's clock. A call over it follows
  ``on_duplicate`` (``raise``: ``RateLimited`` with ``retry_after``;
  ``existing``: the most recent admitted publish's handle) or, with
  ``on_rate_limit="delay"``, is published with a countdown to its place in
  the window.

Stores keep them through ``SlotSupport`` and ``RateSupport``; a task using
a limit on a store without them fails loudly (``LimitsNotSupported``).
"""

from __future__ import annotations

import datetime as dt
import inspect
import logging
import os
import random
import re
import string
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Final

from .exceptions import InvalidOptionError, LimitsNotSupported, RateLimited, StoreError
from .identity import digest
from .options import Fallback, OnDuplicate, naming_task, validate_choice
from .stores.base import LockStore, RateAnswer, RateSupport, SlotSupport

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = [
    "LIMIT_OPTIONS",
    "Limits",
    "OnRateLimit",
    "Rate",
    "Slot",
    "admit_publish",
    "admit_unlocked",
    "concurrency_store_key",
    "enter",
    "leave",
    "limits_of",
    "parse_rate",
    "rate_store_key",
    "refuse_native",
    "usage",
    "usage_lines",
]

logger = logging.getLogger("celery_dedup")

#: the task attributes this module reads
LIMIT_OPTIONS: Final = (
    "concurrency_limit",
    "concurrency_key",
    "concurrency_backoff",
    "rate_limit_per_key",
    "rate_key",
    "on_rate_limit",
)

_PERIODS: Final[Mapping[str, float]] = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*([smhd])\s*$")


class OnRateLimit(str, Enum):
    """What a call over ``rate_limit_per_key`` does."""

    #: what a duplicate does (``on_duplicate``: raise ``RateLimited`` or return a handle)
    DUPLICATE = "duplicate"
    #: publish it with a countdown to its place in the window
    DELAY = "delay"


@dataclass(frozen=True)
class Rate:
    """A parsed ``rate_limit_per_key``: ``limit`` publishes per ``period`` seconds."""

    limit: int
    period: float


def parse_rate(value: Any, option: str = "rate_limit_per_key") -> Rate | None:
    """``"10/m"`` as a ``Rate`` (``None`` stays ``None``); anything else is refused."""
    if value is None:
        return None
    match = _RATE.match(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) < 1:
        raise InvalidOptionError(
            option, value, "a string 'N/s', 'N/m', 'N/h' or 'N/d' with N >= 1 (or None)"
        )
    return Rate(int(match.group(1)), _PERIODS[match.group(2)])


def _positive_int(value: Any, option: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(option, value, "an int >= 1 (or None)")
    return value


def _backoff(value: Any, option: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise InvalidOptionError(option, value, "a number of seconds greater than 0 (or None)")
    return float(value)


#: a key option: a template, a callable, or None (the deduplication key)
KeySpec = str | Callable[..., Any] | None


@dataclass(frozen=True)
class Limits:
    """A task's limits, validated once."""

    concurrency: int | None
    concurrency_key: KeySpec
    backoff: float | None
    rate: Rate | None
    rate_key: KeySpec
    on_rate_limit: OnRateLimit
    signature: inspect.Signature


def _key_spec(value: Any, option: str, signature: inspect.Signature) -> KeySpec:
    if value is None or callable(value):
        spec: KeySpec = value
        return spec
    if not isinstance(value, str) or not value:
        raise InvalidOptionError(
            option, value, "a template over the arguments ('{user}'), a callable, or None"
        )
    names = {name for _, name, _, _ in string.Formatter().parse(value) if name}
    fields = {re.split(r"[.\[]", name, maxsplit=1)[0] for name in names}
    unknown = fields - set(signature.parameters)
    if unknown or not fields:
        raise InvalidOptionError(
            option,
            value,
            f"a template naming parameters of the task ({', '.join(signature.parameters)})",
        )
    return value


def limits_of(task: DedupTask) -> Limits | None:
    """The task's limits (``None`` when it has none), validated on first use."""
    cached: Limits | bool | None = task.__dict__.get("_dedup_limits", False)
    if cached is not False:
        return cached if isinstance(cached, Limits) else None
    with naming_task(task.name):
        limits = _build(task)
    task.__dict__["_dedup_limits"] = limits
    return limits


def _build(task: DedupTask) -> Limits | None:
    def attr(name: str) -> Any:
        return getattr(task, name, None)

    concurrency = _positive_int(attr("concurrency_limit"), "concurrency_limit")
    rate = parse_rate(attr("rate_limit_per_key"))
    if concurrency is None and rate is None:
        return None
    signature = inspect.signature(task.run)
    on_rate_limit = attr("on_rate_limit")
    return Limits(
        concurrency=concurrency,
        concurrency_key=_key_spec(attr("concurrency_key"), "concurrency_key", signature),
        backoff=_backoff(attr("concurrency_backoff"), "concurrency_backoff"),
        rate=rate,
        rate_key=_key_spec(attr("rate_key"), "rate_key", signature),
        on_rate_limit=(
            OnRateLimit.DUPLICATE
            if on_rate_limit is None
            else validate_choice(OnRateLimit, on_rate_limit, "on_rate_limit")
        ),
        signature=signature,
    )


def _key_text(
    task: DedupTask,
    limits: Limits,
    spec: KeySpec,
    option: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    default: str | None,
) -> str:
    """The text of a limit's key for one call."""
    if spec is None:
        # No deduplication key (identity="always_unique"): the task as a whole.
        return default if default is not None else task.name
    if callable(spec):
        value = spec(*(args or ()), **(kwargs or {}))
        if not isinstance(value, str) or not value:
            raise InvalidOptionError(option, value, "the callable to return a non-empty string")
        return value
    bound = limits.signature.bind(*(args or ()), **(kwargs or {}))
    bound.apply_defaults()
    return spec.format_map(bound.arguments)


def concurrency_store_key(prefix: str, task_name: str, text: str) -> str:
    """The store key of the slots of one concurrency key of ``task_name``."""
    return f"{prefix}-slots:{task_name}:{digest(text)}"


def rate_store_key(prefix: str, task_name: str, text: str) -> str:
    """The store key of the publish window of one rate key of ``task_name``."""
    return f"{prefix}-rate:{task_name}:{digest(text)}"


def _slots_of(task: DedupTask, store: object) -> SlotSupport:
    if isinstance(store, SlotSupport):
        return store
    raise LimitsNotSupported(task.name, "concurrency_limit", getattr(store, "name", "none"))


def _rates_of(task: DedupTask, store: object) -> RateSupport:
    if isinstance(store, RateSupport):
        return store
    raise LimitsNotSupported(task.name, "rate_limit_per_key", getattr(store, "name", "none"))


# -- the worker: one slot per running body -------------------------------------


@dataclass(frozen=True)
class Slot:
    """A concurrency slot a running body holds."""

    store: SlotSupport
    key: str
    holder: str
    ttl: float


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

    def add(self, slot: Slot) -> None:
        with self.lock:
            self.held[slot.holder] = slot
            self.interval = min(self.interval, max(slot.ttl / 3.0, 0.05))
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
            self.renew()

    def renew(self) -> int:
        with self.lock:
            slots = list(self.held.values())
        groups: dict[tuple[int, float], tuple[SlotSupport, list[tuple[str, str]]]] = {}
        for slot in slots:
            group = groups.setdefault((id(slot.store), slot.ttl), (slot.store, []))
            group[1].append((slot.key, slot.holder))
        renewed = 0
        for (_, ttl), (store, pairs) in groups.items():
            try:
                renewed += store.renew_slots(pairs, ttl)
            except Exception as exc:  # an outage: the next pass tries again
                logger.warning("celery-dedup: could not renew %d slots: %s", len(pairs), exc)
        return renewed


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
    store = _slots_of(task, runtime.store)
    header = worker.header_of(request)
    text = _key_text(
        task,
        limits,
        limits.concurrency_key,
        "concurrency_key",
        args,
        kwargs,
        None if header is None else header.key,
    )
    key = concurrency_store_key(runtime.settings.key_prefix, task.name, text)
    ttl = runtime.settings.lease_ttl
    holder = f"{request.id}:{os.urandom(8).hex()}"
    try:
        taken, in_use = store.take_slot(key, holder, limits.concurrency, ttl)
    except LimitsNotSupported as exc:  # a store of a kind that keeps none (a SQL dialect)
        raise LimitsNotSupported(task.name, "concurrency_limit", exc.store) from None
    except StoreError as exc:
        if runtime.settings.fallback is Fallback.CLOSED:
            reason = f"the store did not answer: {exc}"
            worker._defer(task, request, args, kwargs, key, reason, None)
        logger.warning(
            "celery-dedup: %s[%s] runs without its slot: %s", task.name, request.id, exc
        )
        return None
    if not taken:
        base = limits.backoff if limits.backoff is not None else ttl / 3.0
        countdown = base * random.uniform(0.5, 1.0)
        worker._defer(
            task,
            request,
            args,
            kwargs,
            key,
            f"concurrency limit {limits.concurrency} reached ({in_use} running)",
            None,
            countdown=countdown,
        )
    slot = Slot(store, key, holder, ttl)
    _keeper.add(slot)
    return slot


def leave(slot: Slot | None) -> None:
    """Give the slot back (a store outage leaves it to lapse with its lease)."""
    if slot is None:
        return
    _keeper.remove(slot)
    try:
        slot.store.give_slot(slot.key, slot.holder)
    except StoreError as exc:
        logger.warning("celery-dedup: could not give a slot back (it lapses): %s", exc)


# -- the producer: one window per rate key -------------------------------------


def admit_publish(
    task: DedupTask,
    on_duplicate: OnDuplicate,
    store: LockStore,
    key: str | None,
    task_id: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    *,
    give_back: Callable[[], Any],
    extend: Callable[[float], Any],
) -> Any:
    """Count this publish in its rate key's window, after its lock was taken.

    Returns ``None`` to publish (``options`` may have gained a countdown and
    the lock ``extend``-ed by it: ``on_rate_limit="delay"``), or, for a call
    over the limit, gives the lock back (``give_back``) and raises
    ``RateLimited`` or returns the most recent admitted publish's handle.
    """
    limits = limits_of(task)
    if limits is None or limits.rate is None:
        return None
    runtime = task.dedup_config().runtime
    rates = _rates_of(task, store)
    text = _key_text(task, limits, limits.rate_key, "rate_key", args, kwargs, key)
    rate_key = rate_store_key(runtime.settings.key_prefix, task.name, text)
    delay = limits.on_rate_limit is OnRateLimit.DELAY
    try:
        rate = limits.rate
        answer = rates.hit_rate(rate_key, task_id, rate.limit, rate.period, delay=delay)
    except LimitsNotSupported as exc:
        give_back()
        raise LimitsNotSupported(task.name, "rate_limit_per_key", exc.store) from None
    except StoreError as exc:
        try:
            runtime.fall_back(task.name, exc)
        except Exception:
            give_back()
            raise
        return None
    if answer.admitted:
        if answer.wait > 0:
            runtime.metrics.incr(task.name, "rate_limited")
            _delay(options, answer.wait)
            try:
                extend(answer.wait)
            except StoreError as exc:  # the message still carries its owner token
                logger.warning("celery-dedup: could not extend a delayed call's lock: %s", exc)
        return None
    give_back()
    runtime.metrics.incr(task.name, "rate_limited")
    return _refused(task, on_duplicate, rate_key, answer, task_id)


def admit_unlocked(
    task: DedupTask,
    on_duplicate: OnDuplicate,
    task_id: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> Any:
    """``admit_publish`` for a call that takes no lock (``identity="always_unique"``)."""
    limits = limits_of(task)
    if limits is None or limits.rate is None:
        return None
    store = task.dedup_config().runtime.store
    if store is None:
        raise LimitsNotSupported(task.name, "rate_limit_per_key", "none")
    return admit_publish(
        task, on_duplicate, store, None, task_id, args, kwargs, options,
        give_back=lambda: None, extend=lambda wait: None,
    )


def refuse_native(task: DedupTask) -> None:
    """A call deduplicated by its broker (SQS FIFO) takes no store round trip: a
    task with ``rate_limit_per_key`` cannot be counted there, so it is refused
    loudly rather than published unlimited.
    """
    limits = limits_of(task)
    if limits is not None and limits.rate is not None:
        raise LimitsNotSupported(task.name, "rate_limit_per_key", "native")


def _delay(options: dict[str, Any], wait: float) -> None:
    eta = options.get("eta")
    if eta is not None:
        now = dt.datetime.now(eta.tzinfo) if isinstance(eta, dt.datetime) else None
        if now is not None:
            options["eta"] = max(eta, now + dt.timedelta(seconds=wait))
            return
    options["countdown"] = max(float(options.get("countdown") or 0.0), wait)


def _refused(
    task: DedupTask, on_duplicate: OnDuplicate, rate_key: str, answer: RateAnswer, task_id: str
) -> Any:
    from .results import DeduplicatedResult

    logger.info(
        "celery-dedup: %s[%s] over its rate limit (retry in %.1fs)", task.name, task_id, answer.wait
    )
    if on_duplicate is not OnDuplicate.EXISTING or not answer.last:
        raise RateLimited(task.name, rate_key, answer.wait, answer.last)
    return DeduplicatedResult(
        answer.last,
        app=task.app,
        backend=task.backend,
        deduplication_key=rate_key,
        duplicate_id=task_id,
    )


# -- what the CLI shows ---------------------------------------------------------


def usage(task: DedupTask, text: str) -> dict[str, Any]:
    """The slots and the publish window of one key of ``task`` (its text: ``"user-1"``).

    ``text`` is what the task's key yields for a call: the value of its
    ``concurrency_key``/``rate_key`` template or callable, or the lock key
    when the key is the deduplication key. One round trip per limit.
    """
    limits = limits_of(task)
    if limits is None:
        return {"task": task.name, "key": text}
    runtime = task.dedup_config().runtime
    prefix = runtime.settings.key_prefix
    found: dict[str, Any] = {"task": task.name, "key": text}
    if limits.concurrency is not None:
        slots = _slots_of(task, runtime.store)
        found["concurrency"] = {
            "limit": limits.concurrency,
            "in_use": slots.slots_in_use(concurrency_store_key(prefix, task.name, text)),
        }
    if limits.rate is not None:
        rates = _rates_of(task, runtime.store)
        answer = rates.rate_window(
            rate_store_key(prefix, task.name, text), limits.rate.limit, limits.rate.period
        )
        found["rate"] = {
            "limit": limits.rate.limit,
            "period": limits.rate.period,
            "count": answer.count,
            "free_in": answer.wait,
            "last_task_id": answer.last,
        }
    return found


def usage_lines(found: Mapping[str, Any]) -> list[str]:
    """``usage`` as the CLI prints it."""
    lines = [f"{found['task']}  key {found['key']!r}"]
    if "concurrency" not in found and "rate" not in found:
        return [*lines, "  no concurrency_limit or rate_limit_per_key"]
    if "concurrency" in found:
        slots = found["concurrency"]
        lines.append(f"  concurrency  {slots['in_use']} of {slots['limit']} slots in use")
    if "rate" in found:
        rate = found["rate"]
        line = (
            f"  rate         {rate['count']} of {rate['limit']} publishes "
            f"in the last {rate['period']:g}s"
        )
        if rate["free_in"]:
            line += f", next free in {rate['free_in']:.1f}s"
        lines.append(line)
        if rate["last_task_id"]:
            lines.append(f"  last publish {rate['last_task_id']}")
    return lines
