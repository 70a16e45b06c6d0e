"""A Celery app for prefork worker subprocesses (configured by environment variables)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from celery import Celery, Task
from celery.signals import task_success

from celery_dedup import DedupTask

app = Celery("prefork_app")
app.conf.update(
    broker_url=os.environ.get("TEST_BROKER_URL", "memory://"),
    result_backend=os.environ.get("TEST_BACKEND_URL"),
    task_default_queue=os.environ.get("TEST_QUEUE", "prefork"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(base=DedupTask, unique_for=60, unique_until="finish", time_limit=1)
def overrun(x: int) -> int:
    """Runs past its hard time limit: the pool child is killed."""
    time.sleep(10)
    return x


@app.task(base=DedupTask, unique_for=600, retry_window=30, time_limit=1)
def overrun_cooled(x: int) -> int:
    """Runs past its hard time limit under ``retry_window``: a failure's cooldown applies."""
    time.sleep(10)
    return x


@app.task(base=DedupTask, unique_for=60)
def quick(x: int) -> int:
    """Succeeds in a pool child; releases its lock there."""
    return x * 2


class FlaskStyle(Task):  # type: ignore[type-arg]
    """Flask's documented base task: ``__call__`` runs ``self.run`` itself, no ``super()``."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.run(*args, **kwargs)


class FlaskDedupTask(FlaskStyle, DedupTask):
    """The override resolves first: celery-dedup's envelope must wrap it."""


@app.task(base=FlaskDedupTask, unique_for=60, unique_until="finish")
def flask_style(x: int) -> int:
    """Fails for a negative ``x``: ``finish`` releases after success and after failure."""
    if x < 0:
        raise ValueError(x)
    return x * 3


@app.task(base=DedupTask, unique_for=60)
def cancelled_as_it_ends(x: int) -> int:
    """Its cancel signal (SIGUSR1, as ``cancel_running`` sends it) lands 0.2 s after the
    body returned, while the child stores the result and runs ``task_success``."""
    pid = os.getpid()
    threading.Timer(0.2, os.kill, (pid, signal.SIGUSR1)).start()
    return pid


@task_success.connect(sender=cancelled_as_it_ends, weak=False)
def _slow_success(**_: Any) -> None:
    time.sleep(0.6)  # the post-body work the late signal lands in


@app.task(base=DedupTask, unique_for=60)
def pid_of_child(x: int) -> int:
    """The pool child's pid."""
    return os.getpid()
