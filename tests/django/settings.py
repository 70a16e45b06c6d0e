"""Django settings of the Django test session (``--ds=tests.django.settings``).

The example project's ``shop`` app and Celery app are under test too, so
``example_project/`` goes on ``sys.path``. The test database is a SQLite
file (not ``:memory:``) so in-process worker threads and the test share it.
A PostgreSQL alias is added at run time by ``conftest.py`` once its server
has a port (see ``docs/django.md``).
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import django
from django.db.backends.signals import connection_created

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "example_project") not in sys.path:
    sys.path.insert(0, str(ROOT / "example_project"))

_TMP = Path(tempfile.mkdtemp(prefix="celery-dedup-django-tests-"))
atexit.register(shutil.rmtree, _TMP, True)

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_celery_results",
    "celery_dedup.contrib.django",
    "shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
_WAL = "PRAGMA journal_mode=WAL;"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(_TMP / "db.sqlite3"),
        "OPTIONS": {"timeout": 30},
        "TEST": {"NAME": str(_TMP / "test.sqlite3")},
    }
}
if django.VERSION >= (5, 1):
    DATABASES["default"]["OPTIONS"]["init_command"] = _WAL
else:  # SQLite's init_command is Django 5.1+; the support matrix runs Django 4.2 too.

    def _wal(sender: Any, connection: Any, **kwargs: Any) -> None:
        if connection.vendor == "sqlite":
            connection.cursor().execute(_WAL)

    connection_created.connect(_wal, weak=False)
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Celery, read by example_project/celery.py through namespace="CELERY".
CELERY_BROKER_URL = "memory://"
CELERY_BROKER_TRANSPORT_OPTIONS = {"polling_interval": 0.05}
CELERY_RESULT_BACKEND = "django-db"
CELERY_RESULT_EXTENDED = True
CELERY_TASK_SEND_SENT_EVENT = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_DEDUP_DEFAULT_TTL = 600
