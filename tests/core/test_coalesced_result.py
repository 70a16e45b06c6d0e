"""``CoalescedResult``: a keep_last call's handle follows its replacements (real Redis backend)."""

from __future__ import annotations

import pytest
from celery import states
from celery.exceptions import TaskRevokedError

from celery_dedup.coalesce import CoalescedResult, link_replacement

from .conftest import AppFactory


def test_a_replaced_call_resolves_to_the_run_that_covered_it(app_factory: AppFactory) -> None:
    """REVOKED (or still waiting) messages follow their links to the last replacement's run."""
    app = app_factory("coalesced")
    backend = app.backend
    backend.mark_as_revoked("a", "replaced")
    link_replacement(backend, "a", "b")
    link_replacement(backend, "b", "c")  # b never reached a worker yet: still PENDING
    backend.store_result("c", 20, states.SUCCESS)
    assert CoalescedResult("a", app=app).get(timeout=10) == 20
    assert CoalescedResult("b", app=app).get(timeout=10) == 20
    assert CoalescedResult("a", app=app).state == states.REVOKED  # its own message's state


def test_a_message_that_ran_or_was_revoked_otherwise_answers_for_itself(
    app_factory: AppFactory,
) -> None:
    """Its own failure is its answer even when linked; a revoke without a link raises."""
    app = app_factory("coalesced-own")
    backend = app.backend
    backend.mark_as_failure("f", ValueError("boom"))
    link_replacement(backend, "f", "g")
    backend.store_result("g", 1, states.SUCCESS)
    with pytest.raises(ValueError, match="boom"):
        CoalescedResult("f", app=app).get(timeout=10)
    backend.mark_as_revoked("r", "revoked by its caller")
    with pytest.raises(TaskRevokedError):
        CoalescedResult("r", app=app).get(timeout=10)
