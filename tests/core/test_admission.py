"""The admission pipeline's invariants over every policy, limit, call path and id (issue 31).

A generated matrix, producer side, on Redis and PostgreSQL (call paths include
``enqueue_many(per_item=True)`` of one item, whose reported refusal is
raised by ``_call``): a first call is
published; an identical call follows its ``on_duplicate``; a call of other
arguments under the same full rate key is refused (or, on a path the canvas
rules protect, published with a countdown); a call whose publish fails
leaves nothing behind. Every case counts the messages on the broker and
reads the store: no lock, window entry or revoked marker of a refused or
failed call, rate counts exact, no member lost, no worker-side publish raising.

Every case runs under OpenTelemetry's Celery instrumentation, and its trace
must tell the same story (``_decisions``, ``celery_dedup/otel.py``): one
span per call, named ``apply_async/<task>``, whose ``celery_dedup.outcome``
is what the case saw (``published``, ``deferred`` for a delayed rate
refusal, ``duplicate`` naming its holder, ``refused``, ``unavailable``,
``failed``), one ``published``/``deferred`` span per message on the
broker, an observed call's ``would``, the key as its digest only.

Store answers: ok and duplicate (every test), refused (a full rate window),
error (a store on a closed port: it raises ``StoreUnavailable``, the
fallback decides) and broker down (the publish itself fails: a broker on a
closed port, the key's holder published by a second app on the live one).
The paths that exist only in a worker (a chain step, a retry, a publish
from a body, the concurrency limit, ``send_task``'s guard, a ``__call__``
override) run on a real worker in ``test_admission_worker.py``; Django's
``delay_on_commit`` in ``tests/django/test_admission_on_commit.py``.

Pruned, because they are provably the same code path:

* ``concurrency_limit`` runs only with random ids: no producer step reads
  it (the limit is the worker's), so the id cannot change what the
  producer does; the column proves it adds no step and loses nothing.
* the store-error and broker-down columns run with random ids and on the
  ``delay``, group member, worker-side and ``per_item`` paths: the id is fixed before
  any store round trip, and a signature or chord member goes through
  the same ``apply_async`` as ``delay`` or a group member (``canvas``
  reads ``group_id``/``chord`` alike: ``is_member``).
* callable limit keys and callable rates (``rate_limit_per_key`` a function
  of the call) run where a rate is counted (``rate_callable``), not under
  the error columns: the key and the rate are computed before the store is
  asked.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chain
from celery import _state as celery_state
from celery._state import _task_stack
from kombu.exceptions import OperationalError
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_dedup import (
    DeduplicationUnavailable,
    DedupTask,
    DuplicateTaskError,
    RateLimited,
    enqueue_many,
    inspect_lock,
    task_observed,
)
from celery_dedup.limits import rate_store_key
from celery_dedup.runtime import runtime_for
from celery_dedup.stores.base import RateSupport, revoked_marker_key
from tests.fixtures._servers import free_port
from tests.fixtures.otel import dedup_attributes, instrumented, message_id

from .conftest import AppFactory

POLICIES = ("existing", "raise", "replace", "keep_last", "cancel_running")
LIMITS = ("none", "rate", "rate_callable", "concurrency")
PATHS = (
    "delay", "signature", "chain_first", "group_member", "chord_member", "worker_side",
    "per_item",
)
IDS = ("random", "deterministic", "caller")
_names = itertools.count()
#: bodies run by eager calls: (task name, n)
eager_runs: list[tuple[str, int]] = []


def _user(user: str, n: int) -> str:
    return user


def _rate(user: str, n: int) -> str:
    return "1/h"


@pytest.fixture(params=["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_conf(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The lock store: the Redis result backend, or PostgreSQL."""
    if request.param == "redis":
        return {}
    case = request.getfixturevalue("store_postgres")
    return {"dedup_store": case.url}


@pytest.fixture(scope="module")
def traced() -> Iterator[InMemorySpanExporter]:
    """The Celery instrumentation for the whole matrix (once: it connects Celery's signals)."""
    with instrumented() as exporter:
        yield exporter


