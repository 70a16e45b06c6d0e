"""Per-key limits with real workers on Redis: concurrency slots and publish rates."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dedup import (
    DedupTask,
    InvalidOptionError,
    LimitsNotSupported,
    RateLimited,
)
from celery_dedup.limits import concurrency_store_key, parse_rate
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import RateSupport, SlotSupport
from celery_dedup.stores.memory import MemoryStore
from tests.apps import limits_app
from tests.fixtures._servers import stop
from tests.fixtures._store_case import StoreCase
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant (an end before a start at the same time)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


@pytest.mark.parametrize("backend", [
    pytest.param("redis", id="redis"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
])
def test_concurrency_limit_holds_across_worker_slots(
    app_factory: AppFactory, worker_for: Any, backend: str, request: pytest.FixtureRequest
) -> None:
    """20 messages of one key, 6 free slots, limit 2: never more than 2 at once, all 20 run.

    Slots in the Redis result backend, or in PostgreSQL.
    """
    store_url = None
    if backend == "postgres":
        store_url = request.getfixturevalue("store_postgres").url
    app = app_factory("limits", dedup_lease_ttl=3, dedup_store=store_url)
    spans: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    runs: list[tuple[str, int]] = []
    lock = threading.Lock()

    @app.task(
        base=DedupTask,
        shared=False,
        concurrency_limit=2,
        concurrency_key="{user}",
        concurrency_backoff=0.1,
    )
    def body(user: str, item: int) -> int:
        start = time.monotonic()
        time.sleep(0.15)
        with lock:
            spans[user].append((start, time.monotonic()))
            runs.append((user, item))
        return item

    worker_for(app, concurrency=6, prefetch_multiplier=8)
    results = [body.delay("a", i) for i in range(20)]
    results += [body.delay("b", i) for i in range(4)]
    for result in results:
        result.get(timeout=120)

    assert sorted(runs) == sorted([("a", i) for i in range(20)] + [("b", i) for i in range(4)])
    assert _max_overlap(spans["a"]) <= 2
    assert _max_overlap(spans["b"]) <= 2
    # The limit is per key: b's bodies ran beside a's, not after them.
    last_a_start = max(start for start, _ in spans["a"])
    assert all(start < last_a_start for start, _ in spans["b"])
    store = runtime_for(app).store
    assert isinstance(store, SlotSupport)
    for user in ("a", "b"):
        key = concurrency_store_key("celery-dedup", body.name, user)
        # (the last body gives its slot back as its result is stored: a moment later
        # at most, never a lease's life: a slot left behind lapses only after 6 s)
        wait_until(lambda key=key: store.slots_in_use(key) == 0, timeout=3)
    counts = runtime_for(app).metrics
    counts.flush()


def test_default_concurrency_key_is_the_deduplication_key(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """Without concurrency_key, the lock key is the key: a call published once the
    lock was released at start waits for the running one; another key does not.
    """
    app = app_factory("limits-default", dedup_lease_ttl=3)
    spans: list[tuple[int, float, float]] = []
    started = threading.Event()
    release = threading.Event()

    @app.task(
        base=DedupTask, shared=False, unique_until="start",
        concurrency_limit=1, concurrency_backoff=0.1,
    )
    def job(n: int) -> int:
        start = time.monotonic()
        if not started.is_set():
            started.set()
            release.wait(30)
        spans.append((n, start, time.monotonic()))
        return n

    worker_for(app, concurrency=4)
    first = job.delay(1)
    assert started.wait(30)
    again = job.delay(1)  # the lock went at start: published
    other = job.delay(2)
    assert again.deduplicated is False
    assert other.get(timeout=60) == 2  # another key runs beside the blocked one
    release.set()
    assert first.get(timeout=60) == again.get(timeout=60) == 1
    ones = sorted((s, e) for n, s, e in spans if n == 1)
    assert len(ones) == 2
    assert ones[0][1] <= ones[1][0]  # the same key never overlapped


def _user_of(user: str, item: int) -> str:
    return user


def test_callable_limit_keys_run_in_a_real_worker(
    app_factory: AppFactory, worker_for: Any
) -> None:
    """A function as ``rate_key`` and ``concurrency_key`` is called with the call's arguments.

    Celery keeps task options as class attributes; a plain function there
    would come back as a bound method. 4 calls of user a at 3/m: 3 run, the
    4th raises ``RateLimited``; user b's 2 run; a's never overlap (limit 1).
    """
    app = app_factory("limits-callable", dedup_lease_ttl=3)
    runs: list[tuple[str, int, float, float]] = []

    @app.task(
        base=DedupTask, shared=False, on_duplicate="raise",
        rate_limit_per_key="3/m", rate_key=_user_of,
        concurrency_limit=1, concurrency_key=_user_of, concurrency_backoff=0.1,
    )
    def job(user: str, item: int) -> int:
        start = time.monotonic()
        time.sleep(0.1)
        runs.append((user, item, start, time.monotonic()))
        return item

    results = [job.delay("a", i) for i in range(3)] + [job.delay("b", i) for i in range(2)]
    with pytest.raises(RateLimited):
        job.delay("a", 3)
    worker_for(app, concurrency=4)
    assert [r.get(timeout=60) for r in results] == [0, 1, 2, 0, 1]
    assert sorted((user, item) for user, item, _, _ in runs) == [
        ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)
    ]
    assert _max_overlap([(s, e) for user, _, s, e in runs if user == "a"]) == 1
    store = runtime_for(app).store
    assert isinstance(store, SlotSupport)
    for user in ("a", "b"):
        key = concurrency_store_key("celery-dedup", job.name, user)
        # (given back as the last result is stored: a moment later at most)
        wait_until(lambda key=key: store.slots_in_use(key) == 0, timeout=3)
    assert wait_until(lambda: not list(store.scan("celery-dedup:")), 10)  # every lock released


@pytest.fixture
def limits_env(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment of the limits app's processes (broker db 14, backend and store db 15)."""
    redis_server.flush(14, 15)
    env = {
        "TEST_BROKER_URL": redis_server.url(14),
        "TEST_BACKEND_URL": redis_server.url(15),
        "TEST_MARKS_URL": redis_server.url(15),
        "PYTHONPATH": str(ROOT),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    limits_app.app.conf.update(
        broker_url=env["TEST_BROKER_URL"], result_backend=env["TEST_BACKEND_URL"]
    )
    return env


def _start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "tests.apps.limits_app", "worker",
            "-P", "prefork", "-c", "2", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "INFO", "-Q", "limits",
        ],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture
