"""One registry of options: the "did you mean" list, the validators and the docs agree."""

from __future__ import annotations

import warnings
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_dedup import (
    DedupMode,
    DedupTask,
    Identity,
    OnDuplicate,
    OnKeyReuse,
    OnRateLimit,
    UniqueUntil,
    options,
    registry,
    startup,
)
from celery_dedup.limits import LIMIT_OPTIONS
from celery_dedup.options import DedupConfigWarning
from celery_dedup.task import _ATTRIBUTES

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_registry_names_every_validated_option_and_setting() -> None:
    """What the code validates and reads is exactly what the registry lists."""
    assert set(registry.CALL_NAMES) == set(options.CALL_OPTIONS)
    assert set(registry.TASK_NAMES) == set(_ATTRIBUTES) | set(LIMIT_OPTIONS)
    assert set(registry.SETTING_NAMES) == set(options.SETTINGS) | {"dedup_store_options"}
    assert set(options.TASK_OPTIONS) == set(registry.TASK_NAMES)
    assert frozenset(registry.SETTING_NAMES) == options.KNOWN_SETTINGS
    assert set(startup.DEDUP_OPTIONS) == set(registry.TASK_NAMES)
    option_names = [o.name for o in registry.OPTIONS]
    setting_names = [s.name for s in registry.SETTINGS]
    assert len(option_names) == len(set(option_names))
    assert len(setting_names) == len(set(setting_names))
    # One word at every level on purpose: ``dedup_mode`` per call, per task and app-wide.
    assert set(option_names) & set(setting_names) == {"dedup_mode"}


@pytest.mark.parametrize(("name", "enum"), [
    ("unique_until", UniqueUntil), ("identity", Identity), ("on_duplicate", OnDuplicate),
    ("on_key_reuse", OnKeyReuse), ("on_rate_limit", OnRateLimit), ("dedup_mode", DedupMode),
])  # fmt: skip
def test_choice_options_list_every_value(name: str, enum: type[Enum]) -> None:
    """A choice option's documented values are its enum's values, all of them."""
    option = next(o for o in registry.OPTIONS if o.name == name)
    for member in enum:
        assert f'`"{member.value}"`' in option.values, (name, member.value)


@pytest.mark.parametrize(("page", "markers"), [
    ("usage.md", ("options", "settings")), ("api.md", ("options",)), ("django.md", ("django",)),
    ("limits.md", ("requires",)),
])  # fmt: skip
def test_docs_tables_are_the_registry(page: str, markers: tuple[str, ...]) -> None:
    """The docs' reference tables are rendered from the registry (scripts/option_tables.py)."""
    text = (DOCS / page).read_text()
    for marker in markers:
        assert f"<!-- options:{marker} -->" in text and f"<!-- /options:{marker} -->" in text
    assert registry.fill_tables(text) == text, f"run scripts/option_tables.py ({page})"
    for option in registry.OPTIONS if "options" in markers else ():
        assert f"| `{option.name}` |" in text


def _app(name: str) -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.update(broker_url="memory://", result_backend=None,
                    dedup_store=f"memory://{name}", task_default_queue=name)
    return app


@pytest.mark.parametrize(("typo", "meant", "value"), [
    ("concurency_limit", "concurrency_limit", 1),
    ("rate_limit_per_keys", "rate_limit_per_key", "1/m"),
    ("rate_keys", "rate_key", "{x}"),
    ("on_rate_limt", "on_rate_limit", "delay"),
    ("concurrency_backof", "concurrency_backoff", 5),
])  # fmt: skip
def test_misspelt_limit_option_on_a_task_warns(typo: str, meant: str, value: Any) -> None:
    """A misspelt limit option is not ignored silently: the warning names the right one."""
    app = _app(f"typo-{typo}")
    try:
        with pytest.warns(DedupConfigWarning) as caught:

            @app.task(base=DedupTask, shared=False, name=f"demo.{typo}", **{typo: value})
            def limited(x: int) -> int:
                return x

            assert limited.name == f"demo.{typo}"
        messages = [str(w.message) for w in caught]
        assert any(f"unknown task option {typo!r}" in m and f"did you mean {meant!r}?" in m
                   for m in messages), messages
    finally:
        app.close()


def test_limit_option_on_a_call_warns_and_is_not_published() -> None:
    """``concurrency_limit=`` on a call warns (a task option), is never a message property."""
    app = _app("call-limit")
    published: list[dict[str, Any]] = []

    def record(sender: Any = None, properties: Any = None, **_: Any) -> None:
        published.append(dict(properties or {}))

    before_task_publish.connect(record, weak=False)
    try:

        @app.task(base=DedupTask, shared=False, name="demo.call_limit")
        def work(x: int) -> int:
            return x

        with pytest.warns(DedupConfigWarning) as caught:
            work.apply_async((1,), concurrency_limit=1)
        assert any("'concurrency_limit' is a task option, not a call option" in str(w.message)
                   for w in caught)
        assert len(published) == 1 and "concurrency_limit" not in published[0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            work.apply_async((2,), concurrency_limit=1)  # once per task and name
        assert len(published) == 2 and "concurrency_limit" not in published[1]
    finally:
        before_task_publish.disconnect(record)
        app.close()


def test_a_correct_limit_option_does_not_warn() -> None:
    """The registry's names themselves never warn."""
    app = _app("no-warning")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DedupConfigWarning)

            @app.task(base=DedupTask, shared=False, name="demo.fine", concurrency_limit=1,
                      concurrency_key="{x}", rate_limit_per_key="5/m", rate_key="{x}",
                      on_rate_limit="delay", concurrency_backoff=2)
            def fine(x: int) -> int:
                return x

            assert fine.name == "demo.fine"
    finally:
        app.close()
