"""Exceptions raised by celery-dedup.

The hierarchy::

    DedupError
    ├── InvalidOptionError (ValueError)        a bad option value: names option, value, allowed
    ├── DedupKeyError (TypeError)              an argument cannot be part of a key
    ├── MissingDeduplicationKey (ValueError)   identity="caller_provided" without a key
    ├── DuplicateTaskError                     on_duplicate="raise" and the key is held
    │   └── KeyReuseError                      on_key_reuse="raise": the caller's key is held
    │                                          by a publish with different arguments
    ├── CancelTimeout (TimeoutError)           on_duplicate="cancel_running": the key stayed held
    ├── CancelOwnRunError (RuntimeError)       cancel_running called by the run holding the key
    ├── RateLimited                            rate_limit_per_key is reached (``retry_after``)
    ├── DeduplicationUnavailable (RuntimeError) no usable store and dedup_fallback="closed"
    ├── MalformedHeader (ValueError)           a message's celery_dedup header cannot be decoded
    ├── ResultLost (RuntimeError)              the body ran to its end, its worker died before
    │                                          Celery stored the result (stored as FAILURE)
    ├── StoreError                             a store operation failed (never a driver's exception)
    │   ├── StoreUnavailable (ConnectionError) the lock store cannot be reached
    │   ├── StoreContention                    the store stayed contended after bounded retries
    │   └── StoreRefused                       the server answered with an error: read-only
    │       │                                  (failover), full (noeviction), busy, misconfigured
    │       └── StorePermissionDenied (PermissionError)  the store's user may not do this
    ├── ScanNotSupported (NotImplementedError) the store cannot list its locks (memcached)
    └── ImproperlyConfigured                   unknown store scheme or missing driver
        │ (also celery.exceptions.ImproperlyConfigured)
        └── LimitsNotSupported                 concurrency/rate limits on a store without them

``KeyReuseWarning`` (a ``UserWarning``) is what ``on_key_reuse="warn"`` emits.

Context lives in attributes; the holder's task id never enters a message, so
messages are safe to show to an API client.

Every exception keeps its constructor's arguments, in order, in ``args``, so
``type(exc)(*exc.args)`` rebuilds it with the same fields: that is how pickle
and Celery's JSON result backend bring an exception raised inside a task back
to the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured

__all__ = [
    "CancelOwnRunError",
    "CancelTimeout",
    "DedupError",
    "DedupKeyError",
    "DeduplicationUnavailable",
    "DuplicateTaskError",
    "FencingNotSupported",
    "ImproperlyConfigured",
    "InvalidOptionError",
    "KeyReuseError",
    "KeyReuseWarning",
    "LimitsNotSupported",
    "MalformedHeader",
    "MissingDeduplicationKey",
    "NoFenceError",
    "RateLimited",
    "ResultLost",
    "ScanNotSupported",
    "StoreContention",
    "StoreError",
    "StorePermissionDenied",
    "StoreRefused",
    "StoreUnavailable",
]

#: true under every policy: the holder may be queued, running or (``expiry``,
#: ``success`` after a failure) already finished within its window
E_DUPLICATE = (
    "{task_name} was already enqueued for this deduplication key within its "
    "deduplication window"
)
E_KEY_REUSE = (
    "{task_name}: this deduplication key is already in use for a call with different "
    "arguments within its deduplication window; use a new key for different work"
)
E_MISSING_KEY = (
    "{task_name} uses identity='caller_provided': pass deduplication_key= "
    "(for example an Idempotency-Key header) when enqueueing it"
)
E_CANCEL_TIMEOUT = (
    "{task_name}: the run holding this deduplication key was cancelled but did not free "
    "the key within {waited:g}s (cancel_wait); nothing was published"
)
E_CANCEL_OWN_RUN = (
    "{task_name}: on_duplicate='cancel_running' was called from inside the run that holds "
    "this deduplication key; cancelling it would wait for itself. Call it from outside "
    "that run, or use on_duplicate='replace' or 'existing' for such calls"
)
E_INVALID_OPTION = "{option}={value!r} is not valid; expected {allowed}"


class DedupError(Exception):
    """Root of every celery-dedup exception."""

    def _keep(self, message: str, *args: Any) -> None:
        """Show ``message``; keep the constructor's ``args`` (they rebuild the exception)."""
        self.args = args
        self._message = message

    def __str__(self) -> str:
        message: str | None = self.__dict__.get("_message")
        return super().__str__() if message is None else message


