"""Hostile and odd input, generated: keys, secrecy of arguments, and every store against the model.

- Calls whose arguments are the same once delivered share one key; calls
  that differ never do.
- No raw argument text reaches a store key, a stored value or a log line.
- A ``RuleBasedStateMachine`` drives acquire/release/extend/take_over/claim/
  revoke/unrevoke/expire against a real store and ``MemoryStore`` (on a
  model clock) and requires the same answers and the same live locks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_dedup import DedupTask, DuplicateTaskError, dedup_key_for
from celery_dedup.exceptions import ScanNotSupported
from celery_dedup.stores.base import Lock, LockStore
from celery_dedup.stores.memory import MemoryStore
from celery_dedup.stores.redis import RedisStore
from tests.fixtures._store_case import StoreCase
from tests.fixtures.logs import DedupLog
from tests.fixtures.redis import RedisServer

#: the database of the session Redis the store tests below use
STATE_DB = 43

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def make_task(**conf: Any) -> Any:
    app = Celery("properties", set_as_current=False)
    app.conf.update(broker_url="memory://", task_default_queue="props", **conf)

    @app.task(base=DedupTask, shared=False, name="props.f", unique_for=60)
    def f(a: Any, b: Any = None, c: Any = 0) -> None:
        return None

    return f


def reordered(value: Any) -> Any:
    """The same value with every dict built in reverse key order."""
    if isinstance(value, dict):
        return {k: reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return tuple(reordered(v) for v in value)
    return value


def delivered(value: Any) -> str:
    """What the worker receives, as comparable text."""
    return json.dumps(value, sort_keys=True)


@settings(max_examples=200, deadline=None)
@given(a=json_values, b=json_values)
def test_calls_equal_once_delivered_share_one_key(a: Any, b: Any) -> None:
    """Positional or keyword, defaults spelt out or not, dict order, tuples: one key."""
    f = make_task()
    key = dedup_key_for(f, (a, b))
    assert key == dedup_key_for(f, (), {"a": a, "b": b})
    assert key == dedup_key_for(f, (a,), {"b": b, "c": 0})
    assert key == dedup_key_for(f, (reordered(a), reordered(b)))
    assert key is not None and key.startswith("celery-dedup:props.f:")


@settings(max_examples=200, deadline=None)
@given(x=json_values, y=json_values)
def test_calls_that_differ_once_delivered_never_share_a_key(x: Any, y: Any) -> None:
    assume(delivered(x) != delivered(y))
    f = make_task()
    assert dedup_key_for(f, (x,)) != dedup_key_for(f, (y,))


@settings(max_examples=100, deadline=None)
@given(keys=st.dictionaries(st.integers(-1000, 1000), json_scalars, min_size=1, max_size=4))
def test_int_dict_keys_are_keyed_as_the_worker_receives_them(keys: dict[int, Any]) -> None:
    """JSON turns ``{1: x}`` into ``{"1": x}``: both are one call for the worker."""
    f = make_task()
    as_text = {str(k): v for k, v in keys.items()}
    assert dedup_key_for(f, (keys,)) == dedup_key_for(f, (as_text,))


MARKER = "Zq7-SECRET-MARKER-4wX"
secret_text = st.builds(
    lambda pre, post: f"{pre}{MARKER}{post}", st.text(max_size=5), st.text(max_size=5)
)
secret_values = st.recursive(
    secret_text | json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(secret_text, inner, max_size=3),
    max_leaves=6,
).filter(lambda v: MARKER in json.dumps(v))


@pytest.mark.redis
def test_no_argument_text_reaches_the_store_or_the_log(
    redis_server: RedisServer, dedup_log: DedupLog
) -> None:
    """Publish and duplicate calls carrying a marker: it is nowhere in keys, values or logs."""
    client = redis_server.client(STATE_DB)
    f = make_task(dedup_store=redis_server.url(STATE_DB), dedup_metrics_flush_interval=0)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(value=secret_values, raise_=st.booleans())
    def publish_twice(value: Any, raise_: bool) -> None:
        client.flushdb()
        first = f.apply_async((value,), {"b": [MARKER]})
        assert MARKER not in str(first.deduplication_key)
        try:
            on_duplicate = "raise" if raise_ else "existing"
            again = f.apply_async((value,), {"b": [MARKER]}, on_duplicate=on_duplicate)
            assert again.deduplicated is True and MARKER not in repr(again)
        except DuplicateTaskError as exc:
            assert MARKER not in str(exc) and MARKER not in repr(exc.key)
        for key in client.scan_iter():
            assert MARKER.encode() not in key
            assert MARKER.encode() not in dump(client, key)

    publish_twice()
    lines = [record.getMessage() for record in dedup_log.records]
    assert lines and not [line for line in lines if MARKER in line]
    client.close()


def dump(client: redis.Redis, key: bytes) -> bytes:
    """Every byte a key of the store holds (locks and counters are hashes, markers strings)."""
    kind = client.type(key)
    parts: list[Any]
    if kind == b"hash":
        parts = [field for pair in client.hgetall(key).items() for field in pair]
    elif kind == b"string":
        parts = [client.get(key) or b""]
    else:
        raise AssertionError(f"the store wrote a {kind!r} at {key!r}")
    return b"".join(bytes(part) for part in parts)


# -- the stores against the model --------------------------------------------

KEYS = [f"celery-dedup:sm:{name}" for name in ("k1", "k2", "k3")]
OWNERS = ["o1", "o2", "o3", "o4"]
#: every lock and marker the machine writes outlives the run, except through ``expire``
LONG = 600.0


@dataclass
class Clock:
    """The model's time: moves only when the machine expires a lock."""

    now: float

    def __call__(self) -> float:
        return self.now


