"""The public surface of the package."""

from __future__ import annotations

import subprocess
import sys

import celery_dedup


def test_all_equals_public_names() -> None:
    """__all__ lists exactly the public names the package exports."""
    public = {
        name
        for name in vars(celery_dedup)
        if not name.startswith("_")
        and not isinstance(getattr(celery_dedup, name), type(sys))
        and name != "annotations"
    }
    assert set(celery_dedup.__all__) == public
    assert sorted(celery_dedup.__all__) == celery_dedup.__all__


def test_design_names_are_exported() -> None:
    """Every name DESIGN promises is importable from celery_dedup."""
    for name in (
        "DedupTask",
        "DeduplicatedResult",
        "enqueue_many",
        "time_bucket",
        "dedup_key_for",
        "release",
        "revoke",
        "inspect_lock",
        "UniqueUntil",
        "Identity",
        "OnDuplicate",
        "DuplicateTaskError",
        "KeyReuseError",
        "KeyReuseWarning",
        "OnKeyReuse",
        "key_reused",
        "DedupKeyError",
        "MissingDeduplicationKey",
        "DeduplicationUnavailable",
        "task_deduplicated",
        "lock_acquired",
        "lock_released",
        "lock_replaced",
        "dedup_fallback",
    ):
        assert name in celery_dedup.__all__, name


def test_import_is_cheap() -> None:
    """Importing celery_dedup loads no store driver (redis, SQLAlchemy, pymemcache, Django ORM)."""
    code = (
        "import sys, celery_dedup; "
        "print(sorted(m for m in ('redis', 'sqlalchemy', 'pymemcache', 'django.db') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_exception_hierarchy() -> None:
    """Every exception derives from DedupError and the builtin callers expect."""
    assert issubclass(celery_dedup.DedupKeyError, TypeError)
    assert issubclass(celery_dedup.MissingDeduplicationKey, ValueError)
    assert issubclass(celery_dedup.InvalidOptionError, ValueError)
    assert issubclass(celery_dedup.DeduplicationUnavailable, RuntimeError)
    for name in ("DedupKeyError", "DuplicateTaskError", "StoreUnavailable", "ImproperlyConfigured"):
        assert issubclass(getattr(celery_dedup, name), celery_dedup.DedupError)
