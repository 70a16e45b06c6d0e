"""What only a published call may do, and nothing can undo: dismiss or revoke the holder it
displaced; then the handle ``apply_async`` returns.
"""

from __future__ import annotations

from typing import Any

from .. import cancel, coalesce
from ..options import OnDuplicate
from ..results import mark_result
from ..signals import lock_replaced
from ..stores.base import Lock
from .state import Admission

__all__ = ["apply", "revoke_replaced"]


def apply(adm: Admission) -> Any:
    """Run the effects of a published call and return its handle."""
    if adm.cancelled is not None:
        assert adm.key is not None
        cancel.dismiss(adm.task, adm.key, adm.task_id, adm.cancelled)
    if adm.previous is not None:
        assert adm.key is not None
        revoke_replaced(adm, adm.previous)
    result = adm.result
    if adm.header.last and adm.locked:
        result = coalesce.following(result)
    return mark_result(result, adm.key, adm.header.token)


def revoke_replaced(adm: Admission, previous: Lock) -> None:
    """Tell workers to drop the replaced message (saves work; its start claim refuses it).

    A ``keep_last`` holder whose run is in progress is followed, not
    replaced: no revoke is broadcast (its run goes on to its end).
    """
    task, key, policy = adm.task, adm.key, adm.policy or OnDuplicate.REPLACE.value
    assert key is not None
    adm.config.runtime.metrics.incr(task.name, "replaced")
    follows = policy == OnDuplicate.KEEP_LAST.value and previous.started
    lock_replaced.send(
        sender=task,
        key=key,
        task_id=adm.task_id,
        previous_task_id=previous.task_id,
        policy=policy,
        follow_up=follows,
    )
    if not follows:
        cancel.drop_message(task, key, previous.task_id, adm.task_id, "replaced")
