"""How long a message the worker puts back (a deferral) waits before it comes back.

A worker defers a message, publishing the very same message again with a
countdown, when it must not run it yet: a copy of it is running, the store
did not answer (``dedup_fallback="closed"``), its key's concurrency limit is
full, or the ``keep_last`` run it follows is still in progress. Whatever the
reason, the countdown follows one curve:

* **exponential**: the ``n``-th deferral of one attempt (``n`` from 0) waits
  ``base * 2**n`` seconds, where ``base`` is the reason's first step
  (``BASE``, one second, unless the reason knows better: a third of the
  running lease for a running copy, ``coalesce.wait_for`` for a ``keep_last``
  follow-up, ``concurrency_backoff`` for a full limit);
* **capped** at ``CAP`` (60 s): a deferred message runs at most about a
  minute after what held it back ended;
* **jittered**: drawn uniformly between half and all of that step, so
  messages deferred together do not come back together;
* **within the visibility timeout**: never longer than ``ceiling`` of the
  broker's ``visibility_timeout`` (Redis, SQS), the timeout minus a margin
  (``MARGIN``, half a second, or ``MARGIN_SHARE``, a tenth of it, the larger; never
  below half of it). The worker holds a message waiting for its countdown
  unacknowledged; a countdown the transport outlasts would have it
  restore the message to the queue, and every restored copy would be
  deferred again, multiplying the copies of one message.

A message deferred by a full concurrency limit on a store that hands slots
over (``handoff``) is published again at once when a slot frees: its
countdown is then only the safety net.

The number of deferrals travels with the message in its ``FIELD`` header,
tagged with the attempt it counts (``runs.attempt_of``): a ``retry()`` is a
new attempt and starts from the first step again. Celery's own ``retries``
never changes: a deferral is the same attempt.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "BASE",
    "CAP",
    "FACTOR",
    "FIELD",
    "LATE",
    "MARGIN",
    "MARGIN_SHARE",
    "ceiling",
    "copy_life",
    "countdown",
    "deferrals_of",
    "longest_countdown",
    "mark",
    "within_visibility",
]

#: The header a deferred message carries: ``"<attempt>/<deferrals so far>"``.
FIELD: Final = "dedup_deferred"
#: Seconds of the first step when the reason has no step of its own.
BASE: Final = 1.0
#: Each deferral of an attempt waits this many times longer than the one before.
FACTOR: Final = 2.0
#: The longest step, in seconds.
CAP: Final = 60.0
#: Seconds kept between a countdown and the broker's ``visibility_timeout``
#: (or ``MARGIN_SHARE`` of the timeout, when that is more): the time between
#: the ETA and the acknowledgement of the copy the worker then defers again.
MARGIN: Final = 0.5
MARGIN_SHARE: Final = 0.1
#: Seconds a busy worker (its pool full, its store stalled) may start a due
#: deferred copy late, at least: ``copy_life`` allows the countdown again, or this.
LATE: Final = 5.0
#: Deferral counts above this are read as this (``FACTOR ** 64`` is plenty).
_MOST: Final = 64


def ceiling(visibility_timeout: float) -> float | None:
    """The longest countdown a deferral may have on this broker (``None``: no limit).

    ``visibility_timeout`` is 0 for a transport that never redelivers a
    message it holds unacknowledged (AMQP).
    """
    if visibility_timeout <= 0:
        return None
    margin = max(MARGIN, MARGIN_SHARE * visibility_timeout)
    return max(visibility_timeout - margin, visibility_timeout / 2.0)


def within_visibility(seconds: float, visibility_timeout: float) -> float:
    """``seconds``, shortened to ``ceiling(visibility_timeout)`` if longer."""
    limit = ceiling(visibility_timeout)
    return seconds if limit is None else min(seconds, limit)


def longest_countdown(visibility_timeout: float) -> float:
    """The longest countdown any deferral has on this broker: ``CAP`` within its ``ceiling``."""
    return within_visibility(CAP, visibility_timeout)


def copy_life(countdown: float) -> float:
    """How long after it is published a copy due in ``countdown`` seconds may still start.

    The countdown, then as long again (at least ``LATE``) for a worker that
    starts a due message late.
    """
    return countdown + max(countdown, LATE)


def countdown(
    deferrals: int,
    *,
    base: float = BASE,
    visibility_timeout: float = 0.0,
    rng: random.Random | None = None,
) -> float:
    """The countdown of a message deferred ``deferrals`` times before in this attempt.

    ``min(CAP, base * FACTOR**deferrals)``, drawn between half and all of
    it, then shortened to the broker's ``ceiling``.
    """
    n = min(max(deferrals, 0), _MOST)
    step = min(CAP, max(base, 0.0) * FACTOR**n)
    draw = (rng or random).uniform(step / 2.0, step)
    return within_visibility(draw, visibility_timeout)


def deferrals_of(request: Any, attempt: str) -> int:
    """How many times the message of ``request`` was deferred in ``attempt`` (0 if never).

    ``request`` is a running task's request context; a field that names
    another attempt (a retry's copy of its headers), or that is not one
    this module wrote, counts as none.
    """
    value = getattr(request, FIELD, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(FIELD) if isinstance(headers, Mapping) else None
    if not isinstance(value, str) or len(value) > 64:
        return 0
    tagged, _, count = value.rpartition("/")
    if tagged != attempt or not (count.isascii() and count.isdigit()):
        return 0
    return min(int(count), _MOST)


def mark(attempt: str, deferrals: int) -> str:
    """The ``FIELD`` value of a message deferred ``deferrals`` times in ``attempt``."""
    return f"{attempt}/{deferrals}"