def same(real: Lock | None, model: Lock | None) -> bool:
    """Two answers name the same holder (times differ by design)."""
    if real is None or model is None:
        return real is model
    return (real.owner, real.task_id, real.task_name, real.policy, real.started) == (
        model.owner, model.task_id, model.task_name, model.policy, model.started,
    )


def held(store: LockStore) -> list[tuple[str, str]]:
    """Every live lock of the machine's keys, as ``(key, owner)``."""
    return sorted((lock.key, lock.owner) for lock in store.scan("celery-dedup:sm:"))


def machine_for(
    store: LockStore, flush: Callable[[], Any], *, scans: bool, expiry: float | None
) -> type[RuleBasedStateMachine]:
    """A state machine comparing ``store`` with ``MemoryStore``.

    ``expiry``: seconds after which a lock extended to 1 ms is certainly
    gone (``None``: the store's TTLs are too coarse to expire one in a test).
    """

    class StoreMachine(RuleBasedStateMachine):
        owners = Bundle("owners")

        def __init__(self) -> None:
            super().__init__()
            flush()
            self.clock = Clock(time.time())
            self.model = MemoryStore(clock=self.clock)
            self.real = store

        @initialize(target=owners)
        def first_owner(self) -> str:
            return OWNERS[0]

        @rule(target=owners, owner=st.sampled_from(OWNERS))
        def another_owner(self, owner: str) -> str:
            return owner

        @staticmethod
        def meta(owner: str, started: bool = False) -> dict[str, str]:
            return {
                "task_name": "sm.task",
                "policy": "success",
                "task_id": f"id-{owner}",
                "started": "1" if started else "",
            }

        @rule(key=st.sampled_from(KEYS), owner=owners, started=st.booleans())
        def acquire(self, key: str, owner: str, started: bool) -> None:
            meta = self.meta(owner, started)
            real = self.real.acquire(key, owner, LONG, meta)
            assert same(real, self.model.acquire(key, owner, LONG, meta))

        @rule(key=st.sampled_from(KEYS), owner=owners)
        def release(self, key: str, owner: str) -> None:
            assert self.real.release(key, owner) == self.model.release(key, owner)

        @rule(key=st.sampled_from(KEYS), owner=owners)
        def extend(self, key: str, owner: str) -> None:
            assert self.real.extend(key, owner, LONG) == self.model.extend(key, owner, LONG)

        @rule(key=st.sampled_from(KEYS), owner=owners)
        def take_over(self, key: str, owner: str) -> None:
            meta = self.meta(owner)
            real = self.real.take_over(key, owner, LONG, meta)
            assert same(real, self.model.take_over(key, owner, LONG, meta))

        @rule(key=st.sampled_from(KEYS), owner=owners, release=st.booleans(), retake=st.booleans())
        def claim(self, key: str, owner: str, release: bool, retake: bool) -> None:
            ttl = LONG if retake else None
            meta = self.meta(owner)
            real = self.real.claim(key, owner, release=release, ttl=ttl, meta=meta)
            model = self.model.claim(key, owner, release=release, ttl=ttl, meta=meta)
            assert real.outcome == model.outcome and same(real.holder, model.holder)

        @rule(key=st.sampled_from(KEYS), owner=owners)
        def revoke(self, key: str, owner: str) -> None:
            assert self.real.revoke(key, owner, LONG) == self.model.revoke(key, owner, LONG)

        @rule(key=st.sampled_from(KEYS), owner=owners)
        def unrevoke(self, key: str, owner: str) -> None:
            self.real.unrevoke(key, owner)
            self.model.unrevoke(key, owner)

        @precondition(lambda _: expiry is not None)
        @rule(key=st.sampled_from(KEYS))
        def expire(self, key: str) -> None:
            """Let the current lock of ``key`` reach its TTL (markers keep theirs)."""
            holder = self.model.get(key)
            if holder is None:
                return
            assert self.real.extend(key, holder.owner, 0.001)
            assert self.model.extend(key, holder.owner, 0.001)
            assert expiry is not None
            self.clock.now += expiry
            time.sleep(expiry)

        @invariant()
        def same_locks(self) -> None:
            for key in KEYS:
                assert same(self.real.get(key), self.model.get(key)), key
            if scans:
                assert held(self.real) == held(self.model)

    return StoreMachine


