"""Signals sent by celery-dedup (declarations only).

Connect receivers like Celery's own signals::

    from celery_dedup.signals import task_deduplicated

    @task_deduplicated.connect
    def on_duplicate(sender, key, existing_task_id, **kwargs): ...

``sender`` is always the task (a ``DedupTask`` instance). Keys are the hashed
store keys, never raw arguments.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "dedup_fallback",
    "lock_acquired",
    "lock_released",
    "lock_replaced",
    "task_deduplicated",
    "task_skipped",
]

#: A call was a duplicate and nothing was published (``on_duplicate`` =
#: ``"existing"`` or ``"raise"``). Sent in the publishing process, before
#: ``DuplicateTaskError`` is raised. ``duplicate_id`` is the id the call
#: would have had; it was never published.
task_deduplicated = Signal(
    name="task_deduplicated",
    providing_args={"key", "existing_task_id", "duplicate_id", "args", "kwargs", "ttl"},
)

#: A lock was taken for a new task id, just before its message is published
#: (or, for messages that bypassed ``apply_async``, when the worker starts it).
lock_acquired = Signal(
    name="lock_acquired",
    providing_args={"key", "task_id", "ttl", "policy"},
)

#: A lock was actively released by its owner. ``reason`` is one of
#: ``"start"``, ``"success"``, ``"failure"``, ``"revoked"``, ``"publish_failed"``,
#: ``"manual"``, ``"reaped"``. Sent only when the store deleted the lock.
lock_released = Signal(
    name="lock_released",
    providing_args={"key", "task_id", "reason"},
)

#: ``on_duplicate="replace"`` took a lock over: ``task_id`` is the new holder,
#: ``previous_task_id`` the one that is being revoked.
lock_replaced = Signal(
    name="lock_replaced",
    providing_args={"key", "task_id", "previous_task_id"},
)

#: No lock could be used and ``dedup_fallback`` decided: ``reason`` is
#: ``"no_store"`` or ``"unavailable"``, ``action`` is ``"open"`` (published
#: without a lock) or ``"closed"`` (``DeduplicationUnavailable`` raised).
dedup_fallback = Signal(
    name="dedup_fallback",
    providing_args={"reason", "action", "error"},
)

#: A worker did not run a task because another task holds its lock (a message
#: that bypassed ``apply_async``, or a task replaced by a newer call). The
#: task ends in state ``IGNORED``.
task_skipped = Signal(
    name="task_skipped",
    providing_args={"key", "task_id", "existing_task_id", "reason"},
)
