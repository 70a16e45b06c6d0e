"""The settings lint at call time: each task's first call.

The first call of each task in a process runs the lint's settings rules
for that task (no store round trip; the server rules only from an answer
the worker's start or ``celery dedup check`` already got) and warns with a
``DedupLintWarning`` per finding.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from .lint import Finding, app_facts, lint_config, lint_server, task_facts

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["DedupLintWarning", "lint_first_call"]


class DedupLintWarning(UserWarning):
    """A setting that lets duplicates or lost work through (``celery_dedup.lint``).

    Not a ``DedupConfigWarning`` (a misspelt or ignored option): a test
    suite that turns warnings into errors can let these through by category.
    """


def _warn(findings: list[Finding]) -> None:
    for finding in findings:
        warnings.warn(finding.line(), DedupLintWarning, stacklevel=4)


def lint_first_call(task: Any, runtime: Runtime) -> None:
    """Warn about ``task``'s settings, once per task and process."""
    runtime.linted.add(task.name)
    try:
        facts, mine = app_facts(task.app), task_facts(task)
    except Exception:  # an invalid option raises on the call's own path
        return
    found = lint_config(facts, [mine])
    if runtime.durability is not None:
        found += lint_server(facts, [mine], runtime.durability)
    if "" in runtime.linted:  # the app-wide findings were reported already
        found = [finding for finding in found if finding.task is not None]
    runtime.linted.add("")
    _warn(found)
