"""The Celery app, configured from Django's settings, its tasks autodiscovered."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lazyproj.settings")

app = Celery("lazyproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
