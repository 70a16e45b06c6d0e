"""Settings: SQLite at ``LAZY_SQLITE``, the admin, locks in the project's database.

``LAZY_FAULTS`` (``plain`` or ``option``) installs the app ``faults``, whose
tasks ``dedup_locks check`` fails on.
"""

from __future__ import annotations

import os

SECRET_KEY = "lazy-only-not-secret"
USE_TZ = True
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_dedup.contrib.django",
    "orders",
]
if os.environ.get("LAZY_FAULTS"):
    INSTALLED_APPS.append("faults")
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "lazyproj.urls"
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
DATABASES = {
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["LAZY_SQLITE"]}
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

CELERY_BROKER_URL = "memory://"
CELERY_DEDUP_STORE = "django-db"
CELERY_DEDUP_FALLBACK = "closed"
