"""The composition matrix's ``on_commit`` column (issue 31): ``delay_on_commit`` under every
``on_duplicate``, limit and id scheme, on a Redis and a PostgreSQL lock store.

Inside ``transaction.atomic()`` a call, a call of other arguments under the
same rate key, and the first call again: nothing is published before the
commit; at the commit each distinct call is published once (the repeated
one folded), no refusal raises out of the commit (a call over its rate
waits for its place: the caller got ``None`` and an exception would abort
the commit's later hooks), and the rate window counts exactly the messages
published. The first call again in a later transaction is a duplicate at
its commit: answered without raising, or taking the key over per policy.
A rolled-back transaction publishes nothing and leaves no lock and no
window entry. Messages are counted with ``after_task_publish``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from celery.signals import after_task_publish
from django.db import transaction
from django.test import override_settings

from celery_dedup import DedupTask, inspect_lock, task_observed
from celery_dedup.limits import rate_store_key
from celery_dedup.runtime import reset_runtime, runtime_for
from celery_dedup.stores.base import RateSupport
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.redis import RedisServer

POLICIES = ("existing", "raise", "replace", "keep_last", "cancel_running")
LIMITS = ("none", "rate", "concurrency")
IDS = ("random", "deterministic")
_names = itertools.count()


class Rollback(Exception):
    """Raised to roll the transaction back."""


@pytest.fixture(params=["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def app(
    request: pytest.FixtureRequest, celery_app: Any, transactional_db: None,
    redis_server: RedisServer,
) -> Iterator[Any]:
    """The example app with its locks in a Redis or PostgreSQL store (which count rates)."""
    if request.param == "redis":
        redis_server.flush(9)
        url = redis_server.url(9)
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        with server.connect() as conn:
            conn.execute(
                "DO $$ BEGIN IF to_regclass('celery_dedup_sql_lock') IS NOT NULL THEN "
                "DELETE FROM celery_dedup_sql_lock; END IF; "
                "IF to_regclass('celery_dedup_sql_rate') IS NOT NULL THEN "
                "DELETE FROM celery_dedup_sql_rate; END IF; END $$"
            )
        url = "db+" + server.url()
    with override_settings(CELERY_DEDUP_STORE=url):
        reset_runtime(celery_app)
        yield celery_app
    reset_runtime(celery_app)


@pytest.fixture
def published() -> Iterator[list[str]]:
    """Names of the tasks whose messages reached the broker, in order."""
    names: list[str] = []

    def record(sender: Any = None, **_: Any) -> None:
        names.append(str(sender))

    after_task_publish.connect(record, weak=False)
    yield names
    after_task_publish.disconnect(record)


def _task(app: Any, policy: str, limit: str, ids: str, mode: str = "enforce") -> Any:
    options: dict[str, Any] = {"on_duplicate": policy, "unique_for": 600, "dedup_mode": mode}
    if policy == "cancel_running":
        options["cancel_wait"] = 2
    if limit == "concurrency":
        options.update(concurrency_limit=1, concurrency_key="{user}")
    elif limit == "rate":
        options.update(rate_limit_per_key="1/h", rate_key="{user}")
    if ids == "deterministic":
        options["deterministic_id"] = True

    @app.task(base=DedupTask, shared=False, name=f"oncommit.job{next(_names)}", **options)
    def job(user: str, n: int) -> int:
        return n

    return job


def _key(job: Any, n: int) -> str:
    key = job.dedup_key(("u", n), {}, job.dedup_config().default_call)
    assert key is not None
    return str(key)


def _window(app: Any, job: Any) -> int:
    store = runtime_for(app).store
    assert isinstance(store, RateSupport)
    return store.rate_window(rate_store_key("celery-dedup", job.name, "u"), 1, 3600).count


@pytest.mark.parametrize(
    ("policy", "limit", "ids"), list(itertools.product(POLICIES, LIMITS, IDS))
)
def test_on_commit_calls_keep_the_admission_invariants(
    app: Any, published: list[str], policy: str, limit: str, ids: str
) -> None:
    job = _task(app, policy, limit, ids)
    with transaction.atomic():
        assert job.delay_on_commit("u", 1) is None
        assert job.delay_on_commit("u", 2) is None  # other arguments, the same rate key
        assert job.delay_on_commit("u", 1) is None  # folded into the first
        assert published == []
    # Committed without an exception: each distinct call published once.
    assert published == [job.name, job.name]
    assert inspect_lock(_key(job, 1), app=app) is not None
    assert inspect_lock(_key(job, 2), app=app) is not None
    if limit == "rate":
        assert _window(app, job) == 2  # the second waits for its place: counted, exact

    # The first call again, in a later transaction: a duplicate at the commit never
    # raises (``raise`` answers the holder's handle); a take-over publishes.
    takes_over = policy in ("replace", "keep_last", "cancel_running")
    with transaction.atomic():
        job.delay_on_commit("u", 1)
    expected = 3 if takes_over else 2
    assert published == [job.name] * expected
    if limit == "rate":
        assert _window(app, job) == expected

    with pytest.raises(Rollback), transaction.atomic():
        job.delay_on_commit("u", 3)
        raise Rollback
    assert published == [job.name] * expected
    assert inspect_lock(_key(job, 3), app=app) is None
    if limit == "rate":
        assert _window(app, job) == expected


@pytest.mark.parametrize(("policy", "limit"), list(itertools.product(POLICIES, LIMITS)))
def test_observed_on_commit_calls_are_never_folded(
    app: Any, published: list[str], policy: str, limit: str
) -> None:
    """``dedup_mode="observe"``: at the commit every call is published; the repeated one is
    counted once (what enforcing would have folded or taken over), nothing raises."""
    job = _task(app, policy, limit, "random", mode="observe")
    seen: list[str] = []

    def receive(sender: Any = None, would: str = "", **_: Any) -> None:
        seen.append(would)

    task_observed.connect(receive, weak=False)
    try:
        with transaction.atomic():
            job.delay_on_commit("u", 1)
            job.delay_on_commit("u", 2)
            job.delay_on_commit("u", 1)
            assert published == []
    finally:
        task_observed.disconnect(receive)
    assert published == [job.name] * 3
    takes_over = {"replace": "replace", "keep_last": "replace", "cancel_running": "cancel"}
    assert seen == [takes_over.get(policy, "deduplicate")]
    lock = inspect_lock(_key(job, 1), app=app)
    assert lock is not None  # the first call's, never taken over
    if limit == "rate":
        assert _window(app, job) == 2  # the observed call holds no place in the window
