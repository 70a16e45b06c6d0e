"""``debounce_max_wait`` caps a ``replace`` debounce under constant traffic (issue 24, item 3).

A call every 0.2 s for 5 s, each with ``countdown=1``: without the cap the
debounce would run once, after the traffic stops. With
``debounce_max_wait=2`` every burst runs at most 2 s after its first call
(plus a scheduling margin), and the last run carries the last call's
arguments. Judged from the timestamps the calls and the bodies record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_dedup import DedupTask, InvalidOptionError, inspect_lock
from tests.fixtures.postgres import PostgresServer

from .conftest import AppFactory, wait_until

pytestmark = pytest.mark.timeout(180)

#: seconds a worker may take past the capped ETA to start a body on 2 loaded cores
MARGIN = 2.0


@pytest.fixture(params=["redis", "postgres"])
def store_app(request: pytest.FixtureRequest, app_factory: AppFactory) -> Iterator[Celery]:
    """An app whose locks live in the result backend's Redis or in PostgreSQL."""
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        with server.connect() as conn:
            conn.execute(
                "DO $$ BEGIN IF to_regclass('celery_dedup_sql_lock') IS NOT NULL THEN "
                "DELETE FROM celery_dedup_sql_lock; DELETE FROM celery_dedup_sql_revoked; "
                "END IF; END $$"
            )
        yield app_factory("debounce-pg", dedup_store="db+" + server.url())
    else:
        yield app_factory("debounce-redis")


def test_constant_traffic_still_runs_within_max_wait(store_app: Celery, worker_for: Any) -> None:
    """Each run starts within max_wait of its burst's first call; the last run has the last args."""
    app = store_app
    started: list[tuple[float, int]] = []
    lock = threading.Lock()

    @app.task(
        base=DedupTask,
        shared=False,
        unique_for=60,
        on_duplicate="replace",
        debounce_max_wait=2,
        unique_on=("doc",),
    )
    def reindex(doc: int, version: int) -> int:
        with lock:
            started.append((time.time(), version))
        return version

    worker_for(app)
    called: list[float] = []
    results = []
    begin = time.monotonic()
    while time.monotonic() - begin < 5:
        called.append(time.time())
        results.append(reindex.apply_async((1, len(called) - 1), countdown=1))
        time.sleep(0.2)
    last = len(called) - 1
    wait_until(lambda: any(version == last for _, version in started), timeout=30)
    time.sleep(1)  # a run that should not happen would have started by now
    with lock:
        runs = sorted(started)
    versions = [version for _, version in runs]
    assert len(runs) >= 2, runs
    assert versions == sorted(set(versions)), "a call ran twice, or out of order"
    assert versions[-1] == last
    first_call = 0
    for at, version in runs:
        # The burst's first call is the one after the version the previous run carried.
        assert at - called[first_call] <= 2 + MARGIN, (first_call, version, runs)
        first_call = version + 1
    wait_until(lambda: inspect_lock(results[-1].deduplication_key, app=app) is None)


def test_max_wait_is_validated(app_factory: AppFactory) -> None:
    """A bad value raises InvalidOptionError naming the task, the option and the value."""
    app = app_factory("debounce-bad")

    @app.task(base=DedupTask, shared=False, on_duplicate="replace")
    def job(x: int) -> int:
        return x

    with pytest.raises(InvalidOptionError) as raised:
        job.apply_async((1,), debounce_max_wait=-1)
    message = str(raised.value)
    assert "debounce_max_wait" in message and "-1" in message and job.name in message
    with pytest.raises(InvalidOptionError, match="cancel_signal"):
        job.apply_async((1,), cancel_signal="SIGNOPE")
    with pytest.raises(InvalidOptionError, match="cancel_wait"):
        job.apply_async((1,), cancel_wait="soon")
    with pytest.raises(InvalidOptionError, match="on_duplicate"):
        job.apply_async((1,), on_duplicate="cancel_everything")
    with pytest.raises(InvalidOptionError, match="cancel_signal='SIGNOPE'"):

        @app.task(base=DedupTask, shared=False, on_duplicate="cancel_running",
                  cancel_signal="SIGNOPE")
        def bad(x: int) -> int:
            return x

        assert bad.name  # the task class is built on first use

    app.conf.dedup_cancel_wait = -1
    with pytest.raises(InvalidOptionError, match="dedup_cancel_wait=-1"):
        job.delay(1)
    app.conf.dedup_cancel_wait = None  # the default again


