"""Options are validated where they are given, before anything is published."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_dedup import DedupTask, InvalidOptionError, dedup_key_for
from celery_dedup.runtime import runtime_for
from tests.fixtures.redis import RedisServer

from .conftest import AppFactory

BAD_CALL_OPTIONS = [
    ("unique_until", "sometimes", "'start', 'success', 'finish', 'expiry'"),
    ("on_duplicate", "ignore", "'existing', 'raise', 'replace', 'keep_last', 'cancel_running'"),
    ("identity", "loose", "'strict', 'caller_provided', 'always_unique'"),
    ("unique_for", -5, "greater than 0"),
    ("unique_for", "600", "seconds"),
    ("unique_for", True, "seconds"),
    ("unique_for", 1e17, "at most 315360000"),
    ("unique_for", float("nan"), "greater than 0"),
    ("deterministic_id", "yes", "True or False"),
    ("deduplication_key", 42, "a non-empty string"),
    ("deduplication_key", "", "a non-empty string"),
]


def queue_length(redis_server: RedisServer, queue: str) -> int:
    return int(redis_server.client(3).llen(queue))


@pytest.mark.parametrize(("option", "value", "allowed"), BAD_CALL_OPTIONS)
def test_bad_call_option_names_option_value_and_allowed(
    app_factory: AppFactory, redis_server: RedisServer, option: str, value: Any, allowed: str
) -> None:
    """A bad per-call option raises ValueError naming it, and publishes nothing."""
    app = app_factory("opts")

    @app.task(base=DedupTask, shared=False)
    def job(x: int) -> int:
        return x

    with pytest.raises(InvalidOptionError) as info:
        job.apply_async((1,), **{option: value})
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(f"{job.name}: {option}={value!r}")
    assert allowed in message
    assert queue_length(redis_server, "q-opts") == 0


@pytest.mark.parametrize(("option", "value", "allowed"), BAD_CALL_OPTIONS[:7])
def test_bad_task_attribute_fails_at_definition(option: str, value: Any, allowed: str) -> None:
    """A bad task attribute raises when the task is defined, not when it is called."""
    app = Celery("attrs", set_as_current=False)
    with pytest.raises(InvalidOptionError, match=allowed.replace("(", r"\(")) as info:

        @app.task(base=DedupTask, shared=False, **{option: value})
        def job(x: int) -> int:
            return x

        job.name  # noqa: B018 - tasks are created lazily; touching one evaluates it
    assert info.value.option == option


@pytest.mark.parametrize(
    ("setting", "value", "allowed"),
    [
        ("dedup_default_unique_until", "later", "'start', 'success'"),
        ("dedup_default_identity", "x", "'strict'"),
        ("dedup_default_on_duplicate", "x", "'existing'"),
        ("dedup_fallback", "ajar", "'open', 'closed'"),
        ("dedup_default_ttl", 0, "greater than 0"),
        ("dedup_key_prefix", "has space", "without whitespace"),
        ("dedup_send_events", "yes", "True or False"),
    ],
)
def test_bad_setting_names_the_setting(setting: str, value: Any, allowed: str) -> None:
    """A bad dedup_* setting raises on first use, naming setting, value and allowed values."""
    app = Celery("settings", set_as_current=False)
    app.conf.update({"task_always_eager": True, setting: value})

    @app.task(base=DedupTask, shared=False)
    def job(x: int) -> int:
        return x

    with pytest.raises(InvalidOptionError) as info:
        job.delay(1)
    assert str(info.value).startswith(f"{job.name}: {setting}={value!r}")
    assert allowed in str(info.value)


def test_precedence_call_over_task_over_settings() -> None:
    """A call option beats the task attribute, which beats the app setting."""
    app = Celery("precedence", set_as_current=False)
    app.conf.update(
        dedup_store="memory://precedence",
        dedup_default_ttl=111,
        dedup_default_unique_until="finish",
        dedup_key_prefix="myapp",
    )

    @app.task(base=DedupTask, shared=False, unique_until="expiry")
    def with_attr(x: int) -> int:
        return x

    @app.task(base=DedupTask, shared=False)
    def without_attr(x: int) -> int:
        return x

    assert with_attr.dedup_config().unique_until.value == "expiry"
    assert without_attr.dedup_config().unique_until.value == "finish"
    assert without_attr.dedup_config().unique_for == 111
    assert with_attr.dedup_config().resolve({"unique_until": "start"}).unique_until == "start"
    key = dedup_key_for(without_attr, (1,))
    assert key is not None and key.startswith("myapp:")
    assert runtime_for(app).settings.default_ttl == 111


def test_unique_for_accepts_timedelta_and_zero_means_bypass() -> None:
    """timedelta is seconds; unique_for=0 or None publishes with no lock at all."""
    app = Celery("td", set_as_current=False)
    app.conf.update(dedup_store="memory://td", task_always_eager=True)

    @app.task(base=DedupTask, shared=False, unique_for=timedelta(minutes=10))
    def job(x: int) -> int:
        return x

    assert job.dedup_config().unique_for == 600
    assert dedup_key_for(job, (1,), unique_for=0) is None
    assert job.apply_async((1,), unique_for=None).deduplicated is False
    assert job.apply_async((1,), unique_for=None).deduplication_key is None


def test_reset_runtime_rereads_settings() -> None:
    """reset_runtime makes an app in use pick up changed dedup_* settings and task options."""
    from celery_dedup.runtime import reset_runtime

    app = Celery("reset", set_as_current=False)
    app.conf.update(dedup_store="memory://reset", dedup_default_ttl=100)

    @app.task(base=DedupTask, shared=False)
    def job(x: int) -> int:
        return x

    assert job.dedup_config().unique_for == 100
    app.conf.dedup_default_ttl = 200
    # A changed setting takes effect on the next call (test fixtures do this).
    assert job.dedup_config().unique_for == 200
    assert runtime_for(app).settings.default_ttl == 200
    app.conf.dedup_default_ttl = 300
    reset_runtime(app)
    assert job.dedup_config().unique_for == 300
