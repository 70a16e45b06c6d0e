"""Recording a run: producers, worker signals and task bodies write to a separate Redis.

The recorder lives on its own redis-server, so a test can kill, pause or
empty the lock store and the broker without losing the trace. Each record is
one JSON object pushed to a list; ``Recorder.trace()`` reads them back as a
``model.Trace``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
from celery.signals import (
    before_task_publish,
    task_postrun,
    task_prerun,
    task_received,
    task_revoked,
    worker_ready,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from celery_dedup import CancelTimeout, DuplicateTaskError, dedup_key_for, otel
from celery_dedup.header import HEADER
from celery_dedup.options import pop_call_options
from celery_dedup.signals import task_observed, task_skipped
from celery_dedup.stores.base import LockStore
from celery_dedup.worker import header_in

from .model import (
    Call,
    Event,
    Finding,
    Holding,
    Revoke,
    Scan,
    Seen,
    SpanRecord,
    Trace,
    check,
    unfinished,
    unfinished_observed,
)

__all__ = [
    "TASK_PREFIX",
    "Producer",
    "Recorder",
    "Scanner",
    "install_tracing",
    "install_worker_probes",
    "poll",
    "scan_once",
]

#: Only tasks whose name starts with this are recorded.
TASK_PREFIX = "rel."

_LISTS = ("calls", "revokes", "events", "scans", "spans")


class Recorder:
    """The run's records in a Redis of their own."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url)

    def _push(self, name: str, record: Mapping[str, Any]) -> None:
        self.client.rpush(f"rel:{name}", json.dumps(record))

    def call(self, call: Call) -> None:
        """Record one ``apply_async``."""
        self._push("calls", asdict(call))

    def revoke(self, revoke: Revoke) -> None:
        """Record one ``celery_dedup.revoke``."""
        self._push("revokes", asdict(revoke))

    def event(self, event: Event) -> None:
        """Record something seen on a worker."""
        self._push("events", asdict(event))

    def span(self, span: SpanRecord) -> None:
        """Record one finished span carrying celery-dedup's decision."""
        self._push("spans", asdict(span))

    def scan(self, scan: Scan) -> None:
        """Record one scan of the store."""
        self._push("scans", asdict(scan))

    def next_run(self, token: str, retries: int) -> int:
        """Count a start of one try of one message; 1 for its first run."""
        return int(self.client.incr(f"rel:runs:{token}:{retries}"))

    def mark(self, name: str, value: Mapping[str, Any]) -> None:
        """Record a marker (a worker became ready...)."""
        self._push(f"mark:{name}", value)

    def marks(self, name: str) -> list[dict[str, Any]]:
        """Every marker recorded under ``name``."""
        return [json.loads(raw) for raw in self.client.lrange(f"rel:mark:{name}", 0, -1)]

    def events(
        self, kind: str | None = None, *, token: str | None = None, task_id: str | None = None
    ) -> list[Event]:
        """The worker records so far, of ``kind`` for ``token``/``task_id`` when given."""
        events = [Event(**json.loads(raw)) for raw in self.client.lrange("rel:events", 0, -1)]
        return [
            e
            for e in events
            if (kind is None or e.kind == kind)
            and (token is None or e.token == token)
            and (task_id is None or e.task_id == task_id)
        ]

    def trace(self) -> Trace:
        """Everything recorded so far."""
        raw = {name: self.client.lrange(f"rel:{name}", 0, -1) for name in _LISTS}
        return Trace(
            calls=[Call(**json.loads(r)) for r in raw["calls"]],
            revokes=[Revoke(**json.loads(r)) for r in raw["revokes"]],
            events=[Event(**json.loads(r)) for r in raw["events"]],
            scans=[_scan(json.loads(r)) for r in raw["scans"]],
            spans=[SpanRecord(**json.loads(r)) for r in raw["spans"]],
        )

    def drained(
        self,
        timeout: float,
        logs: Callable[[], Sequence[str]] = lambda: (),
        excused: Callable[[Holding], bool] = lambda _: False,
        dump: Path | None = None,
    ) -> Trace:
        """The trace once every published message (and every call observe published
        anyway) is final, polled each second.

        On a timeout the assertion names each unfinished message with its
        events and the worker log lines that mention its task id (``logs``:
        the workers' log texts), so a stuck or lost message can be told from
        a slow machine. ``excused`` messages are not waited for (a fault that
        loses messages as plain Celery does: the caller judges them). On a
        timeout the trace so far is written to ``dump``.
        """

        def drained() -> bool:
            return all(excused(h) for h in waited_for(self.trace()))

        try:
            poll(drained, timeout, interval=1.0, what="queue drained")
        except AssertionError as exc:
            where = ""
            if dump is not None:
                dump.write_text(self.trace().to_json())
                where = f"\ntrace: {dump}"
            raise AssertionError(f"{exc}\n{self.diagnose(logs())}{where}") from None
        return self.trace()

    def diagnose(self, logs: Sequence[str] = (), limit: int = 10) -> str:
        """The unfinished messages, their events and their log lines, for a failure message."""
        left = waited_for(self.trace())
        lines = [f"{len(left)} unfinished messages; the first {min(limit, len(left))}:"]
        for holding in left[:limit]:
            call = holding.call
            lines.append(f"* {call.task_id} key {call.key} at {call.t0:.2f} until {call.until}")
            lines.extend(
                f"    {e.t:.2f} {e.kind} {e.outcome} retries={e.retries} pid={e.pid}"
                for e in sorted(holding.events, key=lambda e: e.t)
            )
            lines.extend(
                f"    log: {line.strip()[:300]}"
                for text in logs
                for line in text.splitlines()
                if call.task_id in line
            )
        return "\n".join(lines)

    def settled(self, timeout: float = 60) -> Trace:
        """The trace once every published message has a final record."""
        poll(lambda: not waited_for(self.trace()), timeout, interval=0.2, what="messages final")
        return self.trace()

    def findings(
        self, timeout: float = 60, ttl_slack: float = 0.0, max_receptions: int | None = None
    ) -> list[Finding]:
        """What the checker finds once every published message is final."""
        return check(self.settled(timeout), ttl_slack=ttl_slack, max_receptions=max_receptions)

    def clear(self) -> None:
        """Forget every record."""
        self.client.flushdb()

    def close(self) -> None:
        """Close the client."""
        self.client.close()


