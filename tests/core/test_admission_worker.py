"""The admission matrix where a worker is involved: one shared real worker (issue 31).

Every ``on_duplicate`` x limit (none, ``rate_limit_per_key``,
``concurrency_limit``, each with a template key and fixed limit, and with a
callable key and a callable limit) x task
class (``DedupTask``, and a Flask-style base whose ``__call__`` runs
``self.run`` without ``super()``) x the paths that only exist with a
worker:

* ``chain``: a chain of three steps; the second and third are published by
  the worker (a rate-refused step is delayed, never dropped);
* ``chord``: three members and a body (no member lost, the body once);
* ``retry``: a body that retries once (the holder's republish);
* ``fail``: a body that fails (every job has a ``retry_window``): its key is
  held for the cooldown, not its hour of ``unique_for``, so the same call
  made once the cases ran is published and runs again;
* ``send_task``: a copy that bypasses ``apply_async`` while the call is
  held (the worker's guard skips it);
* ``observe``: a held call, then the same call twice with
  ``dedup_mode="observe"``: published anyway (over the rate too), the
  holder never displaced, all three run;
* ``worker_side`` (random ids, ``deterministic_id``, the caller's
  ``task_id``): a body publishing a held call twice and another call: never
  raising, each call's work run once;
* ``shared_key`` (``replace``/``keep_last``, SEEN 8): two chord members
  under one ``deduplication_key`` never displace each other: both run, the
  body runs once.

Every job sets ``fence=True``: the runs of one key that took a lock get
distinct fencing tokens. Bodies record ``(n, attempt)`` in Redis, and how many bodies of their
concurrency key run at that moment. Every case is launched first, on one
module-scoped app and thread-pool worker, each under its own user (so its
own lock, rate and concurrency keys); the fixture then waits until the
worker holds nothing (no message reserved, scheduled, running or unacked)
and each parametrized test asserts one case exactly: the recorded runs,
the results, the store (no lock left), the concurrency never exceeded.

Every case runs under OpenTelemetry's Celery instrumentation (the session's
provider, ``tests/fixtures/otel.py``; the exporter read once, when the
worker is idle), and its trace must tell the same story (``_spans_agree``):
each publish of the case's calls, from the test or from a worker (a chain's
next step, a body's publishes, a retry), has its ``apply_async/<task>`` span
saying ``published`` (``deferred`` for a rate-delayed one), ``duplicate``
naming its holder, never ``refused``/``failed``/``unavailable``; every
``run/<task>`` span whose body ran (the body marks its span) carries no
``celery_dedup.skipped``/``celery_dedup.deferred`` event, and every one
whose body did not run carries exactly one, with the reason this case
allows (the ``send_task`` copy: held by its call; a ``concurrency_limit``
deferral; a replaced holder), as the span's own ``celery_dedup.outcome``.

Pruned, as the same code path: the id dimension runs on ``worker_side``
only (on the other paths Celery freezes the ids before ``apply_async``, so
``deterministic_id`` and a caller's id never reach admission); the rate
window is one second (``1/s``) so a delayed step comes back within the run.
"""

from __future__ import annotations

import gc
import itertools
import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Task, chain, chord, states
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from celery.signals import task_postrun, task_prerun
from celery.worker import state as worker_state
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_dedup import DedupTask, dedup_key_for, inspect_lock, otel
from celery_dedup.limits import concurrency_store_key
from celery_dedup.runtime import runtime_for
from tests.fixtures.otel import dedup_attributes, instrumented, message_id
from tests.fixtures.redis import RedisServer

from .conftest import make_app, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

BROKER_DB, BACKEND_DB, RUNS_DB = 36, 37, 38
POLICIES = ("existing", "raise", "replace", "keep_last", "cancel_running")
LIMITS = ("none", "rate", "rate_callable", "concurrency", "concurrency_callable")
BASES = ("dedup", "flask")
PATHS = ("chain", "chord", "retry", "send_task", "fail", "observe")
#: every job's ``retry_window``: a failed run holds its key this long, not ``unique_for``
RETRY_WINDOW = 2
#: the ``fail`` path's ``unique_for``: far longer than the whole module runs
FAIL_UNIQUE_FOR = 3600
#: seconds the ``send_task`` path's call holds its key before it runs
SEND_TASK_HOLD = 30
IDS = ("random", "deterministic", "caller")
#: the attribute a body sets on its run span (its user): the body ran in that span
RAN = "admw.ran"


