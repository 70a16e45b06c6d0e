"""Every lint rule names a hole a real worker falls into (issue 31).

One scenario per ``W1xx`` rule, with the setting the rule names: a real
in-thread worker, a Redis broker and the store the rule is about. Bodies
append to a Redis list, and each test asserts the exact number of runs.
Where the rule's advice is cheap to apply, the same scenario with it keeps
one run. The retired ids (``W103``, ``W104``, ``W105``) are backed by
scenarios showing the body still runs once: ``W104``'s in
``tests/core/test_runs_once.py`` (an ETA of 3.5 visibility timeouts), and
``W105``'s here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.signals import task_received

from celery_dedup import DedupTask, inspect_lock, release
from celery_dedup.lint import RETIRED, RULES
from celery_dedup.reaper import reap, register_reaper
from celery_dedup.runtime import runtime_for
from celery_dedup.startup import lint_app
from celery_dedup.stores.redis import RedisStore
from tests.fixtures._servers import running
from tests.fixtures.memcached import MemcachedServer
from tests.fixtures.redis import RedisServer, redis_configured, start_redis
from tests.reliability.servers import flaky_redis

from .conftest import AppFactory, wait_until

pytestmark = pytest.mark.timeout(120)

#: the database of the list the bodies append to
RUNS_DB = 5
#: a Redis broker that delivers an unacknowledged message again after 1 s
REDELIVER_FAST = {"visibility_timeout": 1, "unacked_restore_interval": 0.5,
                  "unacked_restore_throttle": 0.5}


@pytest.fixture
def runs(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """The list of body events (``start:x``, ``end:x``), emptied for each test."""
    client = redis_server.client(RUNS_DB)
    client.delete("runs")
    yield client
    client.delete("runs")
    client.close()


def events(runs: redis.Redis) -> list[str]:
    """Every event the bodies logged, in order."""
    return [e.decode() for e in runs.lrange("runs", 0, -1)]


@pytest.fixture
def received() -> Iterator[list[str]]:
    """The task id of every message the in-thread workers received, copies included."""
    seen: list[str] = []

    def on_received(request: Any = None, **_: Any) -> None:
        seen.append(request.id)

    task_received.connect(on_received, weak=False)
    yield seen
    task_received.disconnect(on_received)


def ids(app: Celery) -> set[str]:
    """The lint ids reported for ``app`` (the server asked)."""
    return {finding.id for finding in lint_app(app)}


def test_every_rule_has_a_scenario_here_or_is_retired() -> None:
    """A new rule needs its scenario in this file (or a reason it names no hole)."""
    source = Path(__file__).read_text()
    # W103's scenario: tests/core/test_runs_once.py.
    for rule in {*RULES, *RETIRED} - {"W103"}:
        if rule.startswith("W"):
            assert f"def test_{rule.lower()}_" in source, rule
    assert {"W102", "W103", "W104", "W105"} <= RETIRED


# W101 ---------------------------------------------------------------------


def _w101(app: Celery, runs: redis.Redis, unique_for: float) -> Any:
    @app.task(base=DedupTask, shared=False, name="s.export", unique_for=unique_for,
              time_limit=6)
    def export(x: int) -> int:
        runs.rpush("runs", f"start:{x}")
        time.sleep(3)
        runs.rpush("runs", f"end:{x}")
        return x

    return export


def test_w101_a_lock_shorter_than_the_run_lets_a_second_run_beside_it(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    """unique_for=1 s, a 3 s body: the lock expires mid-run, an identical call is admitted."""
    app = app_factory("w101")
    export = _w101(app, runs, unique_for=1)
    assert "W101" in ids(app)
    worker_for(app)
    first = export.delay(1)
    wait_until(lambda: "start:1" in events(runs))
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is None)
    second = export.delay(1)
    assert second.deduplicated is False
    assert first.get(timeout=20) == second.get(timeout=20) == 1
    assert events(runs).count("start:1") == 2
    # both bodies ran at once: the second started before the first ended
    assert events(runs).index("start:1", 1) < events(runs).index("end:1")


def test_w101_advice_a_lock_as_long_as_the_limit_keeps_one_run(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    app = app_factory("w101ok")
    export = _w101(app, runs, unique_for=6)
    assert "W101" not in ids(app)
    worker_for(app)
    first = export.delay(1)
    wait_until(lambda: "start:1" in events(runs))
    time.sleep(1.5)  # the moment the short lock above had expired
    assert export.delay(1).deduplicated is True
    assert first.get(timeout=20) == 1
    assert events(runs) == ["start:1", "end:1"]


# W102 ---------------------------------------------------------------------


def _w102(app: Celery, runs: redis.Redis, until: str) -> Any:
    @app.task(base=DedupTask, shared=False, bind=True, name="s.notify", unique_for=60,
              unique_until=until, max_retries=1)
    def notify(self: Any, x: int) -> int:
        runs.rpush("runs", f"try:{x}")
        if self.request.retries == 0 and runs.incr("first-attempts") == 1:
            raise self.retry(countdown=2)
        runs.rpush("runs", f"done:{x}")
        return x

    return notify


def test_w102_retired_a_retry_holds_the_key_while_it_waits(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    """unique_until="start" + a retry with countdown: the retry takes the key again when it
    is published, so an identical call while it waits is refused and the work runs once."""
    runs.delete("first-attempts")
    app = app_factory("w102")
    notify = _w102(app, runs, "start")
    assert "W102" not in ids(app)
    worker_for(app)
    first = notify.delay(1)
    wait_until(lambda: "try:1" in events(runs))
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is not None)
    assert notify.delay(1).deduplicated is True  # the retry waits for its countdown
    assert first.get(timeout=20) == 1
    assert events(runs) == ["try:1", "try:1", "done:1"]
    assert inspect_lock(first.deduplication_key, app=app) is None


def test_w102_advice_success_holds_the_key_through_the_retry(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis
) -> None:
    runs.delete("first-attempts")
    app = app_factory("w102ok")
    notify = _w102(app, runs, "success")
    worker_for(app)
    first = notify.delay(1)
    wait_until(lambda: "try:1" in events(runs))
    assert notify.delay(1).deduplicated is True
    assert first.get(timeout=20) == 1
    assert events(runs) == ["try:1", "try:1", "done:1"]
    assert inspect_lock(first.deduplication_key, app=app) is None


# W106 ---------------------------------------------------------------------


def _fill(server: RedisServer) -> None:
    """Write 64 KiB values until the server evicts or refuses (maxmemory reached)."""
    with server.client(0) as client:
        for n in range(400):
            try:
                client.set(f"junk:{n}", b"x" * 65536)
            except redis.exceptions.OutOfMemoryError:
                return
        raise AssertionError("the server never refused a write")


def _w106(app_factory: AppFactory, server: RedisServer, runs: redis.Redis, name: str) -> Any:
    app = app_factory(name, dedup_store=server.url(1))

    @app.task(base=DedupTask, shared=False, name="s.charge", unique_for=60,
              unique_until="expiry")
    def charge(x: int) -> int:
        runs.rpush("runs", f"charge:{x}")
        return x

    return app, charge


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru"])
def test_w106_an_evicting_store_drops_a_held_lock(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, tmp_path: Path, policy: str
) -> None:
    """maxmemory 4 MB and an LRU policy: memory pressure evicts the lock, the call runs again."""
    with redis_configured(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", policy) as store:
        app, charge = _w106(app_factory, store, runs, f"w106-{policy}")
        assert "W106" in ids(app)
        worker_for(app)
        first = charge.delay(1)
        assert first.get(timeout=20) == 1
        assert inspect_lock(first.deduplication_key, app=app) is not None
        with store.client(0) as client:  # volatile-*: only keys with a TTL go, locks first
            for n in range(400):
                client.set(f"junk:{n}", b"x" * 65536, ex=3600 if "volatile" in policy else None)
                if inspect_lock(first.deduplication_key, app=app) is None:
                    break
        assert inspect_lock(first.deduplication_key, app=app) is None
        second = charge.delay(1)
        assert second.deduplicated is False
        assert second.get(timeout=20) == 1
        assert events(runs) == ["charge:1", "charge:1"]


def test_w106_advice_noeviction_keeps_the_lock_under_pressure(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, tmp_path: Path
) -> None:
    with redis_configured(tmp_path, "--maxmemory", "4mb",
                          "--maxmemory-policy", "noeviction") as store:
        app, charge = _w106(app_factory, store, runs, "w106ok")
        assert "W106" not in ids(app)
        worker_for(app)
        first = charge.delay(1)
        assert first.get(timeout=20) == 1
        _fill(store)  # refused with OOM once full: nothing is evicted
        assert inspect_lock(first.deduplication_key, app=app) is not None
        store.flush(0)  # room again for the call's own writes
        assert charge.delay(1).deduplicated is True
        assert events(runs) == ["charge:1"]


# W107 ---------------------------------------------------------------------


def _w107(app: Celery, runs: redis.Redis) -> Any:
    @app.task(base=DedupTask, shared=False, name="s.invoice", unique_for=300,
              unique_until="expiry")
    def invoice(x: int) -> int:
        runs.rpush("runs", f"invoice:{x}")
        return x

    return invoice


def test_w107_a_store_without_persistence_forgets_expiry_keys_on_restart(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, tmp_path: Path
) -> None:
    """A Redis store with neither RDB nor AOF restarts: the expiry key is gone, it runs again."""
    with flaky_redis(tmp_path / "store") as store:
        app = app_factory("w107", dedup_store=store.url(1))
        invoice = _w107(app, runs)
        assert "W107" in ids(app)
        worker_for(app)
        first = invoice.delay(1)
        assert first.get(timeout=20) == 1
        assert invoice.delay(1).deduplicated is True
        store.kill()
        store.start()
        wait_until(lambda: _answers(store.url(1)))
        second = invoice.delay(1)
        assert second.deduplicated is False
        assert second.get(timeout=20) == 1
        assert events(runs) == ["invoice:1", "invoice:1"]


def _answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url) as client:
            return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


def test_w107_advice_an_aof_store_keeps_expiry_keys_across_a_restart(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, tmp_path: Path
) -> None:
    argv, port = start_redis(tmp_path)
    argv = [*argv, "--appendonly", "yes", "--appendfsync", "always"]
    url = f"redis://127.0.0.1:{port}/1"
    app = app_factory("w107ok", dedup_store=url)
    invoice = _w107(app, runs)
    with running(argv, port, log=tmp_path / "redis-1.log"):
        assert "W107" not in ids(app)
        worker_for(app)
        first = invoice.delay(1)
        assert first.get(timeout=20) == 1
    with running(argv, port, log=tmp_path / "redis-2.log"):
        wait_until(lambda: _answers(url))
        assert inspect_lock(first.deduplication_key, app=app) is not None
        assert invoice.delay(1).deduplicated is True
        assert events(runs) == ["invoice:1"]


# W109 ---------------------------------------------------------------------


def _ship(target: Celery, runs: redis.Redis) -> Any:
    @target.task(base=DedupTask, shared=False, name="s.ship", unique_for=60)
    def ship(x: int) -> int:
        runs.rpush("runs", f"start:{x}")
        time.sleep(1)
        runs.rpush("runs", f"end:{x}")
        return x

    return ship


def test_w109_processes_with_different_memcached_lists_both_run(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis,
    memcached_pair: tuple[MemcachedServer, MemcachedServer],
) -> None:
    """Two servers, and a deploy where some processes list both and others only the first
    (their producers and workers): a key the first kind places on the second server is
    free for the other kind, so the same call runs on both at once."""
    a, b = memcached_pair
    both = app_factory("w109-both", dedup_store=f"memcached://127.0.0.1:{a.port};"
                       f"127.0.0.1:{b.port}")
    first_only = app_factory("w109-first", dedup_store=a.url)
    ship, ship_elsewhere = _ship(both, runs), _ship(first_only, runs)
    assert "W109" in ids(both)
    # an argument whose key the two-server processes place on the second server
    x = next(x for x in range(64) if _placed_on_second(both, first_only, ship, x))
    worker_for(both)
    worker_for(first_only)
    results = [ship.delay(x), ship_elsewhere.delay(x)]
    assert [r.deduplicated for r in results] == [False, False]
    assert [r.get(timeout=20) for r in results] == [x, x]
    assert events(runs).count(f"start:{x}") == 2


def _placed_on_second(both: Celery, first_only: Celery, task: Any, x: int) -> bool:
    """Whether a call of ``task(x)`` locks on the second server (probed, then freed)."""
    probe = task.delay(x)
    assert inspect_lock(probe.deduplication_key, app=both) is not None
    placed = inspect_lock(probe.deduplication_key, app=first_only) is None
    assert release(probe)
    with both.connection_for_write() as conn:
        conn.default_channel.queue_purge(both.conf.task_default_queue)
    return placed


def test_w109_advice_one_server_agrees(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis,
    memcached_pair: tuple[MemcachedServer, MemcachedServer],
) -> None:
    a, _ = memcached_pair
    apps = [app_factory("w109ok", dedup_store=a.url) for _ in range(2)]  # one queue
    tasks = [_ship(target, runs) for target in apps]
    assert "W109" not in ids(apps[0])
    worker_for(apps[0])
    results = [task.delay(1) for task in tasks]
    assert [r.deduplicated for r in results] == [False, True]
    assert results[0].get(timeout=20) == 1
    assert events(runs) == ["start:1", "end:1"]


# W104, W105 (retired) -------------------------------------------------------


def test_w105_retired_an_acks_late_run_longer_than_the_visibility_timeout_runs_once(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, received: list[str]
) -> None:
    """visibility_timeout 1 s, an acks_late 4 s body: the broker delivers the running
    message again (several times); each copy is deferred by the running lease, then
    refused by the done marker. One run, nothing left behind."""
    app = app_factory("w105", broker_transport_options=REDELIVER_FAST)

    @app.task(base=DedupTask, shared=False, name="s.report", unique_for=60, acks_late=True,
              time_limit=8)
    def report(x: int) -> int:
        runs.rpush("runs", f"start:{x}")
        time.sleep(4)
        runs.rpush("runs", f"end:{x}")
        return x

    assert "W105" not in ids(app)
    worker_for(app)
    result = report.delay(1)
    assert result.get(timeout=30) == 1
    assert received.count(result.id) >= 2  # delivered again while it ran
    time.sleep(3)  # copies the broker still restores arrive and are refused
    assert events(runs) == ["start:1", "end:1"]
    assert inspect_lock(result.deduplication_key, app=app) is None


def test_w104_retired_a_countdown_longer_than_the_visibility_timeout_runs_once(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, received: list[str]
) -> None:
    """visibility_timeout 1 s, a countdown of 3 s: the waiting message is delivered again;
    each copy is refused by the run's records. One run (a prefork worker under every
    ``unique_until``: tests/core/test_runs_once.py)."""
    app = app_factory("w104", broker_transport_options=REDELIVER_FAST)

    @app.task(base=DedupTask, shared=False, name="s.remind", unique_for=60)
    def remind(x: int) -> int:
        runs.rpush("runs", f"start:{x}")
        return x

    worker_for(app)
    result = remind.apply_async((1,), countdown=3)
    assert result.get(timeout=30) == 1
    wait_until(lambda: received.count(result.id) >= 2)  # the broker delivered a copy
    time.sleep(3)  # copies the broker still restores arrive and are refused
    assert events(runs) == ["start:1"]
    assert inspect_lock(result.deduplication_key, app=app) is None
    assert {"W104", "W105"} <= RETIRED and not {"W104", "W105"} & set(RULES)


# W108 ---------------------------------------------------------------------


def _w108(app: Celery, runs: redis.Redis) -> Any:
    register_reaper(app)

    @app.task(base=DedupTask, shared=False, name="s.invoice", unique_for=300,
              unique_until="finish")
    def invoice(x: int) -> int:
        runs.rpush("runs", f"run:{x}")
        return x

    return invoice


class _ReleaseLost(RedisStore):
    """A store whose end-of-run writes are lost (the worker was killed as the store
    stalled, after the backend stored the result): the holder's lock stays."""

    def end_run(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def release(self, key: str, owner: str) -> bool:
        return False


@pytest.mark.parametrize("result_expires", [1, None])
def test_w108_a_result_gone_before_the_reaper_keeps_a_finished_holders_lock(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, redis_server: RedisServer,
    result_expires: int | None,
) -> None:
    """The holder ran and its SUCCESS was stored, but its lock was left behind. With
    ``result_expires`` (1 s) shorter than ``unique_for`` the result is gone when the
    reaper looks: the lock stays and the next call is refused for unique_for; with
    results kept, the reaper frees it and the next call runs."""
    app = app_factory(f"w108-{result_expires}", result_expires=result_expires)
    invoice = _w108(app, runs)
    assert ("W108" in ids(app)) is (result_expires is not None)
    store = runtime_for(app).store
    assert store is not None
    runtime_for(app).use_store(_ReleaseLost.from_url(redis_server.url(4), app=app))
    worker_for(app)
    first = invoice.delay(1)
    assert first.get(timeout=30) == 1
    runtime_for(app).use_store(store)
    assert inspect_lock(first.deduplication_key, app=app) is not None  # left behind
    if result_expires is not None:
        wait_until(lambda: app.backend.get(app.backend.get_key_for_task(first.id)) is None,
                   timeout=30)
    reaped = {lock.task_id for lock in reap(app)}
    again = invoice.delay(1)
    if result_expires is not None:
        assert reaped == set() and again.deduplicated is True  # the hole
        assert events(runs) == ["run:1"]
    else:
        assert reaped == {first.id} and again.deduplicated is False
        assert again.get(timeout=30) == 1
        assert events(runs) == ["run:1", "run:1"]
