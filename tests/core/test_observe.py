"""``dedup_mode="observe"``: refusals published anyway and counted, with a real worker
(issue 34, item 2).

Bodies count their runs in a Redis list; the signal, the event (a real
receiver on the broker), the counters in the store and the locks left in
the store are inspected; then the one setting switched to ``"enforce"``
suppresses again. The lock store is the Redis result backend or PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, states

from celery_dedup import DedupTask, InvalidOptionError, RateLimited, inspect_lock, task_observed
from celery_dedup.metrics import key_counter
from celery_dedup.runtime import runtime_for
from tests.fixtures._events import Recorder

from .conftest import AppFactory, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]


@pytest.fixture
def observed() -> Iterator[list[dict[str, Any]]]:
    """Every ``task_observed`` signal sent in this process."""
    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        seen.append({"task": sender.name, **kwargs})

    task_observed.connect(receive, weak=False)
    yield seen
    task_observed.disconnect(receive)


@pytest.fixture
def recorder() -> Iterator[list[Recorder]]:
    """Event receivers to close at the end."""
    made: list[Recorder] = []
    yield made
    for item in made:
        item.close()


def _counts(app: Celery) -> dict[tuple[str, str], int]:
    return runtime_for(app).metrics.read()


def test_observed_duplicates_run_and_enforce_suppresses(
    app_factory: AppFactory,
    worker_for: Any,
    runs: redis.Redis,
    store_conf: dict[str, Any],
    observed: list[dict[str, Any]],
    recorder: list[Recorder],
) -> None:
    """Observed: every call runs, each would-be duplicate counted once; enforce: suppressed."""
    app = app_factory("obs-dup", dedup_mode="observe", dedup_send_events=True, **store_conf)
    events = Recorder(app)
    recorder.append(events)

    @app.task(base=DedupTask, shared=False, unique_for=600)
    def job(x: int) -> int:
        runs.rpush(f"obs-dup:{x}", x)
        return x

    holder = job.delay(1)
    copies = [job.delay(1), job.delay(1)]
    assert holder.deduplicated is False
    assert all(c.deduplicated is False for c in copies)
    assert len({holder.id, *(c.id for c in copies)}) == 3
    assert [(s["would"], s["task_id"], s["existing_task_id"]) for s in observed] == [
        ("deduplicate", c.id, holder.id) for c in copies
    ]
    lock = inspect_lock(holder.deduplication_key, app=app)
    assert lock is not None and lock.task_id == holder.id  # the holder's lock, as enforcing

    # One setting: the same call is suppressed again.
    app.conf.dedup_mode = "enforce"
    suppressed = job.delay(1)
    assert suppressed.deduplicated is True and suppressed.id == holder.id
    other = job.delay(2)
    assert job.delay(2).id == other.id
    # A call may still observe on its own.
    per_call = job.apply_async((2,), dedup_mode="observe")
    assert per_call.deduplicated is False and per_call.id != other.id
    assert len(observed) == 3

    worker_for(app)
    for result in (holder, *copies, other, per_call):
        assert result.get(timeout=30) in (1, 2)
        assert result.state == states.SUCCESS
    assert runs.lrange("obs-dup:1", 0, -1) == [b"1"] * 3
    assert runs.lrange("obs-dup:2", 0, -1) == [b"2"] * 2
    # Every lock released by its holder, the observed runs broke none.
    for key in (holder.deduplication_key, other.deduplication_key):
        wait_until(lambda key=key: inspect_lock(key, app=app) is None, timeout=30)
    counts = _counts(app)
    assert counts[(job.name, "would_deduplicate")] == 3
    assert counts[(job.name, "deduplicated")] == 2
    assert counts[(key_counter(job.name, holder.deduplication_key), "would_deduplicate")] == 2
    assert counts[(key_counter(job.name, other.deduplication_key), "would_deduplicate")] == 1
    seen = events.of("task-observed")
    assert sorted(e["published_id"] for e in seen) == sorted(
        [c.id for c in copies] + [per_call.id]
    )
    assert all(e["uuid"] not in (holder.id, other.id, per_call.id) for e in seen)
    assert {e["parent_id"] for e in seen} == {holder.id, other.id}


@pytest.mark.parametrize("policy", ["replace", "keep_last", "cancel_running", "debounce"])
def test_observed_take_overs_revoke_and_cancel_nothing(
    app_factory: AppFactory,
    worker_for: Any,
    runs: redis.Redis,
    store_conf: dict[str, Any],
    observed: list[dict[str, Any]],
    policy: str,
) -> None:
    """replace, keep_last, cancel_running, a capped debounce: both calls run, counted."""
    app = app_factory(f"obs-{policy}", **store_conf)
    options: dict[str, Any] = {"on_duplicate": policy, "dedup_mode": "observe"}
    if policy == "debounce":
        options.update(on_duplicate="replace", debounce_max_wait=5)

    @app.task(base=DedupTask, shared=False, unique_for=600, **options)
    def job(x: int) -> int:
        runs.rpush(f"obs-{policy}", x)
        return x

    first = job.apply_async((1,), countdown=0.5 if policy == "debounce" else None)
    second = job.apply_async((1,), countdown=0.5 if policy == "debounce" else None)
    assert second.id != first.id and second.deduplicated is False
    would = "cancel" if policy == "cancel_running" else "replace"
    assert [(s["would"], s["existing_task_id"]) for s in observed] == [(would, first.id)]
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.task_id == first.id  # never taken over
    worker_for(app)
    assert first.get(timeout=30) == 1 and second.get(timeout=30) == 1
    assert first.state == second.state == states.SUCCESS  # nothing revoked or terminated
    assert runs.lrange(f"obs-{policy}", 0, -1) == [b"1", b"1"]
    wait_until(lambda: inspect_lock(first.deduplication_key, app=app) is None, timeout=30)
    counts = _counts(app)
    assert counts[(job.name, f"would_{would}")] == 1
    assert counts.get((job.name, "replaced"), 0) == counts.get((job.name, "cancelled"), 0) == 0


def test_observed_rate_limit_runs_and_enforce_refuses(
    app_factory: AppFactory,
    worker_for: Any,
    runs: redis.Redis,
    store_conf: dict[str, Any],
    observed: list[dict[str, Any]],
) -> None:
    """Over rate_limit_per_key: published anyway (not counted in the window); enforce refuses."""
    app = app_factory("obs-rate", **store_conf)

    @app.task(base=DedupTask, shared=False, unique_for=600, rate_limit_per_key="1/h",
              rate_key="{user}", dedup_mode="observe")
    def job(user: int, n: int) -> int:
        runs.rpush("obs-rate", n)
        return n

    results = [job.delay(1, n) for n in range(3)]
    assert [s["would"] for s in observed] == ["rate_limit", "rate_limit"]
    assert [s["task_id"] for s in observed] == [r.id for r in results[1:]]
    assert observed[0]["existing_task_id"] is None and observed[0]["policy"] == "raise"
    with pytest.raises(RateLimited):
        job.apply_async((1, 9), dedup_mode="enforce")
    worker_for(app)
    assert [r.get(timeout=30) for r in results] == [0, 1, 2]
    assert sorted(runs.lrange("obs-rate", 0, -1)) == [b"0", b"1", b"2"]
    for r in results:
        wait_until(lambda r=r: inspect_lock(r.deduplication_key, app=app) is None, timeout=30)
    assert _counts(app)[(job.name, "would_rate_limit")] == 2


def test_an_observed_send_task_copy_runs_and_keeps_the_holders_lock(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, store_conf: dict[str, Any],
    observed: list[dict[str, Any]],
) -> None:
    """The worker's guard counts a copy sent past apply_async instead of skipping it."""
    app = app_factory("obs-guard", **store_conf)

    @app.task(base=DedupTask, shared=False, unique_for=600, unique_until="expiry",
              dedup_mode="observe")
    def job(x: int) -> int:
        runs.rpush("obs-guard", x)
        return x

    holder = job.delay(1)
    worker_for(app)
    assert holder.get(timeout=30) == 1
    copy = app.send_task(job.name, (1,))
    assert copy.get(timeout=30) == 1 and copy.state == states.SUCCESS
    assert runs.lrange("obs-guard", 0, -1) == [b"1", b"1"]
    lock = inspect_lock(holder.deduplication_key, app=app)
    assert lock is not None and lock.task_id == holder.id  # still the holder's
    wait_until(lambda: observed, timeout=10)
    assert [(s["would"], s["task_id"], s["policy"]) for s in observed] == [
        ("deduplicate", copy.id, "unannounced duplicate")
    ]


