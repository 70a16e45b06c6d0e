"""``manage.py check`` reports the settings lint as ``celery_dedup.W1xx`` (and ``I1xx``).

Each id fires on a minimal bad configuration and not on the good one; the
rules that need the store's server run with ``--database`` (real Redis
servers configured for the case); ``SILENCED_SYSTEM_CHECKS`` and
``dedup_silenced_warnings`` silence them.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from celery_dedup import DedupTask
from celery_dedup.reaper import register_reaper
from tests.fixtures.redis import RedisServer, redis_configured

Tasks = dict[str, dict[str, Any]]


def _body() -> None:
    """A task body: the checks never run it."""


@pytest.fixture
def lint_app() -> Iterator[Any]:
    """Make a finalized app the current one for the test (the example's afterwards)."""
    from example_project.celery import app as example

    made: list[Celery] = []

    def make(store: str, tasks: Tasks, broker: str = "memory://", reaper: bool = False,
             **conf: Any) -> Celery:
        app = Celery("lintdj", broker=broker, backend="cache+memory://", set_as_current=True)
        app.conf.update(dedup_store=store, **conf)
        for name, options in tasks.items():
            app.task(base=DedupTask, name=name, shared=False, **options)(_body)
        if reaper:
            register_reaper(app)
        app.finalize()
        made.append(app)
        return app

    yield make
    example.set_current()
    for app in made:
        app.close()


def _reported(*args: str) -> set[tuple[str, str | None]]:
    """The ``celery_dedup.W1xx``/``I1xx`` ids ``manage.py check`` prints, with their task."""
    out = io.StringIO()
    call_command("check", *args, stdout=out, stderr=out)
    found = set()
    for line in out.getvalue().splitlines():
        for prefix in ("?: (celery_dedup.", ": (celery_dedup."):
            head, sep, tail = line.partition(prefix)
            code = tail[:4]
            if sep and code[:2] in ("W1", "I1"):
                found.add((code, None if head in ("", "?") else head.strip()))
                break
    return found



#: (id, the task it names or None, bad configuration, good configuration); the example
#: project's shared tasks join these apps, so task findings are matched on "t.a"
CASES: list[tuple[str, str | None, tuple[str, Tasks, dict[str, Any]],
                  tuple[str, Tasks, dict[str, Any]]]] = [
    ("W101", "t.a",
     ("django-db", {"t.a": {"unique_for": 10, "time_limit": 60}}, {}),
     ("django-db", {"t.a": {"unique_for": 60, "time_limit": 60}}, {})),
    ("W107", None,
     ("memory://", {"t.a": {"unique_until": "expiry"}}, {}),
     ("django-db", {"t.a": {"unique_until": "expiry"}}, {})),
    ("W108", "t.a",
     ("memory://", {"t.a": {"unique_for": 600}}, {"reaper": True, "result_expires": 60}),
     ("memory://", {"t.a": {"unique_for": 600}}, {"reaper": True, "result_expires": 6000})),
    ("W109", None,
     ("memcached://127.0.0.1:9;127.0.0.1:10", {"t.a": {}}, {}),
     ("memcached://127.0.0.1:9", {"t.a": {}}, {})),
]


@pytest.mark.parametrize(("check_id", "task", "bad", "good"), CASES,
                         ids=[c[0] for c in CASES])
def test_each_settings_lint_id_is_a_system_check(
    lint_app: Any, check_id: str, task: str | None, bad: tuple[str, Tasks, dict[str, Any]],
    good: tuple[str, Tasks, dict[str, Any]], db: None,
) -> None:
    """``manage.py check`` reports the id on the bad configuration only."""
    store, tasks, conf = bad
    lint_app(store, tasks, **conf)
    assert (check_id, task) in _reported()
    with override_settings(SILENCED_SYSTEM_CHECKS=[f"celery_dedup.{check_id}"]):
        assert check_id not in {code for code, _ in _reported()}
    store, tasks, conf = good
    lint_app(store, tasks, **conf)
    assert (check_id, task) not in _reported()


def test_a_task_finding_names_the_task(lint_app: Any) -> None:
    """The task is the check message's object; ``dedup_silenced`` silences it for that task."""
    lint_app("django-db", {"t.loud": {"unique_for": 10, "time_limit": 60},
                           "t.quiet": {"unique_for": 10, "time_limit": 60,
                                       "dedup_silenced": ["celery_dedup.W101"]}})
    found = _reported()
    assert ("W101", "t.loud") in found and ("W101", "t.quiet") not in found


@pytest.fixture(scope="module")
def lru_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis that evicts any key under memory pressure."""
    with redis_configured(tmp_path_factory.mktemp("lru"), "--maxmemory", "64mb",
                          "--maxmemory-policy", "allkeys-lru") as server:
        yield server


@pytest.fixture(scope="module")
def secret_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis that refuses ``CONFIG``."""
    with redis_configured(tmp_path_factory.mktemp("noconfig"), "--rename-command", "CONFIG",
                          "") as server:
        yield server


@pytest.fixture(scope="module")
def durable_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis with the AOF on."""
    with redis_configured(tmp_path_factory.mktemp("aof"), "--appendonly", "yes") as server:
        yield server


def test_server_rules_run_with_the_database_tag(
    lint_app: Any, lru_redis: RedisServer, redis_server: RedisServer, secret_redis: RedisServer,
    durable_redis: RedisServer, db: None,
) -> None:
    """W106/I106/W107/I107 ask the server: ``check --database default`` only."""
    expiry = {"t.a": {"unique_until": "expiry"}}
    lint_app(lru_redis.url(3), expiry)
    assert not {c for c, _ in _reported()} & {"W106", "I106", "W107", "I107"}
    assert {c for c, _ in _reported("--database", "default")} >= {"W106", "W107"}
    lint_app(redis_server.url(3), expiry)  # noeviction, no RDB/AOF
    assert {c for c, _ in _reported("--database", "default")} & {"W106", "W107"} == {"W107"}
    lint_app(durable_redis.url(3), expiry)
    assert not {c for c, _ in _reported("--database", "default")} & {"W106", "W107"}
    lint_app(secret_redis.url(3), expiry)
    found = {c for c, _ in _reported("--database", "default")}
    assert found & {"W106", "I106", "W107", "I107"} == {"I106", "I107"}
    lint_app(lru_redis.url(3), expiry, dedup_silenced_warnings=["W106"])
    assert {c for c, _ in _reported("--database", "default")} & {"W106", "W107"} == {"W107"}


def test_idempotency_recipe_passes_both_checks(
    lint_app: Any, durable_redis: RedisServer, db: None
) -> None:
    """``unique_for=86400, unique_until="expiry"`` on a Redis broker and store:
    ``manage.py check --database default`` reports nothing and
    ``manage.py dedup_locks check`` passes (W103 is retired).
    """
    lint_app(durable_redis.url(3), {"t.pay": {"unique_for": 86400, "unique_until": "expiry"}},
             broker=durable_redis.url(2))
    assert _reported("--database", "default") == set()
    out = io.StringIO()
    call_command("dedup_locks", "check", "--timeout", "20", stdout=out)
    assert out.getvalue().rstrip().splitlines()[-1].endswith("deduplication is working")


def test_django_cache_stores_answer_for_their_backend(
    lint_app: Any, settings: Any, lru_redis: RedisServer, tmp_path: Any, db: None
) -> None:
    """A LocMemCache forgets expiry keys (W107), a file cache keeps them, a Redis cache asks."""
    backend = "django.core.cache.backends."
    settings.CACHES = {
        **settings.CACHES,
        "lint-locmem": {"BACKEND": backend + "locmem.LocMemCache", "LOCATION": "lint"},
        "lint-file": {"BACKEND": backend + "filebased.FileBasedCache",
                      "LOCATION": str(tmp_path / "cache")},
        "lint-redis": {"BACKEND": backend + "redis.RedisCache", "LOCATION": lru_redis.url(4)},
    }
    expiry = {"t.a": {"unique_until": "expiry"}}
    server_ids = {"W106", "I106", "W107", "I107"}
    lint_app("django-cache://lint-locmem", expiry)
    assert {c for c, _ in _reported("--database", "default")} & server_ids == {"W107"}
    lint_app("django-cache://lint-file", expiry)
    assert not {c for c, _ in _reported("--database", "default")} & server_ids
    lint_app("django-cache://lint-redis", expiry)
    assert {c for c, _ in _reported("--database", "default")} & server_ids == {"W106", "W107"}


def test_invalid_silencing_is_e032_not_a_crash(lint_app: Any, db: None) -> None:
    """A bad ``dedup_silenced_warnings`` is reported by E032; the lint checks step aside."""
    lint_app("django-db", {"t.a": {"unique_for": 10, "time_limit": 60}},
             dedup_silenced_warnings="W101")
    out = io.StringIO()
    with pytest.raises(SystemCheckError, match=r"celery_dedup\.E032"):
        call_command("check", "--database", "default", stdout=out, stderr=out)