def run_machine(case: StoreCase, examples: int = 60, expiry: float | None = 0.01) -> None:
    try:
        list(case.store.scan("celery-dedup:sm:"))
        scans = True
    except ScanNotSupported:
        scans = False
    machine = machine_for(case.store, case.flush, scans=scans, expiry=expiry)
    run_state_machine_as_test(  # type: ignore[no-untyped-call]  # untyped in hypothesis
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


@pytest.fixture
def redis_case(redis_server: RedisServer) -> Iterator[StoreCase]:
    client = redis_server.client(STATE_DB)
    store = RedisStore(redis_server.client(STATE_DB))
    yield StoreCase(url=redis_server.url(STATE_DB), store=store, flush=client.flushdb)
    client.flushdb()
    client.close()
    store.close()


STORES = [
    pytest.param("redis_case", marks=pytest.mark.redis, id="redis"),
    pytest.param("store_redis_cluster", marks=pytest.mark.redis_cluster, id="redis-cluster"),
    pytest.param("store_sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("store_postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("store_mysql", marks=pytest.mark.mysql, id="mysql"),
    pytest.param("store_memcached", marks=pytest.mark.memcached, id="memcached"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fixture", STORES)
def test_store_behaves_like_the_memory_model(fixture: str, request: pytest.FixtureRequest) -> None:
    case: StoreCase = request.getfixturevalue(fixture)
    # memcached counts TTLs in whole seconds on its own clock: no expiry in a test.
    run_machine(case, expiry=None if fixture == "store_memcached" else 0.01)


def test_the_machine_catches_a_store_that_ignores_owners() -> None:
    """The machine is not vacuous: a store whose release skips the owner check fails it."""

    class Careless(MemoryStore):
        def release(self, key: str, owner: str) -> bool:
            holder = self.get(key)
            return holder is not None and super().release(key, holder.owner)

    careless = Careless()
    case = StoreCase(url="memory://", store=careless, flush=careless.clear)
    with pytest.raises(AssertionError):
        run_machine(case, examples=100)

