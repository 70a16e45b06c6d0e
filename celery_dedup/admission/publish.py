"""The publish step: hand the message to Celery (it happened, or it raised)."""

from __future__ import annotations

from .. import coalesce, otel, worker
from ..signals import lock_acquired
from .state import Admission, Refusal

__all__ = ["PublishStep"]


class PublishStep:
    """Publish with the header the lock step chose; an error undoes the steps before it.

    An eager call runs its body inside ``publish()``: its own hooks apply
    the policy once the body started, so only a call that raised before
    its body ran (wrong arity, an unserialisable argument) is undone.
    """

    def enter(self, adm: Admission) -> Refusal | None:
        """Publish (never refuses)."""
        task, key = adm.task, adm.key
        if adm.locked:
            assert key is not None
            adm.config.runtime.metrics.incr(task.name, "acquired")
            lock_acquired.send(
                sender=task,
                key=key,
                task_id=adm.task_id,
                ttl=adm.notes.get("ttl"),
                policy=adm.header.until.value,
            )
        otel.publishing(adm)
        owner = adm.header.owner(adm.task_id)
        follows = adm.previous if adm.header.last and adm.locked else None
        try:
            if follows is None:  # (the common case: no context to enter)
                adm.result = adm.publish(adm.task_id, adm.header)
            else:
                with coalesce.linked(task.backend, follows, adm.task_id):
                    adm.result = adm.publish(adm.task_id, adm.header)
        except BaseException as exc:
            adm.body_started = worker.eager_body_started(owner)
            if not adm.body_started:
                otel.failed(adm, exc)
            raise
        finally:
            worker.eager_body_started(owner)
        orphan = adm.notes.pop("orphan", None)
        if orphan is not None:
            # The message carries the owner token: it owns a late-landing lock.
            adm.config.runtime.forget_orphan(orphan)
        return None

    def undo(self, adm: Admission) -> None:
        """Nothing: a publish is never undone (later effects cannot refuse)."""
