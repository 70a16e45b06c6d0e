"""A naive ``eta`` means UTC everywhere, as Celery reads it, whatever the host's time zone."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery.signals import before_task_publish

from celery_dedup import DedupTask
from celery_dedup.debounce import cap_eta
from celery_dedup.runtime import runtime_for

from .conftest import AppFactory

ZONES = ["Asia/Tokyo", "America/New_York", "UTC"]


@pytest.fixture(params=ZONES)
def host_zone(request: pytest.FixtureRequest) -> Iterator[str]:
    """The process runs in another local time zone (``TZ``), restored afterwards."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = request.param
    time.tzset()
    try:
        yield request.param
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


def _naive_utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _as_utc(value: Any) -> datetime:
    when = datetime.fromisoformat(value) if isinstance(value, str) else value
    assert isinstance(when, datetime)
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def test_delayed_rate_place_keeps_a_naive_eta_in_utc(
    host_zone: str, app_factory: AppFactory, worker_for: Any
) -> None:
    """on_rate_limit="delay" at 1/s, two calls with a naive ``eta`` of now: both run once,
    the second a second after the first (not hours late, not at once).
    """
    app = app_factory("naive-eta-rate")
    starts: list[tuple[int, float]] = []
    etas: list[Any] = []

    @app.task(
        base=DedupTask, shared=False, unique_for=30,
        rate_limit_per_key="1/s", rate_key="{user}", on_rate_limit="delay",
    )
    def job(user: str, n: int) -> int:
        starts.append((n, time.time()))
        return n

    def seen(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == job.name:
            etas.append((headers or {}).get("eta"))

    before_task_publish.connect(seen, weak=False)
    try:
        first = job.apply_async(("u", 1), eta=_naive_utc_now())
        second = job.apply_async(("u", 2), eta=_naive_utc_now())
    finally:
        before_task_publish.disconnect(seen)
    assert first.deduplicated is False and second.deduplicated is False
    # The second's place is a second after the first's window entry: read as UTC,
    # never hours off (a naive eta read in the host's zone), never at once.
    place = _as_utc(etas[1]) - _as_utc(etas[0])
    assert timedelta(seconds=0.5) < place < timedelta(minutes=1), (host_zone, place)
    worker_for(app, concurrency=2)
    assert first.get(timeout=30) == 1
    assert second.get(timeout=30) == 2
    assert sorted(n for n, _ in starts) == [1, 2]
    at = dict(starts)
    assert at[2] >= _as_utc(etas[1]).timestamp() - 0.1  # it waited for its place


def test_lock_of_a_naive_eta_lives_until_it_runs(host_zone: str, app_factory: AppFactory) -> None:
    """A call 100 s ahead by a naive ``eta`` holds its lock 100 s plus ``unique_for``."""
    app = app_factory("naive-eta-lock")

    @app.task(base=DedupTask, shared=False, unique_for=10)
    def job(n: int) -> int:
        return n

    job.apply_async((1,), eta=_naive_utc_now() + timedelta(seconds=100))
    store = runtime_for(app).store
    assert store is not None
    (lock,) = list(store.scan("celery-dedup:"))
    assert 100 < lock.ttl <= 110, (host_zone, lock.ttl)
    assert job.apply_async((1,), eta=_naive_utc_now()).deduplicated is True


def test_debounce_cap_reads_a_naive_eta_as_utc(host_zone: str) -> None:
    """``debounce_max_wait`` caps a naive ``eta`` by its UTC reading."""
    start = time.time()
    far: dict[str, Any] = {"eta": _naive_utc_now() + timedelta(seconds=100)}
    assert cap_eta(far, start, 30) is True
    assert abs(_as_utc(far["eta"]).timestamp() - (start + 30)) < 1
    near: dict[str, Any] = {"eta": _naive_utc_now() + timedelta(seconds=10)}
    assert cap_eta(near, start, 30) is False
