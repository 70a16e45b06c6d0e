"""``dedup_mode="observe"``: a refusal is published anyway, and counted.

The steps run exactly as when enforcing (the key computed, the rate
window asked, the lock taken), so what is counted is what ``"enforce"``
would have done. A call a step refuses (a duplicate, a full rate window)
is then let in unchanged: the steps it entered are undone first, so the
store is left as enforcing leaves it (no lock taken for it, nothing
counted in the window), and it is published without a lock (the worker
runs it unchecked: it is no copy of the holder's run, and the holder's
lock, owned by its own token, is released by the holder as usual).

In observe mode nothing irreversible happens: ``replace``, ``keep_last``
and ``cancel_running`` never take a key over, revoke or terminate a
holder; a held key counts what they would have done. A rate limit never
delays a call (``on_rate_limit="delay"``): over the limit it is counted.
"""

from __future__ import annotations

import logging

from .. import observed
from ..options import DedupMode, OnDuplicate
from .canvas import takes_over
from .state import Admission, Refusal

__all__ = ["observing", "record", "would"]

logger = logging.getLogger("celery_dedup")


def observing(adm: Admission) -> bool:
    """Whether this call's refusals are published anyway (``dedup_mode="observe"``)."""
    return adm.call.mode is DedupMode.OBSERVE


def would(adm: Admission, refusal: Refusal) -> str:
    """What enforcing would have done: ``deduplicate``, ``replace``, ``cancel``, ``rate_limit``."""
    if refusal.kind != "duplicate":
        return "rate_limit"
    policy = adm.call.on_duplicate
    if not takes_over(policy, adm.options):  # (inside a canvas they are duplicates too)
        return "deduplicate"
    return "cancel" if policy is OnDuplicate.CANCEL_RUNNING else "replace"


def record(adm: Admission, refusal: Refusal) -> None:
    """Count the observed refusal: metrics (per task and per key), signal, event."""
    task = adm.task
    runtime = adm.config.runtime
    outcome = would(adm, refusal)
    holder = refusal.holder
    holder_id = holder.task_id if holder is not None else None
    if outcome == "rate_limit":
        from ..limits import limits_of

        limits = limits_of(task)
        policy = limits.on_rate_limit.value if limits is not None else ""
    else:
        policy = adm.call.on_duplicate.value
    adm.notes["observed"] = outcome
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "celery-dedup: %s[%s] observed: would %s (%s); published anyway",
            task.name, adm.task_id, outcome, policy,
        )  # fmt: skip
    observed.report(
        task,
        runtime,
        key=adm.key,
        counted_key=adm.key if adm.key is not None else adm.notes.get("rate_key"),
        task_id=adm.task_id,
        holder_id=holder_id,
        would=outcome,
        policy=policy,
        args=adm.args,
        kwargs=adm.kwargs,
    )