def test_a_burst_shared_by_producers_keeps_its_start(store_app: Celery) -> None:
    """A call that could not guess the burst (another producer made its first call) takes the
    key again under the burst's start; its ETA is capped from that start."""
    from datetime import datetime

    from celery.signals import before_task_publish

    from celery_dedup import debounce
    from celery_dedup.results import owner_of

    app = store_app

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="replace",
              debounce_max_wait=2)
    def job(x: int) -> int:
        return x

    etas: list[str] = []

    def published(headers: Any = None, **_: Any) -> None:
        etas.append(headers["eta"])

    before_task_publish.connect(published)
    try:
        first = job.apply_async((1,), countdown=30)
        start = debounce.token_start(owner_of(first) or "")
        assert start is not None
        debounce._recent.clear()  # as if the next call came from another process
        time.sleep(0.1)
        second = job.apply_async((1,), countdown=30)
    finally:
        before_task_publish.disconnect(published)
    held = inspect_lock(second.deduplication_key, app=app)
    assert held is not None and held.task_id == second.id
    assert debounce.token_start(held.owner) == start
    # Both capped from the burst's start (the first call's own countdown too).
    for eta in etas:
        assert datetime.fromisoformat(eta).timestamp() == pytest.approx(start + 2, abs=0.01)
    assert len(etas) == 2


def test_two_producers_taking_the_key_again_at_once_both_publish(store_app: Celery) -> None:
    """Two calls from different producers, both guessing the burst wrong, take the key again
    interleaved (a, b, a, b): each finds the other's token. Neither may hand the key back to
    the other (each would then publish nothing, the key locked by nobody's message); the
    later take-over wins and both calls publish."""
    from celery_dedup import debounce
    from celery_dedup.results import owner_of
    from celery_dedup.runtime import runtime_for
    from celery_dedup.stores.base import RevokingTakeOver

    app = store_app

    @app.task(base=DedupTask, shared=False, unique_for=60, on_duplicate="replace",
              debounce_max_wait=2)
    def job(x: int) -> int:
        return x

    job.apply_async((1,), countdown=30)  # the burst's queued holder
    store = runtime_for(app).store
    assert store is not None
    # The take-over a replacing call makes (with the revoke, where the store can).
    method = "take_over_revoking" if isinstance(store, RevokingTakeOver) else "take_over"
    real = getattr(store, method)
    order = ["a", "b", "a", "b"]
    step = [0]
    turn = threading.Condition()

    def take_over(*args: Any, **kwargs: Any) -> Any:
        me = threading.current_thread().name
        with turn:
            assert turn.wait_for(lambda: order[step[0]] == me, timeout=10), order[step[0]]
        try:
            return real(*args, **kwargs)
        finally:
            with turn:
                step[0] += 1
                turn.notify_all()

    results: dict[str, Any] = {}

    def call(name: str) -> None:
        results[name] = job.apply_async((1,), countdown=30)

    debounce._recent.clear()  # both as if made by other processes: both guess wrong
    setattr(store, method, take_over)
    try:
        threads = [threading.Thread(target=call, args=(n,), name=n) for n in ("a", "b")]
        for thread in threads:
            thread.start()
            time.sleep(0.02)  # (b's guessed burst start differs from a's)
        for thread in threads:
            thread.join(20)
    finally:
        delattr(store, method)
    assert step[0] == 4 and set(results) == {"a", "b"}
    assert not results["a"].deduplicated and not results["b"].deduplicated
    held = inspect_lock(results["b"].deduplication_key, app=app)
    assert held is not None and held.owner == owner_of(results["b"])


def test_the_cap_never_runs_a_call_before_its_place_in_a_rate_window(
    store_app: Celery, redis_server: Any
) -> None:
    """``replace`` + ``debounce_max_wait`` + ``rate_limit_per_key`` with ``on_rate_limit="delay"``:
    a call the full window delays keeps its place even past the cap (the rate wins)."""
    import json
    from datetime import datetime

    app = store_app

    @app.task(
        base=DedupTask,
        shared=False,
        unique_for=600,
        on_duplicate="replace",
        debounce_max_wait=1,
        unique_on=("doc",),
        rate_limit_per_key="1/m",
        rate_key="{doc}",
        on_rate_limit="delay",
    )
    def edit(doc: int, version: int) -> int:
        return version

    sent = time.time()
    edit.apply_async((1, 1), countdown=0.5)  # the window's one place: now
    second = edit.apply_async((1, 2), countdown=0.5)  # replaces it; its place: a minute on
    queue = app.conf.task_default_queue
    with redis_server.client(3) as client:
        headers = [json.loads(raw)["headers"] for raw in client.lrange(queue, 0, -1)]
    mine = next(h for h in headers if h["id"] == second.id)
    eta = datetime.fromisoformat(mine["eta"]).timestamp()
    assert eta >= sent + 59, eta - sent  # not start + max_wait (a second on)
