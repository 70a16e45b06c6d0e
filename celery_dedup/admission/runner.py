"""Run the admission steps in their fixed order; undo them in reverse on a refusal or error."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from celery.utils import uuid

from ..header import NO_LOCK
from . import canvas, effects, observe, rate
from .lock import LockStep
from .publish import PublishStep
from .rate import RateStep
from .rated import RatedLockStep, offered
from .state import Admission, Refusal, Step

__all__ = ["LOCKED", "RATED", "UNLOCKED", "admit", "admit_unlocked", "run"]

logger = logging.getLogger("celery_dedup")

#: a call with a key: check, lock, publish
LOCKED: Sequence[Step] = (RateStep(), LockStep(), PublishStep())
#: a call without a key (``identity="always_unique"``): check, publish
UNLOCKED: Sequence[Step] = (RateStep(), PublishStep())


def run(adm: Admission, steps: Sequence[Step]) -> tuple[bool, object]:
    """Enter each step in order; on a refusal or error, undo the entered ones in reverse.

    A refusal the canvas rules overrule (``canvas.lets_in``) is let in by
    its own step and the call goes on. Under ``dedup_mode="observe"`` any
    other refusal is undone, counted and let in unchanged: only the publish
    is left to run (``observe``). Returns ``(True, None)`` when every step
    passed, ``(False, answer)`` with the refusal's answer otherwise.
    """
    entered: list[Step] = []
    try:
        for step in steps:
            if "observed" in adm.notes and not isinstance(step, PublishStep):
                continue  # observed: published as it is, nothing else written for it
            refusal = step.enter(adm)
            if refusal is not None:
                if canvas.lets_in(adm, refusal):
                    assert refusal.let_in is not None
                    refusal.let_in()
                elif observe.observing(adm):
                    _undo(adm, entered)
                    entered.clear()
                    _observed(adm, refusal)
                    continue
                else:
                    _undo(adm, entered)
                    return False, refusal.answer()
            entered.append(step)
    except BaseException:
        _undo(adm, entered)
        raise
    return True, None


def _observed(adm: Admission, refusal: Refusal) -> None:
    """Let an observed refusal in: no lock, its own task id, counted once."""
    adm.header, adm.locked, adm.previous, adm.cancelled = NO_LOCK, False, None, None
    if refusal.kind == "rate" and refusal.holder is None:
        # As enforcing answers it: a full window over a held key is its duplicate.
        held = rate.holder_of(adm)
        if held is not None:
            refusal = Refusal("duplicate", refusal.answer, holder=held)
    holder = refusal.holder
    if holder is not None and holder.task_id == adm.task_id:
        # A deterministic id is the holder's: two messages must never share one.
        adm.task_id = uuid()
    observe.record(adm, refusal)


def _undo(adm: Admission, entered: list[Step]) -> None:
    for step in reversed(entered):
        try:
            step.undo(adm)
        except Exception:  # an undo is best effort: the TTL bounds what it leaves
            logger.warning("celery-dedup: could not undo %s", type(step).__name__, exc_info=True)


#: a call with a key and a rate limit, on a store that counts and locks at once
RATED: Sequence[Step] = (
    RatedLockStep(lambda adm: run(adm, (RateStep(), LockStep()))),
    PublishStep(),
)


def admit(adm: Admission) -> object:
    """Admit a call that has a key; after its publish, the effects nothing can undo."""
    admitted, answer = run(adm, RATED if offered(adm) else LOCKED)
    return effects.apply(adm) if admitted else answer


def admit_unlocked(adm: Admission) -> object:
    """Admit a call that takes no lock (only its checks apply)."""
    admitted, answer = run(adm, UNLOCKED)
    return effects.apply(adm) if admitted else answer
