"""The settings lint: each id fires on a minimal bad configuration and not on the good one.

Through the real entry points: ``celery dedup check`` (the CLI), the log of
an embedded worker's start, the first call of each task (a
``DedupLintWarning``), on real Redis servers configured for the case
(``maxmemory-policy``, persistence, a refused ``CONFIG``) and real memcached.
Django's ``manage.py check`` is tested in tests/django/test_lint_checks.py.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.celery import celery
from celery.contrib.testing.worker import start_worker
from celery.utils import uuid
from click.testing import CliRunner

from celery_dedup import DedupTask
from celery_dedup.exceptions import InvalidOptionError
from celery_dedup.lint import RETIRED, RULES
from celery_dedup.lint_calls import DedupLintWarning
from celery_dedup.reaper import register_reaper
from celery_dedup.runtime import runtime_for
from tests.apps import cli_app
from tests.apps.isolation import own_tasks_only
from tests.fixtures.logs import DedupLog
from tests.fixtures.memcached import MemcachedServer
from tests.fixtures.redis import RedisServer, redis_configured

#: ``celery-dedup W101 (task t.a): …`` → ``("W101", "t.a")``
FOUND = re.compile(r"celery-dedup ([WI]1\d\d)(?: \(task ([^)]+)\))?:")

Ids = set[tuple[str, str | None]]
Make = Callable[[], Celery]


def _body() -> None:
    """A task body: the lint never runs it."""


def build(store: str, tasks: dict[str, dict[str, Any]], broker: str = "memory://",
          reaper: bool = False, **conf: Any) -> Make:
    """A factory of fresh apps with these ``DedupTask``s (each entry point gets its own)."""

    def make() -> Celery:
        app = Celery("lint", broker=broker, backend="cache+memory://", set_as_current=False)
        # A queue of its own: the in-memory broker is shared by the whole process.
        app.conf.update(dedup_store=store, broker_connection_retry_on_startup=True,
                        worker_hijack_root_logger=False, task_default_queue=f"lint-{uuid()}",
                        **conf)
        for name, options in tasks.items():
            app.task(base=DedupTask, name=name, shared=False, **options)(_body)
        if reaper:
            register_reaper(app)
        own_tasks_only(app, __name__)
        return app

    return make


def via_check(make: Make, monkeypatch: pytest.MonkeyPatch) -> tuple[Ids, int]:
    """``celery dedup check --json``: the lint ids it reports, and its exit code."""
    app = make()
    monkeypatch.setattr(cli_app, "app", app)
    try:
        result = CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", "check",
                                             "--json", "--timeout", "20"])
    finally:
        app.close()
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["store"]["ok"], result.output
    return {(f["id"], f["task"]) for f in report["lint"]}, result.exit_code


def _parse(lines: list[str]) -> Ids:
    return {(m[1], m[2]) for m in map(FOUND.match, lines) if m}


def via_worker(make: Make, log: DedupLog) -> Ids:
    """The lint ids an embedded worker logs at its start."""
    app = make()
    log.records.clear()
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            pass
    finally:
        app.close()
    return _parse(log.warnings())


def via_first_call(make: Make, **call: Any) -> Ids:
    """The lint ids warned by the first call of each task (``call``: its options)."""
    app = make()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in sorted(app.tasks):
                task = app.tasks[name]
                if isinstance(task, DedupTask):
                    task.apply_async(**call)
    finally:
        _release_all(app)
        app.close()
    return _parse([str(w.message) for w in caught if w.category is DedupLintWarning])


def _release_all(app: Celery) -> None:
    """Free the locks the calls took (the memory store is shared by the whole process)."""
    store = runtime_for(app).store
    assert store is not None
    for lock in list(store.scan("celery-dedup:")):
        store.release(lock.key, lock.owner)


def everywhere(make: Make, monkeypatch: pytest.MonkeyPatch, log: DedupLog) -> list[Ids]:
    """The ids reported by ``celery dedup check``, the worker's start and the first call."""
    return [via_check(make, monkeypatch)[0], via_worker(make, log), via_first_call(make)]


@pytest.fixture(scope="module")
def lru_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis that evicts any key under memory pressure."""
    with redis_configured(tmp_path_factory.mktemp("lru"), "--maxmemory", "64mb",
                          "--maxmemory-policy", "allkeys-lru") as server:
        yield server


@pytest.fixture(scope="module")
def durable_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis that keeps its keys across a restart (AOF) and never evicts."""
    with redis_configured(tmp_path_factory.mktemp("aof"), "--appendonly", "yes") as server:
        yield server


