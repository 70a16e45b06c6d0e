"""The Celery app's task modules, imported as a worker imports them.

Celery's Django layout (``app.autodiscover_tasks()``) imports each app's
``tasks`` module lazily, when the app imports its default modules: a
worker does at start, ``runserver`` never does. A web process therefore
knows only the tasks some view imported. The admin's call lookup and the
system checks import them first, as ``celery dedup`` does.
"""

from __future__ import annotations

import threading
from typing import Any, Final

__all__ = ["import_task_modules"]

_DONE: Final = "_celery_dedup_task_modules_imported"
_local = threading.local()


def import_task_modules(app: Any) -> bool:
    """Import ``app``'s task modules once (``imports``, ``include``, autodiscovery).

    ``app.loader.import_default_modules()``, as ``celery report`` and a
    worker call it. Under Django, Celery's fixup runs the system checks
    while it imports them, and the checks call this: such a nested call
    returns ``False`` at once. ``True`` once they are imported. An import error is raised
    (and tried again by the next call).
    """
    if app.__dict__.get(_DONE):
        return True
    if getattr(_local, "importing", False):
        return False
    _local.importing = True
    try:
        app.loader.import_default_modules()
    finally:
        _local.importing = False
    app.__dict__[_DONE] = True
    return True
