"""``CELERY_DEDUP_*`` Django settings reach celery-dedup through Celery's namespace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from django.test import override_settings

from celery_dedup.runtime import reset_runtime, runtime_for
from celery_dedup.stores.django import DjangoStore

ROOT = Path(__file__).resolve().parents[2]


def _lock_ttl(app: Any, key: str) -> float:
    """Publish ``notify`` under ``key`` (no ``unique_for``: the default TTL applies)."""
    from shop.tasks import notify

    notify._dedup_config = None
    reset_runtime(app)
    result = notify.apply_async((1, "welcome"), deduplication_key=key)
    lock = runtime_for(app).store.get(result.deduplication_key)
    assert lock is not None and lock.task_id == result.id
    return lock.ttl


def test_django_setting_sets_the_default_ttl(celery_app: Any, transactional_db: None) -> None:
    """``CELERY_DEDUP_DEFAULT_TTL`` in Django settings is the TTL of a lock without unique_for."""
    with override_settings(CELERY_DEDUP_DEFAULT_TTL=123):
        assert celery_app.conf.dedup_default_ttl == 123
        ttl = _lock_ttl(celery_app, "settings-1")
    assert 120 < ttl <= 123


def test_app_conf_wins_over_django_settings(celery_app: Any, transactional_db: None) -> None:
    """A value set on ``app.conf`` in code takes precedence over the Django setting."""
    celery_app.conf.dedup_default_ttl = 45
    try:
        with override_settings(CELERY_DEDUP_DEFAULT_TTL=123):
            ttl = _lock_ttl(celery_app, "settings-2")
    finally:
        celery_app.conf.changes.pop("dedup_default_ttl")
    assert 40 < ttl <= 45


def test_builtin_default_without_any_setting(celery_app: Any, transactional_db: None) -> None:
    """With neither set, the built-in default TTL (3600 s) applies."""
    with override_settings():
        from django.conf import settings

        del settings.CELERY_DEDUP_DEFAULT_TTL
        ttl = _lock_ttl(celery_app, "settings-3")
    assert 3590 < ttl <= 3600


def test_every_setting_is_read_through_the_namespace(celery_app: Any) -> None:
    """Each ``CELERY_DEDUP_*`` setting lands in the runtime's validated settings."""
    with override_settings(
        CELERY_DEDUP_KEY_PREFIX="shop-locks",
        CELERY_DEDUP_DEFAULT_UNIQUE_UNTIL="finish",
        CELERY_DEDUP_DEFAULT_IDENTITY="always_unique",
        CELERY_DEDUP_DEFAULT_ON_DUPLICATE="raise",
        CELERY_DEDUP_FALLBACK="closed",
        CELERY_DEDUP_SEND_EVENTS=True,
    ):
        reset_runtime(celery_app)
        s = runtime_for(celery_app).settings
        assert s.key_prefix == "shop-locks"
        assert (s.default_unique_until.value, s.default_identity.value) == (
            "finish", "always_unique",
        )
        assert (s.default_on_duplicate.value, s.fallback.value) == ("raise", "closed")
        assert s.send_events is True


def test_django_db_backend_selects_the_django_store(celery_app: Any) -> None:
    """``result_backend='django-db'`` makes the Django DB store the app's lock store."""
    store = runtime_for(celery_app).store
    assert isinstance(store, DjangoStore) and store.using == "default"


def test_store_alias_from_url(celery_app: Any) -> None:
    """``CELERY_DEDUP_STORE='django-db://ALIAS'`` picks that DATABASES alias (checked)."""
    import pytest

    from celery_dedup.exceptions import ImproperlyConfigured

    with override_settings(CELERY_DEDUP_STORE="django-db://default"):
        reset_runtime(celery_app)
        store = runtime_for(celery_app).store
        assert isinstance(store, DjangoStore) and store.using == "default"
    with override_settings(CELERY_DEDUP_STORE="django-db://nope"):
        reset_runtime(celery_app)
        with pytest.raises(ImproperlyConfigured, match="nope"):
            _ = runtime_for(celery_app).store


def test_import_celery_dedup_imports_no_django() -> None:
    """``import celery_dedup`` loads no Django settings, ORM or app registry.

    (kombu's JSON module itself imports ``django.utils.functional`` when
    Django is installed; that is not ours and touches no settings.)
    """
    code = (
        "import sys, celery_dedup, celery_dedup.task, celery_dedup.runtime, celery_dedup.api\n"
        "heavy = ('django.conf', 'django.db', 'django.apps', 'django.contrib')\n"
        "bad = sorted(m for m in sys.modules if m.startswith(heavy))\n"
        "assert not bad, bad\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_core_modules_never_read_django_settings() -> None:
    """The core modules (the package's top level, the store protocol) never touch Django settings.

    Only Django-specific modules do: ``contrib/django`` and the lazily loaded
    Django stores.
    """
    package = ROOT / "celery_dedup"
    stores = package / "stores"
    core = [*package.glob("*.py"), stores / "__init__.py", stores / "base.py"]
    assert len(core) > 10
    offenders = [
        str(path.relative_to(ROOT))
        for path in core
        if any(s in path.read_text() for s in ("django.conf", "from django", "import django"))
    ]
    assert offenders == []