@pytest.fixture(scope="module")
def secret_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis that refuses ``CONFIG`` (as managed services do)."""
    with redis_configured(tmp_path_factory.mktemp("noconfig"), "--rename-command", "CONFIG",
                          "") as server:
        yield server


# -- one test per id -----------------------------------------------------------------


def test_w101_unique_for_shorter_than_the_time_limit(
    monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """A lock of 10 s on a task allowed to run 60 s can expire mid-run."""
    bad = build("memory://", {"t.w101": {"unique_for": 10, "time_limit": 60},
                              "t.w101soft": {"unique_for": 10, "soft_time_limit": 60,
                                             "unique_until": "finish"}})
    good = build("memory://", {"t.w101": {"unique_for": 60, "time_limit": 60},
                               "t.start": {"unique_for": 10, "time_limit": 60,
                                           "unique_until": "start"}})
    for found in everywhere(bad, monkeypatch, dedup_log):
        assert {("W101", "t.w101"), ("W101", "t.w101soft")} <= found
    for found in everywhere(good, monkeypatch, dedup_log):
        assert not {i for i, _ in found} & {"W101"}


def test_w102_retired_unique_until_start_on_a_task_that_retries(
    monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """Retired: a retry takes its key again when it is published, so the key is held while
    it waits (tests/core/test_lint_scenarios.py runs the work once). Never reported."""
    retrying = build("memory://", {
        "t.auto": {"unique_until": "start", "autoretry_for": (ValueError,)},
        "t.max": {"unique_until": "start", "max_retries": 5},
    })
    for found in everywhere(retrying, monkeypatch, dedup_log):
        assert "W102" not in {i for i, _ in found}


def test_idempotency_recipe_on_a_redis_broker_passes_the_lint(
    durable_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """``unique_for=86400, unique_until="expiry"`` on a Redis broker (redelivery after 1 h):
    nothing reported anywhere, ``celery dedup check`` exits 0.

    W103 (visibility_timeout shorter than unique_for) is retired: the copies
    such a broker delivers again are refused by the run records
    (tests/core/test_runs_once.py runs each body once under a 2 s timeout);
    so is a run longer than the timeout (W105, retired too).
    """
    recipe = {"unique_for": 86400, "unique_until": "expiry"}
    for options in ({}, {"broker_transport_options": {"visibility_timeout": 60}}):
        make = build(durable_redis.url(2), {"t.pay": recipe}, broker=durable_redis.url(1),
                     **options)
        found, code = via_check(make, monkeypatch)
        assert (found, code) == (set(), 0)
        assert via_worker(make, dedup_log) == set()
        assert via_first_call(make) == set()
    assert "W103" not in RULES and "W103" in RETIRED
    silenced = build(durable_redis.url(2), {"t.pay": {**recipe, "dedup_silenced": ("W103",)}},
                     broker=durable_redis.url(1), dedup_silenced_warnings=["W103"])
    assert via_check(silenced, monkeypatch) == (set(), 0)  # old settings keep working


def test_w104_and_w105_retired_a_broker_redelivering_sooner_than_the_work_ends(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """Retired: a countdown past the visibility_timeout (W104) or an acks_late run longer
    than it (W105) is delivered again, and each copy is refused by the run's records
    (tests/core/test_runs_once.py, tests/core/test_lint_scenarios.py). Never reported."""
    options = {"broker_transport_options": {"visibility_timeout": 60}}
    make = build("memory://", {"t.w104": {"unique_for": 60}}, broker=redis_url, **options)
    assert via_first_call(make, countdown=120) == set()
    later = datetime.now(timezone.utc) + timedelta(minutes=5)
    assert via_first_call(make, eta=later) == set()
    app = make()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            app.tasks["t.w104"].apply_async((), countdown=120)
    finally:
        _release_all(app)
        app.close()
    assert [w for w in caught if w.category is DedupLintWarning] == []
    late = build("memory://", {"t.w105": {"unique_for": 30, "acks_late": True,
                                          "time_limit": 120}}, broker=redis_url, **options)
    for found in everywhere(late, monkeypatch, dedup_log):
        assert not {i for i, _ in found} & {"W104", "W105"}
    assert {"W104", "W105"} <= RETIRED and not {"W104", "W105"} & set(RULES)


def test_w106_redis_store_that_evicts(
    lru_redis: RedisServer, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
    dedup_log: DedupLog,
) -> None:
    """``allkeys-lru`` can evict a held lock; ``noeviction`` cannot (asked with CONFIG GET)."""
    bad = build(lru_redis.url(2), {"t.w106": {}})
    good = build(redis_server.url(2), {"t.w106": {}})
    found, code = via_check(bad, monkeypatch)
    assert ("W106", None) in found and code == 1
    assert ("W106", None) in via_worker(bad, dedup_log)
    for found in (via_check(good, monkeypatch)[0], via_worker(good, dedup_log)):
        assert not {i for i, _ in found} & {"W106", "I106"}


def test_i106_cannot_decide_eviction_when_config_is_refused(
    secret_redis: RedisServer, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
    dedup_log: DedupLog,
) -> None:
    """A server that refuses CONFIG GET gets "cannot decide", never a guess (and no failure)."""
    make = build(secret_redis.url(2), {"t.i106": {}})
    found, code = via_check(make, monkeypatch)
    assert found == {("I106", None)} and code == 0
    assert via_worker(make, dedup_log) == {("I106", None)}
    assert "W106" not in {i for i, _ in via_check(build(redis_server.url(2), {"t": {}}),
                                                      monkeypatch)[0]}


def test_w107_store_that_forgets_expiry_keys_on_restart(
    redis_server: RedisServer, durable_redis: RedisServer, memcached_server: MemcachedServer,
    monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog,
) -> None:
    """Expiry idempotency keys on Redis without RDB/AOF, memcached or memory: W107."""
    expiry = {"t.w107": {"unique_until": "expiry"}}
    for store in (redis_server.url(2), memcached_server.url, "memory://"):
        make = build(store, expiry)
        found, code = via_check(make, monkeypatch)
        assert ("W107", None) in found and code == 1, store
        assert ("W107", None) in via_worker(make, dedup_log), store
    # Settings alone decide memcached and memory: the first call says so too.
    assert ("W107", None) in via_first_call(build(memcached_server.url, expiry))
    good = [build(durable_redis.url(2), expiry),
            build(redis_server.url(2), {"t.w107": {"unique_until": "success"}})]
    for make in good:
        for found in (via_check(make, monkeypatch)[0], via_worker(make, dedup_log),
                      via_first_call(make)):
            assert not {i for i, _ in found} & {"W107", "I107"}


def test_i107_cannot_decide_persistence_when_config_is_refused(
    secret_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """Expiry keys on a server that refuses CONFIG GET: "cannot decide", not W107."""
    make = build(secret_redis.url(2), {"t.i107": {"unique_until": "expiry"}})
    found, code = via_check(make, monkeypatch)
    assert found == {("I106", None), ("I107", None)} and code == 0
    assert ("I107", None) in via_worker(make, dedup_log)
    success = build(secret_redis.url(2), {"t.i107": {"unique_until": "success"}})
    assert "I107" not in {i for i, _ in via_check(success, monkeypatch)[0]}


def test_w108_result_expires_shorter_than_unique_for_with_the_reaper(
    monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """The reaper frees locks from results: results gone before the lock leave it stuck."""
    tasks = {"t.w108": {"unique_for": 600}}
    bad = build("memory://", tasks, reaper=True, result_expires=60)
    for found in everywhere(bad, monkeypatch, dedup_log):
        assert ("W108", "t.w108") in found
    good = [build("memory://", tasks, reaper=True, result_expires=3600),
            build("memory://", tasks, reaper=False, result_expires=60),
            build("memory://", tasks, reaper=True, result_expires=None)]
    for make in good:
        for found in everywhere(make, monkeypatch, dedup_log):
            assert "W108" not in {i for i, _ in found}


def test_w109_memcached_store_with_several_servers(
    memcached_pair: tuple[MemcachedServer, MemcachedServer], monkeypatch: pytest.MonkeyPatch,
    dedup_log: DedupLog,
) -> None:
    """Keys spread over two memcached servers without failover: W109."""
    one, two = memcached_pair
    both = f"memcached://127.0.0.1:{one.port};127.0.0.1:{two.port}"
    for found in everywhere(build(both, {"t.w109": {}}), monkeypatch, dedup_log):
        assert ("W109", None) in found
    for found in everywhere(build(one.url, {"t.w109": {}}), monkeypatch, dedup_log):
        assert "W109" not in {i for i, _ in found}


# -- silencing -----------------------------------------------------------------------


def test_a_task_attribute_silences_its_own_findings(
    monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """``dedup_silenced=("W101",)`` hides W101 for that task only."""
    make = build("memory://", {
        "t.quiet": {"unique_for": 10, "time_limit": 60, "dedup_silenced": ("W101",)},
        "t.loud": {"unique_for": 10, "time_limit": 60},
    })
    for found in everywhere(make, monkeypatch, dedup_log):
        assert ("W101", "t.loud") in found and ("W101", "t.quiet") not in found


def test_the_setting_silences_findings_app_wide(
    lru_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, dedup_log: DedupLog
) -> None:
    """``dedup_silenced_warnings`` takes bare and Django-style ids; check then exits 0."""
    make = build(lru_redis.url(2), {"t.a": {"unique_for": 10, "time_limit": 60},
                                     "t.b": {"unique_for": 10, "time_limit": 60}},
                 dedup_silenced_warnings=["W101", "celery_dedup.W106"])
    found, code = via_check(make, monkeypatch)
    assert found == set() and code == 0
    assert via_worker(make, dedup_log) == set()
    assert via_first_call(make) == set()


def test_invalid_silencing_is_refused_naming_it() -> None:
    """A string instead of a list, or an unknown id shape, is an InvalidOptionError."""
    app = build("memory://", {"t.bad": {"dedup_silenced": "W101"}})()
    with pytest.raises(InvalidOptionError, match=r"t\.bad.*dedup_silenced"):
        app.finalize()
    app.close()
    make = build("memory://", {"t.a": {}}, dedup_silenced_warnings=["W1O1"])
    app = make()
    with pytest.raises(InvalidOptionError, match="dedup_silenced_warnings"):
        app.tasks["t.a"].delay()
    app.close()


def test_every_rule_has_a_fix_and_a_docs_entry() -> None:
    """Each id is listed on the lint page with its one-line fix."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "lint.md").read_text()
    for rule in RULES.values():
        assert f"`{rule.id}`" in page and rule.fix in page, rule.id


