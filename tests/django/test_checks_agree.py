"""System checks agree with what the first call does.

A store a call could not build is a blocking error (E016): a misspelt
``DATABASES`` or ``CACHES`` alias, a ``DummyCache``. An empty
``CELERY_DEDUP_STORE`` means "derive it", in the checks as at run time. An
app deduplicating natively on SQS gets a warning (W012), not E014.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.core.checks import ERROR
from django.core.management import call_command
from django.test import override_settings

from celery_dedup.contrib.django.checks import check_settings
from celery_dedup.exceptions import ImproperlyConfigured
from celery_dedup.runtime import reset_runtime

DUMMY = {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}


def _ids(level: int | None = None) -> set[str]:
    return {m.id for m in check_settings() if level is None or m.level >= level}


def _first_call(app: Any) -> Any:
    from shop.tasks import sync_address

    reset_runtime(app)
    sync_address._dedup_config = None
    try:
        return sync_address.delay(41, {"zip": "1"})
    finally:
        reset_runtime(app)
        sync_address._dedup_config = None


@pytest.mark.parametrize(
    ("store", "caches"),
    [
        ("django-cache://defualt", None),
        ("django-db://defualt", None),
        ("django-cache://dummy", {"dummy": DUMMY}),
    ],
    ids=["misspelt-cache", "misspelt-database", "dummy-cache"],
)
def test_a_store_no_call_can_build_is_an_error(
    celery_app: Any, settings: Any, transactional_db: None, store: str, caches: Any
) -> None:
    """The check reports E016 as an error, and the first call fails the same way."""
    if caches:
        settings.CACHES = {**settings.CACHES, **caches}
    with override_settings(CELERY_DEDUP_STORE=store, CELERY_DEDUP_FALLBACK="closed"):
        assert "celery_dedup.E016" in _ids(ERROR)
        with pytest.raises(ImproperlyConfigured):
            _first_call(celery_app)


def test_empty_store_setting_derives_in_checks_and_calls(
    celery_app: Any, transactional_db: None
) -> None:
    """``CELERY_DEDUP_STORE = ""``: no error from the checks, and the call locks (django-db)."""
    with override_settings(CELERY_DEDUP_STORE=""):
        assert not _ids(ERROR)
        call_command("check")
        assert not _first_call(celery_app).deduplicated


def test_native_sqs_app_is_not_blocked(celery_app: Any) -> None:
    """No store but an SQS broker with native dedup: a warning, and ``check`` passes."""
    with override_settings(
        CELERY_BROKER_URL="sqs://", CELERY_RESULT_BACKEND=None, CELERY_DEDUP_STORE=None
    ):
        assert "celery_dedup.E014" not in _ids()
        assert "celery_dedup.W012" in _ids()
        call_command("check")
    with override_settings(
        CELERY_BROKER_URL="sqs://", CELERY_RESULT_BACKEND=None, CELERY_DEDUP_NATIVE="never"
    ):
        assert "celery_dedup.E014" in _ids(ERROR)