class FlaskTask(Task):  # type: ignore[type-arg]
    """Flask's documented base task: ``__call__`` runs ``self.run``, never ``super()``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class FlaskDedupTask(FlaskTask, DedupTask):
    """``FlaskTask.__call__`` is the one the class resolves (the envelope wraps it)."""


def _user_of(user: str, n: int, mode: str = "") -> str:
    return user


def _rate_of(user: str, n: int, mode: str = "") -> str:
    return "1/s"


def _limit_of(user: str, n: int, mode: str = "") -> int:
    return 1


@dataclass
class Case:
    """One launched combination, and what it left to assert."""

    base: str
    policy: str
    limit: str
    path: str
    ids: str = "random"
    results: list[AsyncResult] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def id(self) -> str:
        return f"{self.base}-{self.policy}-{self.limit}-{self.path}-{self.ids}"

    @property
    def user(self) -> str:
        return f"{self.path}-{self.ids}"


def _cases() -> list[Case]:
    cases = []
    for base, policy, limit in itertools.product(BASES, POLICIES, LIMITS):
        for path in PATHS:
            cases.append(Case(base, policy, limit, path))
        for ids in IDS:
            cases.append(Case(base, policy, limit, "worker_side", ids))
        if policy in ("replace", "keep_last"):
            cases.append(Case(base, policy, limit, "shared_key"))
    return cases


CASES = _cases()


class Deliveries:
    """Each message id's deliveries (``task_prerun``), and the ids two deliveries of which
    ran at once (the thread pool): the instrumentation's run span of such a delivery may be
    ended by the other's ``task_postrun``, or never end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: Counter[str] = Counter()
        self.active: Counter[str] = Counter()
        self.overlapped: set[str] = set()

    def prerun(self, task_id: str = "", **_: Any) -> None:
        with self.lock:
            if self.active[task_id]:
                self.overlapped.add(task_id)
            self.active[task_id] += 1
            self.count[task_id] += 1

    def postrun(self, task_id: str = "", **_: Any) -> None:
        with self.lock:
            self.active[task_id] -= 1


