"""Options that only work with another one: checked where the task is defined, at its first
use and at each call (``registry.REQUIRES`` says which).

``rate_key`` without ``rate_limit_per_key``, ``cancel_wait`` on a task that
does not cancel, ``debounce_max_wait`` without ``on_duplicate="replace"``:
each would be silently ignored, so each raises ``OptionCombinationError``
naming both options instead. ``retry_window`` needs a ``unique_until``
that keeps a failed run's lock (``"success"`` or ``"expiry"``: a wanted
value ``"a|b"`` means either) and must be shorter than ``unique_for`` (a
cooldown as long as the window shortens nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .exceptions import InvalidOptionError, OptionCombinationError
from .registry import REQUIRES

__all__ = ["check_call", "check_resolved", "check_task", "check_window"]

#: the options a call or an app setting may decide, so checked against what they resolve to
_DECIDED = ("on_duplicate", "unique_until")


def _text(value: Any) -> str:
    return str(getattr(value, "value", value))


def _check(name: str, value: Any, actual: Any, task_name: str, undecided_ok: bool) -> None:
    requires = REQUIRES.get(name)
    if requires is None or value is None:
        return
    needed, wanted = requires
    if actual is None:
        if wanted and undecided_ok:
            return  # an app setting decides: checked again at first use
        raise OptionCombinationError(name, value, needed, wanted, None, task_name)
    if wanted and _text(actual) not in wanted.split("|"):
        raise OptionCombinationError(name, value, needed, wanted, _text(actual), task_name)


def check_task(own: Mapping[str, Any], lookup: Any, task_name: str, skip: frozenset[str]) -> None:
    """At definition: every option the task class itself sets, against what it resolves to.

    ``lookup(name)`` is the class's value (inherited ones included); an
    ``on_duplicate`` left to the app's setting is checked at first use.
    """
    for name in REQUIRES:
        if name in own and name not in skip:
            _check(name, own[name], lookup(REQUIRES[name][0]), task_name, undecided_ok=True)


def check_resolved(own: Mapping[str, Any], resolved: Mapping[str, Any], task_name: str) -> None:
    """At first use: options needing an ``on_duplicate`` or ``unique_until`` an app setting
    decided (``resolved``: the task's resolved value of each)."""
    for name, (needed, _wanted) in REQUIRES.items():
        if needed in _DECIDED and name in own:
            _check(name, own[name], resolved[needed], task_name, undecided_ok=False)


def check_call(given: Mapping[str, Any], resolved: Mapping[str, Any], task_name: str) -> None:
    """At a call: the options it gives, against the ``on_duplicate`` and ``unique_until`` it
    resolves to."""
    for name, (needed, _wanted) in REQUIRES.items():
        if needed in _DECIDED and name in given:
            _check(name, given[name], resolved[needed], task_name, undecided_ok=False)


def check_window(window: float | None, unique_for: float | None, task_name: str) -> None:
    """``retry_window`` shorter than ``unique_for``: a cooldown the window does not outlast."""
    if window is not None and unique_for is not None and window >= unique_for:
        raise InvalidOptionError(
            "retry_window",
            window,
            f"seconds shorter than unique_for ({unique_for:g}), or None",
            task_name,
        )
