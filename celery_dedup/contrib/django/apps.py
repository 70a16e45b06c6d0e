"""The Django app of celery-dedup."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

__all__ = ["CeleryDedupConfig"]

#: Django settings that change what celery-dedup resolves (``namespace="CELERY"``)
_WATCHED_PREFIXES = ("CELERY_DEDUP_", "CELERY_RESULT_BACKEND", "CELERY_BROKER_URL")


def _settings_changed(setting: str = "", **_: Any) -> None:
    """``setting_changed`` (``override_settings``): every app's next call re-reads them."""
    if not setting.startswith(_WATCHED_PREFIXES):
        return
    from ...runtime import invalidate_all

    # Every Celery app of the project, not only celery.current_app.
    invalidate_all()


class CeleryDedupConfig(AppConfig):  # type: ignore[misc]
    """Lock model, admin page of live locks and ``CELERY_DEDUP_*`` system checks."""

    name = "celery_dedup.contrib.django"
    label = "celery_dedup"
    verbose_name = _("Celery dedup")
    # Set here so a project's DEFAULT_AUTO_FIELD never creates a migration.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks and follow changes of ``CELERY_DEDUP_*`` settings."""
        from django.core import checks
        from django.core.signals import setting_changed

        from .checks import check_settings, check_store, check_tasks

        checks.register(check_settings)
        checks.register(check_tasks)
        checks.register(check_store, checks.Tags.database)
        setting_changed.connect(_settings_changed, dispatch_uid="celery_dedup.settings_changed")
