"""A freed concurrency slot goes to the oldest message waiting for it (``SlotHandoff``).

A message that finds its concurrency key full is listed in the key's wait
list with its *payload*: the very message ``worker._defer`` publishes,
without a countdown, serialized with the task's serializer. The body that
gives a slot back (or any take that finds a slot free) reserves it for the
oldest waiter in the same store call and gets its payload back; the worker
then publishes it at once, with Celery's plain publish (same task id, same
headers), and the copy takes the reserved slot. The deferred copy the
waiter parked with its backoff stays the safety net: a payload that was
never published, a copy revoked or lost, a worker killed holding the slot.

A ``keep_last`` follow-up waiting for its key's run gate is woken the same
way (``GateHandoff``): its payload is listed at the gate, and the run's
end, opening the gate, hands it back to the ending worker to publish.

The place in the list is the call's time (``CALLED_FIELD``, written when
the call is published and kept by every copy), so the key runs its waiting
messages in call order however their deliveries interleave.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

from kombu.serialization import dumps, loads, prepare_accept_content

from . import backoff
from .stores.base import SlotWaiter

if TYPE_CHECKING:
    from .task import DedupTask

__all__ = ["CALLED_FIELD", "called_at", "waiter_of", "wake"]

logger = logging.getLogger("celery_dedup")

#: The header with the call's publish time (seconds since the epoch, the producer's clock).
CALLED_FIELD: Final = "dedup_called"


def called_at(request: Any) -> float | None:
    """The call time ``request``'s message carries, or ``None`` (none, or not a time)."""
    value = getattr(request, CALLED_FIELD, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(CALLED_FIELD) if isinstance(headers, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    # A clock far ahead would put the message behind every other: it goes in now.
    return min(float(value), time.time())


def waiter_of(
    task: DedupTask, request: Any, args: Any, kwargs: Any, countdown: float
) -> SlotWaiter | None:
    """This message as a waiter whose parked copy comes back after ``countdown`` seconds.

    ``None`` when the message cannot be serialized again (it then waits
    with its backoff alone).
    """
    from . import worker

    try:
        options = worker.deferred_options(task, request, args, kwargs, None)
        body = {"task": task.name, "args": list(args or ()), "kwargs": dict(kwargs or {})}
        body["options"] = options
        content_type, encoding, data = dumps(body, serializer=task.serializer)
    except Exception as exc:  # a message its own serializer cannot write again
        logger.warning(
            "celery-dedup: %s[%s] waits without a handoff: %s", task.name, request.id, exc
        )
        return None
    written: Any = data  # ``str`` from a text serializer (json, yaml)
    raw = written if isinstance(written, bytes) else str(written).encode(encoding or "utf-8")
    payload = f"{content_type};{encoding}\n".encode() + raw
    order = called_at(request) or time.time()
    life = backoff.copy_life(countdown)  # the entry outlives its parked copy
    return SlotWaiter(str(request.id), order, payload, life)


def wake(task: DedupTask, payloads: Iterable[bytes]) -> int:
    """Publish each woken waiter's message at once; how many were published.

    Never raises: a payload that does not decode or publish is logged, and
    its reservation lapses (the waiter's parked copy comes back for it).
    """
    from celery.app.task import Task

    published = 0
    for payload in payloads:
        try:
            head, _, raw = payload.partition(b"\n")
            content_type, _, encoding = head.decode().partition(";")
            accept = prepare_accept_content(task.app.conf.accept_content)
            body = loads(raw, content_type, encoding or "utf-8", accept=accept)
            name = body["task"]
            target: Any = task if name == task.name else task.app.tasks[name]
            options = dict(body["options"])
            Task.apply_async(target, tuple(body["args"]), dict(body["kwargs"]), **options)
            published += 1
            logger.info(
                "celery-dedup: %s[%s] woken: its turn came (a slot or its key's run gate)",
                name,
                options.get("task_id"),
            )
        except Exception as exc:
            logger.warning("celery-dedup: could not wake a waiting message (it lapses): %s", exc)
    return published