class Lab:
    """The shared app, its tasks and worker, and what the bodies recorded."""

    def __init__(self, redis_server: RedisServer) -> None:
        self.runs = redis_server.client(RUNS_DB)
        self.app = make_app(
            redis_server,
            "admw",
            broker_url=redis_server.url(BROKER_DB),
            result_backend=redis_server.url(BACKEND_DB),
            dedup_send_events=False,
        )
        self.jobs: dict[tuple[str, str, str], Any] = {}
        self.spans = Spans(())
        self.deliveries = Deliveries()
        #: bodies run, by message id
        self.bodies: Counter[str] = Counter()
        for base, policy, limit in itertools.product(BASES, POLICIES, LIMITS):
            self.jobs[base, policy, limit] = self._job(base, policy, limit)
        runs = self.runs

        @self.app.task(name="admw.collect", shared=False)
        def collect(values: list[int], user: str) -> int:
            runs.rpush(f"body:{user}", json.dumps(sorted(values)))
            return len(values)

        @self.app.task(name="admw.launch", shared=False)
        def launch(base: str, policy: str, limit: str, user: str, ids: str) -> list[str]:
            job = self.jobs[base, policy, limit]
            made = []
            for i, n in enumerate((1, 1, 2)):
                options: dict[str, Any] = {}
                if ids == "deterministic":
                    options["deterministic_id"] = True
                elif ids == "caller":
                    options["task_id"] = f"{user}-{base}-{policy}-{limit}-{i}"
                # A held first call: its message waits for its ETA while the
                # second arrives (never raising, whatever on_duplicate says).
                countdown = 3 if n == 1 else None
                made.append(job.apply_async((user, n), countdown=countdown, **options).id)
            return made

        self.collect, self.launch = collect, launch

    def _job(self, base: str, policy: str, limit: str) -> Any:
        options: dict[str, Any] = {
            "on_duplicate": policy, "unique_for": 60, "bind": True, "retry_window": RETRY_WINDOW,
            "fence": True,
        }  # fmt: skip
        if policy == "cancel_running":
            options["cancel_wait"] = 5
        # The callable forms: the key and the limit are functions of the call.
        per_call = limit.endswith("callable")
        if limit.startswith("rate"):
            options["rate_limit_per_key"] = _rate_of if per_call else "1/s"
            options["rate_key"] = _user_of if per_call else "{user}"
        elif limit.startswith("concurrency"):
            options["concurrency_limit"] = _limit_of if per_call else 1
            options["concurrency_key"] = _user_of if per_call else "{user}"
            options["concurrency_backoff"] = 0.2
        name = f"admw.{base}.{policy}.{limit}"
        runs, bodies, lock = self.runs, self.bodies, self.deliveries.lock

        @self.app.task(
            base=FlaskDedupTask if base == "flask" else DedupTask,
            shared=False,
            name=name,
            **options,
        )
        def job(self: Any, user: str, n: int, mode: str = "") -> int:
            attempt = int(self.request.retries or 0)
            active = f"active:{name}:{user}"
            runs.rpush(f"conc:{name}:{user}", runs.incr(active))
            # The run span (the instrumentation's, current in the body): its body ran.
            trace.get_current_span().set_attribute(RAN, user)
            with lock:
                bodies[self.request.id] += 1
            try:
                runs.rpush(f"runs:{name}:{user}", json.dumps([n, attempt]))
                fence = getattr(self.request, "dedup_fence", None)  # None: a run with no lock
                runs.rpush(f"fences:{name}:{user}", json.dumps([n, fence]))
                time.sleep(0.05)  # (bodies of one key overlap unless limited)
            finally:
                runs.decr(active)
            if mode == "retry" and attempt == 0:
                raise self.retry(countdown=0.2)
            if mode == "fail":
                raise ValueError("fail")
            return n

        return job

    def start(self, case: Case) -> None:
        """Publish ``case``'s calls (from here, or from a body for ``worker_side``)."""
        job, user = self.jobs[case.base, case.policy, case.limit], case.user
        try:
            if case.path == "chain":
                case.results.append(
                    chain(job.si(user, 1), job.si(user, 2), job.si(user, 1)).apply_async()
                )
            elif case.path == "chord":
                members = [job.s(user, n) for n in (1, 2, 3)]
                case.results.append(chord(members)(self.collect.s(f"{job.name}:{user}")))
            elif case.path == "shared_key":
                members = [job.s(user, n).set(deduplication_key=user) for n in (1, 2)]
                case.results.append(chord(members)(self.collect.s(f"{job.name}:{user}")))
            elif case.path == "retry":
                case.results.append(job.delay(user, 1, "retry"))
            elif case.path == "fail":
                case.results.append(job.apply_async((user, 1, "fail"), unique_for=FAIL_UNIQUE_FOR))
            elif case.path == "observe":
                case.results.append(job.apply_async((user, 1), countdown=3))
                case.results += [
                    job.apply_async((user, 1), dedup_mode="observe") for _ in range(2)
                ]
            elif case.path == "send_task":
                # Held long enough that the copy is handled while it holds the key,
                # however long the worker's backlog of every case's messages is.
                case.results.append(job.apply_async((user, 1), countdown=SEND_TASK_HOLD))
                case.results.append(self.app.send_task(job.name, args=[user, 1]))
            else:
                case.results.append(
                    self.launch.delay(case.base, case.policy, case.limit, user, case.ids)
                )
        except BaseException as exc:  # asserted by the case's own test
            case.error = exc

    def recorded(self, case: Case, prefix: str) -> list[Any]:
        name = self.jobs[case.base, case.policy, case.limit].name
        key = f"{prefix}:{name}:{case.user}"
        return [json.loads(raw) for raw in self.runs.lrange(key, 0, -1)]

    def idle(self) -> bool:
        """Nothing left anywhere: queue, unacked, reserved (ETA included) or running."""
        with self.app.connection_for_write() as conn:
            client = conn.default_channel.client
            waiting = client.llen(self.app.conf.task_default_queue) + client.hlen("unacked")
        return not waiting and not worker_state.reserved_requests and not (
            worker_state.active_requests
        )


