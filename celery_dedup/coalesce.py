"""``on_duplicate="keep_last"``: one run in progress per key, plus one queued follow-up.

The producer side is ``replace``'s take-over: a call takes the key over
and marks the previous owner revoked (two round trips when the key was
held, one when it was free). A queued holder that had not started never
runs; a holder whose run is in progress runs to its end (its
owner-checked release no longer finds its lock, and only copies of it,
should its worker die, are refused), and the new message is its
*follow-up*. Every later call replaces the follow-up while it waits, so
the one that eventually runs carries the latest call's arguments.

What keeps a follow-up from running beside the run in progress is the
key's **run gate**: a TTL lock of its own (``gate_key``, a digest under a
namespace no lock listing sees) that every ``keep_last`` run holds from
its start to its end, owned by its delivery token and renewed with its
running lease by the worker's main process. A message that finds the gate
held is deferred (published again for later, as a copy waiting for a
running copy is); a run whose worker dies gives the gate up when its pool
child is seen to die, or lets it lapse within one lease.

This module holds only the gate: the take-over is ``DedupTask``'s, the
deferral the worker's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .exceptions import StoreError
from .stores.base import RUNNING_POLICY, LockStore, run_record_key

__all__ = ["GATE_POLICY", "Gate", "gate_key", "leave", "renew", "try_enter"]

logger = logging.getLogger("celery_dedup")

#: The ``policy`` a gate record is written with: a running lease's (listings
#: and reapers leave it out; its key is outside every lock prefix too).
GATE_POLICY = RUNNING_POLICY


@dataclass(frozen=True)
class Gate:
    """The run gate of one key, as one run holds it (or tries to)."""

    store: LockStore
    #: the gate's store key (``gate_key``)
    key: str
    #: the holding run's delivery token
    token: str


def gate_key(key: str) -> str:
    """The store key of ``key``'s run gate: shared by every publish on the key."""
    return run_record_key(key, "", "keep_last")


def try_enter(
    store: LockStore, key: str, token: str, lease: float, task_name: str, task_id: str
) -> tuple[Gate, bool]:
    """Take ``key``'s run gate for ``token`` for ``lease`` seconds (one round trip).

    Returns the gate and whether this run holds it (a copy of this very
    delivery that holds it already counts as holding it). Store errors
    propagate: the caller defers.
    """
    gate = Gate(store, gate_key(key), token)
    meta = {"task_name": task_name, "policy": GATE_POLICY, "task_id": task_id}
    holder = store.acquire(gate.key, token, lease, meta)
    return gate, holder is None or holder.owner == token


def leave(gate: Gate | None) -> None:
    """Give the gate up (owner-checked); a store error leaves it to lapse within a lease."""
    if gate is None:
        return
    try:
        gate.store.release(gate.key, gate.token)
    except StoreError as exc:
        logger.warning(
            "celery-dedup: could not open the keep_last run gate (it lapses within "
            "one lease): %s",
            exc,
        )


def renew(gate: Gate, lease: float) -> bool:
    """Keep a running run's gate alive (the worker's main process)."""
    return gate.store.extend(gate.key, gate.token, lease)
