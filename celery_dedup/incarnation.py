"""Delivery tokens that say which worker process renews their lease, and whether it died.

A running lease is renewed by the worker's main process. When that process
is killed (the whole worker SIGKILLed, the machine's OOM killer), its
lease lives on for its record's life (``runs.record_life``, two leases by
default) and a copy the broker redelivers is deferred until then: with a
short ``visibility_timeout`` that is many receptions of one message.

A delivery token therefore starts with the **scope** of the process that
made it (a digest of the kernel's boot id and the pid namespace: within one
scope a pid names one process) and that process's **pid**. A copy that
finds the lease of such a token in its own scope, held by a pid that no
longer exists, knows the run died with its worker and takes its lease over
at once (``RunRef.inherits``: atomically, by one copy only). Anywhere else
(another machine or container, no ``/proc``) nothing is concluded and the
copy waits for the record to lapse, as before. A pid reused by another
process reads as alive: the copy waits (never the unsafe way).
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from typing import Final

from .header import new_token

__all__ = ["died", "new_delivery_token"]

_SEPARATOR: Final = "."


@cache
def _scope() -> str:
    """This kernel boot and pid namespace, as 10 hex digits (``""``: unknown here)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return hashlib.sha256(f"{boot_id}/{namespace}".encode()).hexdigest()[:10]


def new_delivery_token() -> str:
    """A fresh delivery token naming this process (the one that renews its lease)."""
    scope = _scope()
    if not scope:
        return new_token()
    return f"{scope}{_SEPARATOR}{os.getpid()}{_SEPARATOR}{new_token()}"


def died(token: str) -> bool:
    """Whether the process that made ``token`` is known to be gone.

    Only for a token made in this scope by another pid that no longer
    exists; ``False`` whenever that cannot be known.
    """
    scope, sep, rest = token.partition(_SEPARATOR)
    if not sep or scope != _scope() or not scope:
        return False
    pid_text, sep, _ = rest.partition(_SEPARATOR)
    if not sep or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid <= 1 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (exists, owned by another user)
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """A killed process its parent has not reaped yet is gone for our purpose."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[-1].split()
    except OSError:
        return False
    return bool(fields) and fields[0] == "Z"