@pytest.fixture(autouse=True)
def spans(traced: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    """The case's spans (the exporter cleared); the current app restored afterwards (the
    instrumentation looks a published task up in the current app, ``_app`` sets it)."""
    previous = celery_state.default_app, celery_state._tls.current_app
    traced.clear()
    yield traced
    celery_state.default_app, celery_state._tls.current_app = previous


def _app(app_factory: AppFactory, conf: dict[str, Any]) -> Celery:
    app = app_factory(f"adm{next(_names)}", dedup_send_events=False, **conf)
    app.set_current()
    return app


def _decisions(spans: InMemorySpanExporter, job: Any) -> list[dict[str, Any]]:
    """What the trace says of ``job``'s calls, in order: each span's ``celery_dedup.*``
    attributes and, on a publish span, the message's ``id``.

    Every such span names a key by its digest only (never the raw key, never
    the arguments).
    """
    decisions = []
    for span in spans.get_finished_spans():
        if span.name != f"apply_async/{job.name}":
            continue
        attributes = dedup_attributes(span)
        digest = attributes.get("key_digest")
        assert isinstance(digest, str) and ":" not in digest, attributes
        assert not any("celery-dedup:" in str(value) for value in attributes.values())
        decisions.append({**attributes, "id": message_id(span)})
    return decisions


def _digest(job: Any, n: int) -> str:
    return _key(job, n).rsplit(":", 1)[-1]


def _task(app: Celery, policy: str, limit: str, ids: str, mode: str = "enforce") -> Any:
    # Every task has a failure cooldown (``retry_window``): it never changes what a
    # producer does (the worker matrix runs its failures).
    options: dict[str, Any] = {"on_duplicate": policy, "unique_for": 600, "retry_window": 5}
    if mode != "enforce":
        options["dedup_mode"] = mode
    if policy == "cancel_running":
        options["cancel_wait"] = 2
    if limit == "concurrency":
        options["concurrency_limit"] = 1
        options["concurrency_key"] = "{user}"
    elif limit != "none":
        # The callable form: the key and the rate are functions of the call.
        options["rate_limit_per_key"] = _rate if limit == "rate_callable" else "1/h"
        options["rate_key"] = _user if limit == "rate_callable" else "{user}"
    if ids == "deterministic":
        options["deterministic_id"] = True
    name = f"adm.job{next(_names)}"

    @app.task(base=DedupTask, shared=False, name=name, **options)
    def job(user: str, n: int) -> int:
        eager_runs.append((name, n))
        return n

    return job


class _InWorker:
    """Make ``app.current_worker_task`` answer a running parent task."""

    def __init__(self, app: Celery) -> None:
        @app.task(shared=False, name=f"adm.parent{next(_names)}")
        def parent() -> None:
            return None

        self.parent = parent

    def __enter__(self) -> None:
        self.parent.push_request(id="parent-id", called_directly=False)
        _task_stack.push(self.parent)

    def __exit__(self, *exc: object) -> None:
        _task_stack.pop()
        self.parent.pop_request()


def _call(app: Celery, job: Any, path: str, ids: str, n: int) -> Any:
    options: dict[str, Any] = {}
    if ids == "caller":
        options["task_id"] = f"caller-{job.name}-{n}"
    if path == "delay" and not options:
        return job.delay("u", n)
    if path == "signature":
        return job.s("u", n).set(**options).apply_async()
    if path == "chain_first":
        # A caller's task_id names the chain's last step (Celery's rule).
        return chain(job.si("u", n), job.si("u", n + 100)).apply_async(**options)
    if path == "group_member":
        return job.apply_async(("u", n), group_id=f"g-{job.name}", group_index=n, **options)
    if path == "chord_member":
        body = app.signature("adm.body")
        return job.apply_async(("u", n), chord=body, group_id=f"c-{job.name}", **options)
    if path == "worker_side":
        with _InWorker(app):
            return job.apply_async(("u", n), **options)
    if path == "per_item":
        # A refused or failed item is reported, not raised: raise what it reports.
        outcome = enqueue_many([job.s("u", n).set(**options)], per_item=True, app=app)[0]
        if outcome.error is not None:
            raise outcome.error
        return outcome.result
    return job.apply_async(("u", n), **options)


def _queued(app: Celery) -> int:
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        return int(client.llen(app.conf.task_default_queue))


def _etas(app: Celery) -> list[tuple[str, str | None]]:
    """The id and ETA of every message on the broker, oldest first (kombu pushes left)."""
    with app.connection_for_write() as conn:
        client = conn.default_channel.client
        raw = client.lrange(app.conf.task_default_queue, 0, -1)
    headers = [json.loads(body)["headers"] for body in reversed(raw)]
    return [(h["id"], h.get("eta")) for h in headers]


def _window(app: Celery, job: Any) -> int:
    store = runtime_for(app).store
    assert isinstance(store, RateSupport)
    key = rate_store_key("celery-dedup", job.name, "u")
    return store.rate_window(key, 1, 3600).count


def _protected(path: str) -> bool:
    return path in ("group_member", "chord_member", "worker_side")


def _rated(limit: str) -> bool:
    return limit in ("rate", "rate_callable")


def _key(job: Any, n: int) -> str:
    key = job.dedup_key(("u", n), {}, job.dedup_config().default_call)
    assert key is not None
    return str(key)


def _cases() -> Iterator[Any]:
    for policy, limit, path, ids in itertools.product(POLICIES, LIMITS, PATHS, IDS):
        if limit == "concurrency" and ids != "random":
            continue  # no producer step reads the concurrency limit (module docstring)
        yield pytest.param(policy, limit, path, ids, id=f"{policy}-{limit}-{path}-{ids}")


@pytest.mark.parametrize(("policy", "limit", "path", "ids"), list(_cases()))
def test_refused_call_leaves_nothing_and_loses_nothing(
    app_factory: AppFactory, store_conf: dict[str, Any], spans: InMemorySpanExporter,
    policy: str, limit: str, path: str, ids: str,
) -> None:
    """A call refused by its rate leaves no lock, window entry or revoked marker; a protected
    path is published (delayed) instead of refused or raising; counts are exact."""
    app = _app(app_factory, store_conf)
    job = _task(app, policy, limit, ids)
    first = _call(app, job, path, ids, 1)
    # (a chain answers with its last step's result, which admission never sees)
    assert getattr(first, "deduplicated", False) is False
    first_lock = inspect_lock(_key(job, 1), app=app)
    assert first_lock is not None
    published = 1
    assert _queued(app) == published

    try:
        other = _call(app, job, path, ids, 2)
    except RateLimited as exc:
        assert _rated(limit) and not _protected(path)
        assert 0 < exc.retry_after <= 3600
        # Nothing left behind: no lock for the refused call, the first keeps its own.
        assert inspect_lock(_key(job, 2), app=app) is None
        after = inspect_lock(_key(job, 1), app=app)
        assert after is not None and after.owner == first_lock.owner
        store = runtime_for(app).store
        assert store is not None
        assert store.get(revoked_marker_key(_key(job, 1), first_lock.owner)) is None
    else:
        # A different call is never answered with a handle.
        assert getattr(other, "deduplicated", False) is False
        assert not _rated(limit) or _protected(path)
        published += 1
    assert _queued(app) == published
    if _rated(limit):
        assert _window(app, job) == published  # exact: one entry per message
    # The trace: the first call published; the other published, delayed or refused.
    first_span, other_span = _decisions(spans, job)
    assert first_span["outcome"] == "published" and first_span["key_digest"] == _digest(job, 1)
    assert other_span["key_digest"] == _digest(job, 2)
    if published == 1:
        assert other_span["outcome"] == "refused" and other_span["id"] is None
        assert 0 < other_span["retry_after"] <= 3600
    else:
        assert other_span["outcome"] == ("deferred" if _rated(limit) else "published")
        assert other_span["id"] is not None and other_span["id"] != first_span["id"]
    if path != "chain_first":  # (a chain answers with its last step)
        assert first_span["id"] == first.id


@pytest.mark.parametrize(("policy", "limit", "path", "ids"), list(_cases()))
def test_observed_calls_are_published_and_leave_the_store_as_enforcing(
    app_factory: AppFactory, store_conf: dict[str, Any], spans: InMemorySpanExporter,
    policy: str, limit: str, path: str, ids: str,
) -> None:
    """``dedup_mode="observe"``: an identical call and a call over the rate are published
    (never raising), counted once each where enforcing would refuse or take over; the
    holder keeps its key unrevoked, and a refused call leaves no lock and no window entry."""
    app = _app(app_factory, store_conf)
    job = _task(app, policy, limit, ids, mode="observe")
    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    task_observed.connect(receive, weak=False)
    try:
        first = _call(app, job, path, ids, 1)
        first_lock = inspect_lock(_key(job, 1), app=app)
        assert first_lock is not None
        again = _call(app, job, path, ids, 1)
        other = _call(app, job, path, ids, 2)
    finally:
        task_observed.disconnect(receive)
    for result in (first, again, other):
        assert getattr(result, "deduplicated", False) is False
    assert _queued(app) == 3
    after = inspect_lock(_key(job, 1), app=app)
    assert after is not None and after.owner == first_lock.owner  # never taken over
    store = runtime_for(app).store
    assert store is not None
    assert store.get(revoked_marker_key(_key(job, 1), first_lock.owner)) is None
    # What enforcing refuses or takes over is counted; what the canvas rules let in is not.
    kept = path in ("group_member", "chord_member")
    over_rate = _rated(limit) and not _protected(path)
    assert len(seen) == (0 if kept else 1) + (1 if over_rate else 0)
    if over_rate:
        assert seen[-1]["would"] == "rate_limit" and seen[-1]["key"] == _key(job, 2)
        assert inspect_lock(_key(job, 2), app=app) is None
        assert _window(app, job) == 1  # only the first call is in the window
    # As enforcing: a take-over over the rate is refused by the rate first.
    takes = policy in ("replace", "keep_last") or (
        policy == "cancel_running" and path != "chain_first"
    )
    if not kept:
        expected = "deduplicate"
        if takes:
            expected = "rate_limit" if over_rate else (
                "cancel" if policy == "cancel_running" else "replace"
            )
        assert seen[0]["would"] == expected and seen[0]["key"] == _key(job, 1)
        assert seen[0]["existing_task_id"] == (
            None if expected == "rate_limit" else first_lock.task_id
        )
    # The trace: three publish spans; an observed call's says what enforcing would have done.
    decisions = _decisions(spans, job)
    # Published, or delayed (``deferred``) where the canvas rules delay a protected call
    # over the rate: as the message on the broker says (its ETA).
    messages = _etas(app)
    assert [d["id"] for d in decisions] == [message for message, _ in messages]
    assert [d["outcome"] for d in decisions] == [
        "deferred" if eta else "published" for _, eta in messages
    ]
    assert decisions[0]["outcome"] == "published"
    if not (_rated(limit) and _protected(path)):
        assert [d["outcome"] for d in decisions] == ["published"] * 3
    assert [d["key_digest"] for d in decisions] == [_digest(job, n) for n in (1, 1, 2)]
    assert [d.get("would") for d in decisions] == [
        None,
        None if kept else seen[0]["would"],
        "rate_limit" if over_rate else None,
    ]
    # Nothing taken over.
    assert not any("replaced_task_id" in d or "cancelled_task_id" in d for d in decisions)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit", LIMITS)
def test_duplicate_follows_on_duplicate_not_the_rate(
    app_factory: AppFactory, store_conf: dict[str, Any], spans: InMemorySpanExporter,
    policy: str, limit: str,
) -> None:
    """An identical call is answered per ``on_duplicate`` even when its rate window is full;
    a take-over refused by the rate leaves the holder holding, unrevoked."""
    app = _app(app_factory, store_conf)
    job = _task(app, policy, limit, "random")
    first = job.delay("u", 1)
    lock = inspect_lock(first.deduplication_key, app=app)
    assert lock is not None
    if policy == "existing":
        again = job.delay("u", 1)
        assert again.deduplicated is True and again.id == first.id
    elif policy == "raise":
        with pytest.raises(DuplicateTaskError):
            job.delay("u", 1)
    elif _rated(limit):
        with pytest.raises(RateLimited):
            job.delay("u", 1)
        after = inspect_lock(first.deduplication_key, app=app)
        assert after is not None and after.owner == lock.owner
        store = runtime_for(app).store
        assert store is not None
        assert store.get(revoked_marker_key(first.deduplication_key, lock.owner)) is None
    else:
        again = job.delay("u", 1)
        assert again.deduplicated is False and again.id != first.id
    takes_over = policy in ("replace", "keep_last", "cancel_running")
    expected = 2 if takes_over and not _rated(limit) else 1
    assert _queued(app) == expected
    if _rated(limit):
        assert _window(app, job) == 1
    holder, again_span = _decisions(spans, job)
    assert holder["outcome"] == "published" and holder["id"] == first.id
    assert again_span["key_digest"] == holder["key_digest"] == _digest(job, 1)
    if not takes_over:
        assert again_span["outcome"] == "duplicate" and again_span["id"] is None
        assert again_span["holder_id"] == first.id and again_span["policy"] == policy
    elif _rated(limit):
        assert again_span["outcome"] == "refused" and "holder_id" not in again_span
    else:
        assert again_span["outcome"] == "published" and again_span["id"] != first.id
        took = "cancelled_task_id" if policy == "cancel_running" else "replaced_task_id"
        assert again_span[took] == first.id


@pytest.mark.parametrize("limit", LIMITS)
def test_failed_publish_leaves_nothing(
    app_factory: AppFactory, store_conf: dict[str, Any], spans: InMemorySpanExporter,
    limit: str,
) -> None:
    """A publish that raises gives back its lock and its window entry: the next call publishes."""
    app = _app(app_factory, store_conf)
    job = _task(app, "existing", limit, "random")

    class Boom(Exception):
        pass

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise Boom("broker down")

    original = job.app.send_task
    job.app.send_task = broken
    try:
        with pytest.raises(Boom):
            job.delay("u", 1)
    finally:
        job.app.send_task = original
    key = job.dedup_key(("u", 1), {}, job.dedup_config().default_call)
    assert inspect_lock(key, app=app) is None
    if _rated(limit):
        assert _window(app, job) == 0
    result = job.delay("u", 1)
    assert result.deduplicated is False and _queued(app) == 1
    # The trace: the failed call says so (no span claims it published), then the publish.
    failed, published = _decisions(spans, job)
    assert failed["outcome"] == "failed" and failed["error"] == "Boom"
    assert published["outcome"] == "published" and published["id"] == result.id


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit", ("none", "rate"))
def test_duplicate_chain_is_never_dropped_silently(
    app_factory: AppFactory, store_conf: dict[str, Any], spans: InMemorySpanExporter,
    policy: str, limit: str,
) -> None:
    """A chain whose first step is held: ``replace``/``keep_last`` publish it (taking the key
    over), every other policy raises ``DuplicateTaskError`` (nothing could stand in for the
    chain's result); a take-over the rate refuses raises ``RateLimited``. Never a silent drop."""
    app = _app(app_factory, store_conf)
    job = _task(app, policy, limit, "random")
    holder = job.delay("u", 1)
    lock = inspect_lock(holder.deduplication_key, app=app)
    assert lock is not None
    flow = chain(job.si("u", 1), job.si("u", 101))
    if policy in ("replace", "keep_last") and limit == "none":
        result = flow.apply_async()
        assert getattr(result, "deduplicated", False) is False
        assert _queued(app) == 2
        taken = inspect_lock(holder.deduplication_key, app=app)
        assert taken is not None and taken.owner != lock.owner
        _, step = _decisions(spans, job)
        assert step["outcome"] == "published" and step["replaced_task_id"] == holder.id
        return
    expected = RateLimited if policy in ("replace", "keep_last") else DuplicateTaskError
    with pytest.raises(expected):
        flow.apply_async()
    _, step = _decisions(spans, job)
    if expected is RateLimited:
        assert step["outcome"] == "refused"
    else:
        assert step["outcome"] == "duplicate" and step["holder_id"] == holder.id
    assert _queued(app) == 1
    after = inspect_lock(holder.deduplication_key, app=app)
    assert after is not None and after.owner == lock.owner
    store = runtime_for(app).store
    assert store is not None
    assert store.get(revoked_marker_key(holder.deduplication_key, lock.owner)) is None
    if limit != "none":
        assert _window(app, job) == 1


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit", ("none", "rate", "rate_callable"))
@pytest.mark.parametrize("ids", IDS)
def test_eager_runs_admitted_bodies_once(
    app_factory: AppFactory, store_conf: dict[str, Any], spans: InMemorySpanExporter,
    policy: str, limit: str, ids: str,
) -> None:
    """``task_always_eager`` goes through the same admission: an admitted call's body runs
    once in the caller and releases its lock; a call over the rate raises before its body,
    leaving no lock and no window entry."""
    app = _app(app_factory, {**store_conf, "task_always_eager": True})
    job = _task(app, policy, limit, ids)
    eager_runs.clear()
    first = _call(app, job, "delay", ids, 1)
    assert first.get() == 1 and first.deduplicated is False
    assert eager_runs == [(job.name, 1)]
    assert inspect_lock(_key(job, 1), app=app) is None  # released at success
    if _rated(limit):
        with pytest.raises(RateLimited):
            _call(app, job, "delay", ids, 2)
        assert eager_runs == [(job.name, 1)]
        assert inspect_lock(_key(job, 2), app=app) is None
        assert _window(app, job) == 1
    else:
        assert _call(app, job, "delay", ids, 2).get() == 2
        assert eager_runs == [(job.name, 1), (job.name, 2)]
        assert inspect_lock(_key(job, 2), app=app) is None
    assert _queued(app) == 0
    # The trace: an eager call publishes no message (no publish span); a refusal says so.
    decisions = _decisions(spans, job)
    assert [d["outcome"] for d in decisions] == (["refused"] if _rated(limit) else [])


ERROR_PATHS = ("delay", "group_member", "worker_side", "per_item")
#: the paths a refusal raises from (``per_item``: reported per item, ``_call`` raises it)
RAISING = ("delay", "per_item")


@pytest.fixture(params=["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def dead_store(request: pytest.FixtureRequest) -> str:
    """A store URL of each kind on a port nothing listens on: every call raises
    ``StoreUnavailable`` inside the store."""
    port = free_port()
    if request.param == "redis":
        return f"redis://127.0.0.1:{port}/0"
    return f"db+postgresql+psycopg://dedup@127.0.0.1:{port}/dedup"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit", ("none", "rate"))
@pytest.mark.parametrize("path", ERROR_PATHS)
@pytest.mark.parametrize("fallback", ("open", "closed"))
def test_store_error_follows_the_fallback(
    app_factory: AppFactory, dead_store: str, spans: InMemorySpanExporter, policy: str,
    limit: str, path: str, fallback: str,
) -> None:
    """A store that does not answer: ``open`` publishes without a lock, ``closed`` raises
    ``DeduplicationUnavailable`` before publishing, except from a worker (published: the
    parent never fails for a dedup reason). Never a half-admitted call."""
    app = _app(app_factory, {"dedup_store": dead_store, "dedup_fallback": fallback})
    job = _task(app, policy, limit, "random")
    if fallback == "closed" and path != "worker_side":
        with pytest.raises(DeduplicationUnavailable):
            _call(app, job, path, "random", 1)
        assert _queued(app) == 0
        (refusal,) = _decisions(spans, job)
        assert refusal["outcome"] == "unavailable" and refusal["id"] is None
        assert refusal["error"] == "StoreUnavailable"
        return
    result = _call(app, job, path, "random", 1)
    assert getattr(result, "deduplicated", False) is False
    again = _call(app, job, path, "random", 1)  # nothing could tell it is a duplicate
    assert getattr(again, "deduplicated", False) is False
    assert _queued(app) == 2
    # The trace: both published, each saying it went without a lock.
    decisions = _decisions(spans, job)
    assert [(d["outcome"], d["fallback"]) for d in decisions] == [("published", fallback)] * 2
    assert [d["id"] for d in decisions] == [result.id, again.id]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("limit", ("none", "rate"))
@pytest.mark.parametrize("path", ERROR_PATHS)
def test_broker_down_leaves_nothing(
    app_factory: AppFactory, store_conf: dict[str, Any], spans: InMemorySpanExporter,
    policy: str, limit: str, path: str,
) -> None:
    """The broker is down (a closed port): a call that would publish raises the broker's
    error, as a plain task's call does, and leaves no lock, no window entry and no revoked
    marker; a taken-over holder (published by an app on the live broker) gets its key back.
    A duplicate answered without publishing needs no broker."""
    up = _app(app_factory, store_conf)
    down = app_factory(
        f"adm{next(_names)}",
        dedup_send_events=False,
        broker_url=f"redis://127.0.0.1:{free_port()}/0",
        task_default_queue=up.conf.task_default_queue,  # (the queue is part of the key)
        task_publish_retry=False,
        # Fail the connection at once (kombu would retry it for seconds).
        broker_transport_options={"max_retries": 1, "interval_start": 0, "interval_step": 0},
        **store_conf,
    )
    holder_job = _task(up, policy, limit, "random")
    job = _task(down, policy, limit, "random")
    job.name = holder_job.name  # (the same task in two processes' apps)
    down.tasks[job.name] = job
    holder = holder_job.delay("u", 1)
    lock = inspect_lock(holder.deduplication_key, app=up)
    assert lock is not None
    store = runtime_for(up).store
    assert store is not None
    down.set_current()  # (the instrumentation looks the task up in the current app)

    # Different arguments: it must publish, and the broker is down.
    refused = limit == "rate" and not _protected(path)
    with pytest.raises(RateLimited if refused else OperationalError):
        _call(down, job, path, "random", 2)
    assert inspect_lock(_key(job, 2), app=up) is None
    if limit == "rate":
        assert _window(up, holder_job) == 1  # the holder's entry only

    # The same arguments: answered per on_duplicate without the broker; a group member
    # (never suppressed) or a take-over must publish, and its publish fails.
    takes_over = policy in ("replace", "keep_last", "cancel_running")
    if path != "group_member" and not takes_over:
        same = "duplicate"
        if policy == "raise" and path in RAISING:
            with pytest.raises(DuplicateTaskError):
                _call(down, job, path, "random", 1)
        else:
            again = _call(down, job, path, "random", 1)
            assert again.deduplicated is True and again.id == holder.id
    elif path in RAISING and limit == "rate":
        same = "refused"
        with pytest.raises(RateLimited):  # the take-over is a new publish: over the rate
            _call(down, job, path, "random", 1)
    else:
        same = "failed"
        with pytest.raises(OperationalError):
            _call(down, job, path, "random", 1)
    # The trace: only the holder's publish says published; a failed publish says failed.
    holder_span, other, again_span = _decisions(spans, job)
    assert holder_span["outcome"] == "published" and holder_span["id"] == holder.id
    assert other["outcome"] == ("refused" if refused else "failed")
    assert again_span["outcome"] == same
    for decision in (other, again_span):
        if decision["outcome"] == "failed":
            assert decision["error"] == "OperationalError"
        if decision["outcome"] == "duplicate":
            assert decision["holder_id"] == holder.id
    after = inspect_lock(holder.deduplication_key, app=up)
    assert after is not None and after.owner == lock.owner
    assert store.get(revoked_marker_key(holder.deduplication_key, lock.owner)) is None
    if limit == "rate":
        assert _window(up, holder_job) == 1
    assert _queued(up) == 1
