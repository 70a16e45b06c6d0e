"""What celery-dedup needs from the Celery it runs on (5.3 to 5.7).

Every difference between the supported Celery minors that the package meets
is handled here, in one place, each with the version that brought it:

* ``Task._dump_pydantic_arguments`` (Celery 5.5, ``@app.task(pydantic=True)``):
  ``DedupTask`` computes keys on the arguments ``apply_async`` publishes,
  which for a pydantic task are the dumped models. Celery before 5.5 has no
  pydantic tasks, so the attribute is given its 5.5 default (``None``: "no
  dump") on ``celery.Task``, exactly what 5.5+ declares.

* ``Task.push_request`` (Celery 5.5 keeps the current request's fields in
  the request it pushes): ``DedupTask`` has its own ``__call__``, which
  calls ``Task.__call__``, which pushes a request of the call's arguments.
  Before 5.5 that request lost the message's fields, so ``self.request.id``
  read ``None`` in the body of a bound task (eager mode, thread and solo
  pools). ``DedupTask`` gets 5.5's ``push_request`` there (``backport``).

Importing ``celery_dedup`` applies them; nothing here changes what a newer
Celery does.
"""

from __future__ import annotations

from typing import Any

import celery
from celery import Task
from celery.app.task import Context

__all__ = ["CELERY_VERSION", "at_least", "backport"]

#: (major, minor) of the running Celery
CELERY_VERSION: tuple[int, int] = tuple(int(n) for n in celery.__version__.split(".")[:2])  # type: ignore[assignment]


def at_least(major: int, minor: int) -> bool:
    """Whether the running Celery is ``major.minor`` or newer."""
    return (major, minor) <= CELERY_VERSION


def _push_request(self: Task[Any, Any], *args: Any, **kwargs: Any) -> None:
    """Celery 5.5's ``Task.push_request``: the new request keeps the current one's fields."""
    self.request_stack.push(Context(*args, **{**self.request.__dict__, **kwargs}))


def backport(task_class: type[Task[Any, Any]]) -> None:
    """Give ``task_class`` what it relies on from Celery 5.5 when an older Celery runs."""
    if not at_least(5, 5):
        task_class.push_request = _push_request  # type: ignore[method-assign]


if not hasattr(Task, "_dump_pydantic_arguments"):  # Celery < 5.5
    Task._dump_pydantic_arguments = None  # type: ignore[attr-defined]
