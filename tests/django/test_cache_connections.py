"""Django cache stores as a threaded server uses them.

- ``RedisCache``: Django makes a cache object (and a connection pool) per
  thread; the store keeps one pool per process, so 300 calls from 300
  request threads use a handful of connections, not 300;
- a generic cache (local memory, file): a call that loses an
  acquire race over an expired lock is told the winner, never the expired
  previous holder.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from celery_dedup.stores.django_cache import DjangoCacheStore

META = {"task_name": "tests.cache", "policy": "success", "task_id": "id-cache"}
BACKEND = "django.core.cache.backends."


def _in_new_thread(work: Any) -> Any:
    """Run ``work`` in a fresh thread, as a thread-per-request server does."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join(30)
    return out[0]


def test_redis_cache_store_shares_one_pool(settings: Any, redis_server: Any) -> None:
    """300 calls, each from a new thread: a few Redis connections in all, not one per call."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": {"BACKEND": BACKEND + "redis.RedisCache", "LOCATION": redis_server.url(3)},
    }
    redis_server.flush(3)
    observer = redis_server.client()
    before = int(observer.info("clients")["connected_clients"])
    store = DjangoCacheStore("locks")
    for i in range(300):
        key = f"cache:conn:{i // 2}"
        if i % 2 == 0:
            assert _in_new_thread(lambda k=key: store.acquire(k, "owner", 30, META)) is None
        else:
            assert _in_new_thread(lambda k=key: store.release(k, "owner")) is True
    after = int(observer.info("clients")["connected_clients"])
    assert after - before <= 2
    observer.close()


@pytest.mark.parametrize("kind", ["locmem", "file"])
def test_losing_an_acquire_race_names_the_winner(settings: Any, tmp_path: Path, kind: str) -> None:
    """Over an expired lock, 8 racing acquires: one wins, the 7 others are told the winner."""
    config: dict[str, Any] = {
        "locmem": {"BACKEND": BACKEND + "locmem.LocMemCache", "LOCATION": "race"},
        "file": {"BACKEND": BACKEND + "filebased.FileBasedCache", "LOCATION": str(tmp_path)},
    }[kind]
    settings.CACHES = {**settings.CACHES, "race": config}
    store = DjangoCacheStore("race")
    key = "cache:race"
    assert store.acquire(key, "expired-holder", 0.3, META) is None
    held = store.get(key)
    assert held is not None
    deadline = held.expires_at + 0.05
    while time.time() < deadline:
        time.sleep(0.02)
    barrier = threading.Barrier(8)
    answers: dict[str, str] = {}

    def race(owner: str) -> None:
        barrier.wait(10)
        holder = store.acquire(key, owner, 30, META)
        answers[owner] = owner if holder is None else holder.owner

    threads = [threading.Thread(target=race, args=(f"owner-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    winners = {holder for holder in answers.values()}
    assert len(answers) == 8
    assert "expired-holder" not in winners
    assert len(winners) == 1
    lock = store.get(key)
    assert lock is not None and lock.owner in winners
