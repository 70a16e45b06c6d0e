"""A DedupTask whose calls never collide behaves exactly as a plain Task (issue 21).

The same scenarios run through a plain app and a DedupTask app on a real
broker with a real worker (Redis and RabbitMQ), and eagerly; every call has
arguments no other call has, so nothing is ever a duplicate. Messages,
executions, states, results, retries and canvas outcomes must be the same
(see ``harness``); a difference is a bug unless the docs name it.

CI runs a fixed list covering every form once plus a few seeded random
batches; ``DEDUP_PARITY_FULL=1`` runs many more, randomly seeded.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .conftest import Pair
from .harness import Scenario, crc, describe_difference, run
from .scenarios import EAGER_CALLS, FULL, covering, scenarios

BATCH = 40 if FULL else 6
_nonces = itertools.count(1)


def _settings(full_examples: int) -> Any:
    return settings(
        max_examples=full_examples if FULL else 2,
        derandomize=not FULL,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )


#: the full run takes as long as it needs; CI's share stays bounded
pytestmark = pytest.mark.timeout(4 * 3600 if FULL else 300)


def compare(pair: Pair, batch: Sequence[Scenario], label: str) -> None:
    """Run ``batch`` on the plain side, then on the DedupTask side; assert no difference."""
    nonces = [crc(f"{label}:{next(_nonces)}:{i}") for i in range(len(batch))]
    outcomes: dict[str, list[dict[str, Any]]] = {}
    for side in (pair.plain, pair.dedup):
        with pair.working(side):
            outcomes[side.label] = [
                run(side, pair.capture, scenario, nonce)
                for scenario, nonce in zip(batch, nonces, strict=True)
            ]
    differences = [
        f"{scenario}\n{describe_difference(plain, dedup)}"
        for scenario, plain, dedup in zip(batch, outcomes["plain"], outcomes["dedup"],
                                          strict=True)
        if plain != dedup
    ]
    assert not differences, "\n\n".join(differences)
    unsettled = [s for s, o in zip(batch, outcomes["plain"], strict=True) if not o["settled"]]
    assert not unsettled, f"runs that never settled (on both sides): {unsettled}"


def test_covering_list_on_redis(redis_pair: Pair) -> None:
    """Every call form, route form, serializer and option at least once, on Redis."""
    compare(redis_pair, covering(), "redis-cover")


def test_covering_list_on_rabbitmq(amqp_pair: Pair) -> None:
    """The same on RabbitMQ."""
    compare(amqp_pair, covering(), "amqp-cover")


@_settings(full_examples=10)
@given(batch=st.lists(scenarios(), min_size=BATCH, max_size=BATCH))
def test_generated_on_redis(redis_pair: Pair, batch: list[Scenario]) -> None:
    """Generated scenarios on Redis."""
    compare(redis_pair, batch, "redis-gen")


@_settings(full_examples=10)
@given(batch=st.lists(scenarios(), min_size=BATCH, max_size=BATCH))
def test_generated_on_rabbitmq(amqp_pair: Pair, batch: list[Scenario]) -> None:
    """Generated scenarios on RabbitMQ."""
    compare(amqp_pair, batch, "amqp-gen")


def test_covering_list_eager(eager_pair: Pair) -> None:
    """Every eager call form (``send_task`` is never eager) with the same options, eagerly."""
    compare(eager_pair, covering(EAGER_CALLS), "eager-cover")


@_settings(full_examples=10)
@given(batch=st.lists(scenarios(EAGER_CALLS), min_size=BATCH, max_size=BATCH))
def test_generated_eager(eager_pair: Pair, batch: list[Scenario]) -> None:
    """Generated scenarios, eagerly."""
    compare(eager_pair, batch, "eager-gen")
