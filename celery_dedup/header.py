"""The ``celery_dedup`` message header: how the worker learns key and policy.

The producer writes it; the worker reads it and never recomputes the key.
A message published through ``DedupTask.apply_async`` always carries it;
one without a key (``{"v": 1}``) was published without a lock on purpose.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .policy import UniqueUntil

__all__ = ["HEADER", "LockHeader", "new_token", "read_header"]

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
        return encoded

    @classmethod
    def decode(cls, raw: Mapping[str, Any]) -> LockHeader:
        """Parse a header value written by ``encode``."""
        key = raw.get("key")
        if not key:
            return cls()
        return cls(
            key=str(key),
            until=UniqueUntil(raw.get("until", UniqueUntil.SUCCESS.value)),
            unique_for=float(raw.get("for") or 0.0),
            replace=bool(raw.get("replace")),
            token=str(raw["tok"]) if raw.get("tok") else None,
            last=bool(raw.get("last")),
        )


NO_LOCK: Final = LockHeader()


def new_token() -> str:
    """A fresh owner token: 128 random bits in 22 URL-safe characters.

    Never derived from anything a caller sees.
    """
    return secrets.token_urlsafe(16)


def read_header(headers: Mapping[str, Any] | None) -> LockHeader | None:
    """The ``LockHeader`` in a message's headers, or ``None`` if it has none."""
    raw = (headers or {}).get(HEADER)
    if not isinstance(raw, Mapping):
        return None
    return LockHeader.decode(raw)
