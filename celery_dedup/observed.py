"""What ``dedup_mode="observe"`` let through is reported: counted, signalled, sent.

The producer (a refused call published anyway, ``admission.observe``) and
the worker (a run that finds its key held and runs anyway) report the same
way: the ``would_<outcome>`` counters per task and per key, the
``task_observed`` signal and, when events are on, the ``task-observed``
event.
"""

from __future__ import annotations

from typing import Any

from . import events
from .metrics import key_counter
from .signals import task_observed

__all__ = ["report"]


def report(
    task: Any,
    runtime: Any,
    *,
    key: str | None,
    counted_key: str | None,
    task_id: str,
    holder_id: str | None,
    would: str,
    policy: str,
    args: Any,
    kwargs: Any,
) -> None:
    """Report what enforcing would have done (``would``) to ``task``'s call ``task_id``.

    ``key`` is the signal's lock key; ``counted_key`` the key the per-key
    counter is kept under (a rate refusal's rate key when there is no lock key).
    """
    counter = f"would_{would}"
    runtime.metrics.incr(task.name, counter)
    if counted_key is not None:
        runtime.metrics.incr(key_counter(task.name, counted_key), counter)
    task_observed.send(
        sender=task, key=key, task_id=task_id, existing_task_id=holder_id,
        would=would, policy=policy, args=args, kwargs=kwargs,
    )  # fmt: skip
    if runtime.settings.send_events:
        events.send_observed(
            task.app, task_name=task.name, task_id=task_id, holder_id=holder_id,
            would=would, policy=policy, args=args, kwargs=kwargs,
        )  # fmt: skip
