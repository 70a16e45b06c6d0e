"""One window entry per publish: a task id made unique by a nonce.

A rate window counts publishes, not task ids: calls that share a task id
(``deterministic_id=True``, a caller's stable ``task_id=``) are each a
publish. Stores keep ``<task id>#<16 hex digits>`` as an entry's member
and give the task id back in their answers and listings.
"""

from __future__ import annotations

import secrets

__all__ = ["new_entry", "task_id_of"]

_SEPARATOR = "#"
_NONCE_HEX = 16


def new_entry(task_id: str) -> str:
    """A window member for one publish of ``task_id``, unique among its window's."""
    return f"{task_id}{_SEPARATOR}{secrets.token_hex(_NONCE_HEX // 2)}"


def task_id_of(entry: str) -> str:
    """The task id of a window member (a member written before nonces: itself)."""
    head, sep, nonce = entry.rpartition(_SEPARATOR)
    if sep and len(nonce) == _NONCE_HEX and all(c in "0123456789abcdef" for c in nonce):
        return head
    return entry
