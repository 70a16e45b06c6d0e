"""The deferral backoff: exponential, jittered, capped, within the visibility timeout."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_dedup import backoff


class Ends(random.Random):
    """A ``Random`` whose ``uniform`` returns its low (``low=True``) or high end."""

    def __init__(self, low: bool) -> None:
        super().__init__(0)
        self.low = low

    def uniform(self, a: float, b: float) -> float:
        return a if self.low else b


def test_the_steps_double_from_the_base_up_to_the_cap() -> None:
    """1, 2, 4, 8, 16, 32, then 60 s for every later deferral (highest draws)."""
    high = Ends(low=False)
    steps = [backoff.countdown(n, rng=high) for n in range(9)]
    assert steps == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_the_jitter_draws_between_half_and_all_of_a_step() -> None:
    """The lowest draw is half the step; draws of a real ``Random`` stay in between."""
    assert backoff.countdown(3, rng=Ends(low=True)) == 4.0
    rng = random.Random(7)
    draws = [backoff.countdown(3, rng=rng) for _ in range(200)]
    assert all(4.0 <= d <= 8.0 for d in draws)
    assert len(set(draws)) > 100


def test_a_reason_starts_from_its_own_base() -> None:
    """A running copy's first step is a third of the lease (20 s of 60 s)."""
    assert backoff.countdown(0, base=20.0, rng=Ends(low=False)) == 20.0
    assert backoff.countdown(1, base=20.0, rng=Ends(low=False)) == 40.0
    assert backoff.countdown(2, base=20.0, rng=Ends(low=False)) == backoff.CAP


@pytest.mark.parametrize(
    ("visibility", "limit"),
    [(0.0, None), (3600.0, 3240.0), (30.0, 27.0), (8.0, 7.2), (2.0, 1.5), (1.0, 0.5)],
)
def test_the_ceiling_keeps_a_margin_below_the_visibility_timeout(
    visibility: float, limit: float | None
) -> None:
    """The timeout minus 0.5 s or 10 %, never below half of it; no limit without a timeout."""
    assert backoff.ceiling(visibility) == limit


@given(
    deferrals=st.integers(-5, 10_000),
    base=st.floats(0.0, 1e6),
    visibility=st.floats(0.0, 1e6),
)
def test_no_countdown_outlasts_the_visibility_timeout(
    deferrals: int, base: float, visibility: float
) -> None:
    """Whatever the count, base and timeout: ``0 <= countdown <= min(CAP, ceiling)``."""
    value = backoff.countdown(deferrals, base=base, visibility_timeout=visibility)
    assert 0.0 <= value <= backoff.CAP
    if visibility > 0:
        assert value < visibility
        limit = backoff.ceiling(visibility)
        assert limit is not None and value <= limit


def test_the_count_travels_tagged_with_its_attempt() -> None:
    """A count read back under its own attempt; another attempt's (a retry's) reads 0."""
    request = SimpleNamespace(dedup_deferred=backoff.mark("0.0", 4))
    assert backoff.deferrals_of(request, "0.0") == 4
    assert backoff.deferrals_of(request, "1.0") == 0
    headers_only = SimpleNamespace(headers={backoff.FIELD: backoff.mark("2.1", 3)})
    assert backoff.deferrals_of(headers_only, "2.1") == 3


@pytest.mark.parametrize(
    "value", [None, 7, "7", "0.0/", "0.0/x", "0.0/-1", "0.0/²", "0.0/" + "9" * 100, ["0.0/1"]]
)
def test_a_count_this_module_did_not_write_counts_as_none(value: object) -> None:
    """A missing, foreign or hostile field reads as no deferral yet."""
    assert backoff.deferrals_of(SimpleNamespace(dedup_deferred=value), "0.0") == 0


def test_a_huge_count_is_read_as_the_most() -> None:
    """A forged count cannot make the arithmetic overflow: the step is the cap."""
    request = SimpleNamespace(dedup_deferred="0.0/" + "9" * 30)
    assert backoff.deferrals_of(request, "0.0") == 64
    assert backoff.countdown(10**9, rng=Ends(low=False)) == backoff.CAP
