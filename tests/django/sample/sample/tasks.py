"""Deduplicated tasks of both apps."""

from __future__ import annotations

import threading

from celery_dedup import DedupTask

from .celery import app, reports


@app.task(base=DedupTask, name="sample.sync_address")
def sync_address(user_id: int) -> int:
    """Push a user's address somewhere."""
    return user_id


@reports.task(base=DedupTask, name="sample.build_report")
def build_report(customer: int) -> int:
    """Build a customer's report."""
    return customer


#: executions per key of ``record`` in this process (the pooled-load script reads it)
EXECUTED: dict[str, int] = {}
_EXECUTED_LOCK = threading.Lock()


@app.task(base=DedupTask, name="sample.record", unique_until="expiry")
def record(key: str) -> None:
    """Count one execution of ``key``, after a query of the project's own."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    with _EXECUTED_LOCK:
        EXECUTED[key] = EXECUTED.get(key, 0) + 1
