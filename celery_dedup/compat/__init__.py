"""Drop-in shims for users of celery-once and celery-singleton.

Change one import and keep the task code::

    from celery_dedup.compat.celery_once import QueueOnce, AlreadyQueued
    from celery_dedup.compat.celery_singleton import Singleton, DuplicateTaskError, clear_locks

``import celery_dedup`` never imports this package. See ``docs/migrating.md``
for the option mapping and every behaviour difference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["adopt_setting"]


def adopt_setting(app: Celery, name: str, value: Any) -> bool:
    """Set ``app.conf[name] = value`` when ``name`` is unset and ``value`` is not ``None``.

    The shims copy the other library's settings (a lock URL, a key prefix)
    into the ``dedup_*`` setting they stand for, so an explicit ``dedup_*``
    setting always wins. Returns whether the setting was written.
    """
    if value is None or app.conf.get(name) is not None:
        return False
    app.conf[name] = value
    return True
