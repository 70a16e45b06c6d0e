"""Native deduplication: brokers that drop duplicate messages themselves.

Amazon SQS FIFO queues drop a message whose ``MessageDeduplicationId`` was
seen in the last 5 minutes; kombu's SQS transport forwards that message
property on ``.fifo`` queues. When ``dedup_native`` allows it and a call goes
to such a queue, the key's digest becomes the ``MessageDeduplicationId`` and
no lock store is touched.

SQS accepts a duplicate without telling the producer, so the task id is
always derived from the key: the result handle a duplicate call gets is the
real task's. ``deduplicated`` is ``None`` on that handle: only the broker
knows. Retries never reuse the id (the holder republish path does not set it).
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any, Final

__all__ = [
    "SQS_WINDOW",
    "Native",
    "native_property",
    "set_native_options",
    "uses_native",
    "warn_unhonoured",
]

logger = logging.getLogger("celery_dedup")

#: SQS FIFO's fixed deduplication window, in seconds
SQS_WINDOW: Final = 300.0

W_WINDOW = (
    "celery-dedup: %s goes to SQS FIFO queue %r, which deduplicates for a fixed %.0f s; "
    "unique_for=%.0f, unique_until=%r and on_duplicate=%r cannot be honoured there "
    "(dedup_native='never' uses the lock store instead)"
)


class Native(str, Enum):
    """Whether to hand deduplication to a broker that does it itself."""

    #: use the broker's deduplication whenever the target queue has it
    AUTO = "auto"
    #: always use the lock store
    NEVER = "never"


def uses_native(mode: Native, scheme: str, queue: str) -> bool:
    """Whether a call to ``queue`` on a ``scheme`` broker is deduplicated natively."""
    return mode is Native.AUTO and scheme.lower() == "sqs" and queue.endswith(".fifo")


def native_property(key: str) -> str:
    """The ``MessageDeduplicationId`` of a key: its digest (32 of SQS's 128 characters)."""
    return key.rsplit(":", 1)[-1]


_warned: set[tuple[str, str]] = set()


def warn_unhonoured(
    task_name: str, queue: str, unique_for: float, unique_until: str, on_duplicate: str
) -> None:
    """Warn once per task and queue when the options ask more than the fixed window."""
    if unique_for == SQS_WINDOW and unique_until == "expiry" and on_duplicate == "existing":
        return
    if (task_name, queue) in _warned:
        return
    _warned.add((task_name, queue))
    logger.warning(
        W_WINDOW, task_name, queue, SQS_WINDOW, unique_for, unique_until, on_duplicate
    )


def set_native_options(options: dict[str, Any], key: str) -> None:
    """Put the deduplication id on the message (a broker message property)."""
    options["MessageDeduplicationId"] = native_property(key)
