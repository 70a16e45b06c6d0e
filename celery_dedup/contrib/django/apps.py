"""The Django app of celery-dedup."""

from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

__all__ = ["CeleryDedupConfig"]


class CeleryDedupConfig(AppConfig):  # type: ignore[misc]
    """Lock model, admin page of live locks and ``CELERY_DEDUP_*`` system checks."""

    name = "celery_dedup.contrib.django"
    label = "celery_dedup"
    verbose_name = _("Celery dedup")
    # Set here so a project's DEFAULT_AUTO_FIELD never creates a migration.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the system checks."""
        from django.core import checks

        from .checks import check_settings

        checks.register(check_settings)
