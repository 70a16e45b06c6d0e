"""Options that only work with another one are refused where they are combined (issue 31).

At the task's definition (``@app.task``), at its first use when an app
setting decided (``dedup_default_on_duplicate``), and at a call that
combines them: ``OptionCombinationError`` (an ``InvalidOptionError``, a
``ValueError``) naming the task, both options and what was found. Nothing is
published by a refused call.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_dedup import DedupTask, InvalidOptionError, OptionCombinationError
from celery_dedup.registry import REQUIRES

from .conftest import AppFactory

#: option → (its value, the options that make it meaningful)
GIVEN: dict[str, tuple[Any, dict[str, Any]]] = {
    "rate_key": ("{user}", {"rate_limit_per_key": "5/m"}),
    "on_rate_limit": ("delay", {"rate_limit_per_key": "5/m"}),
    "concurrency_key": ("{user}", {"concurrency_limit": 2}),
    "concurrency_backoff": (1.0, {"concurrency_limit": 2}),
    "debounce_max_wait": (30, {"on_duplicate": "replace"}),
    "cancel_wait": (5, {"on_duplicate": "cancel_running"}),
    "cancel_signal": ("SIGTERM", {"on_duplicate": "cancel_running"}),
    "retry_window": (5, {"unique_until": "success"}),
}

#: the value of a decided option that makes each option meaningless
WRONG: dict[str, dict[str, Any]] = {
    "on_duplicate": {"on_duplicate": "existing"},
    "unique_until": {"unique_until": "finish"},
}


def test_every_requirement_is_covered() -> None:
    assert set(GIVEN) == set(REQUIRES)


@pytest.mark.parametrize("option", sorted(GIVEN))
def test_definition_refuses_an_option_without_its_partner(
    app_factory: AppFactory, option: str
) -> None:
    app = app_factory("combo-def")
    value, partner = GIVEN[option]
    needed = REQUIRES[option][0]
    wrong = WRONG.get(needed, {})
    with pytest.raises(OptionCombinationError) as info:

        @app.task(base=DedupTask, shared=False, name=f"combo.{option}", **{option: value}, **wrong)
        def job(user: str) -> None:
            return None

        job.name  # noqa: B018 - tasks are created lazily; touching one evaluates it

    exc = info.value
    assert isinstance(exc, InvalidOptionError) and isinstance(exc, ValueError)
    assert (exc.option, exc.requires, exc.task_name) == (option, needed, f"combo.{option}")
    assert option in str(exc) and needed in str(exc) and f"combo.{option}" in str(exc)

    # With its partner, the same task is defined and publishes.
    @app.task(base=DedupTask, shared=False, name=f"combo.ok.{option}", **{option: value},
              **partner)
    def fine(user: str) -> None:
        return None

    assert fine.delay("ada").deduplicated is False


@pytest.mark.parametrize("option", ["debounce_max_wait", "cancel_wait", "cancel_signal"])
def test_first_use_checks_the_app_default_policy(app_factory: AppFactory, option: str) -> None:
    """``on_duplicate`` left to ``dedup_default_on_duplicate``: checked at the first call,
    before anything is published."""
    app = app_factory("combo-default", dedup_default_on_duplicate="existing")
    value, _ = GIVEN[option]

    @app.task(base=DedupTask, shared=False, name=f"combo.default.{option}", **{option: value})
    def job(user: str) -> None:
        return None

    with pytest.raises(OptionCombinationError, match="on_duplicate is 'existing'"):
        job.delay("ada")
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(app.conf.task_default_queue) == 0

    wanted = REQUIRES[option][1]
    other = app_factory("combo-default-ok", dedup_default_on_duplicate=wanted)

    @other.task(base=DedupTask, shared=False, name=f"combo.default.ok.{option}",
                **{option: value})
    def fine(user: str) -> None:
        return None

    assert fine.delay("ada").deduplicated is False


@pytest.mark.parametrize("option", ["debounce_max_wait", "cancel_wait", "cancel_signal"])
def test_a_call_combining_them_raises_before_publishing(
    app_factory: AppFactory, option: str
) -> None:
    app = app_factory("combo-call")
    value, partner = GIVEN[option]

    @app.task(base=DedupTask, shared=False, name=f"combo.call.{option}")
    def job(user: str) -> None:
        return None

    with pytest.raises(OptionCombinationError) as info:
        job.apply_async(("ada",), **{option: value})
    assert info.value.task_name == job.name and info.value.actual == "existing"
    with pytest.raises(OptionCombinationError):
        job.s("ada").set(**{option: value}).apply_async()
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(app.conf.task_default_queue) == 0
    # Given together at the call, they publish.
    assert job.apply_async(("ada",), **{option: value}, **partner).deduplicated is False


def test_a_base_class_may_carry_defaults_for_its_tasks(app_factory: AppFactory) -> None:
    """A base's ``cancel_wait`` is a default for the tasks that cancel, not an error for
    the others: only what a task sets itself is checked."""
    app = app_factory("combo-base")

    class Base(DedupTask):
        abstract = True
        cancel_wait = 3

    @app.task(base=Base, shared=False, name="combo.base.plain")
    def plain(user: str) -> None:
        return None

    assert plain.delay("ada").deduplicated is False


@pytest.mark.parametrize("option", sorted(GIVEN))
def test_observe_composes_with_every_option(app_factory: AppFactory, option: str) -> None:
    """``dedup_mode="observe"`` needs no partner and refuses none: with each option and its
    partner (on the task, or at the call through a signature), a duplicate is published."""
    app = app_factory("combo-observe")
    value, partner = GIVEN[option]

    @app.task(base=DedupTask, shared=False, name=f"combo.observe.{option}",
              **{option: value}, **partner, dedup_mode="observe")
    def job(user: str) -> None:
        return None

    first = job.delay("ada")
    again = job.delay("ada")
    assert first.deduplicated is False and again.deduplicated is False
    assert again.id != first.id
    # The same combination an option at a time at the call, observed per call.
    if REQUIRES[option][0] in ("on_duplicate", "unique_until"):

        @app.task(base=DedupTask, shared=False, name=f"combo.observe.call.{option}")
        def plain(user: str) -> None:
            return None

        sig = plain.s("ada").set(**{option: value}, **partner)
        assert sig.apply_async().deduplicated is False
        assert sig.clone().set(dedup_mode="observe").apply_async().deduplicated is False
