"""``manage.py check``: every invalid celery-dedup setting is reported with its id and a hint."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from celery_dedup.contrib.django.checks import CHECK_IDS, check_settings

BAD_VALUES = [
    ("CELERY_DEDUP_STORE", 42, "celery_dedup.E001"),
    ("CELERY_DEDUP_KEY_PREFIX", "has space", "celery_dedup.E002"),
    ("CELERY_DEDUP_DEFAULT_TTL", -5, "celery_dedup.E003"),
    ("CELERY_DEDUP_DEFAULT_UNIQUE_UNTIL", "forever", "celery_dedup.E004"),
    ("CELERY_DEDUP_DEFAULT_IDENTITY", "loose", "celery_dedup.E005"),
    ("CELERY_DEDUP_DEFAULT_ON_DUPLICATE", "ignore", "celery_dedup.E006"),
    ("CELERY_DEDUP_FALLBACK", "maybe", "celery_dedup.E007"),
    ("CELERY_DEDUP_SEND_EVENTS", "yes", "celery_dedup.E008"),
    ("CELERY_DEDUP_STORE", "mongodb://localhost/locks", "celery_dedup.E009"),
    ("CELERY_DEDUP_STORE_OPTIONS", ["timeout"], "celery_dedup.E010"),
    ("CELERY_DEDUP_METRICS_FLUSH_INTERVAL", -1, "celery_dedup.E011"),
    ("CELERY_DEDUP_NATIVE", "sometimes", "celery_dedup.E012"),
    ("CELERY_DEDUP_REVOKED_TTL", -1, "celery_dedup.E013"),
    ("CELERY_DEDUP_SILENCED_WARNINGS", "W101", "celery_dedup.E032"),
    ("CELERY_DEDUP_MODE", "shadow", "celery_dedup.E042"),
]


@pytest.fixture
def app() -> Iterator[Any]:
    """The example's Celery app; values set on ``app.conf`` in a test are removed after it."""
    from example_project.celery import app

    before = set(app.conf.changes)
    yield app
    for name in set(app.conf.changes) - before:
        app.conf.changes.pop(name)


def _ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


@pytest.mark.parametrize(("setting", "value", "check_id"), BAD_VALUES,
                         ids=[b[2] for b in BAD_VALUES])
def test_each_invalid_setting_has_its_id(app: Any, setting: str, value: Any, check_id: str) -> None:
    """An invalid value yields exactly one error with its id, naming the setting, plus a hint."""
    with override_settings(**{setting: value}):
        messages = check_settings()
    assert _ids(messages) == [check_id]
    (error,) = messages
    assert setting in error.msg and error.hint
    assert error.is_serious()


def test_every_setting_has_a_check_id() -> None:
    """Each validated setting of options.SETTINGS maps to its own id."""
    from celery_dedup.options import SETTINGS

    assert set(CHECK_IDS) == set(SETTINGS)
    assert len(set(CHECK_IDS.values())) == len(CHECK_IDS)


def test_error_lists_allowed_values_from_the_task_validator(app: Any) -> None:
    """The message and hint come from the validator the task uses (the allowed choices)."""
    with override_settings(CELERY_DEDUP_DEFAULT_UNIQUE_UNTIL="forever"):
        (error,) = check_settings()
    for choice in ("'start'", "'success'", "'finish'", "'expiry'"):
        assert choice in error.msg and choice in error.hint
    assert "'forever'" in error.msg and "'success'" in error.hint


def test_unknown_setting_is_a_warning_with_a_suggestion(app: Any) -> None:
    """A typo (``CELERY_DEDUP_DEFAULT_TTLL``) is celery_dedup.W001 suggesting the real name."""
    with override_settings(CELERY_DEDUP_DEFAULT_TTLL=5):
        (warning,) = check_settings()
    assert warning.id == "celery_dedup.W001" and not warning.is_serious()
    assert "CELERY_DEDUP_DEFAULT_TTL?" in warning.hint


def test_value_set_on_app_conf_is_checked_too(app: Any) -> None:
    """A bad value set in code (``app.conf.dedup_fallback``) is reported naming app.conf."""
    app.conf.dedup_fallback = "sometimes"
    messages = check_settings()
    assert _ids(messages) == ["celery_dedup.E007"]
    assert "app.conf.dedup_fallback" in messages[0].msg


