"""One identity on every path: routed queues, delivered arguments, the send_task guard.

Each test runs real workers on the test Redis and counts executions in a
Redis list written by the task body (``Runs``), so the counts hold whatever
pool runs the body.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery, states
from celery.signals import before_task_publish
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu import Exchange, Queue
from kombu.serialization import dumps, loads

from celery_dedup import DedupKeyError, DedupTask, KeyReuseWarning, dedup_key_for, inspect_lock
from celery_dedup.worker import GUARD_PREFIX, guard_header
from tests.fixtures.rabbitmq import RabbitMQServer
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

#: the Redis database task bodies record their executions in
RUNS_DB = 5
#: the broker database of ``make_app`` apps
BROKER_DB = 3


class Runs:
    """Executions recorded by task bodies in a Redis list, in order."""

    def __init__(self, server: RedisServer, name: str = "runs") -> None:
        self.client = server.client(RUNS_DB)
        self.name = name

    @classmethod
    @contextmanager
    def on(cls, server: RedisServer) -> Iterator[Runs]:
        """A fresh, empty list for one test."""
        runs = cls(server)
        runs.client.flushdb()
        try:
            yield runs
        finally:
            runs.client.flushdb()
            runs.client.close()

    def record(self, value: Any) -> None:
        """Append ``value`` (JSON, ASCII-escaped so any string fits)."""
        self.client.rpush(self.name, json.dumps(value))

    def all(self) -> list[Any]:
        """Every recorded value, in execution order."""
        return [json.loads(raw) for raw in self.client.lrange(self.name, 0, -1)]


@pytest.fixture
def runs(redis_server: RedisServer) -> Iterator[Runs]:
    """An empty ``Runs`` list on the test Redis."""
    with Runs.on(redis_server) as recorded:
        yield recorded


def queued(server: RedisServer, queue: str) -> int:
    """Messages waiting in ``queue`` on the broker database."""
    with server.client(BROKER_DB) as client:
        return int(client.llen(queue))


def skipped(app: Celery, task_id: str) -> Mapping[str, Any]:
    """Wait until ``task_id`` was skipped by the worker; its stored meta."""
    result = app.AsyncResult(task_id)
    wait_until(lambda: str(result.state) == states.IGNORED)
    return dict(result.info)


def test_routed_delay_and_send_task_run_once(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer, runs: Runs
) -> None:
    """``task_routes`` sends the task to a non-default queue: delay and send_task share a key.

    ``expiry`` makes the outcome independent of the order the worker takes the
    two messages in: whichever starts second finds the key held.
    """
    app = app_factory("routing", task_routes={"routed.sync": {"queue": "q-routed"}})

    @app.task(
        base=DedupTask, shared=False, name="routed.sync", unique_for=30, unique_until="expiry"
    )
    def sync(user_id: int) -> int:
        runs.record(user_id)
        return user_id

    first = sync.delay(1)
    assert first.deduplicated is False
    assert first.deduplication_key == dedup_key_for(sync, (1,))
    assert first.deduplication_key == dedup_key_for(sync, (1,), queue="q-routed")
    assert first.deduplication_key != dedup_key_for(sync, (1,), queue="q-routing")
    raw = app.send_task("routed.sync", args=(1,))
    assert queued(redis_server, "q-routed") == 2 and queued(redis_server, "q-routing") == 0

    worker_for(app, queues=["q-routed"])
    assert first.get(timeout=10) == 1
    meta = skipped(app, raw.id)
    assert meta["skipped"] == "unannounced duplicate" and meta["holder"] == first.id
    assert runs.all() == [1]
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None and lock.task_id == first.id and lock.policy == "expiry"

    # The other way round: the guard's lock makes a later delay() a duplicate.
    raw_first = app.send_task("routed.sync", args=(2,))
    assert raw_first.get(timeout=10) == 2
    again = sync.delay(2)
    assert again.deduplicated is True and again.id == raw_first.id
    assert runs.all() == [1, 2]


def test_router_function_routes_by_argument(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """A router choosing the queue from the arguments: each call keyed on its own queue."""

    def by_parity(name: str, args: Any, kwargs: Any, options: Any, **_: Any) -> Any:
        if name != "parity.sync":
            return None
        value = args[0] if args else kwargs["x"]
        return {"queue": "q-even" if value % 2 == 0 else "q-odd"}

    app = app_factory("parity", task_routes=(by_parity,))

    @app.task(
        base=DedupTask, shared=False, name="parity.sync", unique_for=30, unique_until="expiry"
    )
    def sync(x: int) -> int:
        runs.record(x)
        return x

    even, odd = sync.delay(2), sync.delay(x=3)
    assert even.deduplication_key == dedup_key_for(sync, (2,), queue="q-even")
    assert odd.deduplication_key == dedup_key_for(sync, (), {"x": 3}, queue="q-odd")
    assert dedup_key_for(sync, (3,)) == odd.deduplication_key
    copies = [
        app.send_task("parity.sync", args=(2,)),
        app.send_task("parity.sync", kwargs={"x": 3}),
    ]

    worker_for(app, queues=["q-even", "q-odd"])
    assert even.get(timeout=10) == 2 and odd.get(timeout=10) == 3
    assert [skipped(app, copy.id)["holder"] for copy in copies] == [even.id, odd.id]
    assert sorted(runs.all()) == [2, 3]


def test_router_is_resolved_once_per_call(app_factory: AppFactory) -> None:
    """The key is computed on the queue the message actually goes to (routers run once).

    A round-robin router is legitimate Celery; resolving it twice per call
    keys the call on one queue and publishes it to the other.
    """
    turns = itertools.cycle(["q-rr-a", "q-rr-b"])
    calls: list[str] = []

    def round_robin(name: str, *_: Any, **__: Any) -> Any:
        if name != "rr.sync":
            return None
        queue = next(turns)
        calls.append(queue)
        return {"queue": queue}

    app = app_factory("rr", task_routes=(round_robin,))

    @app.task(base=DedupTask, shared=False, name="rr.sync", unique_for=30)
    def sync(x: int) -> int:
        return x

    sent: list[str] = []

    def record(headers: Any = None, routing_key: Any = None, **_: Any) -> None:
        if (headers or {}).get("task") == "rr.sync":
            sent.append(str(routing_key))

    before_task_publish.connect(record, weak=False)
    try:
        result = sync.delay(1)
    finally:
        before_task_publish.disconnect(record)
    assert len(sent) == 1
    assert result.deduplication_key == dedup_key_for(sync, (1,), queue=sent[0])
    assert len(calls) == 1, f"router called {len(calls)} times for one publish: {calls}"


def _bound_queue(suffix: str) -> dict[str, Any]:
    name = f"q-bound-{suffix}"
    return {
        "task_queues": [Queue(name, Exchange(f"x-{name}", type="topic"), routing_key=f"rk.{name}")],
        "task_routes": {"bound.sync": {"queue": name}},
    }


def _default_routing_key(suffix: str) -> dict[str, Any]:
    # The layout of Celery's routing guide: a default exchange and routing key.
    return {
        "task_default_queue": f"q-bound-{suffix}",
        "task_default_exchange": f"x-tasks-{suffix}",
        "task_default_exchange_type": "topic",
        "task_default_routing_key": "task.default",
    }


@pytest.mark.rabbitmq
@pytest.mark.parametrize("layout", [_bound_queue, _default_routing_key])
def test_queue_whose_routing_key_differs_from_its_name(
    app_factory: AppFactory,
    worker_for: Any,
    runs: Runs,
    rabbitmq_server: RabbitMQServer,
    layout: Callable[[str], dict[str, Any]],
) -> None:
    """On AMQP, a queue bound to a topic exchange under another routing key: one run.

    (Celery publishes to direct exchanges through the default exchange with
    the queue name as routing key, so only topic/fanout layouts differ.)

    The producer keys on the queue name; the worker's guard must key on the
    same queue, not on the message's routing key (Redis reports the queue
    name as the routing key, RabbitMQ the real routing key).
    """
    suffix = uuid.uuid4().hex[:8]
    app = app_factory("bound", broker_url=rabbitmq_server.url, **layout(suffix))

    @app.task(base=DedupTask, shared=False, name="bound.sync", unique_for=30, unique_until="expiry")
    def sync(x: int) -> int:
        runs.record(x)
        return x

    first = sync.delay(1)
    raw = app.send_task("bound.sync", args=(1,))
    worker_for(app, queues=[f"q-bound-{suffix}"])
    assert first.get(timeout=10) == 1
    wait_until(lambda: app.AsyncResult(raw.id).state in states.READY_STATES | {states.IGNORED})
    assert runs.all() == [1], "the send_task copy ran: the guard keyed another queue"


def test_int_keyed_dict_is_one_call(app_factory: AppFactory, worker_for: Any, runs: Runs) -> None:
    """``{1: 9.5}`` through delay and ``{"1": 9.5}`` through send_task: one run (JSON)."""
    app = app_factory("intkeys")

    @app.task(
        base=DedupTask, shared=False, name="intkeys.price", unique_for=30, unique_until="expiry"
    )
    def price(prices: dict[str, float]) -> dict[str, float]:
        runs.record(prices)
        return prices

    assert dedup_key_for(price, ({1: 9.5},)) == dedup_key_for(price, ({"1": 9.5},))
    assert dedup_key_for(price, (1,)) != dedup_key_for(price, ("1",))
    assert dedup_key_for(price, ({1: 9.5},)) != dedup_key_for(price, ({"1": 9.6},))
    first = price.delay({1: 9.5})
    assert price.delay({"1": 9.5}).deduplicated is True
    raw = app.send_task("intkeys.price", args=({"1": 9.5},))
    worker_for(app)
    assert first.get(timeout=10) == {"1": 9.5}
    assert skipped(app, raw.id)["holder"] == first.id
    assert runs.all() == [{"1": 9.5}]


def test_message_serializer_decides_the_delivered_arguments(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """A call published with ``serializer="pickle"`` and its send_task copy: one run.

    Pickle delivers ``{1: 9.5}`` unchanged to the worker, so the guard must
    key what it received as delivered by the message's serializer, as the
    producer did.
    """
    app = app_factory("pickled", accept_content=["json", "pickle"])

    @app.task(
        base=DedupTask, shared=False, name="pickled.price", unique_for=30, unique_until="expiry"
    )
    def price(prices: dict[int, float]) -> int:
        runs.record(sorted(prices))
        return len(prices)

    first = price.apply_async(({1: 9.5},), serializer="pickle")
    raw = app.send_task("pickled.price", args=({1: 9.5},), serializer="pickle")
    worker_for(app)
    assert first.get(timeout=10) == 1
    wait_until(lambda: app.AsyncResult(raw.id).state in states.READY_STATES | {states.IGNORED})
    assert runs.all() == [[1]], "the pickled send_task copy was keyed as JSON by the guard"


def test_sequential_send_task_copies_throttle(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """Non-overlapping send_task copies run once per ``unique_for`` (default ``success``)."""
    app = app_factory("throttle")

    @app.task(base=DedupTask, shared=False, name="throttle.sync", unique_for=2)
    def sync(x: int) -> int:
        runs.record(x)
        return x

    worker_for(app)
    first = app.send_task("throttle.sync", args=(5,))
    assert first.get(timeout=10) == 5
    key = dedup_key_for(sync, (5,))
    assert key is not None
    lock = inspect_lock(key, app=app)
    assert lock is not None
    assert (lock.task_id, lock.policy) == (first.id, "expiry")
    assert lock.owner.startswith(GUARD_PREFIX)
    assert 0 < lock.ttl <= 2

    second = app.send_task("throttle.sync", args=(5,))
    meta = skipped(app, second.id)
    assert meta == {
        "skipped": "unannounced duplicate",
        "deduplication_key": key,
        "holder": first.id,
    }
    again = sync.delay(5)
    assert again.deduplicated is True and again.id == first.id
    assert runs.all() == [5]

    wait_until(lambda: inspect_lock(key, app=app) is None, timeout=5)
    third = app.send_task("throttle.sync", args=(5,))
    assert third.get(timeout=10) == 5
    assert runs.all() == [5, 5]


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def test_deep_nesting_names_the_argument(
    app_factory: AppFactory, worker_for: Any, redis_server: RedisServer, runs: Runs
) -> None:
    """600 levels: DedupKeyError naming the argument, nothing published; a key still works."""
    app = app_factory("deep")

    @app.task(base=DedupTask, shared=False, name="deep.store", unique_for=30)
    def store(user_id: int, payload: Any) -> int:
        runs.record(user_id)
        return user_id

    deep = _nested(600)
    for call in (lambda: store.delay(1, deep), lambda: dedup_key_for(store, (1, deep))):
        with pytest.raises(DedupKeyError) as info:
            call()
        assert info.value.argument == "payload" and "payload" in str(info.value)
    assert queued(redis_server, "q-deep") == 0
    with pytest.raises(DedupKeyError) as info:
        store.delay(1, {"a": _nested(600)})
    assert info.value.argument == "payload"

    # What the error suggests: a caller key. Plain Celery delivers the value.
    keyed = store.apply_async((2, deep), deduplication_key="deep:2")
    assert store.apply_async((2, deep), deduplication_key="deep:2").deduplicated is True
    worker_for(app)
    assert keyed.get(timeout=10) == 2
    assert runs.all() == [2]


def test_lone_surrogates_work_like_plain_celery(
    app_factory: AppFactory, worker_for: Any, runs: Runs
) -> None:
    """``"a\\ud800"`` as an argument and in a deduplication_key: keyed, deduplicated, run once."""
    app = app_factory("surrogate")

    @app.task(
        base=DedupTask, shared=False, name="surrogate.echo", unique_for=30, unique_until="expiry"
    )
    def echo(text: str) -> int:
        runs.record(text)
        return len(text)

    first = echo.delay("a\ud800")
    assert first.deduplicated is False
    assert echo.delay("a\ud800").deduplicated is True
    assert dedup_key_for(echo, ("a\ud800",)) == first.deduplication_key
    assert dedup_key_for(echo, ("a\ud801",)) != first.deduplication_key
    raw = app.send_task("surrogate.echo", args=("a\ud800",))

    keyed = echo.apply_async(("x",), deduplication_key="k\ud800")
    with pytest.warns(KeyReuseWarning):  # the same key for other arguments
        assert echo.apply_async(("y",), deduplication_key="k\ud800").deduplicated is True
    other = echo.apply_async(("z",), deduplication_key="k\ud801")
    assert other.deduplicated is False

    worker_for(app)
    assert [r.get(timeout=10) for r in (first, keyed, other)] == [2, 1, 1]
    assert skipped(app, raw.id)["holder"] == first.id
    assert sorted(runs.all()) == sorted(["a\ud800", "x", "z"])


# -- property: the producer's key is the worker guard's key ------------------

_keys = st.text(max_size=4) | st.integers() | st.booleans() | st.none()
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=()), max_size=6)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(_keys, inner, max_size=3)
    ),
    max_leaves=12,
)
_extra = st.dictionaries(
    st.text(min_size=1, max_size=5).filter(lambda k: k not in ("a", "b")), _values, max_size=3
)


def _queue_for(args: Any) -> str:
    """Where the property test's router sends a call (recomputed independently)."""
    return "q-prop-long" if len(args) > 2 else "q-prop-short"


