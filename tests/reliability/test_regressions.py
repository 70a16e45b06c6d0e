"""Scenarios the soak found, replayed one at a time on a real prefork worker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dedup.stores.memcached import MemcachedStore
from tests.fixtures._servers import free_port, running
from tests.fixtures.memcached import memcached_argv

from .apps import work_task
from .conftest import Backends
from .model import summary
from .probe import Producer, Recorder, poll
from .workers import WorkerPool

AppFactory = Callable[[dict[str, Any]], Celery]


@pytest.mark.redis
def test_an_expired_deterministic_message_does_not_discard_later_runs(
    backends: Backends, recorder: Recorder, workers: WorkerPool, producer_app: AppFactory
) -> None:
    """A message that expires must not take every later run of its key with it.

    With ``deterministic_id`` all runs of a key share one task id. Celery's
    worker adds an expired message's id to its in-memory revoked set
    (``Request.maybe_expire``), which then discards every later message with
    that id, for hours: a call that returned "published" never runs.
    """
    conf = backends.conf()
    workers.start(conf, concurrency=1)
    task = work_task(producer_app(conf))
    producer = Producer(recorder)
    expired = producer.call(task, (1, {}), deterministic_id=True, expires=-1.0)
    poll(
        lambda: recorder.events("revoked", task_id=expired.id),
        30,
        what="the expired message dropped",
    )
    fresh = producer.call(task, (1, {}), deterministic_id=True)
    assert fresh.deduplicated is False and fresh.id == expired.id
    poll(
        lambda: recorder.events("postrun", task_id=fresh.id)
        or recorder.events("revoked", task_id=fresh.id)[1:],
        30,
        what="the fresh message handled",
    )
    findings = recorder.findings()
    assert not findings, summary(findings)
    assert recorder.events("end", task_id=fresh.id), "the fresh run never ran its body"


@pytest.mark.memcached
def test_a_memcached_scan_sees_every_live_lock(tmp_path: Path) -> None:
    """``scan`` (reaper, ``celery dedup list``/``purge``, revoke by id) must not miss locks.

    Found by the store state machine: ``lru_crawler metadump all`` walks the
    LRU segments while memcached moves recently used items between them, so
    live items go unlisted (``metadump hash`` walks the hash table instead).
    A fresh server: how often items are missed depends on what it holds.
    """
    port = free_port()
    with running(memcached_argv(port), port, log=tmp_path / "memcached.log"):
        store = MemcachedStore.from_url(f"memcached://127.0.0.1:{port}")
        meta = {"task_name": "rel.work", "policy": "success", "task_id": "t"}
        keys: list[str] = []
        missed: list[int] = []
        for n in range(150):
            keys.append(f"celery-dedup:rel.work:{n:04d}")
            assert store.acquire(keys[-1], f"o{n}", 600, meta) is None
            for _ in range(3):  # recently used items move between LRU segments
                store.claim(keys[-1], "someone-else", release=False, ttl=None, meta=meta)
            listed = {lock.key for lock in store.scan("celery-dedup:rel.work:")}
            if set(keys) - listed:
                missed.append(n)
        store.close()
    assert missed == [], f"{len(missed)} of 150 scans missed a live lock"
