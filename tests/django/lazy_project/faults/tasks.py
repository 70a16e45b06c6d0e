"""Tasks ``dedup_locks check`` fails on: a forgotten base; with
``LAZY_FAULTS=option`` also an invalid option (which fails registration)."""

from __future__ import annotations

import os

from celery import shared_task

from celery_dedup import DedupTask


@shared_task(name="faults.forgot_base", unique_for=60)
def forgot_base(n: int) -> int:
    """Meant to be deduplicated, but not a DedupTask."""
    return n


if os.environ.get("LAZY_FAULTS") == "option":

    @shared_task(base=DedupTask, name="faults.bad_policy", unique_until="sometime")
    def bad_policy(n: int) -> int:
        """A DedupTask whose unique_until is not one of the policies."""
        return n
