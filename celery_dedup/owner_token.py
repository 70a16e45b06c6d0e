"""Owner tokens: a publish's secret, and the facts it leaves for the next caller.

Every store keeps an owner token opaque and hands the holder's token back to
the producer in the same round trip that finds the key held, so a fact about
the holder that the next call needs (the fingerprint of its arguments, the
start of its debounce burst) travels in the token at no extra round trip and
with no store schema change::

    <22-character secret>[.<name><value>]...

A name is one lowercase letter, a value lowercase letters and digits. The
secret is what proves ownership; a duplicate caller is only ever given the
holder without its token (``Lock.without_owner``).
"""

from __future__ import annotations

from typing import Final

from .header import new_token

__all__ = ["BURST_START", "FINGERPRINT", "facts_of", "mint"]

#: the fingerprint of the call's delivered arguments (``key_reuse``)
FINGERPRINT: Final = "f"
#: the start of the debounce burst the publish belongs to (``debounce``)
BURST_START: Final = "b"

_SEPARATOR: Final = "."
#: ``new_token()``: 128 random bits in 22 URL-safe characters (never a ".")
_SECRET_LENGTH: Final = 22
_VALUE: Final = frozenset("0123456789abcdefghijklmnopqrstuvwxyz")


def mint(**facts: str | None) -> str:
    """A fresh owner token carrying ``facts`` (those given as ``None`` are left out)."""
    secret = new_token()
    given = sorted((name, value) for name, value in facts.items() if value is not None)
    if not given:
        return secret
    for name, value in given:
        if len(name) != 1 or not value or not _VALUE.issuperset(value):
            raise ValueError(f"owner token fact {name}={value!r}: one letter, [0-9a-z]+")
    return secret + "".join(f"{_SEPARATOR}{name}{value}" for name, value in given)


def facts_of(owner: str) -> dict[str, str]:
    """The facts an owner token carries (none for plain tokens and task ids)."""
    secret, separator, rest = owner.partition(_SEPARATOR)
    if not separator or len(secret) != _SECRET_LENGTH:
        return {}
    facts: dict[str, str] = {}
    for part in rest.split(_SEPARATOR):
        if len(part) < 2 or not _VALUE.issuperset(part):
            return {}
        facts[part[0]] = part[1:]
    return facts