def test_valid_settings_pass(app: Any) -> None:
    """Valid values of every setting produce no message."""
    with override_settings(
        CELERY_DEDUP_STORE="django-db",
        CELERY_DEDUP_KEY_PREFIX="shop",
        CELERY_DEDUP_DEFAULT_TTL=30,
        CELERY_DEDUP_DEFAULT_UNIQUE_UNTIL="finish",
        CELERY_DEDUP_DEFAULT_IDENTITY="strict",
        CELERY_DEDUP_DEFAULT_ON_DUPLICATE="raise",
        CELERY_DEDUP_FALLBACK="closed",
        CELERY_DEDUP_SEND_EVENTS=False,
        CELERY_DEDUP_STORE_OPTIONS={},
    ):
        assert check_settings() == []


def test_manage_py_check_fails_on_bad_unique_until(app: Any) -> None:
    """``manage.py check`` stops with celery_dedup.E004 for a bad DEFAULT_UNIQUE_UNTIL."""
    with (
        override_settings(CELERY_DEDUP_DEFAULT_UNIQUE_UNTIL="never"),
        pytest.raises(SystemCheckError) as excinfo,
    ):
        call_command("check")
    assert "celery_dedup.E004" in str(excinfo.value)
    assert "CELERY_DEDUP_DEFAULT_UNIQUE_UNTIL" in str(excinfo.value)


def test_manage_py_check_passes_on_the_test_settings(app: Any, capsys: Any) -> None:
    """The test settings (valid dedup settings) pass ``manage.py check``."""
    call_command("check")
    assert "no issues" in capsys.readouterr().out


def test_no_derivable_store_is_an_error_unless_open_on_purpose(app: Any) -> None:
    """rpc:// results on a non-Redis broker: E014, unless CELERY_DEDUP_FALLBACK is set."""
    with override_settings(CELERY_RESULT_BACKEND="rpc://", CELERY_BROKER_URL="memory://"):
        errors = [m for m in check_settings() if m.id == "celery_dedup.E014"]
        assert len(errors) == 1
        assert "every DedupTask call would fail" in errors[0].msg
        assert "CELERY_DEDUP_FALLBACK = 'open'" in errors[0].hint
        with override_settings(CELERY_DEDUP_FALLBACK="open"):
            assert [m.id for m in check_settings()] == []


def test_override_settings_takes_effect_on_the_next_call(app: Any, transactional_db: None) -> None:
    """A CELERY_DEDUP_* setting changed with override_settings applies without a reset."""
    from shop.tasks import sync_address

    from celery_dedup.runtime import runtime_for

    before = sync_address.delay(1, {"zip": "1"})
    assert before.deduplication_key.startswith("celery-dedup:")
    with override_settings(CELERY_DEDUP_KEY_PREFIX="overridden"):
        during = sync_address.delay(1, {"zip": "1"})
        assert during.deduplicated is False
        assert during.deduplication_key.startswith("overridden:")
    after = sync_address.delay(1, {"zip": "1"})
    assert after.deduplicated is True and after.id == before.id
    assert runtime_for(app).settings.key_prefix == "celery-dedup"


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("django.core.cache.backends.db.DatabaseCache", ["celery_dedup.W010"]),
        ("django.core.cache.backends.locmem.LocMemCache", ["celery_dedup.W011"]),
        ("django.core.cache.backends.filebased.FileBasedCache", []),
    ],
)
def test_cache_store_guarantee_is_checked(
    app: Any, tmp_path: Any, backend: str, expected: list[str]
) -> None:
    """A django-cache store warns when its backend is best effort or one process only."""
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {"BACKEND": backend, "LOCATION": str(tmp_path / "locks")},
    }
    with override_settings(CACHES=caches, CELERY_DEDUP_STORE="django-cache://locks"):
        found = [m for m in check_settings() if m.id in ("celery_dedup.W010", "celery_dedup.W011")]
        assert [m.id for m in found] == expected
        for message in found:
            assert "'locks'" in message.msg and message.hint
