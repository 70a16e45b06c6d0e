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

Pruned, as the same code path: the id dimension runs on ``worker_side``
only (on the other paths Celery freezes the ids before ``apply_async``, so
``deterministic_id`` and a caller's id never reach admission); the rate
window is one second (``1/s``) so a delayed step comes back within the run.
"""

from __future__ import annotations

import gc
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Task, chain, chord, states
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from celery.worker import state as worker_state

from celery_dedup import DedupTask, inspect_lock
from celery_dedup.runtime import runtime_for
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
        runs = self.runs

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


@pytest.fixture(scope="module")
def lab(redis_server: RedisServer) -> Iterator[Lab]:
    """Every case launched on one worker, run to the end."""
    redis_server.flush(BROKER_DB, BACKEND_DB, RUNS_DB)
    lab = Lab(redis_server)
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
        yield lab
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


def test_every_case_was_launched() -> None:
    """The matrix is the product it claims (a guard against pruning it by accident)."""
    assert len(CASES) == len(BASES) * len(LIMITS) * (
        len(POLICIES) * (len(PATHS) + len(IDS)) + 2
    )

