"""The example teaches the right policy: money and mail cannot run twice in their window."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_dedup import DuplicateTaskError
from celery_dedup.runtime import runtime_for


def _runs(task: Any, detail: str) -> int:
    from shop.models import TaskRun

    return int(TaskRun.objects.filter(task_name=task.name, detail=detail).count())


def test_double_submit_after_the_charge_finished_charges_once(
    worker: Any, celery_app: Any
) -> None:
    """A second submit 100 ms after the first charge succeeded is refused: one charge."""
    from shop import tasks

    paid = tasks.process_payment.delay("pay-77", "19.99", "EUR")
    assert paid.get(timeout=30) == "charged 19.99 EUR"
    time.sleep(0.1)  # the client's second click, after the charge finished
    with pytest.raises(DuplicateTaskError) as excinfo:
        tasks.process_payment.delay("pay-77", "19.99", "EUR")
    assert "within its deduplication window" in str(excinfo.value)
    assert paid.id not in str(excinfo.value)
    # Another amount for the same payment id is the same payment: refused too.
    with pytest.raises(DuplicateTaskError):
        tasks.process_payment.delay("pay-77", "29.99", "EUR")
    lock = runtime_for(celery_app).store.get(paid.deduplication_key)
    assert lock is not None and lock.task_id == paid.id and lock.ttl > 23 * 3600
    assert _runs(tasks.process_payment, "payment=pay-77") == 1


def test_payment_and_mail_policies_are_expiry_with_a_key(celery_app: Any) -> None:
    """Money and mail lock an idempotency key with ``unique_until="expiry"``."""
    from shop import tasks

    for task in (tasks.process_payment, tasks.send_digest, tasks.notify, tasks.fulfill_order):
        assert task.dedup_config().unique_until.value == "expiry", task.name
    assert tasks.payment_key("pay-1", "1.00", "EUR") == "payment:pay-1"


def test_keyed_mail_is_sent_once_even_after_it_was_sent(worker: Any, celery_app: Any) -> None:
    """``notify`` with an idempotency key: sent once, a repeat after delivery is suppressed."""
    from shop import tasks

    first = tasks.notify.apply_async((5, "welcome"), deduplication_key="welcome:user-5")
    assert first.get(timeout=30) == "sent"
    again = tasks.notify.apply_async((5, "welcome"), deduplication_key="welcome:user-5")
    assert again.deduplicated is True and again.id == first.id
    unkeyed = [tasks.notify.delay(5, "export-ready") for _ in range(2)]
    assert [r.get(timeout=30) for r in unkeyed] == ["sent", "sent"]
    assert _runs(tasks.notify, "user=5 template=welcome") == 1
    assert _runs(tasks.notify, "user=5 template=export-ready") == 2