def workers(limits_env: dict[str, str], tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Prefork worker subprocesses of the limits app (stopped at teardown)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            stop(proc)


def test_killed_worker_slot_comes_back(
    limits_env: dict[str, str],
    workers: list[subprocess.Popen[bytes]],
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    """SIGKILL the worker whose body holds the only slot: the slot lapses, the rest run."""
    marks = redis_server.client(15)
    workers.append(_start_worker(limits_env, tmp_path / "first.log"))
    blocked = limits_app.hold.delay("u", 0)
    wait_until(lambda: marks.lrange("started:u", 0, -1) == [b"0"], timeout=60)
    rest = [limits_app.hold.delay("u", i) for i in (1, 2, 3)]
    store = runtime_for(limits_app.app).store
    assert isinstance(store, SlotSupport)
    key = concurrency_store_key("celery-dedup", limits_app.hold.name, "u")
    assert store.slots_in_use(key) == 1
    # Kill once each of them was deferred: a message kombu's Redis transport
    # popped but had not yet recorded as unacked is lost by any SIGKILL (the
    # first hop after a publish); a deferred copy waits for its countdown
    # recorded as unacked, and comes back.
    log = tmp_path / "first.log"
    wait_until(
        lambda: all(f"hold[{r.id}] deferred" in log.read_text() for r in rest), timeout=60
    )
    os.killpg(workers[0].pid, signal.SIGKILL)
    workers[0].wait(timeout=30)

    workers.append(_start_worker(limits_env, tmp_path / "second.log"))
    for result in rest:
        assert result.get(timeout=90) in (1, 2, 3)
    # The killed body's message comes back too (acks_late) once its running lease lapsed.
    assert blocked.get(timeout=90) == 0
    started = [int(x) for x in marks.lrange("started:u", 0, -1)]
    assert started[0] == 0
    assert sorted(started) == [0, 0, 1, 2, 3]  # each ran once; item 0 again after the kill
    wait_until(lambda: store.slots_in_use(key) == 0, timeout=30)


@pytest.fixture(params=[
    pytest.param("redis", id="redis"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
])
def rate_store(request: pytest.FixtureRequest, limits_env: dict[str, str]) -> str:
    """The store the rate is counted in: the Redis result backend, or PostgreSQL (emptied)."""
    if request.param == "redis":
        return ""
    case: StoreCase = request.getfixturevalue("store_postgres")
    return case.url


def _rate_calls(store_url: str, rate: str, on_rate_limit: str) -> list[Any]:
    """50 calls of one rate key from 4 processes started together."""
    os.environ["TEST_RATE"] = rate
    os.environ["TEST_ON_RATE_LIMIT"] = on_rate_limit
    os.environ["TEST_STORE_URL"] = store_url
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(4) as pool:
            start_at = time.time() + 3
            shares = [list(range(i, 50, 4)) for i in range(4)]
            answers = pool.starmap(
                limits_app.call_many, [("user-1", share, start_at) for share in shares]
            )
    finally:
        del os.environ["TEST_RATE"]
        del os.environ["TEST_ON_RATE_LIMIT"]
        del os.environ["TEST_STORE_URL"]
    return [answer for share in answers for answer in share]


def _queued(redis_server: RedisServer) -> list[dict[str, Any]]:
    import json

    client = redis_server.client(14)
    return [json.loads(raw)["headers"] for raw in client.lrange("limits", 0, -1)]


def test_rate_limit_per_second_from_four_processes(
    rate_store: str, redis_server: RedisServer
) -> None:
    """5/s, 50 calls from 4 processes: never more than 5 in a second; the rest raise.

    On Redis and PostgreSQL.
    """
    answers = _rate_calls(rate_store, "5/s", "duplicate")
    published = [a for a in answers if a[1] != "raised"]
    raised = [a for a in answers if a[1] == "raised"]
    assert len(published) + len(raised) == 50
    assert len(published) >= 5
    assert len(_queued(redis_server)) == len(published)
    assert all(0 < a[4] <= 1.0 for a in raised)
    # Calls whose admission surely fell within the second after another call started
    # (their whole call inside it): at most 5 in all. (A call's admission lies
    # somewhere between its start and its return; under load that span is wide,
    # so only calls that started and returned inside the second count.)
    for _, _, before, _, _ in published:
        within = [p for p in published if p[2] >= before and p[3] < before + 1.0]
        assert len(within) <= 5


def test_rate_limit_exact_per_window(
    rate_store: str, redis_server: RedisServer
) -> None:
    """5/m, 50 calls from 4 processes: exactly 5 published, 45 raise ``RateLimited``."""
    answers = _rate_calls(rate_store, "5/m", "duplicate")
    # Counted in the store under test (PostgreSQL: nothing in Redis).
    assert bool(redis_server.client(15).keys("celery-dedup-rate:*")) is not bool(rate_store)
    assert sum(a[1] != "raised" for a in answers) == 5
    assert sum(a[1] == "raised" for a in answers) == 45
    assert len(_queued(redis_server)) == 5


def test_rate_limit_delay_spreads_publishes(
    rate_store: str, redis_server: RedisServer
) -> None:
    """on_rate_limit="delay": all 50 are published, 5 now and the rest with an ETA per window."""
    answers = _rate_calls(rate_store, "5/m", "delay")
    assert all(a[1] != "raised" for a in answers)
    headers = _queued(redis_server)
    assert len(headers) == 50
    assert sum(h.get("eta") is None for h in headers) == 5
    from datetime import datetime

    etas = sorted(datetime.fromisoformat(h["eta"]) for h in headers if h.get("eta"))
    assert len(etas) == 45
    # 9 later windows of 5: the last ones are due about 9 minutes from now.
    assert (etas[-1] - etas[0]).total_seconds() >= 7 * 60


def test_cli_shows_slots_and_window(limits_env: dict[str, str]) -> None:
    """``celery dedup limits TASK KEY`` shows the slots in use and the current window."""
    import json

    from celery.bin.celery import celery
    from click.testing import CliRunner

    store = runtime_for(limits_app.app).store
    assert isinstance(store, SlotSupport)
    key = concurrency_store_key("celery-dedup", limits_app.hold.name, "cli-user")
    assert store.take_slot(key, "someone", 1, 30) == (True, 1)
    published = limits_app.ping.delay("cli-user", 1)

    def run(*args: str) -> Any:
        result = CliRunner().invoke(
            celery, ["-A", "tests.apps.limits_app:app", "dedup", "limits", *args]
        )
        assert result.exit_code == 0, result.output
        return result.output

    slots = json.loads(run(limits_app.hold.name, "cli-user", "--json"))
    assert slots["concurrency"] == {"limit": 1, "in_use": 1}
    window = json.loads(run(limits_app.ping.name, "cli-user", "--json"))
    assert window["rate"]["count"] == 1
    assert window["rate"]["last_task_id"] == published.id
    text = run(limits_app.ping.name, "cli-user")
    assert "1 of 5 publishes in the last 1s" in text


@pytest.fixture(params=[
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
])
def listed_store(
    request: pytest.FixtureRequest, limits_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> object:
    """The limits app's store: its Redis result backend, or a PostgreSQL ``dedup_store``."""
    if request.param == "postgres":
        case = request.getfixturevalue("store_postgres")
        monkeypatch.setitem(limits_app.app.conf, "dedup_store", case.url)
    else:
        monkeypatch.setitem(limits_app.app.conf, "dedup_store", None)
    return runtime_for(limits_app.app).store


def test_cli_lists_every_live_key(listed_store: object) -> None:
    """``celery dedup limits`` (no KEY) lists each concurrency key with its slots in use and
    each rate key with its count in the window, by task and digest; ``TASK`` narrows it.
    """
    import json

    from celery.bin.celery import celery
    from click.testing import CliRunner

    from celery_dedup import RateLimited
    from celery_dedup.identity import digest
    from celery_dedup.limits import rate_store_key

    store = listed_store
    assert isinstance(store, SlotSupport)
    for user in ("ann", "bob"):
        key = concurrency_store_key("celery-dedup", limits_app.hold.name, user)
        assert store.take_slot(key, f"holder-{user}", 1, 60) == (True, 1)
    ids = [limits_app.ping_hourly.delay("ann", n).id for n in range(3)]
    with pytest.raises(RateLimited):
        limits_app.ping_hourly.delay("ann", 3)
    bob = limits_app.ping_hourly.delay("bob", 0).id
    assert isinstance(store, RateSupport)
    ann_rate = rate_store_key("celery-dedup", limits_app.ping_hourly.name, "ann")
    window = store.rate_window(ann_rate, 3, 3600)
    assert window.count == 3 and window.last in ids

    def run(*args: str) -> Any:
        result = CliRunner().invoke(
            celery, ["-A", "tests.apps.limits_app:app", "dedup", "limits", *args]
        )
        assert result.exit_code == 0, result.output
        return result.output

    listed = json.loads(run("--json"))
    assert listed["concurrency"] == sorted(
        (
            {"task": limits_app.hold.name, "digest": digest(user), "in_use": 1, "limit": 1}
            for user in ("ann", "bob")
        ),
        key=lambda row: row["digest"],
    )
    rates = {row["digest"]: row for row in listed["rate"]}
    assert set(rates) == {digest("ann"), digest("bob")}
    ann, bob_row = rates[digest("ann")], rates[digest("bob")]
    assert (ann["task"], ann["count"], ann["limit"], ann["period"]) == (
        limits_app.ping_hourly.name, 3, 3, 3600.0
    )
    # the newest entry, as the store's own window read names it (ties: by member)
    assert ann["last_task_id"] == window.last and 3000 < ann["free_in"] <= 3600
    assert (bob_row["count"], bob_row["free_in"], bob_row["last_task_id"]) == (1, 0, bob)

    only = json.loads(run(limits_app.ping_hourly.name, "--json"))
    assert only["concurrency"] == [] and len(only["rate"]) == 2

    text = run()
    assert f"{digest('ann')[:16]}  {limits_app.hold.name}  1/1" in text
    assert "2 concurrency keys in use." in text
    assert f"{digest('ann')[:16]}  {limits_app.ping_hourly.name}  3/3" in text
    assert "2 rate keys with publishes." in text
    # The KEY form names the digest the listing shows.
    assert f"(digest {digest('ann')[:16]})" in run(limits_app.ping_hourly.name, "ann")

    # A slot given back leaves the listing.
    key = concurrency_store_key("celery-dedup", limits_app.hold.name, "bob")
    assert store.give_slot(key, "holder-bob")
    assert [row["digest"] for row in json.loads(run("--json"))["concurrency"]] == [digest("ann")]


# -- validation and stores ---------------------------------------------------------


def test_bad_rate_is_a_typed_error() -> None:
    """A rate that is not "N/s|m|h|d" is refused, naming the option and the allowed form."""
    for bad in ("10", "10/w", "0/m", 10, "ten/s"):
        with pytest.raises(InvalidOptionError, match="rate_limit_per_key"):
            parse_rate(bad)
    assert parse_rate("10/m") is not None


def test_bad_template_names_the_task(app_factory: AppFactory) -> None:
    """A concurrency_key naming no parameter fails at the first call, naming the task."""
    app = app_factory("limits-bad")

    @app.task(base=DedupTask, shared=False, concurrency_limit=1, concurrency_key="{nope}")
    def job(user: str) -> None:
        return None

    with pytest.raises(InvalidOptionError, match="concurrency_key") as info:
        job.delay("x")  # the producer resolves the task's limits too
    assert job.name in str(info.value)


class _NoLimits:
    """A lock store without slot or rate support (every other call is the memory store's)."""

    name = "plain"

    def __init__(self) -> None:
        self._inner = MemoryStore()

    def __getattr__(self, name: str) -> Any:
        if name in ("take_slot", "hit_rate"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_store_without_rate_support_is_loud(app_factory: AppFactory) -> None:
    """rate_limit_per_key on a store that cannot count: LimitsNotSupported, nothing published."""
    app = app_factory("limits-plain")

    @app.task(base=DedupTask, shared=False, rate_limit_per_key="1/m")
    def job(user: str) -> None:
        return None

    runtime_for(app).use_store(_NoLimits())  # type: ignore[arg-type]
    with pytest.raises(LimitsNotSupported, match="rate_limit_per_key"):
        job.delay("x")


def test_rate_limited_call_raises_unless_it_asks_for_the_last_publish(
    app_factory: AppFactory,
) -> None:
    """A call over the rate raises ``RateLimited`` whatever ``on_duplicate`` says; only
    ``on_rate_limit="last_publish"`` answers with the latest admitted publish's handle."""
    app = app_factory("limits-existing")

    @app.task(base=DedupTask, shared=False, rate_limit_per_key="2/h", rate_key="{user}")
    def job(user: str, n: int) -> None:
        return None

    @app.task(base=DedupTask, shared=False, rate_limit_per_key="2/h", rate_key="{user}",
              on_rate_limit="last_publish")
    def asks(user: str, n: int) -> None:
        return None

    job.delay("u", 1)
    job.delay("u", 2)
    with pytest.raises(RateLimited) as info:
        job.delay("u", 3)  # different work: never another call's handle
    assert 0 < info.value.retry_after <= 3600
    assert "u" not in str(info.value).split()  # safe to show: no key, no task id
    assert job.delay("v", 1).deduplicated is False  # another rate key
    asks.delay("u", 1)
    second = asks.delay("u", 2)
    third = asks.delay("u", 3)
    assert third.deduplicated is True and third.id == second.id


def test_rate_limit_counts_calls_sharing_a_task_id(app_factory: AppFactory) -> None:
    """5 calls at 2/m with one caller-chosen task id: 2 published, 3 raise ``RateLimited``."""
    app = app_factory("limits-same-id")

    @app.task(base=DedupTask, shared=False, rate_limit_per_key="2/m", rate_key="{user}")
    def job(user: str, n: int) -> None:
        return None

    outcomes = []
    for n in range(5):
        try:
            job.apply_async(("u", n), task_id="stable-id", on_duplicate="raise")
            outcomes.append("published")
        except RateLimited:
            outcomes.append("limited")
    assert outcomes == ["published"] * 2 + ["limited"] * 3


def test_memory_store_slots_follow_the_protocol() -> None:
    """The memory store's slots: a limit, re-entry, give-back and lapsed leases."""
    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    assert store.take_slot("k", "h1", 2, 10) == (True, 1)
    assert store.take_slot("k", "h2", 2, 10) == (True, 2)
    assert store.take_slot("k", "h3", 2, 10) == (False, 2)
    assert store.take_slot("k", "h1", 2, 10) == (True, 2)
    assert store.give_slot("k", "h1") is True
    assert store.give_slot("k", "h1") is False
    now[0] += 11
    assert store.slots_in_use("k") == 0
    assert store.renew_slots([("k", "h2")], 10) == 0


def test_listing_counts_the_tasks_period_and_lapsed_slots() -> None:
    """``live_keys`` counts a rate key's entries inside its task's period only, drops lapsed
    slots, and lists a key of a task no longer registered with an unknown (``None``) limit.
    """
    from celery import Celery

    from celery_dedup.identity import digest
    from celery_dedup.limits import live_keys, rate_store_key

    app = Celery("listing", set_as_current=False)

    @app.task(base=DedupTask, shared=False, rate_limit_per_key="2/m", rate_key="{user}",
              concurrency_limit=3, concurrency_key="{user}")
    def job(user: str) -> None:
        return None

    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    rate = rate_store_key("celery-dedup", job.name, "ann")
    for member in ("old", "a", "b"):
        store.hit_rate(rate, member, 10, 3600, delay=False)
        now[0] += 20  # "old" is 62 s old at the end: outside job's 60 s period
    store.hit_rate(rate_store_key("celery-dedup", "gone.task", "x"), "g", 5, 60, delay=False)
    store.take_slot(concurrency_store_key("celery-dedup", job.name, "ann"), "h1", 3, 100)
    store.take_slot(concurrency_store_key("celery-dedup", job.name, "bob"), "h2", 3, 1)
    now[0] += 2  # bob's slot lapsed

    listed = live_keys(store, "celery-dedup", app.tasks)
    assert listed["concurrency"] == [
        {"task": job.name, "digest": digest("ann"), "in_use": 1, "limit": 3}
    ]
    rows = {row["task"]: row for row in listed["rate"]}
    assert rows["gone.task"]["limit"] is None and rows["gone.task"]["count"] == 1
    ann = rows[job.name]
    assert (ann["count"], ann["limit"], ann["period"], ann["last_task_id"]) == (2, 2, 60.0, "b")
    assert ann["free_in"] == pytest.approx(18.0)  # when "a" (42 s old) leaves the window
    assert [row["task"] for row in live_keys(store, "celery-dedup", app.tasks, "gone.task")[
        "rate"]] == ["gone.task"]
