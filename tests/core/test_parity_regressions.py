"""Regressions of issue 21: a DedupTask that suppresses nothing behaves as a plain task.

Each test counts executions (``Runs``, written by the task bodies) or asserts
the exact error, on the test Redis with a real worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain, states
from kombu import Exchange, Queue
from pydantic import BaseModel

from celery_dedup import DedupTask, dedup_key_for, inspect_lock
from tests.fixtures._servers import running
from tests.fixtures.redis import RedisServer, start_redis

from .conftest import AppFactory, wait_until
from .test_paths_identity import Runs


class Order(BaseModel):
    """A pydantic argument (module level: the task's annotations must resolve)."""

    order_id: int
    note: str


#: every option the routed-call crash hit, with a value that lets the task run now
ROUTED_OPTIONS: dict[str, Any] = {
    "countdown": 0.1,
    "eta": "now",
    "expires": 60,
    "time_limit": 30,
    "soft_time_limit": 20,
    "retries": 0,
    "ignore_result": False,
}


@pytest.fixture
def runs(redis_server: RedisServer) -> Iterator[Runs]:
    """An empty ``Runs`` list on the test Redis."""
    with Runs.on(redis_server) as recorded:
        yield recorded


@pytest.mark.parametrize("option", sorted(ROUTED_OPTIONS))
def test_routed_call_takes_every_celery_option(
    app_factory: AppFactory, worker_for: Any, runs: Runs, option: str
) -> None:
    """``task_routes`` + countdown/eta/expires/time limits/retries/ignore_result: no TypeError."""
    app = app_factory("routedopt", task_routes={"routedopt.hold": {"queue": "q-routed"}})

    @app.task(base=DedupTask, shared=False, name="routedopt.hold", unique_for=30)
    def hold(x: int) -> int:
        runs.record(x)
        return x

    value = ROUTED_OPTIONS[option]
    if option == "eta":
        value = datetime.now(timezone.utc) + timedelta(milliseconds=100)
    result = hold.apply_async([1], **{option: value})
    assert result.deduplicated is False
    worker_for(app, queues=["q-routed"])
    assert result.get(timeout=10) == 1
    assert runs.all() == [1]


def test_routed_task_retries(app_factory: AppFactory, worker_for: Any, runs: Runs) -> None:
    """``self.retry()`` of a routed DedupTask republishes (retries + countdown) and runs again."""
    app = app_factory("routedretry", task_routes={"routedretry.*": {"queue": "q-rretry"}})

    @app.task(
        base=DedupTask, shared=False, bind=True, name="routedretry.flaky", unique_for=30
    )
    def flaky(self: Any, x: int) -> int:
        runs.record(self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0.1, max_retries=3)
        return x

    worker_for(app, queues=["q-rretry"])
    assert flaky.delay(5).get(timeout=15) == 5
    assert runs.all() == [0, 1, 2]


def test_router_sees_the_options_send_task_gives_it(app_factory: AppFactory) -> None:
    """A router function is asked once per call, with the same options as for a plain task."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def router(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any) -> Any:
        seen.append((name, {k: v for k, v in options.items() if k != "headers"}))
        return {"queue": "q-fn"}

    app = app_factory("routerargs", task_routes=(router,))

    @app.task(base=DedupTask, shared=False, name="routerargs.d", unique_for=30, priority=3)
    def dedup(x: int) -> int:
        return x

    @app.task(shared=False, name="routerargs.p", priority=3)
    def plain(x: int) -> int:
        return x

    dedup.apply_async([1], countdown=5, expires=60, retries=0, ignore_result=True)
    plain.apply_async([1], countdown=5, expires=60, retries=0, ignore_result=True)
    assert [name for name, _ in seen] == ["routerargs.d", "routerargs.p"]
    assert seen[0][1] == seen[1][1]


def test_exchange_and_routing_key_route_keys_producer_and_guard_alike(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """A router naming only an exchange and a routing key: ``delay`` + ``send_task`` run once."""
    bound = Queue("q-bound", Exchange("ex-topic", type="direct"), routing_key="rk.one")

    def router(name: str, args: Any, kwargs: Any, options: Any, **_: Any) -> Any:
        return {"exchange": "ex-topic", "routing_key": "rk.one"}

    app = app_factory("exrk", task_queues=[bound], task_routes=(router,))

    @app.task(
        base=DedupTask, shared=False, name="exrk.hold", unique_for=30, unique_until="expiry"
    )
    def hold(x: int) -> int:
        runs.record(x)
        return x

    with app.connection_for_write() as connection:
        bound(connection.default_channel).declare()
    first = hold.delay(7)
    copy = app.send_task("exrk.hold", [7])
    worker_for(app, queues=["q-bound"])
    assert first.get(timeout=10) == 7
    wait_until(lambda: copy.state == states.IGNORED)
    assert runs.all() == [7]
    assert dedup_key_for(hold, [7]) == first.deduplication_key


@pytest.mark.parametrize("serializer", ["msgpack", "yaml"])
def test_msgpack_and_yaml_tasks_publish_and_guard(
    app_factory: AppFactory, worker_for: Any, runs: Runs, serializer: str
) -> None:
    """``delay`` of a msgpack/yaml task publishes (no ContentDisallowed), dedups, and a
    header-less copy of another call runs (it is not dropped as invalid)."""
    app = app_factory(
        f"ser{serializer}", accept_content=["json", serializer], task_serializer=serializer
    )

    @app.task(base=DedupTask, shared=False, name=f"ser{serializer}.hold", unique_for=30)
    def hold(x: int, label: str) -> str:
        runs.record([x, label])
        return f"{label}{x}"

    first = hold.delay(1, "a")
    again = hold.delay(1, "a")
    assert first.deduplicated is False and again.deduplicated is True
    raw = app.send_task(f"ser{serializer}.hold", [2, "b"], serializer=serializer)
    worker_for(app)
    assert first.get(timeout=10) == "a1"
    assert raw.get(timeout=10) == "b2"
    assert sorted(runs.all()) == [[1, "a"], [2, "b"]]


def test_chain_whose_last_step_is_held_completes(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """The last step of a chain, published by the worker while its key is held, still runs:
    the chain's result is the frozen id of that step, which must reach SUCCESS."""
    app = app_factory("lastheld")

    @app.task(base=DedupTask, shared=False, name="lastheld.first", unique_for=30)
    def first(x: int) -> int:
        runs.record(["first", x])
        return x

    @app.task(
        base=DedupTask, shared=False, name="lastheld.then", unique_for=30, unique_until="expiry"
    )
    def then(x: int) -> int:
        runs.record(["then", x])
        return x * 10

    holder = then.delay(1)
    worker_for(app)
    assert holder.get(timeout=10) == 10
    assert inspect_lock(holder.deduplication_key, app=app) is not None  # expiry: still held
    flow = chain(first.s(1), then.s()).apply_async()
    assert flow.get(timeout=10) == 10
    assert flow.state == states.SUCCESS
    assert runs.all() == [["then", 1], ["first", 1], ["then", 1]]


def test_link_callback_whose_key_is_held_is_still_suppressed(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """A ``link`` callback is not a chain step: a held key suppresses it as before."""
    app = app_factory("linkheld")

    @app.task(base=DedupTask, shared=False, name="linkheld.first", unique_for=30)
    def first(x: int) -> int:
        runs.record(["first", x])
        return x

    @app.task(
        base=DedupTask, shared=False, name="linkheld.then", unique_for=30, unique_until="expiry"
    )
    def then(x: int) -> int:
        runs.record(["then", x])
        return x

    holder = then.delay(1)
    worker_for(app)
    assert holder.get(timeout=10) == 1
    assert first.apply_async([1], link=then.s()).get(timeout=10) == 1
    wait_until(lambda: runs.all() == [["then", 1], ["first", 1]])
    assert runs.all() == [["then", 1], ["first", 1]]


@pytest.fixture
def socket_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server also listening on a unix socket; yields the socket's path."""
    argv, port = start_redis(tmp_path)
    path = tmp_path / "redis.sock"
    argv += ["--unixsocket", str(path), "--unixsocketperm", "700"]
    with running(argv, port, log=tmp_path / "redis.log"):
        wait_until(path.exists)
        yield str(path)


def test_socket_backend_keeps_global_keyprefix(socket_redis: str, app_factory: AppFactory) -> None:
    """Two apps on one ``redis+socket://`` backend, kept apart by ``global_keyprefix``,
    never suppress each other's calls; each app's lock sits under its own prefix."""
    url = f"redis+socket://{socket_redis}?virtual_host=1"
    results: list[Any] = []
    for prefix in ("one:", "two:"):
        app = app_factory(
            f"sock{prefix[:-1]}",
            task_default_queue="q-sock",
            result_backend=url,
            result_backend_transport_options={"global_keyprefix": prefix},
        )

        @app.task(base=DedupTask, shared=False, name="sock.hold", unique_for=30)
        def hold(x: int) -> int:
            return x

        results.append(hold.delay(1))
    assert [r.deduplicated for r in results] == [False, False]
    assert results[0].deduplication_key == results[1].deduplication_key
    client = redis.Redis(unix_socket_path=socket_redis, db=1)
    try:
        names = sorted(k.decode() for k in client.keys("*celery-dedup:sock.hold:*"))
    finally:
        client.close()
    key = str(results[0].deduplication_key)
    assert names == [f"one:{key}", f"two:{key}"]



def test_guard_runs_a_copy_that_starts_after_the_holder_released(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """docs/usage.md: a ``send_task`` copy that starts after the ``delay()`` run released its
    lock (``unique_until="success"``) runs, even when it was published while the lock was held
    (a one-slot worker starts it only after the first run ended); a copy starting while that
    copy's guard lock lives is skipped."""
    app = app_factory("guardafter")

    @app.task(base=DedupTask, shared=False, name="guardafter.hold", unique_for=30)
    def hold(x: int) -> int:
        runs.record(x)
        return x

    first = hold.delay(3)
    queued_copy = app.send_task("guardafter.hold", [3])
    worker_for(app, concurrency=1)
    assert first.get(timeout=10) == 3
    assert queued_copy.get(timeout=10) == 3
    # That copy's guard lock lives unique_for from its start: the next copy is throttled.
    after = app.send_task("guardafter.hold", [3])
    wait_until(lambda: after.state == states.IGNORED)
    assert runs.all() == [3, 3]


def test_pydantic_task_is_keyed_on_the_dumped_model(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """``pydantic=True``: the key is computed on what Celery sends (the dumped model), so a
    model argument publishes (no DedupKeyError), an equal model is a duplicate, and a
    header-less copy of it (``send_task`` of the dumped dict) is guarded under the same key."""
    app = app_factory("pyd")

    @app.task(
        base=DedupTask, shared=False, name="pyd.ship", unique_for=30, unique_until="expiry",
        pydantic=True,
    )
    def ship(order: Order) -> int:
        runs.record(order.order_id)
        return order.order_id

    first = ship.delay(Order(order_id=4, note="x"))
    again = ship.delay(Order(order_id=4, note="x"))
    assert first.deduplicated is False and again.deduplicated is True
    copy = app.send_task("pyd.ship", [{"order_id": 4, "note": "x"}])
    worker_for(app)
    assert first.get(timeout=10) == 4
    wait_until(lambda: copy.state == states.IGNORED)
    assert runs.all() == [4]
