"""Idempotent Celery task enqueueing.

::

    @app.task(base=DedupTask, unique_for=600)
    def sync_address(user_id, address): ...

    sync_address.delay(42, {"zip": "10115"})   # publishes
    sync_address.delay(42, {"zip": "10115"})   # duplicate: returns the holder's result
"""

from __future__ import annotations

# Fills in what an older Celery (5.3, 5.4) lacks, before anything uses it.
from . import celery_versions as _celery_versions

# Connects the startup checks (worker-start store probe, dedup options on
# tasks that are not DedupTask) to Celery's signals.
from . import startup as _startup  # noqa: F401
from .api import dedup_key_for, inspect_lock, release, revoke
from .batch import enqueue_many
from .bulk import BulkResult, ItemOutcome, ItemStatus
from .exceptions import (
    CancelOwnRunError,
    CancelTimeout,
    DedupError,
    DedupKeyError,
    DeduplicationUnavailable,
    DuplicateTaskError,
    FencingNotSupported,
    ImproperlyConfigured,
    InvalidOptionError,
    KeyReuseError,
    KeyReuseWarning,
    LimitsNotSupported,
    MalformedHeader,
    MissingDeduplicationKey,
    NoFenceError,
    OptionCombinationError,
    RateLimited,
    ResultLost,
    ScanNotSupported,
    StoreContention,
    StoreError,
    StorePermissionDenied,
    StoreRefused,
    StoreUnavailable,
)
from .fence import current_fence, fenced_hset, fenced_update
from .identity import Identity, time_bucket
from .limits import OnRateLimit
from .options import DedupMode, Fallback, OnDuplicate, OnKeyReuse
from .policy import UniqueUntil
from .results import DeduplicatedResult
from .signals import (
    dedup_fallback,
    key_reused,
    lock_acquired,
    lock_released,
    lock_replaced,
    task_deduplicated,
    task_observed,
    task_skipped,
)
from .stores.base import Lock, RevokeOutcome
from .task import DedupTask

_celery_versions.backport(DedupTask)

__version__ = "0.3.0"

__all__ = [
    "BulkResult",
    "CancelOwnRunError",
    "CancelTimeout",
    "DedupError",
    "DedupKeyError",
    "DedupMode",
    "DedupTask",
    "DeduplicatedResult",
    "DeduplicationUnavailable",
    "DuplicateTaskError",
    "Fallback",
    "FencingNotSupported",
    "Identity",
    "ImproperlyConfigured",
    "InvalidOptionError",
    "ItemOutcome",
    "ItemStatus",
    "KeyReuseError",
    "KeyReuseWarning",
    "LimitsNotSupported",
    "Lock",
    "MalformedHeader",
    "MissingDeduplicationKey",
    "NoFenceError",
    "OnDuplicate",
    "OnKeyReuse",
    "OnRateLimit",
    "OptionCombinationError",
    "RateLimited",
    "ResultLost",
    "RevokeOutcome",
    "ScanNotSupported",
    "StoreContention",
    "StoreError",
    "StorePermissionDenied",
    "StoreRefused",
    "StoreUnavailable",
    "UniqueUntil",
    "current_fence",
    "dedup_fallback",
    "dedup_key_for",
    "enqueue_many",
    "fenced_hset",
    "fenced_update",
    "inspect_lock",
    "key_reused",
    "lock_acquired",
    "lock_released",
    "lock_replaced",
    "release",
    "revoke",
    "task_deduplicated",
    "task_observed",
    "task_skipped",
    "time_bucket",
]
