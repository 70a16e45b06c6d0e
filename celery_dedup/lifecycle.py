"""The lifecycle of a publish, as the task and the worker share it.

One module both sides use, so the arrows point one way (``task`` →
``worker`` → ``lifecycle`` → stores): how a run ended (``Outcome``), what a
running message holds from its start claim to its end (``Held``: key,
owner token, policy, TTL, its run record), the metadata a lock is written
with, and the surface of a task the worker needs (``DedupTaskLike``),
which ``DedupTask`` provides. The running lease and the done marker live in
``runs``; their upkeep in the worker's main process in ``leases``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from .header import LockHeader
from .options import DedupMode, ResolvedOptions
from .policy import UniqueUntil
from .runtime import Runtime
from .stores.base import LockStore, RunRef

__all__ = ["DedupTaskLike", "Held", "Outcome", "TaskConfigLike", "meta_for"]


class TaskConfigLike(Protocol):
    """What the worker reads of a task's resolved options (``TaskConfig``)."""

    @property
    def runtime(self) -> Runtime: ...

    @property
    def unique_for(self) -> float: ...

    @property
    def fence(self) -> bool: ...

    @property
    def mode(self) -> DedupMode: ...

    def resolve(self, given: Mapping[str, Any]) -> ResolvedOptions: ...


class DedupTaskLike(Protocol):
    """The surface of a ``DedupTask`` the worker side uses."""

    @property
    def name(self) -> str: ...

    @property
    def app(self) -> Any: ...

    @property
    def backend(self) -> Any: ...

    @property
    def request(self) -> Any: ...

    @property
    def Request(self) -> Any: ...  # noqa: N802 (Celery's name)

    def dedup_config(self) -> TaskConfigLike: ...

    def dedup_key(
        self,
        args: Any,
        kwargs: Any,
        call: ResolvedOptions,
        queue: Any = ...,
        serializer: str | None = ...,
    ) -> str | None: ...

    def routed_queue(self, options: Mapping[str, Any], args: Any, kwargs: Any) -> str: ...

    def dedup_header(self, task_id: str) -> LockHeader | None: ...

    def update_state(
        self, task_id: Any = ..., state: Any = ..., meta: Any = ..., **kw: Any
    ) -> Any: ...

    def retry(self, *args: Any, **kwargs: Any) -> Any: ...

    def signature_from_request(self, *args: Any, **kwargs: Any) -> Any: ...


class Outcome(str, Enum):
    """How a run ended, as far as its lock is concerned."""

    SUCCESS = "success"
    FAILURE = "failure"
    #: ``raise Ignore()`` in the body, or ``replace()`` with a replacement
    #: that does not take the lock over: released like a success
    IGNORED = "ignored"
    #: ``raise Reject(requeue=False)``: released like a failure
    REJECTED = "rejected"
    #: revoked, expired or terminated by a revoke
    REVOKED = "revoked"
    #: ``raise Reject(requeue=True)``: the message goes back to its queue
    REQUEUED = "requeued"
    #: ``self.retry()``: the retry was published holding the lock
    RETRIED = "retried"

    def releases(self, until: UniqueUntil) -> bool:
        """Whether a lock under ``until`` is released when a run ends like this."""
        if self in (Outcome.REQUEUED, Outcome.RETRIED):
            return False
        if self in (Outcome.SUCCESS, Outcome.IGNORED):
            return until.releases_on_success()
        if self in (Outcome.FAILURE, Outcome.REJECTED):
            return until.releases_on_failure()
        return until.releases_on_revoke()


@dataclass
class Held:
    """The lock a running message holds, from its start claim to its end."""

    store: LockStore
    header: LockHeader
    key: str
    owner: str
    task_id: str
    #: set when the lock passed to a replacement (``self.replace()``)
    handed_over: bool = False
    #: this copy's run record (``None``: eager, or the store did not answer)
    run: RunRef | None = None
    #: the start claim could not reach the store: the lock may not be this run's
    unchecked: bool = False
    #: ``unique_until="start"``: released by the start claim already
    released: bool = False


def meta_for(task: DedupTaskLike, task_id: str, until: UniqueUntil) -> dict[str, str]:
    """The metadata a lock of ``task`` is written with."""
    return {"task_name": task.name, "policy": until.value, "task_id": task_id}
