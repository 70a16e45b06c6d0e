"""The project's two Celery apps, both configured from Django's settings."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sample.settings")

app = Celery("sample")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.set_default()

#: A second app (say, a reporting queue), created after the first.
reports = Celery("sample_reports")
reports.config_from_object("django.conf:settings", namespace="CELERY")
