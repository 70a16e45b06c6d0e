"""The rate and lock steps in one round trip, where the store offers it (``RatedAcquire``).

Checks before effects, as the two steps: the store looks at the key first
(held: a duplicate, nothing counted), then at the window (full: refused,
nothing written), and only then counts the call and takes the key. So a
duplicate of a rate-limited task costs one round trip, as any duplicate,
and a first call one.

Whatever needs the two steps' order takes them (``fallback``): a store
without the operation or keys it cannot join (a cluster's two hash slots),
a take-over or a cancel (``replace``, ``keep_last``, ``cancel_running``,
the debounce cap that reads the rate's reserved place), a count kept in
another store, and a duplicate the canvas rules let in (the call is then
published after all and must be counted). A full window a protected call
may not be refused by (a group or chord member, a worker-side publish) is
asked again with ``delay``: its place reserved and its key taken in one
more round trip, as the two steps do it.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import rates
from ..exceptions import StoreContention, StoreError
from ..limits import limits_of
from ..options import DedupMode
from ..policy import lock_ttl
from ..stores.base import rated_acquire
from . import lock, rate
from .canvas import lets_in, protected, takes_over
from .lock import LockStep
from .rate import RateStep
from .state import Admission, Refusal

__all__ = ["RatedLockStep", "offered"]

#: runs the rate step and the lock step in order (``runner.run``)
Fallback = Callable[[Admission], "tuple[bool, object]"]


def offered(adm: Admission) -> bool:
    """Whether the call has a rate limit and its store can count and lock at once."""
    limits = limits_of(adm.task)
    return (
        limits is not None
        and limits.rate is not None
        and adm.store is not None
        and rated_acquire(adm.store) is not None
    )


class RatedLockStep:
    """``RateStep`` then ``LockStep`` as one store operation; their undos in reverse."""

    def __init__(self, fallback: Fallback) -> None:
        self._fallback = fallback

    def enter(self, adm: Admission) -> Refusal | None:
        """Count and lock in one round trip, or refuse (nothing counted, nothing written)."""
        store, key, unique_for = adm.store, adm.key, adm.call.unique_for
        combined = rated_acquire(store) if store is not None else None
        assert combined is not None and key is not None and unique_for is not None
        window = rates.window_of(adm.task, store, adm.args, adm.kwargs, key)
        assert window is not None
        counter, rate_key, limit, delay = window
        adm.notes["rate_key"] = rate_key
        # Observed, a call over the limit is counted, never delayed (``observe``).
        delay = delay and adm.call.mode is not DedupMode.OBSERVE
        plan = LockStep().plan(adm)
        # (A count kept in another store than the locks cannot join their script.)
        # An observed take-over only acquires, but is judged in the two steps' order
        # as enforcing judges it (its rate first).
        observed_take_over = adm.call.mode is DedupMode.OBSERVE and takes_over(
            adm.call.on_duplicate, adm.options
        )
        if not _same(counter, store) or not plan.acquires or observed_take_over:
            return self._steps(adm)
        adm.notes["ttl"] = plan.ttl
        try:
            answer = combined.acquire_rated(
                key, plan.owner, plan.ttl, plan.meta, rate_key, adm.task_id,
                limit.limit, limit.period, delay=delay, unique_for=unique_for,
            )  # fmt: skip
            if (
                answer is not None
                and answer.holder is None
                and not answer.acquired
                and protected(adm.task, adm.options)
            ):
                # A protected call is never refused: it waits for its place instead.
                answer = combined.acquire_rated(
                    key, plan.owner, plan.ttl, plan.meta, rate_key, adm.task_id,
                    limit.limit, limit.period, delay=True, unique_for=unique_for,
                )  # fmt: skip
        except StoreContention:
            raise  # the store answers: contention is never an outage
        except StoreError as exc:
            # As the two steps: the rate goes on unlimited, the lock as an orphan.
            lock.failed(adm, plan, plan.owner, exc)
            return None
        if answer is None:
            return self._steps(adm)
        if answer.holder is not None:
            refusal = lock.held(adm, answer.holder, plan.owner)
            # Let in, the call is published after all: it must be counted first.
            return self._steps(adm) if lets_in(adm, refusal) else refusal
        assert answer.rate is not None
        if answer.acquired:
            rate.counted(adm, counter, rate_key, answer.rate)
            if answer.rate.wait > 0:  # the reserved place's delay is part of the lock's TTL
                options = adm.options
                adm.notes["ttl"] = lock_ttl(
                    unique_for, countdown=options.get("countdown"), eta=options.get("eta")
                )
            lock.taken(adm, plan, plan.owner)
            return None
        refused = answer.rate
        # The key was free when the window refused: no holder to answer instead.
        return Refusal("rate", lambda: rate.refused(adm, rate_key, refused))

    def undo(self, adm: Admission) -> None:
        """Give the key back, then take the counted publish back out of the window."""
        LockStep().undo(adm)
        RateStep().undo(adm)

    def _steps(self, adm: Admission) -> Refusal | None:
        admitted, answer = self._fallback(adm)
        return None if admitted else Refusal("rate+lock", lambda: answer)


def _same(counter: object, store: object) -> bool:
    return counter is store
