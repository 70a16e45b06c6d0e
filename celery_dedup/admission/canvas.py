"""The canvas and worker-side rules, applied by the runner to every refusal.

* Group and chord members are never suppressed: Celery froze their result
  ids and a chord counts on each of them.
* A chain step published by a worker is never suppressed: the chain's
  result waits for its frozen id.
* A publish from inside a worker (or from beat) never raises a refusal:
  it would fail the parent task (or the schedule).

What "let in" means is the refusing step's: a held key publishes without a
lock, a full rate window reserves the call's place (a countdown).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..options import OnDuplicate
from ..stores.base import Lock
from .state import Admission, Refusal

if TYPE_CHECKING:
    from ..options import ResolvedOptions
    from ..task import DedupTask

__all__ = [
    "from_commit_hook", "in_canvas", "is_canvas", "keeps_duplicate", "lets_in",
    "must_not_raise", "protected", "takes_over",
]

#: set while a transaction's commit hook publishes (``delay_on_commit``): its
#: caller got ``None`` long ago, and a refusal raised there would abort the
#: commit's later hooks (other calls' publishes among them)
_COMMIT_HOOK: ContextVar[bool] = ContextVar("celery_dedup_commit_hook", default=False)


@contextmanager
def from_commit_hook() -> Iterator[None]:
    """Publish as a transaction's commit hook: refusals follow the worker-side rules."""
    token = _COMMIT_HOOK.set(True)
    try:
        yield
    finally:
        _COMMIT_HOOK.reset(token)


def is_canvas(options: Mapping[str, Any]) -> bool:
    """A group member or a chain's first step (not a chord: chords publish members anyway)."""
    return bool((options.get("group_id") or options.get("chain")) and not options.get("chord"))


def in_canvas(options: Mapping[str, Any]) -> bool:
    """A group or chord member, or a chain step: taking its key over would cut a canvas."""
    return bool(options.get("group_id") or options.get("chord") or options.get("chain") is not None)


def is_member(options: Mapping[str, Any]) -> bool:
    """A group or chord member (or a chord body): Celery counts on its frozen id."""
    return bool(options.get("group_id") or options.get("chord"))


def takes_over(policy: OnDuplicate, options: Mapping[str, Any]) -> bool:
    """Whether ``policy`` takes a held key over for this call.

    Members of one group or chord never displace each other (``replace``,
    ``keep_last``); ``cancel_running`` never cancels from inside a canvas.
    """
    if policy in (OnDuplicate.REPLACE, OnDuplicate.KEEP_LAST):
        return not is_member(options)
    return policy is OnDuplicate.CANCEL_RUNNING and not in_canvas(options)


def must_not_raise(task: DedupTask, options: Mapping[str, Any]) -> bool:
    """Inside a worker or beat, raising would fail the parent task or the schedule; in a
    commit hook it would abort the hooks after it."""
    return _COMMIT_HOOK.get() or task.app.current_worker_task is not None or bool(
        (options.get("headers") or {}).get("celery_beat_task")
    )


def chain_step_worker_side(task: DedupTask, options: Mapping[str, Any]) -> bool:
    """A chain step the worker publishes, the last one included (``chain=[]``)."""
    return options.get("chain") is not None and task.app.current_worker_task is not None


def protected(task: DedupTask, options: Mapping[str, Any]) -> bool:
    """Whether no refusal may drop this call or raise from it.

    A group or chord member, or a publish from a worker or beat: it is let
    in (``Refusal.let_in``) whatever refused, except a duplicate that
    ``keeps_duplicate`` allows to be suppressed.
    """
    return is_member(options) or must_not_raise(task, options)


def keeps_duplicate(
    task: DedupTask, call: ResolvedOptions, options: Mapping[str, Any], holder: Lock
) -> bool:
    """Whether a call whose key is held must be published anyway (without a lock).

    A chord member or body, a worker-side chain step, a canvas call from a
    worker, and a group member unless its group was given a key another
    call holds (then the group as a whole is the duplicate).
    """
    if (
        options.get("chord")
        or chain_step_worker_side(task, options)
        or (is_canvas(options) and must_not_raise(task, options))
    ):
        return True
    group_id = options.get("group_id")
    return group_id is not None and (
        call.deduplication_key is None
        or holder.task_id == group_id
        or bool(options.get("group_index"))
    )


def lets_in(adm: Admission, refusal: Refusal) -> bool:
    """Whether the canvas rules overrule ``refusal``: the call goes on, let in by its step."""
    if refusal.let_in is None:
        return False
    if refusal.kind == "duplicate":
        assert refusal.holder is not None
        return keeps_duplicate(adm.task, adm.call, adm.options, refusal.holder)
    return protected(adm.task, adm.options)
