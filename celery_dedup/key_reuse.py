"""Key reuse: a caller's ``deduplication_key`` held by a publish with different arguments.

A publish whose call passed ``deduplication_key=`` writes a fingerprint of
its delivered arguments into its owner token (``owner_token``).
Every store keeps the token opaque and ``acquire`` already returns the
holder's token to the producer, so the comparison costs no store round trip
and no schema change. The secret part stays the holder's: a duplicate caller
is only ever given the holder without its token (``Lock.without_owner``).

The fingerprint is 128 bits of the sha256 of the canonical JSON of the call's
bound arguments (every parameter, defaults applied, ``unique_on`` ignored),
as the serializer delivers them to the worker. The arguments themselves are
never stored.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from enum import Enum
from types import FrameType
from typing import Any, Final

from . import owner_token
from .exceptions import KeyReuseError, KeyReuseWarning
from .identity import ArgumentBinder, as_delivered, canonical_json, digest
from .signals import key_reused
from .stores.base import Lock

__all__ = [
    "OnKeyReuse",
    "conflicts",
    "differ",
    "fingerprint",
    "fingerprint_of",
    "report",
    "token",
]

#: a fingerprint is 32 hex digits
_FINGERPRINT_LENGTH: Final = 32
_HEX: Final = frozenset("0123456789abcdef")


class OnKeyReuse(str, Enum):
    """What a call does when its ``deduplication_key`` is held for different arguments."""

    #: raise ``KeyReuseError`` (a ``DuplicateTaskError``); nothing is published
    RAISE = "raise"
    #: emit a ``KeyReuseWarning``, then answer as a duplicate (the holder's result)
    WARN = "warn"
    #: answer as a duplicate, as before 0.3.0 (no fingerprint is computed)
    IGNORE = "ignore"


def fingerprint(
    binder: ArgumentBinder,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    serializer: str,
) -> str | None:
    """The fingerprint of a call's delivered arguments, or ``None`` if they have none.

    ``None`` for arguments with no canonical form (arbitrary objects under
    ``pickle``, sets) or that do not bind to the task's signature: such a
    call is published exactly as before, and nobody compares against it.
    """
    try:
        delivered_args, delivered_kwargs = as_delivered(args, kwargs, serializer)
        material = canonical_json(binder.bind_all(delivered_args, delivered_kwargs))
    except Exception:
        return None
    return digest(material)


def token(fingerprint: str | None) -> str:
    """A fresh owner token carrying ``fingerprint`` (a plain token for ``None``)."""
    return owner_token.mint(**{owner_token.FINGERPRINT: fingerprint})


def fingerprint_of(owner: str) -> str | None:
    """The fingerprint an owner token carries, or ``None`` (plain tokens, task ids)."""
    found = owner_token.facts_of(owner).get(owner_token.FINGERPRINT)
    if found is None or len(found) != _FINGERPRINT_LENGTH or not _HEX.issuperset(found):
        return None
    return found


def differ(mine: str | None, theirs: str | None) -> bool:
    """Whether two fingerprints are both known and different."""
    return mine is not None and theirs is not None and mine != theirs


def conflicts(owner: str, holder: Lock) -> bool:
    """Whether this call (``owner``) and ``holder`` were made with different arguments.

    Only when both carry a fingerprint: a holder published without one
    (``on_key_reuse="ignore"``, an older version, a key from the task's
    ``deduplication_key`` callable) is never judged.
    """
    mine = fingerprint_of(owner)
    return mine is not None and differ(mine, fingerprint_of(holder.owner))


def report(
    task: Any, mode: OnKeyReuse, key: str, existing_task_id: str, ttl: float | None
) -> None:
    """Count and signal a reused key, then raise ``KeyReuseError`` or warn.

    ``task`` is the ``DedupTask`` (the signal's sender); ``existing_task_id``
    and ``ttl`` describe the holder (``""`` and ``None`` for a call still
    pending in the same Django transaction). Called before anything is
    published.
    """
    if mode is OnKeyReuse.IGNORE:
        return
    task.dedup_config().runtime.metrics.incr(task.name, "key_reused")
    key_reused.send(sender=task, key=key, existing_task_id=existing_task_id, action=mode.value)
    if mode is OnKeyReuse.RAISE:
        raise KeyReuseError(
            task_name=task.name, key=key, existing_task_id=existing_task_id, ttl=ttl
        )
    warnings.warn(
        f"celery-dedup: {task.name}: deduplication key already in use for a call with "
        f"different arguments (lock {key}); this call was answered with the holder's "
        "result and its own arguments will not run (on_key_reuse='warn')",
        KeyReuseWarning,
        stacklevel=_caller_level(),
    )


#: modules whose frames a warning skips to point at the caller's line
_OWN_MODULES: Final = ("celery_dedup", "celery.", "kombu.")


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside celery-dedup and Celery.

    The warning then names the line that made the call (``delay``,
    ``apply_async``, a signature), so the default filter shows it once per
    call site rather than once per process.
    """
    frame: FrameType | None = sys._getframe(2)  # the caller of ``report``: stacklevel 2
    level = 2
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if not module.startswith(_OWN_MODULES):
            return level
        frame = frame.f_back
        level += 1
    return 2
