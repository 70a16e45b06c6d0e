"""Exceptions raised by celery-dedup.

The hierarchy::

    DedupError
    ├── InvalidOptionError (ValueError)        a bad option value: names option, value, allowed
    ├── DedupKeyError (TypeError)              an argument cannot be part of a key
    ├── MissingDeduplicationKey (ValueError)   identity="caller_provided" without a key
    ├── DuplicateTaskError                     on_duplicate="raise" and the key is held
    ├── DeduplicationUnavailable (RuntimeError) no usable store and dedup_fallback="closed"
    ├── StoreUnavailable (ConnectionError)     the lock store cannot be reached
    ├── ScanNotSupported (NotImplementedError) the store cannot list its locks (memcached)
    └── ImproperlyConfigured                   unknown store scheme or missing driver
        (also celery.exceptions.ImproperlyConfigured)

Context lives in keyword-only attributes; the holder's task id never enters a
message, so messages are safe to show to an API client.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured

__all__ = [
    "DedupError",
    "DedupKeyError",
    "DeduplicationUnavailable",
    "DuplicateTaskError",
    "ImproperlyConfigured",
    "InvalidOptionError",
    "MissingDeduplicationKey",
    "ScanNotSupported",
    "StoreUnavailable",
]

E_DUPLICATE = "{task_name} is already queued or running for this deduplication key"
E_MISSING_KEY = (
    "{task_name} uses identity='caller_provided': pass deduplication_key= "
    "(for example an Idempotency-Key header) when enqueueing it"
)
E_INVALID_OPTION = "{option}={value!r} is not valid; expected {allowed}"


class DedupError(Exception):
    """Root of every celery-dedup exception."""


class InvalidOptionError(DedupError, ValueError):
    """An option (per call, task attribute or setting) has a value it cannot take."""

    def __init__(self, option: str, value: Any, allowed: str | Iterable[str]) -> None:
        if not isinstance(allowed, str):
            allowed = "one of " + ", ".join(repr(choice) for choice in allowed)
        super().__init__(E_INVALID_OPTION.format(option=option, value=value, allowed=allowed))
        self.option = option
        self.value = value
        self.allowed = allowed


class DedupKeyError(DedupError, TypeError):
    """An argument cannot be canonicalised into a deduplication key."""

    def __init__(self, message: str, *, argument: str, task_name: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument
        self.task_name = task_name


class MissingDeduplicationKey(DedupError, ValueError):
    """``identity="caller_provided"`` was used without a ``deduplication_key``."""

    def __init__(self, *, task_name: str) -> None:
        super().__init__(E_MISSING_KEY.format(task_name=task_name))
        self.task_name = task_name


class DuplicateTaskError(DedupError):
    """The call is a duplicate and ``on_duplicate="raise"`` was asked for.

    ``existing_task_id`` holds the holder's id for server-side use; it is kept
    out of the message so the message can be returned to an API client.
    """

    def __init__(
        self, *, task_name: str, key: str, existing_task_id: str, ttl: float | None
    ) -> None:
        super().__init__(E_DUPLICATE.format(task_name=task_name))
        self.task_name = task_name
        self.key = key
        self.existing_task_id = existing_task_id
        self.ttl = ttl

    def __repr__(self) -> str:
        return (
            f"DuplicateTaskError(task_name={self.task_name!r}, key={self.key!r}, ttl={self.ttl!r})"
        )


class DeduplicationUnavailable(DedupError, RuntimeError):
    """No lock could be taken and ``dedup_fallback="closed"``: nothing was published."""

    def __init__(self, message: str, *, task_name: str, reason: str) -> None:
        super().__init__(message)
        self.task_name = task_name
        self.reason = reason


class StoreUnavailable(DedupError, ConnectionError):
    """The lock store could not be reached (refused, timed out, gone away)."""

    def __init__(self, message: str, *, store: str) -> None:
        super().__init__(message)
        self.store = store


class ScanNotSupported(DedupError, NotImplementedError):
    """The store cannot list its locks (``scan``), though every other operation works."""

    def __init__(self, message: str, *, store: str) -> None:
        super().__init__(message)
        self.store = store


class ImproperlyConfigured(DedupError, CeleryImproperlyConfigured):
    """A store URL has an unknown scheme, or its driver is not installed."""
