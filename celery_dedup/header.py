"""The ``celery_dedup`` message header: how the worker learns key and policy.

The producer writes it; the worker reads it and never recomputes the key.
A message published through ``DedupTask.apply_async`` always carries it;
one without a key (``{"v": 1}``) was published without a lock on purpose.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .exceptions import MalformedHeader
from .policy import UniqueUntil

__all__ = [
    "HEADER",
    "MAX_KEY",
    "MAX_TOKEN",
    "LockHeader",
    "MalformedHeader",
    "new_token",
    "read_header",
]

HEADER: Final = "celery_dedup"
_VERSION: Final = 1


@dataclass(frozen=True)
class LockHeader:
    """What a message says about its lock."""

    #: the store key, or None when the message was published without a lock
    key: str | None = None
    #: the unlock policy
    until: UniqueUntil = UniqueUntil.SUCCESS
    #: ``unique_for`` in seconds (the TTL base for retries)
    unique_for: float = 0.0
    #: whether a newer call may take the lock over (``replace``, ``keep_last``,
    #: ``cancel_running``)
    replace: bool = False
    #: the owner token of this publish's lock (``None`` on 0.1.0 messages,
    #: whose owner was the task id)
    token: str | None = None
    #: ``on_duplicate="keep_last"``: the run waits for the key's run in
    #: progress to end (``coalesce``)
    last: bool = False
    #: ``unique_until="success"``: seconds the key stays held after a failed
    #: run (``retry_window``), or ``None`` (the rest of ``unique_for``)
    retry_window: float | None = None
    #: ``dedup_mode="observe"``: a start claim that finds another publish
    #: holding the key runs the body anyway (and counts it)
    observe: bool = False

    def owner(self, task_id: str) -> str:
        """The owner the store knows this message's lock by."""
        return self.token or task_id

    def encode(self) -> dict[str, Any]:
        """The header value, JSON-safe."""
        if self.key is None:
            return {"v": _VERSION}
        encoded: dict[str, Any] = {
            "v": _VERSION,
            "key": self.key,
            "until": self.until.value,
            "for": self.unique_for,
            "replace": self.replace,
            "tok": self.token,
        }
        if self.last:
            encoded["last"] = True
        if self.retry_window is not None:
            encoded["rw"] = self.retry_window
        if self.observe:
            encoded["obs"] = True
        return encoded

    @classmethod
    def decode(cls, raw: Any) -> LockHeader:
        """Parse a header value written by ``encode``.

        Raises ``MalformedHeader`` for anything ``encode`` cannot have
        written: not a mapping, another version, a field of the wrong type,
        an unknown policy, a key or token too long to be one, a key without
        a ``for`` of seconds above 0 (a lock always has a TTL). Unknown
        fields are ignored.
        """
        if not isinstance(raw, Mapping):
            raise MalformedHeader("the header", _show(raw), "a mapping")
        version = raw.get("v", _VERSION)
        if type(version) is not int or version != _VERSION:
            raise MalformedHeader("v", _show(version), f"{_VERSION}")
        key = raw.get("key")
        if key is None or key == "":
            return cls()
        return cls(
            key=_text(raw, "key", MAX_KEY),
            until=_until(raw.get("until", UniqueUntil.SUCCESS.value)),
            unique_for=_seconds(raw.get("for")),
            replace=_flag(raw, "replace"),
            token=_text(raw, "tok", MAX_TOKEN) if raw.get("tok") is not None else None,
            last=_flag(raw, "last"),
            retry_window=_seconds(raw["rw"], "rw") if raw.get("rw") is not None else None,
            observe=_flag(raw, "obs"),
        )


#: The longest ``unique_for`` a header may carry (``options.MAX_SECONDS``; not
#: imported: ``options`` depends on this module through ``owner_token``).
MAX_SECONDS: Final = 10 * 365 * 24 * 3600.0
#: The longest key a header may name (a key is a prefix, a task name and a digest).
MAX_KEY: Final = 1024
#: The longest owner token (``new_token`` makes 22 characters, a guard's 38).
MAX_TOKEN: Final = 256


def _show(value: Any) -> str:
    """A short, safe repr of a header value for a message and a log line."""
    try:
        text = repr(value[:40] if isinstance(value, (str, bytes)) else value)
    except Exception:  # a hostile object (pickle): its type is enough
        text = f"a {type(value).__name__}"
    if isinstance(value, (str, bytes)) and len(value) > 40:
        text += f" (and {len(value) - 40} more)"
    return text if len(text) <= 120 else text[:117] + "..."


def _text(raw: Mapping[str, Any], field: str, longest: int) -> str:
    value = raw.get(field)
    if not isinstance(value, str) or not value or len(value) > longest:
        raise MalformedHeader(
            field, _show(value), f"a non-empty string of at most {longest} characters"
        )
    return value


def _until(value: Any) -> UniqueUntil:
    if isinstance(value, str):
        for policy in UniqueUntil:
            if policy.value == value:
                return policy
    raise MalformedHeader(
        "until", _show(value), "one of " + ", ".join(repr(u.value) for u in UniqueUntil)
    )


def _seconds(value: Any, field: str = "for") -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= MAX_SECONDS
    ):
        raise MalformedHeader(
            field, _show(value), f"a number of seconds above 0 and at most {MAX_SECONDS:.0f}"
        )
    return float(value)


def _flag(raw: Mapping[str, Any], field: str) -> bool:
    value = raw.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise MalformedHeader(field, _show(value), "true or false")
    return value


NO_LOCK: Final = LockHeader()


def new_token() -> str:
    """A fresh owner token: 128 random bits in 22 URL-safe characters.

    Never derived from anything a caller sees.
    """
    return secrets.token_urlsafe(16)


def read_header(headers: Mapping[str, Any] | None) -> LockHeader | None:
    """The ``LockHeader`` in a message's headers, or ``None`` if it has none.

    Raises ``MalformedHeader`` when the header is there but cannot be decoded.
    """
    if not isinstance(headers, Mapping):
        return None
    raw = headers.get(HEADER)
    if raw is None:
        return None
    return LockHeader.decode(raw)
