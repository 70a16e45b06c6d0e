"""Signals sent by celery-dedup (declarations only).

Connect receivers like Celery's own signals::

    from celery_dedup.signals import task_deduplicated

    @task_deduplicated.connect
    def on_duplicate(sender, key, existing_task_id, **kwargs): ...

``sender`` is the task (a ``DedupTask`` instance) except where noted below.
``key`` is always the hashed store key (``<prefix>:<task name>:<sha256>``),
never raw arguments. Receivers run synchronously in the process and thread
that sent the signal (the publisher, or the worker's pool process), so they
must be quick and must not raise: an exception in a receiver propagates like
any Celery signal's (use ``connect`` as usual; ``send_robust`` is not used).
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "dedup_fallback",
    "holder_cancelled",
    "key_reused",
    "lock_acquired",
    "lock_released",
    "lock_replaced",
    "task_deduplicated",
    "task_observed",
    "task_skipped",
]

#: A call was a duplicate and nothing was published (``on_duplicate`` =
#: ``"existing"`` or ``"raise"``). Sent in the publishing process, before
#: ``DuplicateTaskError`` is raised and before the ``task-deduplicated``
#: event. ``existing_task_id`` is the holder; ``duplicate_id`` is the id the
#: call would have had (never published; the event's uuid); ``args`` and
#: ``kwargs`` are the call's own (raw) arguments; ``ttl`` is the seconds left
#: on the holder's lock.
task_deduplicated = Signal(
    name="task_deduplicated",
    providing_args=["key", "existing_task_id", "duplicate_id", "args", "kwargs", "ttl"],
)

#: A lock was taken for a new task id, just before its message is published
#: (or, for messages that bypassed ``apply_async``, when the worker starts it).
#: ``task_id`` is the new holder, ``ttl`` the lock's lifetime in seconds
#: (``unique_for`` plus any countdown/ETA), ``policy`` the ``unique_until``
#: value (``"start"``, ``"success"``, ``"finish"`` or ``"expiry"``). Also sent
#: by ``on_duplicate="replace"`` and ``"keep_last"`` before ``lock_replaced``.
lock_acquired = Signal(
    name="lock_acquired",
    providing_args=["key", "task_id", "ttl", "policy"],
)

#: A lock was actively released. Sent only when the store deleted the lock
#: (an expired lock sends nothing). ``task_id`` is the owner it was released
#: for. ``reason`` is ``"start"``, ``"success"`` or ``"failure"`` (the worker,
#: per ``unique_until``), ``"revoked"``/``"expired"`` (a revoked or expired
#: message reached a worker, or ``celery_dedup.revoke``), ``"publish_failed"``
#: (publishing raised after the lock was taken) or ``"manual"``
#: (``celery_dedup.release``, ``celery dedup release``/``purge``). ``sender`` is
#: the task for worker and publisher releases, ``None`` for the API and CLI.
lock_released = Signal(
    name="lock_released",
    providing_args=["key", "task_id", "reason"],
)

#: ``on_duplicate="replace"`` or ``"keep_last"`` took a lock over: ``task_id``
#: is the new holder, ``previous_task_id`` the one that is being revoked;
#: ``policy`` is the ``on_duplicate`` value that acted (``"replace+max_wait"``
#: when ``debounce_max_wait`` capped the new message's ETA). ``follow_up`` is
#: True when ``keep_last`` found the previous holder running: it is not
#: revoked, and the new message runs after it.
lock_replaced = Signal(
    name="lock_replaced",
    providing_args=["key", "task_id", "previous_task_id", "policy", "follow_up"],
)

#: ``on_duplicate="cancel_running"`` cancelled the holder of ``key``:
#: ``cancelled_task_id`` was revoked while queued (``running=False``) or asked
#: to terminate with ``terminate_signal`` (``running=True``); ``task_id`` is the call
#: that will be published once the key is free. Sent in the calling process.
holder_cancelled = Signal(
    name="holder_cancelled",
    providing_args=["key", "task_id", "cancelled_task_id", "running", "terminate_signal", "policy"],
)

#: No lock could be used and ``dedup_fallback`` decided: ``reason`` is
#: ``"no_store"`` or ``"unavailable"``, ``action`` is ``"open"`` (published
#: without a lock) or ``"closed"`` (``DeduplicationUnavailable`` raised),
#: ``error`` the ``StoreUnavailable`` (``None`` for ``"no_store"``). Here
#: ``sender`` is the task's **name** (a string). Sent before publishing or
#: raising.
dedup_fallback = Signal(
    name="dedup_fallback",
    providing_args=["reason", "action", "error"],
)

#: A worker did not run a delivered message. ``task_id`` is the skipped
#: task, ``existing_task_id`` the holder, ``reason`` one of:
#: ``"replaced"``, ``"unannounced duplicate"`` (a message that bypassed
#: ``apply_async``), ``"held by another publish"`` (state ``IGNORED``);
#: ``"revoked"`` (state ``REVOKED``); ``"already ran"`` (a copy the broker
#: redelivered after its run completed: no state, the id is the run's);
#: ``"deferred: …"`` (a copy that arrived while another copy runs, or while
#: the store could not answer: published again for later, no state).
#: Sent in the worker's pool process.
task_skipped = Signal(
    name="task_skipped",
    providing_args=["key", "task_id", "existing_task_id", "reason"],
)

#: A call's caller-given ``deduplication_key`` is held by a publish made with
#: different arguments (compared by fingerprint, see ``on_key_reuse``).
#: ``existing_task_id`` is the holder; ``action`` is ``"raise"``
#: (``KeyReuseError`` follows, nothing is published) or ``"warn"`` (a
#: ``KeyReuseWarning`` follows and the call is answered as a duplicate,
#: ``task_deduplicated`` included). Sent in the publishing process.
key_reused = Signal(
    name="key_reused",
    providing_args=["key", "existing_task_id", "action"],
)

#: ``dedup_mode="observe"``: a call that enforcing would have refused or
#: used to displace another was **published anyway** (nothing suppressed,
#: refused, revoked or cancelled). ``would`` names what ``"enforce"`` would
#: have done: ``"deduplicate"`` (``on_duplicate`` ``"existing"``/``"raise"``:
#: not published), ``"replace"`` (``"replace"``/``"keep_last"``: the holder
#: revoked or followed), ``"cancel"`` (``"cancel_running"``: the holder
#: revoked or terminated) or ``"rate_limit"`` (over ``rate_limit_per_key``:
#: refused or delayed). ``task_id`` is the published call's id,
#: ``existing_task_id`` the key's holder (``None`` for ``"rate_limit"``),
#: ``policy`` the ``on_duplicate`` (or ``on_rate_limit``) value, ``args`` and
#: ``kwargs`` the call's own. Sent once per observed call, in the publishing
#: process, before the publish.
task_observed = Signal(
    name="task_observed",
    providing_args=["key", "task_id", "existing_task_id", "would", "policy", "args", "kwargs"],
)
