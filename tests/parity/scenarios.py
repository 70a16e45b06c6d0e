"""Hypothesis strategies of parity scenarios, and a fixed list covering every form once."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hypothesis import strategies as st

from .harness import ROUTES, SERIALIZERS, Scenario

#: ``DEDUP_PARITY_FULL=1``: many more, randomly seeded scenarios (not for CI)
FULL = os.environ.get("DEDUP_PARITY_FULL", "") not in ("", "0")

CALLS = ("delay", "apply_async", "s", "si", "send_task", "chain", "group", "chord", "nested")
#: calls that take apply_async options (``delay`` takes none)
EAGER_CALLS = tuple(c for c in CALLS if c != "send_task")  # send_task ignores eager mode

#: every apply_async option Celery documents, with values a scenario may use
OPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "countdown": st.sampled_from([0.05, 0.25]),
    "eta": st.sampled_from([0.05, 0.25]),
    "expires": st.sampled_from([60, 90.5]),
    "expires_at": st.just(120),
    "priority": st.integers(0, 9),
    "time_limit": st.just(30),
    "soft_time_limit": st.just(20),
    "ignore_result": st.booleans(),
    "headers": st.just({"x-par": "v"}),
    "shadow": st.just("par.shadowed"),
    "link": st.just(True),
    "link_error": st.just(True),
    "add_to_parent": st.booleans(),
    "queue": st.sampled_from(["q1", "q2", "qx"]),
    "exchange_rk": st.just(True),
    "compression": st.sampled_from(["zlib", "gzip", "bzip2"]),
    "retry": st.booleans(),
    "retry_policy": st.just({"max_retries": 2, "interval_start": 0}),
    "serializer": st.sampled_from(SERIALIZERS),
}


@st.composite
def options(draw: Any, max_size: int = 5) -> tuple[tuple[str, Any], ...]:
    names = draw(st.lists(st.sampled_from(sorted(OPTIONS)), unique=True, max_size=max_size))
    return tuple((name, draw(OPTIONS[name])) for name in sorted(names))


def celery_limitation(scenario: Scenario) -> bool:
    """A scenario plain Celery itself cannot run, identically on both sides.

    kombu's msgpack writes a chain holding a chord (``nested``) as a body the
    worker cannot decode ("unpack(b) received extra data"): the message is
    dropped by the worker with or without celery-dedup.
    """
    options = dict(scenario.options)
    serializer = options.get("serializer") or scenario.serializer
    return scenario.call == "nested" and serializer == "msgpack"


@st.composite
def scenarios(draw: Any, calls: tuple[str, ...] = CALLS) -> Scenario:
    """One call: its form, routes, serializer, options and what its first task does."""
    fail = draw(st.booleans())
    found = Scenario(
        routes=draw(st.sampled_from(ROUTES)),
        serializer=draw(st.sampled_from(SERIALIZERS)),
        call=draw(st.sampled_from(calls)),
        options=draw(options()),
        retries=draw(st.integers(0, 2)),
        replace=not fail and draw(st.booleans()),
        fail=fail,
        members=draw(st.integers(1, 3)),
    )
    if celery_limitation(found):
        kept = tuple((name, value) for name, value in found.options if name != "serializer")
        found = dataclasses.replace(found, serializer="json", options=kept)
    return found


def covering(calls: tuple[str, ...] = CALLS) -> list[Scenario]:
    """Every call form, route form, serializer and option at least once (the CI floor)."""
    names = sorted(OPTIONS)
    values: dict[str, Any] = {
        "countdown": 0.05, "eta": 0.05, "expires": 60, "expires_at": 120, "priority": 5,
        "time_limit": 30, "soft_time_limit": 20, "ignore_result": False,
        "headers": {"x-par": "v"}, "shadow": "par.shadowed", "link": True,
        "link_error": True, "add_to_parent": False, "queue": "q1", "exchange_rk": True,
        "compression": "zlib", "retry": True, "retry_policy": {"max_retries": 1},
        "serializer": "json",
    }
    found = []
    count = max(len(calls) * 2, len(names))
    for i in range(count):
        chosen = {names[(i * 3 + k) % len(names)] for k in range(3)}
        if "queue" in chosen and "exchange_rk" in chosen:
            chosen.discard("exchange_rk")
        found.append(Scenario(
            routes=ROUTES[i % len(ROUTES)],
            serializer=SERIALIZERS[i % len(SERIALIZERS)],
            call=calls[i % len(calls)],
            options=tuple((name, values[name]) for name in sorted(chosen)),
            retries=i % 3 if i % 4 == 1 else 0,
            replace=i % 5 == 2,
            fail=i % 7 == 3,
            members=1 + i % 3,
        ))
    return found
