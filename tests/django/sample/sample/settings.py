"""Settings of the sample project; the database comes from ``SAMPLE_DB_*`` variables.

``SAMPLE_DB_VENDOR`` is ``postgresql`` or ``mysql``; ``SAMPLE_DB_PORT`` the
server's port; ``SAMPLE_DB_POOL=1`` turns on Django's PostgreSQL pool.
"""

from __future__ import annotations

import os

SECRET_KEY = "sample-only-not-secret"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "celery_dedup.contrib.django",
    "sample",
]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

_VENDOR = os.environ.get("SAMPLE_DB_VENDOR", "postgresql")
_OPTIONS: dict[str, object] = {}
if _VENDOR == "postgresql" and os.environ.get("SAMPLE_DB_POOL"):
    _OPTIONS["pool"] = {"min_size": 1, "max_size": 4, "timeout": 10}
DATABASES = {
    "default": {
        "ENGINE": f"django.db.backends.{_VENDOR}",
        "NAME": os.environ.get("SAMPLE_DB_NAME", "sample"),
        "USER": "postgres" if _VENDOR == "postgresql" else "root",
        "HOST": "127.0.0.1",
        "PORT": os.environ.get("SAMPLE_DB_PORT", ""),
        "OPTIONS": _OPTIONS,
    }
}
if _VENDOR == "mysql":
    import pymysql

    pymysql.install_as_MySQLdb()

CELERY_BROKER_URL = "memory://"
CELERY_DEDUP_STORE = "django-db"
CELERY_DEDUP_DEFAULT_TTL = 600