class Spans:
    """The module's finished spans (read once), by what a case looks them up by."""

    def __init__(self, spans: Iterable[ReadableSpan]) -> None:
        #: ``apply_async/<task>`` spans carrying a decision, by task and key digest (a
        #: digest is of the key's text: the same ``deduplication_key`` or concurrency
        #: key of two tasks has one)
        self.decisions: dict[tuple[str, str], list[ReadableSpan]] = defaultdict(list)
        #: ``run/<task>`` spans, by message id
        self.runs: dict[str, list[ReadableSpan]] = defaultdict(list)
        #: message ids a worker skipped or deferred, by task and key digest
        self.skipped: dict[tuple[str, str], set[str]] = defaultdict(set)
        for span in sorted(spans, key=lambda s: s.start_time or 0):
            attributes = dedup_attributes(span)
            message = message_id(span)
            task = span.name.split("/", 1)[-1]
            digest = str(attributes.get("key_digest", ""))
            if span.name.startswith("apply_async/") and attributes:
                self.decisions[task, digest].append(span)
            elif span.name.startswith("run/") and message is not None:
                self.runs[message].append(span)
                if attributes:
                    self.skipped[task, digest].add(message)


@pytest.fixture(scope="module")
def traced() -> Iterator[InMemorySpanExporter]:
    """The Celery instrumentation for the whole module (the worker's runs and publishes too)."""
    with instrumented() as exporter:
        yield exporter


@pytest.fixture(scope="module")
def lab(redis_server: RedisServer, traced: InMemorySpanExporter) -> Iterator[Lab]:
    """Every case launched on one worker, run to the end; the spans they left."""
    redis_server.flush(BROKER_DB, BACKEND_DB, RUNS_DB)
    lab = Lab(redis_server)
    task_prerun.connect(lab.deliveries.prerun, weak=False, dispatch_uid="admw.prerun")
    task_postrun.connect(lab.deliveries.postrun, weak=False, dispatch_uid="admw.postrun")
    with start_worker(
        lab.app,
        pool="threads",
        concurrency=8,
        perform_ping_check=False,
        shutdown_timeout=30,
        loglevel="WARNING",
    ):
        for case in CASES:
            lab.start(case)
        for case in CASES:
            for result in case.results:
                if case.path != "send_task":
                    result.get(timeout=120, propagate=False)
        # The last ETA (SEND_TASK_HOLD) and every delayed or deferred copy: run out.
        wait_until(lab.idle, timeout=120, interval=0.2)
        wait_until(lab.idle, timeout=120, interval=0.2)  # (a retry republished meanwhile)
        lab.spans = Spans(traced.get_finished_spans())
        traced.clear()
        yield lab
    task_prerun.disconnect(dispatch_uid="admw.prerun")
    task_postrun.disconnect(dispatch_uid="admw.postrun")
    for case in CASES:
        case.results.clear()  # (an AsyncResult let go after the server stopped reconnects)
    gc.collect()
    runtime_for(lab.app).metrics.flush()
    lab.app.close()
    lab.runs.close()
    redis_server.flush(BROKER_DB, BACKEND_DB, RUNS_DB)


