"""The example's tasks, each a real use of celery-dedup.

Each body records a ``TaskRun`` row, which is how the demo counts what ran.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import shared_task

from celery_dedup import DedupTask, time_bucket

from .models import TaskRun


def _ran(task: Any, detail: str) -> None:
    TaskRun.objects.create(task_name=task.name, task_id=task.request.id or "", detail=detail)


def digest_key(user_id: int) -> str:
    """One digest per user per UTC day."""
    return f"digest:{user_id}:{time_bucket('day')}"


@shared_task(
    bind=True,
    base=DedupTask,
    deduplication_key=digest_key,
    unique_for=timedelta(days=1),
    unique_until="expiry",
)
def send_digest(self: Any, user_id: int) -> str:
    """A digest mailer: at most one digest per user per day (a throttle, TTL only)."""
    _ran(self, f"user={user_id}")
    return f"digest sent to user {user_id}"


@shared_task(bind=True, base=DedupTask, unique_for=600, unique_until="success")
def sync_address(self: Any, user_id: int, address: dict[str, str]) -> str:
    """Faktory's example: the same sync is queued once until it succeeds."""
    _ran(self, f"user={user_id}")
    return "synced"


def payment_key(payment_id: str, amount: str, currency: str) -> str:
    """The payment's idempotency key: its id, whatever else the call says."""
    return f"payment:{payment_id}"


@shared_task(
    bind=True,
    base=DedupTask,
    deduplication_key=payment_key,
    unique_for=timedelta(hours=24),
    unique_until="expiry",
    on_duplicate="raise",
)
def process_payment(self: Any, payment_id: str, amount: str, currency: str) -> str:
    """Charge once: one charge per payment id for 24 hours, even after it succeeded.

    Money needs ``unique_until="expiry"``: under the default ``"success"`` a
    finished charge frees its lock, and a double submit that arrives after it
    (a retrying client, a second click) would charge again. A duplicate raises
    ``DuplicateTaskError``, which the API answers with 409.
    """
    _ran(self, f"payment={payment_id}")
    return f"charged {amount} {currency}"


@shared_task(
    bind=True,
    base=DedupTask,
    identity="caller_provided",
    unique_for=timedelta(hours=24),
    unique_until="expiry",
)
def fulfill_order(self: Any, order_id: int, items: list[str]) -> str:
    """Keyed by the client's ``Idempotency-Key``, remembered for 24 hours."""
    _ran(self, f"order={order_id}")
    return f"fulfilled {len(items)} items"


def probe_countdown(attempt: int) -> int:
    """Seconds before probe ``attempt`` runs: 5, 15, 25, … minutes."""
    return (5 + attempt * 10) * 60


@shared_task(bind=True, base=DedupTask, unique_for=600, deterministic_id=True)
def probe_server(self: Any, server_url: str, attempt: int) -> str:
    """The federation health check: one scheduled probe per server and attempt.

    Its task id derives from the lock key, so anyone can find the probe's
    result from ``(server_url, attempt)`` alone.
    """
    _ran(self, f"server={server_url} attempt={attempt}")
    return "up"


def schedule_probe(server_url: str, attempt: int = 0) -> Any:
    """Schedule the next probe of ``server_url``; a second call is a no-op."""
    return probe_server.apply_async((server_url, attempt), countdown=probe_countdown(attempt))


@shared_task(bind=True, base=DedupTask, identity="always_unique", unique_until="expiry")
def notify(self: Any, user_id: int, template: str) -> str:
    """A mail: every notification is sent, unless its caller passes an idempotency key.

    Two "your export is ready" mails for two exports are two mails. A mail
    triggered by an event passes the event as its key
    (``deduplication_key=f"welcome:{user_id}"``): the lock lives for the
    default TTL even after the mail went out (``unique_until="expiry"``), so a
    redelivered event never sends it twice.
    """
    _ran(self, f"user={user_id} template={template}")
    return "sent"


@shared_task(bind=True, base=DedupTask, unique_for=3000, unique_until="finish")
def purge_expired_locks(self: Any) -> int:
    """Periodic (``CELERY_BEAT_SCHEDULE``): reclaim expired lock rows; never twice at once."""
    from celery_dedup.runtime import runtime_for
    from celery_dedup.stores.django import DjangoStore

    _ran(self, "")
    store = runtime_for(self.app).store
    return store.purge_expired() if isinstance(store, DjangoStore) else 0
