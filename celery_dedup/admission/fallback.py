"""``dedup_fallback`` for a step whose store did not answer."""

from __future__ import annotations

import logging

from .. import otel
from ..exceptions import DeduplicationUnavailable, StoreError
from .canvas import must_not_raise
from .state import Admission

__all__ = ["fall_back"]

logger = logging.getLogger("celery_dedup")


def fall_back(adm: Admission, error: StoreError | None) -> None:
    """Return to go on without the store's answer (``"open"``), or raise (``"closed"``).

    A publish from inside a worker (a chain step, a callback, a chord
    body) is never refused: the parent already did its work, and failing
    it for a dedup reason would fail its whole canvas.
    """
    try:
        adm.config.runtime.fall_back(adm.task.name, error)
    except DeduplicationUnavailable as exc:
        if adm.task.app.current_worker_task is None and not must_not_raise(
            adm.task, adm.options
        ):
            otel.decided(adm, "unavailable", error=type(error).__name__ if error else None)
            raise
        adm.notes["fallback"] = "closed"
        logger.warning(
            "celery-dedup: %s published without a lock from inside a worker "
            "(dedup_fallback='closed' never fails the parent task): %s",
            adm.task.name,
            exc,
        )
    else:
        adm.notes["fallback"] = "open"
