"""``on_duplicate="cancel_running"`` on the Django DB store: a queued holder is taken over
in one store operation (``QueuedTakeOver``), so the call costs what a ``replace`` costs."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext, override_settings

from celery_dedup import DedupTask
from celery_dedup.runtime import reset_runtime, runtime_for
from celery_dedup.stores.base import QueuedTakeOver
from celery_dedup.stores.django import DjangoStore


def _echo(n: int) -> int:
    return n


@pytest.mark.usefixtures("transactional_db")
def test_cancel_over_a_queued_holder_costs_what_replace_costs(celery_app: Any) -> None:
    """The same statements as replace (take-over transaction + revoke transaction); the
    queued holder is revoked and the new call holds the key."""
    with override_settings(CELERY_DEDUP_METRICS_FLUSH_INTERVAL=3600):
        reset_runtime(celery_app)
        store = runtime_for(celery_app).store
        assert isinstance(store, DjangoStore) and isinstance(store, QueuedTakeOver)
        tasks = {
            policy: celery_app.task(
                _echo, base=DedupTask, shared=False, unique_for=60,
                name=f"tests.django.cost_{policy}", on_duplicate=policy,
            )
            for policy in ("replace", "cancel_running")
        }
        sent: dict[str, list[str]] = {}
        results: dict[str, list[Any]] = {}
        for policy, task in tasks.items():
            first = task.delay(1)
            with CaptureQueriesContext(connections["default"]) as queries:
                second = task.delay(1)
            sent[policy] = [q["sql"].split()[0].upper() for q in queries.captured_queries]
            results[policy] = [first, second]
        reset_runtime(celery_app)
    assert sent["cancel_running"] == sent["replace"], sent
    for policy, (first, second) in results.items():
        holder = store.get(second.deduplication_key)
        assert holder is not None and holder.task_id == second.id != first.id, policy
