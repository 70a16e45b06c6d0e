"""OpenTelemetry: celery-dedup's decisions on the Celery instrumentation's spans (issue 34, item 6).

The SDK's in-memory exporter around ``CeleryInstrumentor`` and a real worker,
the store Redis or PostgreSQL: a first call's publish span says ``published``, a duplicate's span
says ``duplicate`` with the holder's id, a run deferred by its concurrency
limit says so on its worker span; bodies count their runs in Redis. And the
package imports and publishes without OpenTelemetry installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery import _state as celery_state
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_dedup import DedupTask, RateLimited, otel
from tests.fixtures.otel import instrumented
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Every span of the module, celery-dedup's own included (the global provider)."""
    with instrumented() as exporter:
        yield exporter


@pytest.fixture
def traced_app(
    app_factory: AppFactory, exporter: InMemorySpanExporter, store_conf: dict[str, Any]
) -> Iterator[Celery]:
    """An app the instrumentation finds its tasks in (it looks them up in the default app),
    its locks, slots and windows on Redis or PostgreSQL."""
    app = app_factory("otel", **store_conf)
    previous = celery_state.default_app, celery_state._tls.current_app
    app.set_default()
    app.set_current()
    exporter.clear()
    yield app
    celery_state.default_app, celery_state._tls.current_app = previous


def _spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def _dedup(span: ReadableSpan) -> dict[str, Any]:
    attributes = dict(span.attributes or {})
    return {k[len(otel.ATTRIBUTE_PREFIX):]: v for k, v in attributes.items()
            if k.startswith(otel.ATTRIBUTE_PREFIX)}  # fmt: skip


def test_publish_and_duplicate_spans_carry_the_decision(
    traced_app: Celery, worker_for: Any, exporter: InMemorySpanExporter, redis_server: RedisServer
) -> None:
    runs = redis.Redis.from_url(redis_server.url(4))

    @traced_app.task(base=DedupTask, shared=False, name="otel.sync", unique_for=600)
    def sync(user: int) -> int:
        runs.rpush("otel-sync", user)
        return user

    first = sync.delay(7)
    duplicate = sync.delay(7)
    assert duplicate.deduplicated is True and duplicate.id == first.id
    worker_for(traced_app)
    assert first.get(timeout=20) == 7
    wait_until(lambda: _spans(exporter, "run/otel.sync"))

    publish, refused = _spans(exporter, "apply_async/otel.sync")
    digest = first.deduplication_key.rsplit(":", 1)[-1]
    assert _dedup(publish) == {
        "outcome": "published", "task": "otel.sync", "policy": "existing",
        "unique_until": "success", "key_digest": digest,
    }  # fmt: skip
    assert publish.kind is trace.SpanKind.PRODUCER
    assert dict(publish.attributes or {})["messaging.message.id"] == first.id
    assert _dedup(refused) == {
        "outcome": "duplicate", "task": "otel.sync", "policy": "existing",
        "unique_until": "success", "key_digest": digest, "holder_id": first.id,
    }  # fmt: skip
    # Never the raw key: the digest only.
    assert all(first.deduplication_key not in str(v) for v in _dedup(refused).values())
    (run,) = _spans(exporter, "run/otel.sync")
    assert "outcome" not in _dedup(run)  # the body ran: nothing to say
    assert runs.lrange("otel-sync", 0, -1) == [b"7"]


def test_a_deferred_run_is_visible_on_its_worker_span(
    traced_app: Celery, worker_for: Any, exporter: InMemorySpanExporter, redis_server: RedisServer
) -> None:
    runs = redis.Redis.from_url(redis_server.url(4))
    holding = threading.Event()
    go_on = threading.Event()

    @traced_app.task(base=DedupTask, shared=False, name="otel.limited", unique_for=600,
                     concurrency_limit=1, concurrency_key="{user}", concurrency_backoff=0.2)
    def limited(user: str, n: int) -> int:
        runs.rpush("otel-limited", n)
        if n == 1:
            holding.set()
            go_on.wait(20)
        return n

    first = limited.delay("ada", 1)
    worker_for(traced_app, concurrency=2)
    assert holding.wait(20)
    second = limited.delay("ada", 2)

    def deferred() -> list[ReadableSpan]:
        return [s for s in _spans(exporter, "run/otel.limited")
                if _dedup(s).get("outcome") == "deferred"]  # fmt: skip

    (span, *_) = wait_until(deferred, timeout=20)
    go_on.set()
    assert first.get(timeout=20) == 1 and second.get(timeout=20) == 2
    attributes = _dedup(span)
    assert attributes["reason"].startswith("deferred: concurrency limit 1 reached")
    assert dict(span.attributes or {})["messaging.message.id"] == second.id
    (event,) = [e for e in span.events if e.name == "celery_dedup.deferred"]
    assert dict(event.attributes or {})["celery_dedup.reason"] == attributes["reason"]
    assert sorted(runs.lrange("otel-limited", 0, -1)) == [b"1", b"2"]


