"""Issue 10 round trips, counted by the store's own Redis server (``MONITOR``).

The lock store gets a redis-server of its own, so every command a client
sends it is a store round trip (commands run inside a Lua script are
listed as ``lua`` and are not). Expected: 1 per acquire, 1 per duplicate,
and at most 2 per task a real worker executes (start claim + release).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dedup import DedupTask, leases
from celery_dedup.runs import records_of
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import RunRef
from tests.fixtures._servers import running
from tests.fixtures.redis import RedisServer, start_redis

from .conftest import AppFactory, wait_until

pytestmark = pytest.mark.timeout(40)

#: commands a new connection sends once (redis-py's handshake), not per operation
HANDSHAKE = {"CLIENT", "HELLO", "SELECT"}


@pytest.fixture(scope="module")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server that only the lock store talks to."""
    directory: Path = tmp_path_factory.mktemp("store-redis")
    argv, port = start_redis(directory)
    with running(argv, port, log=directory / "redis.log"):
        yield RedisServer(port=port, dir=directory)


class Monitor:
    """Every command clients send to a server, in the order it ran them (``MONITOR``)."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.commands: list[str] = []
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def _listen(self) -> None:
        with self.server.client() as client, client.monitor() as monitor:
            self._ready.set()
            for seen in monitor.listen():
                if seen["client_type"] == "lua":
                    continue  # run by a script: not a round trip
                self.commands.append(seen["command"])
                if seen["command"] == "ECHO monitor:stop":
                    return

    def count(self, action: Callable[[], Any], label: str) -> Counter[str]:
        """Round trips (by command name) the store receives while ``action`` runs."""
        with self.server.client() as client:
            client.echo(f"monitor:{label}:begin")
            action()
            client.echo(f"monitor:{label}:end")
        wait_until(lambda: f"ECHO monitor:{label}:end" in self.commands)
        begin = self.commands.index(f"ECHO monitor:{label}:begin")
        window = self.commands[begin + 1 : self.commands.index(f"ECHO monitor:{label}:end")]
        return Counter(c.split(" ", 1)[0].upper() for c in window)

    def stop(self) -> None:
        """End the listening thread."""
        with self.server.client() as client:
            client.echo("monitor:stop")
        self._thread.join(5)


def sent(counted: Counter[str]) -> int:
    """Round trips in ``counted``, without connection handshakes."""
    return sum(n for name, n in counted.items() if name not in HANDSHAKE)


def test_round_trips_per_acquire_duplicate_and_execution(
    app_factory: AppFactory, worker_for: Any, store_server: RedisServer
) -> None:
    """N acquires cost N, N duplicates cost N, executing N tasks on a worker at most 2N."""
    store_server.flush(0)
    # A lease renewal pass (every third of the lease) is upkeep, not a per-task
    # cost: a lease long enough keeps it out of a slow machine's count, even
    # while the process's renewer wakes every 0.1 s for another app's 0.3 s
    # lease (as an earlier test's leaves it): each lease keeps its own third.
    leases._renewer.start(0.3)
    app = app_factory("own-rt", dedup_store=store_server.url(0), dedup_metrics_flush_interval=3600,
                      dedup_lease_ttl=3600)

    @app.task(base=DedupTask, shared=False, unique_for=60)
    def job(x: int) -> int:
        return x

    n = 20
    store = runtime_for(app).store
    assert store is not None
    meta = {"task_name": job.name, "policy": "success", "task_id": "warm"}
    store.acquire("warm", "o", 5, meta)  # loads every script the counted paths use
    store.claim("warm", "o", release=False, ttl=5, meta=meta)
    store.release("warm", "o")
    warm_run = RunRef("warm", "o", "0.0", "warm-copy")  # and the run-record scripts
    records_of(store).claim_run(warm_run, 5, meta, release=False, ttl=5)
    records_of(store).end_run(warm_run, 5, meta, release=True)

    monitor = Monitor(store_server)
    results: list[Any] = []
    duplicates: list[Any] = []
    try:
        counted = monitor.count(
            lambda: results.extend(job.delay(i) for i in range(n)),
            "acquire",
        )
        assert not any(result.deduplicated for result in results)
        assert sent(counted) == n, counted

        counted = monitor.count(
            lambda: duplicates.extend(job.delay(i) for i in range(n)),
            "duplicate",
        )
        assert all(result.deduplicated for result in duplicates)
        assert sent(counted) == n, counted

        def execute() -> None:
            worker_for(app, concurrency=1)
            assert [result.get(timeout=20) for result in results] == list(range(n))

        counted = monitor.count(execute, "execute")
        probe = 2  # the worker's start probe: one acquire, one release (celery_dedup.startup)
        assert sent(counted) <= 2 * n + probe, counted
        # One lease-and-claim and one done-marker-and-release each.
        assert counted["EVALSHA"] == 2 * n + probe, counted
    finally:
        monitor.stop()
