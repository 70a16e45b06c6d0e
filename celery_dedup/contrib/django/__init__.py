"""celery-dedup for Django: the lock model and its store, admin, system checks, command.

Add ``"celery_dedup.contrib.django"`` to ``INSTALLED_APPS``. Settings are the
app's ``dedup_*`` settings, which Celery reads from ``CELERY_DEDUP_*`` when the
project calls ``app.config_from_object("django.conf:settings", namespace="CELERY")``.
"""