def _held_keys(lab: Lab, case: Case, ns: tuple[int, ...]) -> list[Any]:
    job = lab.jobs[case.base, case.policy, case.limit]
    locks = []
    for n in ns:
        key = job.dedup_key((case.user, n), {}, job.dedup_config().default_call)
        locks.append(inspect_lock(key, app=lab.app))
    return [lock for lock in locks if lock is not None]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_worker_paths_run_each_call_once(lab: Lab, case: Case) -> None:
    """Each call's work ran exactly once (a retry: once per attempt); nothing lost, nothing
    raised in a worker, the concurrency limit never exceeded, no lock left behind."""
    assert case.error is None, repr(case.error)
    runs = sorted(lab.recorded(case, "runs"))
    # fence=True: the runs of one key that took a lock never share a token.
    fences = [(n, fence) for n, fence in lab.recorded(case, "fences") if fence is not None]
    assert fences and len(set(fences)) == len(fences), fences
    if case.path == "chain":
        assert runs == [[1, 0], [1, 0], [2, 0]]
        assert case.results[0].get(timeout=1) == 1
    elif case.path == "chord":
        assert runs == [[1, 0], [2, 0], [3, 0]]
        assert lab.recorded(case, "body") == [[1, 2, 3]]
        assert case.results[0].get(timeout=1) == 3
    elif case.path == "shared_key":
        # SEEN 8: members of one chord sharing a key never revoke each other.
        assert runs == [[1, 0], [2, 0]]
        assert lab.recorded(case, "body") == [[1, 2]]
        assert case.results[0].get(timeout=1) == 2
    elif case.path == "retry":
        assert runs == [[1, 0], [1, 1]]
        assert case.results[0].get(timeout=1) == 1
    elif case.path == "fail":
        assert case.results[0].state == states.FAILURE and runs == [[1, 0]]
        # The cooldown passed long ago, the hour of unique_for has not: published, run again.
        job = lab.jobs[case.base, case.policy, case.limit]
        again = job.apply_async((case.user, 1, "fail"), unique_for=FAIL_UNIQUE_FOR)
        assert again.deduplicated is False and again.id != case.results[0].id
        again.get(timeout=60, propagate=False)
        assert again.state == states.FAILURE
        assert sorted(lab.recorded(case, "runs")) == [[1, 0], [1, 0]]
    elif case.path == "observe":
        # Observed: never suppressed, refused, revoked or cancelled; each call ran.
        assert runs == [[1, 0]] * 3
        assert [r.get(timeout=1) for r in case.results] == [1, 1, 1]
        assert len({r.id for r in case.results}) == 3
        assert not any(r.deduplicated for r in case.results)
    elif case.path == "send_task":
        held, copy = case.results
        assert runs == [[1, 0]]  # the copy found the call held: skipped, visibly
        assert held.get(timeout=1) == 1
        assert lab.app.AsyncResult(copy.id).state == states.IGNORED
    else:
        launched = case.results[0]
        assert launched.state == states.SUCCESS  # a worker-side publish never raises
        assert runs == [[1, 0], [2, 0]]
    if case.limit.startswith("concurrency"):
        assert max(lab.recorded(case, "conc")) == 1
    assert _held_keys(lab, case, (1, 2, 3)) == []
    _spans_agree(lab, case)


def test_every_case_was_launched() -> None:
    """The matrix is the product it claims (a guard against pruning it by accident)."""
    assert len(CASES) == len(BASES) * len(LIMITS) * (
        len(POLICIES) * (len(PATHS) + len(IDS)) + 2
    )



def _digests(job: Any, case: Case) -> set[str]:
    """The key digests of every call a case can make (each mode's arguments, a shared key)."""
    keys = [
        dedup_key_for(job, (case.user, n, *mode))
        for n in (1, 2, 3)
        for mode in ((), ("retry",), ("fail",))
    ]
    keys.append(dedup_key_for(job, (case.user, 1), deduplication_key=case.user))
    return {otel.digest(key) for key in keys if key is not None}



TAKE_OVERS = ("replace", "keep_last", "cancel_running")
#: the reasons a worker may skip or defer a delivery of a case's call, by what the case has
CONCURRENCY_REASONS = ("deferred: concurrency limit 1 reached", "already ran")
TAKE_OVER_REASONS = (
    "revoked", "already ran", "deferred: the previous run of its key",
    "deferred: a copy of it is running",  # (a deterministic id: the call again is a copy)
)


def _reasons(case: Case) -> tuple[str, ...]:
    """The skip and deferral reasons (prefixes) a run span of ``case`` may carry."""
    reasons: tuple[str, ...] = ()
    if case.limit.startswith("concurrency"):
        reasons += CONCURRENCY_REASONS  # (a waiter woken and its deferred copy: one runs)
    if case.path == "send_task":
        reasons += ("unannounced duplicate",)
    if case.path == "worker_side" and case.policy in TAKE_OVERS:
        reasons += TAKE_OVER_REASONS  # the held call, taken over
    return reasons


def _came_back(span: ReadableSpan, runs: list[ReadableSpan]) -> bool:
    """A later delivery of the span's message is its retry."""
    def retries(s: ReadableSpan) -> int:
        value = dict(s.attributes or {}).get("celery.retries")
        return value if isinstance(value, int) else 0

    later = [s for s in runs if (s.start_time or 0) > (span.start_time or 0)]
    return any(retries(s) > retries(span) for s in later)