class InvalidOptionError(DedupError, ValueError):
    """An option (per call, task attribute or setting) has a value it cannot take.

    ``task_name``, when known, prefixes the message.
    """

    def __init__(
        self,
        option: str,
        value: Any,
        allowed: str | Iterable[str],
        task_name: str | None = None,
    ) -> None:
        if not isinstance(allowed, str):
            allowed = "one of " + ", ".join(repr(choice) for choice in allowed)
        self.option = option
        self.value = value
        self.allowed = allowed
        self.name_task(task_name)

    def name_task(self, task_name: str | None) -> None:
        """Say which task the option belongs to (message, ``task_name`` and ``args``)."""
        self.task_name = task_name
        message = E_INVALID_OPTION.format(
            option=self.option, value=self.value, allowed=self.allowed
        )
        self._keep(
            f"{task_name}: {message}" if task_name else message,
            self.option,
            self.value,
            self.allowed,
            task_name,
        )


E_OPTION_NEEDS = "{option}={value!r} needs {needs}; {actual}"


class OptionCombinationError(InvalidOptionError):
    """An option was given without the option it only works with.

    ``option`` (with ``value``) needs ``requires`` set (``required_value``:
    set to that value); ``actual`` is what ``requires`` resolved to. Raised
    where the task is defined, at its first use (an app setting decided),
    or at the call that combined them.
    """

    def __init__(
        self,
        option: str,
        value: Any,
        requires: str,
        required_value: str = "",
        actual: Any = None,
        task_name: str | None = None,
    ) -> None:
        self.requires = requires
        self.required_value = required_value
        self.actual = actual
        super().__init__(option, value, self._needs(), task_name)

    def _needs(self) -> str:
        if "|" in self.required_value:
            either = " or ".join(repr(v) for v in self.required_value.split("|"))
            return f"{self.requires}={either}"
        if self.required_value:
            return f"{self.requires}={self.required_value!r}"
        return f"{self.requires} set"

    def name_task(self, task_name: str | None) -> None:
        """Say which task the options belong to (message, ``task_name`` and ``args``)."""
        self.task_name = task_name
        actual = (
            f"{self.requires} is not set"
            if self.actual is None
            else f"{self.requires} is {self.actual!r}"
        )
        message = E_OPTION_NEEDS.format(
            option=self.option, value=self.value, needs=self._needs(), actual=actual
        )
        self._keep(
            f"{task_name}: {message}" if task_name else message,
            self.option,
            self.value,
            self.requires,
            self.required_value,
            self.actual,
            task_name,
        )


class DedupKeyError(DedupError, TypeError):
    """An argument cannot be canonicalised into a deduplication key."""

    def __init__(self, message: str, argument: str, task_name: str | None = None) -> None:
        self._keep(message, message, argument, task_name)
        self.argument = argument
        self.task_name = task_name


class MissingDeduplicationKey(DedupError, ValueError):
    """``identity="caller_provided"`` was used without a ``deduplication_key``."""

    def __init__(self, task_name: str) -> None:
        self._keep(E_MISSING_KEY.format(task_name=task_name), task_name)
        self.task_name = task_name


class DuplicateTaskError(DedupError):
    """The call is a duplicate and ``on_duplicate="raise"`` was asked for.

    ``existing_task_id`` holds the holder's id for server-side use; it is kept
    out of the message so the message can be returned to an API client.
    """

    def __init__(
        self, task_name: str, key: str, existing_task_id: str, ttl: float | None
    ) -> None:
        self._keep(E_DUPLICATE.format(task_name=task_name), task_name, key, existing_task_id, ttl)
        self.task_name = task_name
        self.key = key
        self.existing_task_id = existing_task_id
        self.ttl = ttl

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task_name={self.task_name!r}, key={self.key!r}, "
            f"ttl={self.ttl!r})"
        )


