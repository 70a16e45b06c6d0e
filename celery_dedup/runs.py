"""Run records: one publish, one run, whatever the broker redelivers.

Every copy of one publish carries the same owner token, so the lock alone
cannot tell a redelivered copy (Redis/SQS ``visibility_timeout``, a message
waiting for its ETA or in a prefetch buffer) from the copy that is running
or already ran. Each *attempt* of a publish (its retry count and
replacement depth: a ``self.retry()`` is a new attempt) therefore gets a
run record in the lock store, beside its lock:

* a **running lease** (``RUNNING_POLICY``), taken by the copy whose body
  starts, owned by that copy's *delivery token* (a fresh token per received
  message) and kept alive by the worker's main process (``leases``) while
  the body runs. A copy that finds a live lease is deferred, not run; a
  crashed run's lease lapses (or is given up when the worker sees its child
  die), and a copy then runs.
* a **done marker** (``DONE_POLICY``) written when the attempt ends, before
  its lock is released: a copy that finds it is acknowledged without
  running. It lives ``done_ttl`` seconds.

Records are plain TTL locks of the store protocol under their own
namespace (``run_record_key``), so every store keeps them with the
operations it already makes atomic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

from .stores.base import DONE_POLICY, RUNNING_POLICY, Lock, LockStore, run_record_key

__all__ = [
    "DELIVERY_FIELD",
    "Run",
    "RunState",
    "abandon",
    "attempt_of",
    "begin",
    "complete",
    "done_ttl_for",
    "renew",
    "run_for",
]


class RunState(str, Enum):
    """What ``begin`` found for an attempt."""

    #: no other copy is running or ran: this copy runs (it holds the lease)
    BEGUN = "begun"
    #: another copy of this attempt is running now (its lease is live)
    RUNNING = "running"
    #: another copy of this attempt completed
    DONE = "done"


@dataclass(frozen=True)
class Run:
    """The run record of one copy of one attempt."""

    store: LockStore
    #: the record's store key (``run_record_key``)
    record: str
    #: this copy's delivery token: owns the lease
    token: str
    #: the lock key, for logs
    key: str


#: The field a worker adds to a received message's request: its delivery token.
DELIVERY_FIELD = "dedup_delivery"


def attempt_of(request: Any) -> str:
    """An attempt's name: its retry count and replacement depth (copies share both).

    ``request`` is a task's request context or a received message's request dict.
    """
    get = request.get if isinstance(request, Mapping) else partial(getattr, request)
    return f"{get('retries', None) or 0}.{get('replaced_task_nesting', None) or 0}"


def run_for(store: LockStore, key: str, owner: str, attempt: str, token: str) -> Run:
    """The run record of ``token``'s copy of ``attempt`` of ``owner``'s publish on ``key``."""
    return Run(store, run_record_key(key, owner, attempt), token, key)


def _meta(task_name: str, task_id: str, policy: str) -> Mapping[str, str]:
    return {"task_name": task_name, "policy": policy, "task_id": task_id}


def begin(run: Run, lease: float, task_name: str, task_id: str) -> tuple[RunState, Lock | None]:
    """Take the lease for ``run`` unless another copy runs or ran (one round trip)."""
    holder = run.store.acquire(
        run.record, run.token, lease, _meta(task_name, task_id, RUNNING_POLICY)
    )
    if holder is None or holder.owner == run.token:
        return RunState.BEGUN, None
    if holder.policy == DONE_POLICY:
        return RunState.DONE, holder
    return RunState.RUNNING, holder


def complete(run: Run, done_ttl: float, task_name: str, task_id: str) -> None:
    """The attempt ended: replace the lease by the done marker (one round trip)."""
    run.store.take_over(run.record, run.token, done_ttl, _meta(task_name, task_id, DONE_POLICY))


def abandon(run: Run) -> bool:
    """Give the lease up: the run did not complete and a copy may run now."""
    return run.store.release(run.record, run.token)


def renew(runs: Iterable[Run], lease: float) -> int:
    """Keep the leases of ``runs`` alive for ``lease`` more seconds; how many were renewed.

    A store with ``extend_many`` renews all of its runs in one round trip;
    others take one per run.
    """
    by_store: dict[int, tuple[LockStore, list[Run]]] = {}
    for run in runs:
        by_store.setdefault(id(run.store), (run.store, []))[1].append(run)
    renewed = 0
    for store, mine in by_store.values():
        extend_many = getattr(store, "extend_many", None)
        if extend_many is not None:
            renewed += int(extend_many([(r.record, r.token) for r in mine], lease))
        else:
            renewed += sum(1 for r in mine if store.extend(r.record, r.token, lease))
    return renewed


def done_ttl_for(
    unique_for: float, lease: float, visibility_timeout: float, given: float | None
) -> float:
    """How long a done marker refuses late copies.

    ``dedup_done_ttl`` when set; else ``unique_for`` plus the transport's
    ``visibility_timeout`` (a copy restored after the run comes at most one
    visibility timeout after it was last seen); never less than the lease.
    """
    if given is not None:
        return max(given, lease)
    return max(unique_for + visibility_timeout, lease)
