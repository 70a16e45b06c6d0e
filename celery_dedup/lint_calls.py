"""The settings lint at call time: each task's first call, and calls with a countdown.

The first call of each task in a process runs the lint's settings rules
for that task (no store round trip; the server rules only from an answer
the worker's start or ``celery dedup check`` already got) and warns with a
``DedupLintWarning`` per finding. A call with a ``countdown`` or ``eta``
longer than the broker's ``visibility_timeout`` warns once per task (W104):
the lint cannot know the longest countdown before a call makes it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .lint import Finding, app_facts, lint_config, lint_countdown, lint_server, task_facts

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["DedupLintWarning", "lint_call_delay", "lint_first_call"]


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


def _delay(options: Mapping[str, Any]) -> float:
    countdown = options.get("countdown")
    if countdown:
        return float(countdown)
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if not isinstance(eta, datetime):
        return 0.0
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=timezone.utc)
    return (eta - datetime.now(timezone.utc)).total_seconds()


def lint_call_delay(task: Any, runtime: Runtime, options: Mapping[str, Any]) -> None:
    """W104, once per task: this call waits longer than the broker redelivers."""
    marker = f"{task.name}\0W104"
    if marker in runtime.linted:
        return
    delay = _delay(options)
    if delay <= runtime.settings.visibility_timeout:
        return
    try:
        finding = lint_countdown(app_facts(task.app), task_facts(task), delay)
    except Exception:  # an invalid option raises on the call's own path
        return
    runtime.linted.add(marker)
    if finding is not None:
        _warn([finding])