class KeyReuseError(DuplicateTaskError):
    """A caller-given ``deduplication_key`` is held by a publish with different arguments.

    Raised with ``on_key_reuse="raise"``, before anything is published. An
    HTTP API maps it to 422 Unprocessable Content (a plain duplicate is 409),
    as the IETF idempotency-key draft does for a key reused with another
    payload. The message names neither the holder's task id nor the
    arguments: it is safe to show to the client.
    """

    def __init__(
        self, task_name: str, key: str, existing_task_id: str, ttl: float | None
    ) -> None:
        super().__init__(task_name, key, existing_task_id, ttl)
        self._keep(E_KEY_REUSE.format(task_name=task_name), *self.args)


class KeyReuseWarning(UserWarning):
    """``on_key_reuse="warn"``: a caller-given key is held by a publish with different arguments.

    The call was answered with the holder's result, as a duplicate. Turn it
    into an error in tests with ``-W error::celery_dedup.KeyReuseWarning``.
    """

class CancelTimeout(DedupError, TimeoutError):
    """``on_duplicate="cancel_running"``: the cancelled holder kept the key past ``cancel_wait``.

    Nothing was published and this call holds no lock. The holder was
    revoked (it never starts again) and, if running, asked to terminate: it
    may still end later. ``existing_task_id`` is for server-side use; the
    message leaves it out.
    """

    def __init__(
        self, task_name: str, key: str, existing_task_id: str, waited: float
    ) -> None:
        self._keep(E_CANCEL_TIMEOUT.format(task_name=task_name, waited=waited),
                   task_name, key, existing_task_id, waited)
        self.task_name = task_name
        self.key = key
        self.existing_task_id = existing_task_id
        self.waited = waited


class CancelOwnRunError(DedupError, RuntimeError):
    """``on_duplicate="cancel_running"`` called by the very run that holds the key.

    It would revoke and terminate itself, then wait for its own end until
    ``cancel_wait``: raised before anything is revoked, published or taken.
    """

    def __init__(self, task_name: str, key: str, task_id: str) -> None:
        self._keep(E_CANCEL_OWN_RUN.format(task_name=task_name), task_name, key, task_id)
        self.task_name = task_name
        self.key = key
        self.task_id = task_id


class DeduplicationUnavailable(DedupError, RuntimeError):
    """No lock could be taken and ``dedup_fallback="closed"``: nothing was published."""

    def __init__(self, message: str, task_name: str, reason: str) -> None:
        self._keep(message, message, task_name, reason)
        self.task_name = task_name
        self.reason = reason


E_RESULT_LOST = (
    "{task_name}[{task_id}]: the body ran to its end{outcome}, but its worker died before "
    "Celery stored the result; the body is not run again (one publish, one run)"
)


class ResultLost(DedupError, RuntimeError):
    """A run's body ended, then its whole worker died before Celery stored the result.

    Stored as the task's ``FAILURE`` by the copy the broker redelivers (it
    finds the run done and does not run it again), so the caller's
    ``get()`` raises this instead of waiting for ever. ``outcome`` is how
    the body ended (``"success"``, ``"failure"``) when the store recorded
    it with the run's done marker, else ``""``.
    """

    def __init__(self, task_name: str, task_id: str, outcome: str = "") -> None:
        ended = f" ({outcome})" if outcome else ""
        message = E_RESULT_LOST.format(task_name=task_name, task_id=task_id, outcome=ended)
        self._keep(message, task_name, task_id, outcome)
        self.task_name = task_name
        self.task_id = task_id
        self.outcome = outcome


E_MALFORMED_HEADER = "malformed celery_dedup header: {field} is {value}; expected {expected}"


class MalformedHeader(DedupError, ValueError):
    """A message's ``celery_dedup`` header cannot be decoded.

    Raised by ``LockHeader.decode``; the worker never lets it out: it logs
    it once per message and handles the message as one without the header
    (its guard computes the key). ``field`` names the part that is wrong,
    ``value`` is a short repr of what it held.
    """

    def __init__(self, field: str, value: str, expected: str) -> None:
        message = E_MALFORMED_HEADER.format(field=field, value=value, expected=expected)
        self._keep(message, field, value, expected)
        self.field = field
        self.value = value
        self.expected = expected


class StoreError(DedupError):
    """A lock store operation failed; the root of every store error.

    Stores translate every driver exception into one of its subclasses at one
    boundary, so neither the producer nor the worker ever sees a driver's
    exception, and each maps the class to the documented fallback.
    """

    def __init__(self, message: str, store: str) -> None:
        self._keep(message, message, store)
        self.store = store


