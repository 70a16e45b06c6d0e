"""The Celery app of the reliability suite, for producers and worker subprocesses alike.

One task, ``rel.work(n, plan)``: its identity is ``n`` alone
(``unique_on``), and ``plan`` says what the body does (sleep, hang on its
first runs, retry, fail), so one key can see every behaviour. The body
records its start and its end (in a ``finally``: every exit but a SIGKILL
writes one) to the recorder.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any, cast

from billiard.exceptions import SoftTimeLimitExceeded
from celery import Celery, Task

from celery_dedup import DedupTask

from .probe import Recorder, body_event, install_tracing, install_worker_probes

__all__ = [
    "SLOTS", "TRACED", "WORK", "PlannedFailure", "from_env", "make_app", "plan_slots", "work_task",
]

#: the task every scenario runs
WORK = "rel.work"

#: Environment variables a worker subprocess reads its configuration from.
CONF_ENV = "REL_CONF"
RECORDER_ENV = "REL_RECORDER"
#: the worker's name (``w1``...), for ``TRACED``
NAME_ENV = "REL_NAME"

#: a ``conf`` key (not a Celery setting): the names of the processes (workers ``w1``...,
#: producers ``p0``...) that run OpenTelemetry's Celery instrumentation, their spans
#: recorded (``probe.install_tracing``) and judged by the checker (``check_spans``)
TRACED = "rel_traced"


class PlannedFailure(Exception):
    """The failure a plan asked for."""


def run_plan(task: Any, recorder: Recorder, n: int, plan: Mapping[str, Any]) -> int:
    """What ``rel.work`` does, as ``plan`` says.

    ``sleep``: seconds of work; ``hang`` and ``hang_runs``: sleep ``hang``
    seconds instead on the first ``hang_runs`` runs of a try (to be killed
    there); ``retries`` and ``retry_countdown``: retry that many times;
    ``fail``: raise on the last try; ``seq``: the call's name in the trace.
    """
    retries = int(task.request.retries or 0)
    seq = str(plan.get("seq", ""))
    start = body_event(task, recorder, "start", seq=seq, slots=int(plan.get("slots", 0)))
    run = recorder.next_run(start.token, retries)
    outcome, countdown = "failure", 0.0
    try:
        hanging = run <= int(plan.get("hang_runs", 0))
        time.sleep(float(plan["hang"] if hanging else plan.get("sleep", 0.0)))
        if retries < int(plan.get("retries", 0)):
            outcome, countdown = "retry", float(plan.get("retry_countdown", 0.1))
        elif not plan.get("fail"):
            outcome = "success"
    except SoftTimeLimitExceeded:
        outcome = "interrupted"
        raise
    finally:
        body_event(task, recorder, "end", outcome=outcome, countdown=countdown, seq=seq)
    if outcome == "retry":
        raise task.retry(countdown=countdown)
    if outcome == "failure":
        raise PlannedFailure(f"planned failure of {n}")
    return n


#: a ``conf`` key (not a Celery setting): ``rel.work``'s class overrides ``__call__``
CALL_OVERRIDE = "rel_call_override"

#: a ``conf`` key (not a Celery setting): ``rel.work`` sets ``fence=True`` (a store
#: that issues fencing tokens); each ``start`` event records the run's token
FENCE = "rel_fence"


#: a ``conf`` key (not a Celery setting): ``rel.work`` sets ``concurrency_limit`` to a
#: callable of the call (``plan_slots``): each call's plan draws the limit of its key
SLOTS = "rel_slots"
#: the limit of a call whose plan draws none: no call of a key waits for another
UNLIMITED_SLOTS = 100


def plan_slots(n: int, plan: Mapping[str, Any]) -> int:
    """``rel.work``'s ``concurrency_limit`` for one call: its plan's ``slots``."""
    return int(plan.get("slots") or UNLIMITED_SLOTS)


class _RunsItself(Task):  # type: ignore[type-arg]
    """Flask's documented base task: ``__call__`` runs ``self.run``, never ``super()``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class CallOverrideTask(_RunsItself, DedupTask):
    """A ``DedupTask`` whose resolved ``__call__`` is an override (the envelope wraps it)."""


def make_app(
    conf: Mapping[str, Any], recorder_url: str, *, probes: bool = False, name: str = ""
) -> Celery:
    """An app with ``rel.work`` on ``conf``; ``probes`` records worker signals (workers only);
    ``name`` (``w1``, ``p0``...) traces the process when ``conf[TRACED]`` lists it.

    With ``conf[CALL_OVERRIDE]`` the task's class overrides ``__call__`` as
    Flask's base task does.
    """
    app = Celery("reliability", set_as_current=False)
    app.conf.update(
        {
            "task_default_queue": "rel",
            "broker_connection_retry_on_startup": True,
            "worker_prefetch_multiplier": 1,
            "result_expires": None,
            "task_track_started": False,
            **conf,
        }
    )
    recorder = Recorder(recorder_url)
    limits: dict[str, Any] = {}
    if conf.get(SLOTS):
        # Per key (the deduplication key), a limit each call draws: a key's
        # limit changes between its calls.
        limits = {"concurrency_limit": plan_slots, "concurrency_backoff": 0.5}

    @app.task(
        base=CallOverrideTask if conf.get(CALL_OVERRIDE) else DedupTask,
        bind=True,
        shared=False,
        name=WORK,
        unique_on=("n",),
        unique_for=30,
        max_retries=5,
        fence=bool(conf.get(FENCE)),
        **limits,
    )
    def work(self: Any, n: int, plan: dict[str, Any]) -> int:
        return run_plan(self, recorder, n, plan)

    if name and name in conf.get(TRACED, ()):
        # Before the probes (see ``install_tracing``); the app is current: the
        # instrumentation finds the task there.
        install_tracing(recorder)
        app.set_current()
    if probes:
        install_worker_probes(recorder)
    return app


def work_task(app: Celery) -> DedupTask:
    """The app's ``rel.work``."""
    return cast(DedupTask, app.tasks[WORK])


def worker_env(conf: Mapping[str, Any], recorder_url: str, name: str = "") -> dict[str, str]:
    """The environment variables ``from_env`` reads."""
    return {CONF_ENV: json.dumps(dict(conf)), RECORDER_ENV: recorder_url, NAME_ENV: name}


def from_env() -> Celery:
    """The worker subprocess's app (``tests.reliability.worker_app``)."""
    return make_app(
        json.loads(os.environ[CONF_ENV]),
        os.environ[RECORDER_ENV],
        probes=True,
        name=os.environ.get(NAME_ENV, ""),
    )
