"""The check step of ``rate_limit_per_key``: a reservation in the rate window, with its undo."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .. import otel, rates
from ..exceptions import StoreContention, StoreError
from ..limits import Rate
from ..options import DedupMode
from ..stores.base import Lock, RateAnswer, RateSupport
from . import duplicate
from .canvas import is_canvas, takes_over
from .fallback import fall_back
from .lock import owner_token
from .state import Admission, Refusal

__all__ = ["RateStep", "counted", "holder_of", "refused"]


@dataclass(frozen=True)
class _Counted:
    rates: RateSupport
    rate_key: str
    member: str


class RateStep:
    """Count the publish in its rate key's window before anything else is written.

    Over the limit the call is refused (``RateLimited``, or the last
    publish's handle when asked for by name) or, with
    ``on_rate_limit="delay"`` and for every call the canvas rules protect,
    admitted at its reserved place with a countdown. The undo takes the
    entry back out (the lock was held, the publish failed).
    """

    def enter(self, adm: Admission) -> Refusal | None:
        """Count the call, or refuse it; nothing counted when it refuses or raises."""
        store = adm.store if adm.store is not None else adm.config.runtime.store
        window = rates.window_of(adm.task, store, adm.args, adm.kwargs, adm.key)
        if window is None:
            return None
        counter, rate_key, rate, delay = window
        adm.notes["rate_key"] = rate_key
        # Observed, a call over the limit is counted, never delayed (``observe``).
        delay = delay and adm.call.mode is not DedupMode.OBSERVE
        answer = self._hit(adm, counter, rate_key, rate, delay)
        if answer is None or answer.admitted:
            return None

        def answer_refusal() -> object:
            held = _duplicate_of(adm)
            if held is not None:
                return held
            return refused(adm, rate_key, answer)

        def let_in() -> None:
            # Never dropped, never raising: the call waits for its place instead.
            self._hit(adm, counter, rate_key, rate, True)

        return Refusal("rate", answer_refusal, let_in)

    def undo(self, adm: Admission) -> None:
        """Take the counted publish back out of the window (not if an eager body ran)."""
        counted: _Counted | None = adm.notes.pop("rate", None)
        if counted is not None and not adm.body_started:
            rates.forget(adm.task, counted.rates, counted.rate_key, counted.member)

    def _hit(
        self, adm: Admission, counter: RateSupport, rate_key: str, rate: Rate, delay: bool
    ) -> RateAnswer | None:
        """One round trip; ``None`` when the store did not answer and the fallback lets it in."""
        try:
            answer = rates.hit(adm.task, counter, rate_key, adm.task_id, rate, delay)
        except StoreContention:
            raise
        except StoreError as exc:
            fall_back(adm, exc)
            return None
        if answer.admitted:
            counted(adm, counter, rate_key, answer)
        return answer


def counted(adm: Admission, counter: RateSupport, rate_key: str, answer: RateAnswer) -> None:
    """The call was counted in its window: its undo, and its delay to a reserved place."""
    adm.notes["rate"] = _Counted(counter, rate_key, answer.entry or adm.task_id)
    rates.delayed(adm.task, adm.options, answer.wait)
    if answer.wait > 0:
        adm.notes["rate_place"] = time.time() + answer.wait


def refused(adm: Admission, rate_key: str, answer: RateAnswer) -> object:
    """What a call over the limit answers (``RateLimited``, or the last publish's handle)."""
    otel.decided(adm, "refused", retry_after=round(answer.wait, 3))
    # A chain's first step has no handle that could stand in for its chain.
    return rates.refused(
        adm.task, rate_key, answer, adm.task_id, adm.args, adm.kwargs,
        may_return=not is_canvas(adm.options),
    )  # fmt: skip


def _duplicate_of(adm: Admission) -> object | None:
    """A refused call whose key is held answers as the duplicate it is (``existing``/``raise``).

    The window is full, but this call is the same work as the live
    holder's: its handle (or ``DuplicateTaskError``) is the true answer.
    """
    holder = holder_of(adm)
    if holder is None:
        return None
    return duplicate.answer(adm, holder, owner_token(adm))


def holder_of(adm: Admission) -> Lock | None:
    """The live holder of a rate-refused call's key, when the call is its duplicate.

    A call that would take the key over (``replace``, ``keep_last``,
    ``cancel_running``) is a new publish: it stays refused; inside a canvas,
    where those policies never take a key over (``canvas.takes_over``), it
    is a duplicate like any other. One more round trip, on refusals only.
    """
    if adm.key is None or adm.store is None:
        return None
    if takes_over(adm.call.on_duplicate, adm.options):
        return None
    try:
        return adm.store.get(adm.key)
    except StoreError:
        return None