class StoreUnavailable(StoreError, ConnectionError):
    """The lock store could not be reached (refused, timed out, gone away)."""


class StoreContention(StoreError):
    """The store stayed contended (deadlocks, lock waits) after bounded retries.

    The store is reachable, so this is never a reason to publish without a
    lock (unlike ``StoreUnavailable``, which ``dedup_fallback`` may turn into
    an unlocked publish).
    """


class StoreRefused(StoreError):
    """The store answered, but refused the operation.

    A replica after a failover (Redis ``READONLY``, PostgreSQL read-only
    transactions), a full server (``OOM`` under ``noeviction``), a server
    that cannot persist (``MISCONF``) or is busy with a script (``BUSY``).
    The fallback treats it like an unreachable store: it is an outage of the
    lock, not a duplicate.
    """


class StorePermissionDenied(StoreRefused, PermissionError):
    """The store's user lacks a right the operation needs (Redis ``NOPERM``, SQL 42501)."""


class ScanNotSupported(DedupError, NotImplementedError):
    """The store cannot list its locks (``scan``), though every other operation works."""

    def __init__(self, message: str, store: str) -> None:
        self._keep(message, message, store)
        self.store = store


class ImproperlyConfigured(DedupError, CeleryImproperlyConfigured):
    """A store URL has an unknown scheme, or its driver is not installed."""


E_RATE_LIMITED = (
    "{task_name} was called more often than its rate limit allows for this key; "
    "retry in {retry_after:.1f}s"
)


class RateLimited(DedupError):
    """The call's rate key is over ``rate_limit_per_key`` and ``on_duplicate="raise"``.

    ``retry_after`` is the number of seconds until the window has room
    again. The message names neither the key nor any task id: it is safe
    to show an API client (``existing_task_id``, the most recent admitted
    publish, is for server-side use).
    """

    def __init__(
        self, task_name: str, key: str, retry_after: float, existing_task_id: str = ""
    ) -> None:
        message = E_RATE_LIMITED.format(task_name=task_name, retry_after=retry_after)
        self._keep(message, task_name, key, retry_after, existing_task_id)
        self.task_name = task_name
        self.key = key
        self.retry_after = retry_after
        self.existing_task_id = existing_task_id

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task_name={self.task_name!r}, key={self.key!r}, "
            f"retry_after={self.retry_after!r})"
        )


class LimitsNotSupported(ImproperlyConfigured):
    """A task uses ``concurrency_limit`` or ``rate_limit_per_key`` on a store that cannot keep them.

    Raised instead of running unlimited: the limit would silently not hold.
    """

    def __init__(self, task_name: str, option: str, store: str) -> None:
        message = (
            f"{option} needs a lock store that keeps concurrency slots and publish "
            f"rates (redis, postgresql, memory); the configured store {store!r} does not"
        )
        if task_name:
            message = f"{task_name}: {message}"
        self._keep(message, task_name, option, store)
        self.task_name = task_name
        self.option = option
        self.store = store


class FencingNotSupported(ImproperlyConfigured):
    """A task sets ``fence=True`` on a store that cannot issue fencing tokens.

    Raised instead of running unfenced: a fenced write would have nothing to
    compare. Redis, Redis Cluster, PostgreSQL (the SQL store) and the memory
    store issue them.
    """

    def __init__(self, task_name: str, store: str) -> None:
        message = (
            f"{task_name}: fence=True needs a lock store that issues fencing tokens in its "
            f"start claim (redis, rediss, redis cluster, db+postgresql, memory); the "
            f"configured store {store!r} does not"
        )
        self._keep(message, task_name, store)
        self.task_name = task_name
        self.store = store


class NoFenceError(DedupError, LookupError):
    """``current_fence()`` was asked outside a fenced run.

    Only the body of a task with ``fence=True`` whose start claim admitted
    it has a fence: not a task without it, not a call with no deduplication
    key (``unique_for=None``: no lock, no fence), not an eager call
    (``task.apply()``, ``task_always_eager``), not a run the fallback let
    through while the store did not answer its start claim, not code
    outside a task.
    """

    def __init__(self, reason: str, task_name: str = "") -> None:
        message = f"no fencing token: {reason}"
        if task_name:
            message = f"{task_name}: {message}"
        self._keep(message, reason, task_name)
        self.reason = reason
        self.task_name = task_name
