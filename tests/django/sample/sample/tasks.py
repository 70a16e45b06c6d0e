"""Deduplicated tasks of both apps."""

from __future__ import annotations

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