def test_producer_key_equals_worker_guard_key() -> None:
    """For JSON-able arguments, ``dedup_key_for`` equals the key the worker's guard computes
    from the delivered message (its JSON body and its routed queue)."""
    app = Celery("prop", set_as_current=False)

    def by_length(name: str, args: Any, *_: Any, **__: Any) -> Any:
        return {"queue": _queue_for(args)} if name == "prop.job" else None

    app.conf.update(dedup_store="memory://paths-prop", task_routes=(by_length,))

    @app.task(base=DedupTask, shared=False, name="prop.job", unique_for=30)
    def job(a: Any, b: Any = None, *rest: Any, **extra: Any) -> None:
        return None

    @settings(max_examples=200, deadline=None, database=None)
    @given(args=st.lists(_values, min_size=1, max_size=4), kwargs=_extra)
    def check(args: list[Any], kwargs: dict[str, Any]) -> None:
        content_type, encoding, body = dumps((args, kwargs, {}), "json")
        delivered_args, delivered_kwargs, _ = loads(body, content_type, encoding)
        header = guard_header(job, "task-id", delivered_args, delivered_kwargs, _queue_for(args))
        assert header is not None
        assert dedup_key_for(job, args, kwargs) == header.key

    try:
        check()
    finally:
        app.close()
