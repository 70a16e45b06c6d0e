"""Options that only work with another one: checked where the task is defined, at its first
use and at each call (``registry.REQUIRES`` says which).

``rate_key`` without ``rate_limit_per_key``, ``cancel_wait`` on a task that
does not cancel, ``debounce_max_wait`` without ``on_duplicate="replace"``:
each would be silently ignored, so each raises ``OptionCombinationError``
naming both options instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .exceptions import OptionCombinationError
from .registry import REQUIRES

__all__ = ["check_call", "check_resolved", "check_task"]


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
    if wanted and _text(actual) != wanted:
        raise OptionCombinationError(name, value, needed, wanted, _text(actual), task_name)


def check_task(own: Mapping[str, Any], lookup: Any, task_name: str, skip: frozenset[str]) -> None:
    """At definition: every option the task class itself sets, against what it resolves to.

    ``lookup(name)`` is the class's value (inherited ones included); an
    ``on_duplicate`` left to the app's setting is checked at first use.
    """
    for name in REQUIRES:
        if name in own and name not in skip:
            _check(name, own[name], lookup(REQUIRES[name][0]), task_name, undecided_ok=True)


def check_resolved(own: Mapping[str, Any], on_duplicate: Any, task_name: str) -> None:
    """At first use: options needing an ``on_duplicate`` the app's setting decided."""
    for name, (needed, _wanted) in REQUIRES.items():
        if needed == "on_duplicate" and name in own:
            _check(name, own[name], on_duplicate, task_name, undecided_ok=False)


def check_call(given: Mapping[str, Any], on_duplicate: Any, task_name: str) -> None:
    """At a call: the options it gives, against the ``on_duplicate`` it resolves to."""
    for name, (needed, _wanted) in REQUIRES.items():
        if needed == "on_duplicate" and name in given:
            _check(name, given[name], on_duplicate, task_name, undecided_ok=False)
