"""Keep a test app's task registry to the tasks of the modules a test names.

Celery adds every task defined with its default ``shared=True`` to every app
finalized afterwards, so an app of one test module also holds the tasks of
every other test module pytest imported: tests that judge *all* of an app's
tasks (``celery dedup check``, the settings lint) drop the foreign ones.
"""

from __future__ import annotations

from typing import Any

from celery import Celery


def own_tasks_only(app: Celery, *modules: str) -> Celery:
    """When ``app`` is finalized, drop the test modules' tasks not defined in ``modules``."""

    def prune(sender: Celery, **_: Any) -> None:
        for name, task in list(sender.tasks.items()):
            if task.__module__.startswith("tests.") and task.__module__ not in modules:
                del sender.tasks[name]

    app.on_after_finalize.connect(prune, weak=False)
    return app