def test_an_observed_message_whose_lock_lapsed_runs_and_leaves_the_new_holders_lock(
    app_factory: AppFactory, worker_for: Any, runs: redis.Redis, store_conf: dict[str, Any],
    observed: list[dict[str, Any]],
) -> None:
    """A's lock lapsed before it ran and B took the key: enforcing skips A, observing runs it
    (counted once) and A's end never releases B's lock."""
    app = app_factory("obs-lapsed", **store_conf)

    @app.task(base=DedupTask, shared=False, dedup_mode="observe")
    def job(x: int) -> int:
        runs.rpush("obs-lapsed", x)
        return x

    lapsed = job.apply_async((1,), unique_for=1)
    wait_until(lambda: inspect_lock(lapsed.deduplication_key, app=app) is None, timeout=10)
    holder = job.apply_async((1,), unique_for=600, unique_until="expiry")
    assert holder.deduplicated is False and observed == []  # the key was free
    worker_for(app)
    assert lapsed.get(timeout=30) == 1 and holder.get(timeout=30) == 1
    assert lapsed.state == states.SUCCESS  # not IGNORED
    assert runs.lrange("obs-lapsed", 0, -1) == [b"1", b"1"]
    wait_until(lambda: observed, timeout=10)
    assert [(s["would"], s["task_id"], s["existing_task_id"], s["policy"]) for s in observed] == [
        ("deduplicate", lapsed.id, holder.id, "held by another publish")
    ]
    lock = inspect_lock(holder.deduplication_key, app=app)
    assert lock is not None and lock.task_id == holder.id  # still B's, for its expiry
    assert _counts(app)[(job.name, "would_deduplicate")] == 1


def test_invalid_modes_name_task_option_value_and_choices(app_factory: AppFactory) -> None:
    """A task attribute, a call option or the app setting with a bad value raise, typed."""
    app = app_factory("obs-bad")
    with pytest.raises(InvalidOptionError) as info:

        @app.task(base=DedupTask, shared=False, name="obs.bad", dedup_mode="shadow")
        def bad() -> None: ...

        bad.name  # noqa: B018 (the task class is built on first use)

    assert info.value.task_name == "obs.bad" and info.value.option == "dedup_mode"
    assert "'shadow'" in str(info.value) and "'observe'" in str(info.value)

    @app.task(base=DedupTask, shared=False, name="obs.ok")
    def ok() -> None: ...

    with pytest.raises(InvalidOptionError, match=r"obs\.ok: dedup_mode='loud'.*'enforce'"):
        ok.apply_async(dedup_mode="loud")
    app.conf.dedup_mode = "dry-run"
    try:
        with pytest.raises(InvalidOptionError, match=r"dedup_mode='dry-run'.*'observe'"):
            ok.delay()
    finally:
        app.conf.dedup_mode = "enforce"