def _spans_agree(lab: Lab, case: Case) -> None:
    """The case's trace tells what happened: each publish's decision, each run's skip."""
    job = lab.jobs[case.base, case.policy, case.limit]
    digests = _digests(job, case)
    decisions = sorted(
        (s for d in digests for s in lab.spans.decisions.get((job.name, d), ())),
        key=lambda s: s.start_time or 0,
    )
    said = [{**dedup_attributes(s), "id": message_id(s)} for s in decisions]
    outcomes = [d["outcome"] for d in said]
    # Worker-side publishes never raise; a rate delays (``deferred``), never refuses.
    rated = case.limit.startswith("rate")
    allowed = {"published", "duplicate"} | ({"deferred"} if rated else set())
    assert set(outcomes) <= allowed, said
    assert all(d["key_digest"] in digests for d in said)
    published = [d["id"] for d in said if d["outcome"] != "duplicate"]
    assert None not in published, said
    if case.path in ("chain", "chord"):
        assert len(published) == len(set(published)) == 3, said
        if case.path == "chain":
            assert published[-1] == case.results[0].id
    elif case.path == "shared_key":  # never displacing each other
        assert len(set(published)) == 2 and not any("replaced_task_id" in d for d in said), said
    elif case.path == "observe":
        assert outcomes == ["published"] * 3, said
        assert [d["id"] for d in said] == [r.id for r in case.results]
        assert "would" not in said[0] and all("would" in d for d in said[1:]), said
    elif case.path == "worker_side":
        made = case.results[0].get(timeout=1)
        assert [d["id"] or d["holder_id"] for d in said] == made, said
        again = said[1]
        if case.policy in ("existing", "raise"):
            assert again["outcome"] == "duplicate" and again["holder_id"] == made[0], said
        else:
            took = "cancelled_task_id" if case.policy == "cancel_running" else "replaced_task_id"
            assert again["outcome"] != "duplicate" and again[took] == made[0], said
        assert said[0]["outcome"] == "published"
    else:  # one call from the test (a retry and a send_task copy are not calls)
        assert outcomes == ["published"] and published == [case.results[0].id], said
    # Runs: every delivery of the case's messages has its run span, its body's mark or
    # its skip (deferral) event with a reason the case allows, never both.
    slot_digests = {otel.digest(concurrency_store_key("", job.name, case.user))}
    messages = set(published) | {
        m for d in digests | slot_digests for m in lab.spans.skipped.get((job.name, d), ())
    }
    if case.path == "send_task":
        messages.add(case.results[1].id)
    reasons = _reasons(case)
    for message in messages:
        runs = [s for s in lab.spans.runs.get(message, ()) if s.name == f"run/{job.name}"]
        overlapped = message in lab.deliveries.overlapped
        if not overlapped:
            assert len(runs) == lab.deliveries.count[message], (message, len(runs))
            assert sum(RAN in (s.attributes or {}) for s in runs) == lab.bodies[message]
        for span in runs:
            events = [e for e in span.events if e.name.startswith(otel.ATTRIBUTE_PREFIX)]
            ran = dict(span.attributes or {}).get(RAN) == case.user
            if ran or (overlapped and not events):
                # (the instrumentation keeps one run span per message id: of two
                # deliveries of one id at once, one span ends early, one never does)
                assert not events and "outcome" not in dedup_attributes(span), span.to_json()
                continue
            if not events and _came_back(span, runs) and case.policy in TAKE_OVERS:
                # A replaced message waiting for its replacement to start comes back
                # as a retry (``worker._come_back``): no skip or deferral is signalled.
                continue
            # One event; rarely (a deterministic id under a concurrency limit) two alike
            # deferrals of one span, the deliveries of the id never seen overlapping.
            assert len({dedup_attributes(e).get("reason") for e in events}) == 1, span.to_json()
            assert len(events) == 1 or case.limit.startswith("concurrency"), span.to_json()
            event = events[0]
            attributes = dedup_attributes(event)
            reason = str(attributes.get("reason"))
            assert reason.startswith(reasons), (reason, reasons)
            outcome = "deferred" if reason.startswith("deferred") else "skipped"
            assert event.name == otel.ATTRIBUTE_PREFIX + outcome
            assert dedup_attributes(span)["outcome"] == outcome
            # (a concurrency deferral names the key of its slots)
            slots = reason.startswith("deferred: concurrency")
            assert attributes["key_digest"] in (slot_digests if slots else digests), attributes
    if case.path == "send_task":  # the copy: skipped, naming its held call
        (copy,) = lab.spans.runs[case.results[1].id]
        assert dedup_attributes(copy)["holder_id"] == case.results[0].id
