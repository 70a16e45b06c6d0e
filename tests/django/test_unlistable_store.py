"""Operator tools on a store that cannot list its locks: a clear message.

The admin page answers 200 with the reason; ``manage.py dedup_locks reap``
and ``celery dedup reap`` end with one line saying why, never a traceback.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client, override_settings

from celery_dedup.runtime import reset_runtime

URL = "/admin/celery_dedup/deduplock/"


@pytest.fixture
def unlistable(celery_app: Any, settings: Any, transactional_db: None) -> Iterator[Any]:
    """The example app on a cache store that cannot list keys, with one lock held."""
    from shop.tasks import sync_address

    settings.CACHES = {**settings.CACHES, "unlistable": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "unlistable",
        "KEY_FUNCTION": "tests.django.test_cache_store.custom_key",
    }}
    with override_settings(CELERY_DEDUP_STORE="django-cache://unlistable"):
        reset_runtime(celery_app)
        sync_address._dedup_config = None
        assert not sync_address.delay(uuid.uuid4().int % 10**9, {"zip": "1"}).deduplicated
        yield celery_app
    reset_runtime(celery_app)
    sync_address._dedup_config = None


def test_admin_page_says_why(unlistable: Any) -> None:
    """The locks page answers 200 and says the store cannot list its locks."""
    User.objects.create_superuser("root", password="pw")
    client = Client()
    client.force_login(User.objects.get(username="root"))
    response = client.get(URL)
    assert response.status_code == 200
    assert "Cannot list the live locks" in response.content.decode()
    assert "cannot list its locks" in response.content.decode()


def test_manage_py_reap_says_why(unlistable: Any) -> None:
    """``manage.py dedup_locks reap``: a ``CommandError`` naming the reason."""
    with pytest.raises(CommandError, match=r"cannot reap: .*cannot list its locks"):
        call_command("dedup_locks", "reap")


def test_celery_dedup_reap_says_why(unlistable: Any) -> None:
    """``celery dedup reap``: exit status 1 and one line saying why, no traceback."""
    result = CliRunner().invoke(
        celery_cli, ["-A", "example_project.celery:app", "dedup", "reap"], catch_exceptions=False
    )
    assert result.exit_code == 1
    assert "cannot reap:" in result.output and "cannot list its locks" in result.output
    assert "Traceback" not in result.output
