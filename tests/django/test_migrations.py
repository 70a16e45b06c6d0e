"""The models and their migrations agree."""

from __future__ import annotations

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    """``makemigrations --check --dry-run`` finds nothing to write (project AutoField differs)."""
    from django.conf import settings

    assert settings.DEFAULT_AUTO_FIELD == "django.db.models.AutoField"
    call_command("makemigrations", "celery_dedup", "shop", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db
def test_migrated_tables_exist() -> None:
    """The migration creates the lock and counter tables."""
    from django.db import connection

    tables = set(connection.introspection.table_names())
    assert {"celery_dedup_lock", "celery_dedup_counter"} <= tables
