"""A store answer the worker cannot read never decides the task's fate (issue 30).

A store of one's own with a bug, or a proxy that mangles a reply, makes the
start claim raise something other than a ``StoreError``. That is a store
that did not answer: the fallback decides (``open`` runs the body once,
unchecked; ``closed`` defers the message until the store answers), and the
task never ends ``FAILURE`` without its body having run. A real worker;
bodies record their runs.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery import states

from celery_dedup import DedupTask
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import Claim, LockMeta

from .conftest import AppFactory, wait_until
from .test_bare_store import BareStore

pytestmark = pytest.mark.timeout(120)


class Garbled(BareStore):
    """A store whose first ``bad`` start claims come back unreadable."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad
        self.garbled = 0
        self.lock = threading.Lock()

    def claim(
        self, key: str, owner: str, *, release: bool, ttl: float | None, meta: LockMeta
    ) -> Claim:
        with self.lock:
            if self.garbled < self.bad:
                self.garbled += 1
                raise KeyError("holder")  # what decoding a truncated reply raises
        return super().claim(key, owner, release=release, ttl=ttl, meta=meta)


@pytest.mark.parametrize("fallback", ["open", "closed"])
def test_an_unreadable_start_claim_follows_the_fallback(
    fallback: str, app_factory: AppFactory, worker_for: Any
) -> None:
    store = Garbled(bad=2 if fallback == "closed" else 1)
    app = app_factory(f"garbled-{fallback}", dedup_fallback=fallback)
    runtime_for(app).use_store(store)
    runs: list[int] = []

    @app.task(base=DedupTask, shared=False, unique_for=60, unique_until="finish")
    def charge(order: int) -> int:
        runs.append(order)
        return order

    result = charge.delay(7)
    worker_for(app)
    assert result.get(timeout=60) == 7
    assert runs == [7]
    assert store.garbled == store.bad  # the claim was garbled, and the body still ran once
    assert app.AsyncResult(result.id).state == states.SUCCESS
    # The run's end released its lock (owner-checked) once the store answered.
    wait_until(lambda: store.get(result.deduplication_key) is None, timeout=30)
