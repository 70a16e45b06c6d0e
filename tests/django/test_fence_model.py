"""Django's fenced update: a row a newer run wrote refuses an older run's update."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, models
from django.test.utils import isolate_apps

from celery_dedup.contrib.django.fence import FencedManager, FenceField


@pytest.fixture
def payments(transactional_db: Any) -> Iterator[Any]:
    """A payment model with a ``FenceField``, in a registry of its own (no migration)."""
    with isolate_apps("shop"):

        class Payment(models.Model):  # type: ignore[misc]
            status = models.CharField(max_length=20, default="pending")
            fence = FenceField()

            objects = FencedManager()

            class Meta:
                app_label = "shop"
                db_table = "test_fence_payment"

        with connection.schema_editor() as editor:
            editor.create_model(Payment)
        yield Payment
        with connection.schema_editor() as editor:
            editor.delete_model(Payment)


def test_fenced_update_lands_for_the_newest_run_only(payments: Any) -> None:
    """Token 7 writes; 9 overwrites; a late 7 is refused; 9 again (the same run) lands."""
    row = payments.objects.create()
    assert row.fence == 0
    mine = payments.objects.filter(pk=row.pk)
    assert mine.fenced_update(fence=7, status="charging") == 1
    assert mine.fenced_update(fence=9, status="charging") == 1
    assert mine.fenced_update(fence=7, status="paid-by-stale") == 0
    assert mine.fenced_update(fence=9, status="paid") == 1
    row.refresh_from_db()
    assert (row.status, row.fence) == ("paid", 9)
