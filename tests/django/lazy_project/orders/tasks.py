"""A deduplicated task, in a module no view imports."""

from __future__ import annotations

from celery import shared_task

from celery_dedup import DedupTask


@shared_task(base=DedupTask, name="orders.sync", unique_for=600)
def sync(order_id: int) -> int:
    """Sync one order."""
    return order_id
