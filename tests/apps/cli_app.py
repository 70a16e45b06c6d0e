"""A small Celery app with ``DedupTask`` tasks, for in-process tests and ``celery -A``.

Run as ``celery -A tests.apps.cli_app …`` it reads its URLs from the
environment: ``DEDUP_TEST_BROKER``, ``DEDUP_TEST_BACKEND`` and
``DEDUP_TEST_STORE`` (the lock store; empty means derive it from the backend).
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_dedup import DedupTask

SYNC = "demo.sync"
SLOW = "demo.slow"


def make_app(
    broker: str | None, backend: str | None = None, store: str | None = None, **conf: object
) -> Celery:
    """A fresh app with the demo tasks, on these URLs."""
    app = Celery("cli_app", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        dedup_store=store or None,
        broker_connection_retry_on_startup=False,
        task_track_started=True,
        worker_hijack_root_logger=False,
        result_expires=3600,
        **conf,
    )

    @app.task(base=DedupTask, name=SYNC, unique_for=600, shared=False)
    def sync(user_id: int, address: str = "") -> int:
        """A task whose calls are deduplicated on its arguments."""
        return user_id

    @app.task(base=DedupTask, name=SLOW, unique_for=600, shared=False)
    def slow(seconds: float, tag: str = "") -> str:
        """Sleep ``seconds``, then return ``tag``: a holder that stays running."""
        time.sleep(seconds)
        return f"done {tag}"

    return app


app = make_app(
    os.environ.get("DEDUP_TEST_BROKER"),
    os.environ.get("DEDUP_TEST_BACKEND"),
    os.environ.get("DEDUP_TEST_STORE"),
)
