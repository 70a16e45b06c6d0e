"""``revoke(result)`` acts on the handle's publish, never on a task id (issue 20, item 4 and 5).

Real in-thread workers on Redis; bodies record each execution in a Redis
list and each test asserts the exact count.
"""

from __future__ import annotations

from typing import Any

import pytest

import celery_dedup
from celery_dedup import RevokeOutcome

from .conftest import AppFactory, wait_until
from .test_ownership import Runs, lock_of, recording_job, runs, skips

__all__ = ["runs", "skips"]  # the fixtures, shared with test_ownership

pytestmark = pytest.mark.timeout(60)


def test_revoking_an_old_handle_leaves_a_later_run_with_its_id_alone(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """The old run finished; a new publish reuses its id; revoking the old handle is a no-op."""
    app = app_factory("revoke-reused-id")
    job = recording_job(app, runs)
    worker_for(app)
    old = job.apply_async([1], task_id="reused-id")
    assert old.get(timeout=10) == 1
    assert celery_dedup.revoke(old) is RevokeOutcome.NOT_HELD
    later = job.apply_async([2], task_id="reused-id")
    assert later.deduplicated is False
    # Not discarded by a revoke-by-id of the old handle: it runs. (Its result
    # is not stored: Celery never overwrites a SUCCESS under the same id.)
    wait_until(lambda: runs.labels() == ["1", "2"], timeout=10)


def test_revoke_after_the_lock_expired_still_stops_the_queued_message(
    app_factory: AppFactory, worker_for: Any, runs: Runs, skips: list[tuple[str, str]]
) -> None:
    """No worker while the 1 s lock expires; ``revoke()`` then leaves a marker: it never runs.

    With a deterministic id no revoke-by-id is broadcast: the marker alone stops it.
    """
    app = app_factory("revoke-expired")
    job = recording_job(app, runs, deterministic_id=True)
    result = job.apply_async([1], unique_for=1)
    wait_until(lambda: lock_of(result, app) is None, timeout=10)
    assert celery_dedup.revoke(result) is RevokeOutcome.NOT_HELD
    worker_for(app)
    # (No state is stored under a deterministic id: later runs share it.)
    wait_until(lambda: (result.id, "revoked") in skips, timeout=15)
    assert runs.count() == 0
    assert lock_of(result, app) is None
    later = job.delay(1)  # the key is free for a new call, which runs
    assert later.deduplicated is False
    assert later.get(timeout=10) == 1
    assert runs.labels() == ["1"]