def _scan(raw: Mapping[str, Any]) -> Scan:
    return Scan(raw["t0"], raw["t1"], tuple(Seen(**lock) for lock in raw["locks"]))


# -- worker side -----------------------------------------------------------


def token_of(task: Any, task_id: str) -> str:
    """The owner token of the running message (``guard:`` + id without a header)."""
    header = task.dedup_header(task_id) if hasattr(task, "dedup_header") else None
    if header is not None and header.token:
        return str(header.token)
    return "guard:" + task_id


def body_event(task: Any, recorder: Recorder, kind: str, **fields: Any) -> Event:
    """Record ``kind`` from inside the body of ``task``'s current run.

    ``seq`` (a field) names the call whose arguments the run carries.
    """
    t = time.time()
    request = task.request
    event = Event(
        kind=kind,
        token=token_of(task, str(request.id)),
        task_id=str(request.id),
        t=t,
        retries=int(request.retries or 0),
        pid=os.getpid(),
        fence=int(getattr(request, "dedup_fence", None) or 0),
        traced=otel.active(),
        **fields,
    )
    recorder.event(event)
    return event


def install_worker_probes(recorder: Recorder) -> None:
    """Record ``task_received``, ``task_prerun``, ``task_postrun``, ``task_revoked``,
    ``task_skipped``.

    Connect after importing ``celery_dedup``: receivers run in connection
    order, so the ``revoked`` record follows celery-dedup's own release.
    """

    def recorded(sender: Any) -> bool:
        return str(getattr(sender, "name", "")).startswith(TASK_PREFIX)

    @task_prerun.connect(weak=False)
    def _prerun(sender: Any = None, task_id: str = "", **_: Any) -> None:
        if recorded(sender):
            body_event(sender, recorder, "prerun")

    @task_postrun.connect(weak=False)
    def _postrun(sender: Any = None, task_id: str = "", state: str = "", **_: Any) -> None:
        if recorded(sender):
            body_event(sender, recorder, "postrun", outcome=str(state))

    @task_skipped.connect(weak=False)
    def _skipped(sender: Any = None, reason: str = "", **_: Any) -> None:
        if recorded(sender):
            body_event(sender, recorder, "skipped", outcome=reason)

    @task_revoked.connect(weak=False)
    def _revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
        if not recorded(sender) or request is None:
            return
        t = time.time()
        header = header_in(request.headers) or header_in({HEADER: getattr(request, HEADER, None)})
        token = header.token if header is not None and header.token else "guard:" + request.id
        recorder.event(
            Event(
                kind="revoked",
                token=str(token),
                task_id=str(request.id),
                t=t,
                outcome="expired" if expired else "revoked",
                pid=os.getpid(),
            )
        )

    @task_received.connect(weak=False)
    def _received(sender: Any = None, request: Any = None, **_: Any) -> None:
        # The worker's main process, once per delivery of a message (after
        # celery-dedup screened it): how many times the broker handed it over.
        task = getattr(request, "task", None)
        if request is None or not recorded(task):
            return
        header = header_in(request.request_dict)
        token = header.token if header is not None and header.token else "guard:" + request.id
        recorder.event(
            Event(
                kind="received",
                token=str(token),
                task_id=str(request.id),
                t=time.time(),
                retries=int(request.request_dict.get("retries") or 0),
                pid=os.getpid(),
            )
        )

    @worker_ready.connect(weak=False)
    def _ready(sender: Any = None, **_: Any) -> None:
        hostname = str(getattr(sender, "hostname", ""))
        recorder.mark("ready", {"hostname": hostname, "pid": os.getpid(), "t": time.time()})


