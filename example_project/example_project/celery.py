"""The project's Celery app: settings come from Django's ``CELERY_*`` settings.

With no ``REDIS_URL`` it runs on an embedded default with zero servers: the
``filesystem://`` broker (folders created here, at startup), results in the
project's SQLite via django-celery-results, and locks in the same database
(the ``django-db`` lock store, derived from the result backend).
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def make_broker_folders(celery_app: Celery) -> None:
    """Create the ``filesystem://`` broker's folders (kombu expects them to exist)."""
    if not str(celery_app.conf.broker_url or "").startswith("filesystem://"):
        return
    options = celery_app.conf.broker_transport_options or {}
    for name in ("data_folder_in", "data_folder_out", "control_folder", "processed_folder"):
        if options.get(name):
            Path(options[name]).mkdir(parents=True, exist_ok=True)


make_broker_folders(app)