def test_a_refused_call_has_a_span_of_its_own(
    traced_app: Celery, exporter: InMemorySpanExporter
) -> None:
    @traced_app.task(base=DedupTask, shared=False, name="otel.rated", unique_for=600,
                     rate_limit_per_key="1/h", rate_key="{user}")
    def rated(user: str, n: int) -> int:
        return n

    first = rated.delay("ada", 1)
    with pytest.raises(RateLimited) as refused:
        rated.delay("ada", 2)
    publish, refusal = _spans(exporter, "apply_async/otel.rated")
    assert _dedup(publish)["outcome"] == "published"
    assert dict(publish.attributes or {})["messaging.message.id"] == first.id
    attributes = _dedup(refusal)
    assert attributes["outcome"] == "refused" and "holder_id" not in attributes
    assert 0 < attributes["retry_after"] <= 3600
    assert attributes["retry_after"] == pytest.approx(refused.value.retry_after, abs=1)
    with traced_app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(traced_app.conf.task_default_queue) == 1


def test_a_delayed_publish_says_deferred(
    traced_app: Celery, exporter: InMemorySpanExporter
) -> None:
    """``on_rate_limit="delay"``: published with a countdown to its place in the window."""

    @traced_app.task(base=DedupTask, shared=False, name="otel.delayed", unique_for=600,
                     rate_limit_per_key="1/h", rate_key="{user}", on_rate_limit="delay")
    def delayed(user: str, n: int) -> int:
        return n

    first, later = delayed.delay("ada", 1), delayed.delay("ada", 2)
    spans = {dict(s.attributes or {})["messaging.message.id"]: _dedup(s)
             for s in _spans(exporter, "apply_async/otel.delayed")}  # fmt: skip
    assert spans[first.id]["outcome"] == "published"
    assert spans[later.id]["outcome"] == "deferred"


def test_an_observed_call_says_what_enforcing_would_have_done(
    traced_app: Celery, exporter: InMemorySpanExporter
) -> None:
    """``dedup_mode="observe"``: the duplicate is published; its span carries ``would``."""

    @traced_app.task(base=DedupTask, shared=False, name="otel.observed", unique_for=600,
                     dedup_mode="observe")
    def observed(user: str) -> str:
        return user

    first, again = observed.delay("ada"), observed.delay("ada")
    spans = {dict(s.attributes or {})["messaging.message.id"]: _dedup(s)
             for s in _spans(exporter, "apply_async/otel.observed")}  # fmt: skip
    assert spans[first.id]["outcome"] == "published" and "would" not in spans[first.id]
    assert spans[again.id]["outcome"] == "published"
    assert spans[again.id]["would"] == "deduplicate"


def test_the_package_works_without_opentelemetry() -> None:
    """Imported and used with every ``opentelemetry`` module blocked (as if not installed)."""
    script = textwrap.dedent(
        """
        import sys

        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError(f"blocked: {name}")
                return None

        sys.meta_path.insert(0, Blocked())
        from celery import Celery
        from celery_dedup import DedupTask, otel

        app = Celery("no-otel", set_as_current=False)
        app.conf.update(task_always_eager=True, dedup_store="memory://no-otel")

        @app.task(base=DedupTask, shared=False, unique_for=60, unique_until="expiry")
        def job(x):
            return x

        assert job.delay(1).get() == 1
        assert job.delay(1).deduplicated is True
        assert otel.active() is False
        assert not any(m.startswith("opentelemetry") for m in sys.modules)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_either_order_of_the_publish_receivers(
    traced_app: Celery, exporter: InMemorySpanExporter
) -> None:
    """Ours connected after the instrumentation's (it was instrumented first): still annotated."""
    from celery.signals import after_task_publish, before_task_publish

    receivers = (
        (before_task_publish, otel._before_publish, "before"),
        (after_task_publish, otel._after_publish, "after"),
    )
    for signal, receiver, uid in receivers:
        signal.disconnect(receiver, dispatch_uid=f"celery_dedup.otel.{uid}")
        signal.connect(receiver, weak=False, dispatch_uid=f"celery_dedup.otel.{uid}")

    @traced_app.task(base=DedupTask, shared=False, name="otel.late", unique_for=600)
    def late(user: int) -> int:
        return user

    first = late.delay(1)
    (publish,) = _spans(exporter, "apply_async/otel.late")
    assert _dedup(publish)["outcome"] == "published"
    assert dict(publish.attributes or {})["messaging.message.id"] == first.id


def test_a_failed_span_never_hides_the_publish_error(
    traced_app: Celery, exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ending the failed publish's span runs while the publish's error propagates: if the
    tracing itself breaks, the caller still gets the publish's error, and the lock is given
    back (the next call publishes)."""

    @traced_app.task(base=DedupTask, shared=False, name="otel.broken", unique_for=600)
    def job(n: int) -> int:
        return n

    class Boom(Exception):
        pass

    def broken_publish(*args: Any, **kwargs: Any) -> Any:
        raise Boom("broker down")

    def broken_tracing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("an exporter bug")

    monkeypatch.setattr(otel, "_end_failed", broken_tracing)
    original = traced_app.send_task
    monkeypatch.setattr(traced_app, "send_task", broken_publish)
    with pytest.raises(Boom):
        job.delay(1)
    monkeypatch.setattr(traced_app, "send_task", original)
    again = job.delay(1)
    assert again.deduplicated is False
    with traced_app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(traced_app.conf.task_default_queue) == 1
