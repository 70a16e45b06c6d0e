"""The same promises under pytest-django: ``db`` and ``transactional_db``."""

from __future__ import annotations

import pytest
from django.test import override_settings

from celery_dedup import DuplicateTaskError
from celery_dedup.contrib.django.models import DedupLock

from .tasks import build_report, sync_address


@pytest.mark.django_db
def test_db_1_leaves_a_lock() -> None:
    """``db``: the second call is a duplicate."""
    assert not sync_address.delay(11).deduplicated
    assert sync_address.delay(11).deduplicated


@pytest.mark.django_db
def test_db_2_sees_no_lock_of_the_previous_test() -> None:
    """``db``: the previous test's lock was rolled back."""
    assert DedupLock.objects.count() == 0
    assert not sync_address.delay(11).deduplicated


@pytest.mark.django_db
def test_db_3_empty_the_table_then_call() -> None:
    """``db``: emptying the lock table, then calling, never hangs."""
    sync_address.delay(12)
    DedupLock.all_rows.all().delete()
    assert not sync_address.delay(12).deduplicated


@pytest.mark.django_db(transaction=True)
def test_transactional_1_leaves_a_lock() -> None:
    """``transactional_db``: the second call is a duplicate."""
    assert not sync_address.delay(13).deduplicated
    assert sync_address.delay(13).deduplicated


@pytest.mark.django_db(transaction=True)
def test_transactional_2_sees_no_lock_of_the_previous_test() -> None:
    """``transactional_db``: the tables were flushed, the lock with them."""
    assert not sync_address.delay(13).deduplicated


@pytest.mark.django_db
def test_settings_fixture_reaches_both_apps(settings: object) -> None:
    """pytest-django's ``settings`` fixture (``override_settings``) reaches both apps."""
    with override_settings(CELERY_DEDUP_DEFAULT_ON_DUPLICATE="raise"):
        build_report.delay(14)
        with pytest.raises(DuplicateTaskError):
            build_report.delay(14)
    assert build_report.delay(14).deduplicated
