"""The producer side of ``rate_limit_per_key``: one sliding window per rate key (see ``limits``).

A call's publish is counted in its rate key's window in one round trip,
before its lock is taken (the admission step ``admission.rate``); a call
over the limit raises ``RateLimited`` (or, asked for by name, returns the
last publish's handle), or is published with a countdown to its reserved
place (``on_rate_limit="delay"``). A refused or failed call's entry is taken
back out of the window (``forget``).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import TYPE_CHECKING, Any

from . import events
from .exceptions import LimitsNotSupported, RateLimited, StoreError
from .limits import (
    OnRateLimit,
    Rate,
    key_text,
    limits_of,
    rate_for,
    rate_store_key,
    rates_of,
)
from .stores.base import LockStore, RateAnswer, RateRelease, RateSupport

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["delayed", "forget", "hit", "refuse_native", "refused", "window_of"]

logger = logging.getLogger("celery_dedup")


def window_of(
    task: DedupTask, store: LockStore | None, args: Any, kwargs: Any, key: str | None
) -> tuple[RateSupport, str, Rate, bool] | None:
    """Where a call of ``task`` is counted: ``(store, rate key, rate, delay)``, or ``None``.

    ``None`` for a task without ``rate_limit_per_key``. Pure but for its
    errors: a store that cannot count (``LimitsNotSupported``), a
    ``rate_key`` the call cannot fill (``KeyError``), a rate callable that
    answers no rate (``InvalidOptionError``). The rate is the call's own
    (a callable's answer for these arguments), evaluated with the key.
    """
    limits = limits_of(task)
    if limits is None or limits.rate is None:
        return None
    if store is None:
        raise LimitsNotSupported(task.name, "rate_limit_per_key", "none")
    rates = rates_of(task, store)
    text = key_text(task, limits, limits.rate_key, "rate_key", args, kwargs, key)
    rate = rate_for(task, limits, args, kwargs)
    rate_key = rate_store_key(task.dedup_config().runtime.settings.key_prefix, task.name, text)
    return rates, rate_key, rate, limits.on_rate_limit is OnRateLimit.DELAY


def hit(
    task: DedupTask, rates: RateSupport, rate_key: str, member: str, rate: Rate, delay: bool
) -> RateAnswer:
    """Count ``member`` in the window (one round trip).

    A store that cannot count raises ``LimitsNotSupported`` naming the task.
    """
    try:
        return rates.hit_rate(rate_key, member, rate.limit, rate.period, delay=delay)
    except LimitsNotSupported as exc:
        raise LimitsNotSupported(task.name, "rate_limit_per_key", exc.store) from None


def forget(task: DedupTask, rates: RateSupport, rate_key: str, member: str) -> None:
    """Take a counted publish back out of its window (it was refused or failed)."""
    if not isinstance(rates, RateRelease):
        return  # the entry lapses with its period
    try:
        rates.forget_rate(rate_key, member)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not take a refused publish of %s out of its rate window: %s",
            task.name,
            exc,
        )


def delayed(task: DedupTask, options: dict[str, Any], wait: float) -> None:
    """An admitted publish waits ``wait`` seconds for its place: count it, delay it."""
    if wait > 0:
        task.dedup_config().runtime.metrics.incr(task.name, "rate_limited")
        _delay(options, wait)


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


def refused(
    task: DedupTask,
    rate_key: str,
    answer: RateAnswer,
    task_id: str,
    args: Any,
    kwargs: Any,
    *,
    may_return: bool,
) -> Any:
    """What a call over the limit answers: ``RateLimited``, or (asked for by name,
    ``on_rate_limit="last_publish"``, where a handle may stand in: ``may_return``)
    the most recent admitted publish's handle. Counted, logged and reported as
    a ``task-rate-limited`` event either way.
    """
    from .results import DeduplicatedResult

    runtime = task.dedup_config().runtime
    runtime.metrics.incr(task.name, "rate_limited")
    logger.info(
        "celery-dedup: %s[%s] over its rate limit (retry in %.1fs)", task.name, task_id, answer.wait
    )
    limits = limits_of(task)
    last = (
        may_return
        and limits is not None
        and limits.on_rate_limit is OnRateLimit.LAST_PUBLISH
        and bool(answer.last)
    )
    if runtime.settings.send_events:
        events.send_rate_limited(
            task.app,
            task_name=task.name,
            task_id=task_id,
            args=args,
            kwargs=kwargs,
            retry_after=answer.wait,
            policy="on_rate_limit=last_publish" if last else "on_rate_limit=raise",
        )
    if not last:
        raise RateLimited(task.name, rate_key, answer.wait, answer.last)
    return DeduplicatedResult(
        answer.last,
        app=task.app,
        backend=task.backend,
        deduplication_key=rate_key,
        duplicate_id=task_id,
    )