# -- spans -----------------------------------------------------------------


def install_tracing(recorder: Recorder) -> None:
    """OpenTelemetry's Celery instrumentation in this process, its spans into ``recorder``.

    Call it before the worker forks its pool (children inherit the
    instrumentation's receivers) and before ``install_worker_probes``: the
    instrumentation's ``task_postrun`` receiver ends (and so records) a run's
    span before the probe records the run final. Spans are exported as
    they end (``SimpleSpanProcessor``), so none is lost with its process.
    """
    from opentelemetry import trace
    from opentelemetry.instrumentation import celery as instrumentation
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_SpanRecorder(recorder)))
    trace.set_tracer_provider(provider)
    instrumentor: Any = instrumentation.CeleryInstrumentor  # (untyped)
    instrumentor().instrument(tracer_provider=provider)


def _dedup_attributes(attributes: Any) -> dict[str, object]:
    prefix = otel.ATTRIBUTE_PREFIX
    return {
        k[len(prefix):]: v for k, v in dict(attributes or {}).items() if k.startswith(prefix)
    }


class _SpanRecorder(SpanExporter):
    """A span exporter writing the ``celery_dedup.*`` part of ``rel.*`` spans to the recorder."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            attributes = _dedup_attributes(span.attributes)
            if not attributes or "/" + TASK_PREFIX not in span.name:
                continue
            self.recorder.span(
                SpanRecord(
                    name=span.name,
                    message_id=str(dict(span.attributes or {}).get("messaging.message.id", "")),
                    pid=os.getpid(),
                    t=(span.end_time or 0) / 1e9,
                    attributes=attributes,
                    events=[
                        {"name": e.name, "attributes": _dedup_attributes(e.attributes)}
                        for e in span.events
                    ],
                )
            )
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to flush: every span is written as it ends."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing to flush."""
        return True


# -- producer side ---------------------------------------------------------

_published = threading.local()


