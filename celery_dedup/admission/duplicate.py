"""What a call whose key is held answers: the holder's handle, or ``DuplicateTaskError``."""

from __future__ import annotations

import logging

from celery.utils import uuid

from .. import events, key_reuse, otel
from ..exceptions import DuplicateTaskError
from ..options import OnDuplicate, OnKeyReuse
from ..results import DeduplicatedResult
from ..signals import task_deduplicated
from ..stores.base import Lock
from .canvas import is_canvas, must_not_raise
from .state import Admission

__all__ = ["answer"]

logger = logging.getLogger("celery_dedup")


def answer(adm: Admission, holder: Lock, owner: str) -> DeduplicatedResult:
    """Report the suppressed call, then return the holder's result or raise.

    A duplicate canvas published outside a worker (a chain's first step,
    the first member of a keyed group) raises ``DuplicateTaskError``
    whatever ``on_duplicate`` says: Celery returns the canvas' result
    before the first step is published, so nothing can stand in for it.
    A caller's key held for other arguments follows ``on_key_reuse`` first.
    """
    task, call, key = adm.task, adm.call, adm.key
    assert key is not None
    policy = call.on_duplicate.value
    if key_reuse.conflicts(owner, holder):
        key_reuse.report(task, call.on_key_reuse, key, holder.task_id, holder.ttl)
        if call.on_key_reuse is not OnKeyReuse.IGNORE:
            policy = f"on_key_reuse={call.on_key_reuse.value}"
    runtime = adm.config.runtime
    duplicate_id = adm.task_id
    if duplicate_id == holder.task_id:
        duplicate_id = uuid()  # a deterministic id: the event needs its own uuid
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "celery-dedup: %s duplicate suppressed (key %s, ttl %.1fs)",
            task.name,
            key.rsplit(":", 1)[-1][:16],
            holder.ttl,
        )
    runtime.metrics.incr(task.name, "deduplicated")
    otel.decided(adm, "duplicate", holder_id=holder.task_id, policy=policy)
    task_deduplicated.send(
        sender=task,
        key=key,
        existing_task_id=holder.task_id,
        duplicate_id=duplicate_id,
        args=adm.args,
        kwargs=adm.kwargs,
        ttl=holder.ttl,
    )
    if runtime.settings.send_events:
        events.send_deduplicated(
            task.app,
            task_name=task.name,
            duplicate_id=duplicate_id,
            holder_id=holder.task_id,
            args=adm.args,
            kwargs=adm.kwargs,
            policy=policy,
        )
    raises = is_canvas(adm.options) or call.on_duplicate is OnDuplicate.RAISE
    if raises and not must_not_raise(task, adm.options):
        raise DuplicateTaskError(
            task_name=task.name, key=key, existing_task_id=holder.task_id, ttl=holder.ttl
        )
    return DeduplicatedResult(
        holder.task_id,
        app=task.app,
        backend=task.backend,
        deduplication_key=key,
        # The owner token is the holder's proof of ownership: never hand it out.
        lock=holder.without_owner(),
        duplicate_id=duplicate_id,
    )
