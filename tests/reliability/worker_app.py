"""``celery -A tests.reliability.worker_app worker``: the suite's app, configured from env vars."""

from __future__ import annotations

from .apps import from_env

app = from_env()
