"""What the admission steps share: the call on its way in, a refusal, a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..header import NO_LOCK, LockHeader
from ..options import ResolvedOptions
from ..stores.base import Lock, LockStore

if TYPE_CHECKING:
    from ..task import DedupTask, TaskConfig

__all__ = ["Admission", "Publish", "Refusal", "Step"]

#: ``publish(task_id, header)``: ``Task.apply_async`` with the header set
Publish = Callable[[str, LockHeader], Any]


@dataclass
class Admission:
    """One call on its way in: its resolved facts, and what the steps did so far."""

    task: DedupTask
    config: TaskConfig
    call: ResolvedOptions
    #: the lock key, or ``None`` for a call that takes no lock
    key: str | None
    task_id: str
    #: the arguments as Celery sends them (routers and keys saw these)
    args: Any
    kwargs: Any
    #: Celery's options for this publish (steps may add a countdown)
    options: dict[str, Any]
    publish: Publish
    store: LockStore | None = None

    # -- written by the steps --------------------------------------------
    #: the message's ``celery_dedup`` header
    header: LockHeader = NO_LOCK
    #: the key was taken (by acquire or take-over): the publish owns it
    locked: bool = False
    #: the holder the key was taken from (``replace``/``keep_last``)
    previous: Lock | None = None
    #: the queued holder ``cancel_running`` took the key from
    cancelled: Lock | None = None
    #: the policy name effects report (``replace+max_wait`` when capped)
    policy: str = ""
    #: an eager call's body ran inside ``publish`` (its own hooks settled the lock)
    body_started: bool = False
    #: ``publish``'s answer
    result: Any = None
    #: scratch space of the steps (e.g. the rate key counted)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """A step's answer that the call does not get in.

    ``answer`` produces what ``apply_async`` returns or raises (the
    holder's handle, ``DuplicateTaskError``, ``RateLimited``…), once the
    undos have run. ``let_in``, when given, is how the refusing step lets
    the call in after all (the canvas rules: a call that must not be
    suppressed); it does the step's part, whose undo the step then keeps.
    """

    #: what refused: ``"duplicate"``, ``"rate"``
    kind: str
    answer: Callable[[], Any]
    let_in: Callable[[], None] | None = None
    #: the live holder of the key (a duplicate)
    holder: Lock | None = None


class Step(Protocol):
    """One unit of admission: do its part or refuse, and undo its part on demand."""

    def enter(self, adm: Admission) -> Refusal | None:
        """Do this step's part (``None``: the call goes on), or refuse the call.

        May raise: the runner then undoes the steps before it and re-raises.
        A step that refuses or raises leaves nothing behind itself.
        """

    def undo(self, adm: Admission) -> None:
        """Take back what ``enter`` did (a later step refused or raised). Never raises."""