@before_task_publish.connect(weak=False)
def _remember_publish(headers: Mapping[str, Any] | None = None, **_: Any) -> None:
    """The id and owner token of the message about to be published (this thread)."""
    header = header_in(headers)
    token = header.token if header is not None and header.token else ""
    _published.last = (str((headers or {}).get("id", "")), str(token))
    tokens = getattr(_published, "tokens", None)
    if tokens is not None:  # a bulk call: every item's publish
        tokens[_published.last[0]] = _published.last[1]


@task_observed.connect(weak=False)
def _remember_observed(task_id: str = "", **_: Any) -> None:
    """The id of the call ``dedup_mode="observe"`` published anyway (this thread)."""
    _published.observed = task_id
    observed = getattr(_published, "observed_many", None)
    if observed is not None:  # a bulk call: every item observe published anyway
        observed.add(task_id)


class Producer:
    """Calls ``apply_async`` and records what it saw."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        #: the record of the last call
        self.last: Call | None = None

    def _record(self, call: Call) -> None:
        self.last = call
        self.recorder.call(call)

    def call(
        self,
        task: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        seq: str = "",
        **options: Any,
    ) -> Any:
        """``task.apply_async(args, kwargs, **options)``, recorded; re-raises its errors.

        ``seq`` names the call in the record (its plan carries it to the body).
        A ``CancelTimeout`` is recorded as outcome ``cancel_timeout``.
        """
        common = self._common(task, args, kwargs, seq, options)
        _published.last = None
        _published.observed = None
        t0 = time.time()
        if options.get("expires") is not None:
            common["expires_at"] = t0 + float(options["expires"])
        try:
            result = task.apply_async(args, kwargs, **options)
        except DuplicateTaskError as exc:
            self._record(
                Call(t0=t0, t1=time.time(), outcome="raised", task_id=exc.existing_task_id,
                     **common)
            )
            raise
        except CancelTimeout:
            # Nothing published, no lock held: the caller saw the refusal.
            self._record(
                Call(t0=t0, t1=time.time(), outcome="cancel_timeout", task_id="", **common)
            )
            raise
        except Exception:
            t1 = time.time()
            task_id, token = _published.last or ("", "")
            self._record(
                Call(t0=t0, t1=t1, outcome="failed", task_id=task_id, token=token, **common)
            )
            raise
        t1 = time.time()
        if getattr(_published, "observed", None) == result.id:
            # Published anyway, without a lock: its message must run (``check_observed``).
            self._record(Call(t0=t0, t1=t1, outcome="observed", task_id=result.id, **common))
            return result
        if result.deduplicated:
            self._record(
                Call(t0=t0, t1=t1, outcome="deduplicated", task_id=result.id, **common)
            )
        else:
            task_id, token = _published.last or (result.id, "")
            self._record(
                Call(t0=t0, t1=t1, outcome="published", task_id=task_id, token=token, **common)
            )
        return result

    def call_many(
        self, task: Any, calls: Sequence[tuple[Sequence[Any], str, Mapping[str, Any]]]
    ) -> Any:
        """``enqueue_many(per_item=True)`` of ``(args, seq, options)`` calls, each recorded
        as a call of its own over the whole bulk call's time (``bulk=True``)."""
        from celery_dedup import ItemStatus, enqueue_many

        commons = [
            {**self._common(task, args, None, seq, options), "bulk": True}
            for args, seq, options in calls
        ]
        _published.tokens = {}
        _published.observed_many = set()
        t0 = time.time()
        for common, (_, _, options) in zip(commons, calls, strict=True):
            if options.get("expires") is not None:
                common["expires_at"] = t0 + float(options["expires"])
        try:
            outcomes = enqueue_many(
                [task.s(*args).set(**options) for args, _, options in calls],
                per_item=True,
                app=task.app,
            )
        finally:
            tokens, _published.tokens = _published.tokens, None
            observed, _published.observed_many = _published.observed_many, None
        t1 = time.time()
        for common, outcome in zip(commons, outcomes, strict=True):
            status, error, result = outcome.status, outcome.error, outcome.result
            if status is ItemStatus.PUBLISHED and result.id in observed:
                # Published anyway, without a lock: its message must run (``check_observed``).
                self._record(Call(t0=t0, t1=t1, outcome="observed", task_id=result.id,
                                  **common))  # fmt: skip
            elif status is ItemStatus.PUBLISHED:
                task_id, token = result.id, tokens.get(result.id, "")
                self._record(Call(t0=t0, t1=t1, outcome="published", task_id=task_id,
                                  token=token, **common))  # fmt: skip
            elif status is ItemStatus.DUPLICATE:
                self._record(Call(t0=t0, t1=t1, outcome="deduplicated", task_id=result.id,
                                  **common))  # fmt: skip
            elif isinstance(error, DuplicateTaskError):
                self._record(Call(t0=t0, t1=t1, outcome="raised",
                                  task_id=error.existing_task_id, **common))  # fmt: skip
            elif isinstance(error, CancelTimeout):
                self._record(Call(t0=t0, t1=t1, outcome="cancel_timeout", task_id="", **common))
            else:
                self._record(Call(t0=t0, t1=t1, outcome="failed", task_id="", **common))
        return outcomes

    @staticmethod
    def _common(
        task: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        seq: str,
        options: Mapping[str, Any],
    ) -> dict[str, Any]:
        """The fields of a call's record known before it is made."""
        call = task.dedup_config().resolve(pop_call_options(dict(options)))
        key = dedup_key_for(task, args, kwargs, **options) or ""
        countdown = float(options.get("countdown") or 0.0)
        # An observing call never takes a key over: it acquires, or is published anyway.
        observing = call.mode.value == "observe"
        policy = "existing" if observing else call.on_duplicate.value
        common: dict[str, Any] = {
            "traced": otel.active(),
            "key": key,
            "until": call.unique_until.value,
            "unique_for": float(call.unique_for or 0.0),
            # keep_last and cancel_running take the lock over as replace does
            # (keep_last adds a run gate; cancel_running waits for a running holder).
            "replace": policy in ("replace", "keep_last", "cancel_running"),
            "keep_last": policy == "keep_last",
            "cancel": policy == "cancel_running",
            "max_wait": call.debounce_max_wait if policy == "replace" else None,
            "countdown": countdown,
            "seq": seq,
            "observe": observing,
            # The worker shortens a failed run's lock only under these policies.
            "retry_window": (
                call.retry_window if call.unique_until.value in ("success", "expiry") else None
            ),
        }
        return common

    def revoke(self, result: Any, **options: Any) -> str:
        """``celery_dedup.revoke(result)``, recorded; returns the outcome's value."""
        from celery_dedup import revoke

        t0 = time.time()
        outcome = revoke(result, **options)
        self.recorder.revoke(
            Revoke(
                key=str(result.deduplication_key),
                task_id=str(result.id),
                t0=t0,
                t1=time.time(),
                outcome=outcome.value,
            )
        )
        return str(outcome.value)


def scan_once(store: LockStore, prefix: str, recorder: Recorder) -> Scan:
    """Scan the store once and record what it held."""
    t0 = time.time()
    locks = tuple(
        Seen(key=lock.key, owner=lock.owner, task_id=lock.task_id, expires_at=lock.expires_at)
        for lock in store.scan(prefix)
    )
    scan = Scan(t0=t0, t1=time.time(), locks=locks)
    recorder.scan(scan)
    return scan


class Scanner:
    """Scans the store every ``interval`` seconds in a thread until stopped."""

    def __init__(
        self, scan: Callable[[], object], interval: float = 1.0
    ) -> None:
        self._scan = scan
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rel-scanner", daemon=True)
        self.count = 0

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._scan()
            self.count += 1

    def __enter__(self) -> Scanner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def waited_for(trace: Trace) -> list[Holding]:
    """What a drain waits for: published messages not final yet, and calls observe
    published anyway that have not run to their end (``check_observed`` judges them)."""
    return unfinished(trace) + unfinished_observed(trace)


def poll(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = ""
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what or predicate}")
        time.sleep(interval)

