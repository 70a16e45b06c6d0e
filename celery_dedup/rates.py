"""The producer side of ``rate_limit_per_key``: one sliding window per rate key (see ``limits``).

After a call's lock is taken, its publish is counted in its rate key's
window in one round trip; a call over the limit gives the lock back and
raises ``RateLimited``, returns the last publish's handle, or is published
with a countdown to its reserved place (``on_rate_limit="delay"``).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .exceptions import LimitsNotSupported, RateLimited, StoreError
from .limits import OnRateLimit, key_text, limits_of, rate_store_key, rates_of
from .options import OnDuplicate
from .stores.base import LockStore, RateAnswer

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["admit_publish", "admit_unlocked", "refuse_native"]

logger = logging.getLogger("celery_dedup")


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
    rates = rates_of(task, store)
    text = key_text(task, limits, limits.rate_key, "rate_key", args, kwargs, key)
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
    """Move the call to its reserved place, ``wait`` seconds from now, never earlier
    than it asked for. Celery runs a ``countdown`` over an ``eta`` and reads a
    naive ``eta`` (or ISO string) as UTC, whatever the host's time zone: so
    does this.
    """
    eta = options.get("eta")
    if not options.get("countdown") and eta is not None:
        when = dt.datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if isinstance(when, dt.datetime):
            if when.tzinfo is None:
                when = when.replace(tzinfo=dt.timezone.utc)
            place = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=wait)
            if place > when:
                options["eta"] = place
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


