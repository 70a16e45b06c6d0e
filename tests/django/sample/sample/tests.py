"""The project's own tests, run by ``manage.py test``: each starts with no lock left.

Test methods run in name order, so ``test_1_*`` leaves a lock that
``test_2_*`` would see as a duplicate if locks leaked between tests.
"""

from __future__ import annotations

import threading

from django.test import TestCase, TransactionTestCase, override_settings

from celery_dedup import DuplicateTaskError
from celery_dedup.contrib.django.models import DedupLock

from .tasks import build_report, sync_address


class LocksRollBackWithTheTest(TestCase):
    """``TestCase``: the lock is written in the test's transaction and rolled back."""

    def test_1_second_call_is_a_duplicate(self) -> None:
        """Two calls inside one test: the second is deduplicated."""
        self.assertFalse(sync_address.delay(1).deduplicated)
        self.assertTrue(sync_address.delay(1).deduplicated)

    def test_2_no_lock_left_by_the_previous_test(self) -> None:
        """The previous test's lock is gone."""
        self.assertEqual(DedupLock.objects.count(), 0)
        self.assertFalse(sync_address.delay(1).deduplicated)

    def test_3_emptying_the_lock_table_then_calling(self) -> None:
        """Deleting every lock inside the test, then calling a task, never hangs."""
        self.assertFalse(sync_address.delay(2).deduplicated)
        DedupLock.all_rows.all().delete()
        self.assertFalse(sync_address.delay(2).deduplicated)

    @override_settings(CELERY_DEDUP_DEFAULT_ON_DUPLICATE="raise")
    def test_4_override_settings_reaches_both_apps(self) -> None:
        """``override_settings`` changes the project's second Celery app too."""
        build_report.delay(7)
        sync_address.delay(7)
        with self.assertRaises(DuplicateTaskError):
            build_report.delay(7)
        with self.assertRaises(DuplicateTaskError):
            sync_address.delay(7)

    def test_5_after_override_the_default_is_back(self) -> None:
        """Outside the override a duplicate is a handle again, not an error."""
        build_report.delay(8)
        self.assertTrue(build_report.delay(8).deduplicated)


class LocksAreFlushedWithTheTables(TransactionTestCase):
    """``TransactionTestCase``: committed locks, emptied with the tables after each test."""

    def test_1_second_call_is_a_duplicate(self) -> None:
        """Two calls: the second is deduplicated."""
        self.assertFalse(sync_address.delay(3).deduplicated)
        self.assertTrue(sync_address.delay(3).deduplicated)

    def test_2_no_lock_left_by_the_previous_test(self) -> None:
        """The previous test's lock was flushed."""
        self.assertFalse(sync_address.delay(3).deduplicated)

    def test_3_another_thread_sees_the_lock(self) -> None:
        """A lock taken here is committed: a call from another thread is its duplicate."""
        self.assertFalse(sync_address.delay(4).deduplicated)
        seen: list[bool] = []
        thread = threading.Thread(target=lambda: seen.append(sync_address.delay(4).deduplicated))
        thread.start()
        thread.join(30)
        self.assertEqual(seen, [True])
