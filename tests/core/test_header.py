"""The ``celery_dedup`` header: what ``encode`` writes decodes; the rest is ``MalformedHeader``."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_dedup import MalformedHeader
from celery_dedup.header import HEADER, MAX_KEY, MAX_SECONDS, LockHeader, read_header
from celery_dedup.options import MAX_SECONDS as OPTIONS_MAX_SECONDS
from celery_dedup.policy import UniqueUntil

GOOD = LockHeader("celery-dedup:t:ab", UniqueUntil.FINISH, 10.0, True, "tok", True)
GUARD = {"v": 1, "key": "k", "until": "expiry", "for": 30, "replace": False, "tok": "guard:a"}


@given(
    key=st.text(min_size=1, max_size=MAX_KEY),
    until=st.sampled_from(list(UniqueUntil)),
    unique_for=st.floats(0, MAX_SECONDS, exclude_min=True),
    replace=st.booleans(),
    token=st.none() | st.text(min_size=1, max_size=64),
    last=st.booleans(),
    window=st.none() | st.floats(0, MAX_SECONDS, exclude_min=True),
)
def test_every_encoded_header_decodes_to_itself(
    key: str, until: UniqueUntil, unique_for: float, replace: bool, token: str | None, last: bool,
    window: float | None,
) -> None:
    """``decode(encode(h)) == h`` for every header the producer can write."""
    header = LockHeader(key, until, unique_for, replace, token, last, retry_window=window)
    assert LockHeader.decode(header.encode()) == header


def test_a_header_without_a_key_is_a_message_published_without_a_lock() -> None:
    """``{"v": 1}`` (and a ``None`` or empty key) is the unlocked header, not an error."""
    assert LockHeader.decode({"v": 1}) == LockHeader()
    assert LockHeader.decode({"v": 1, "key": None}) == LockHeader()
    assert LockHeader.decode({"key": ""}) == LockHeader()


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"v": 1, "key": "k", "until": "bogus", "for": 10}, "until"),
        ("bogus", "the header"),
        ([1, 2], "the header"),
        ({"v": 2, "key": "k"}, "v"),
        ({"v": "1", "key": "k"}, "v"),
        ({"v": True, "key": "k"}, "v"),
        ({"v": 1, "key": 5}, "key"),
        ({"v": 1, "key": "k" * (MAX_KEY + 1)}, "key"),
        ({"v": 1, "key": "k", "for": "10"}, "for"),
        ({"v": 1, "key": "k", "for": math.nan}, "for"),
        ({"v": 1, "key": "k", "for": math.inf}, "for"),
        ({"v": 1, "key": "k", "for": -1}, "for"),
        ({"v": 1, "key": "k", "for": 0}, "for"),
        ({"v": 1, "key": "k"}, "for"),
        ({"v": 1, "key": "k", "for": True}, "for"),
        ({"v": 1, "key": "k", "for": MAX_SECONDS * 2}, "for"),
        ({"v": 1, "key": "k", "for": 5, "replace": "yes"}, "replace"),
        ({"v": 1, "key": "k", "for": 5, "last": 1}, "last"),
        ({"v": 1, "key": "k", "for": 5, "tok": 12}, "tok"),
        ({"v": 1, "key": "k", "for": 5, "tok": "t" * 10_000}, "tok"),
        ({"v": 1, "key": "k", "for": 5, "until": ["start"]}, "until"),
        ({"v": 1, "key": "k", "for": 5, "rw": "60"}, "rw"),
        ({"v": 1, "key": "k", "for": 5, "rw": 0}, "rw"),
        ({"v": 1, "key": "k", "for": 5, "rw": math.inf}, "rw"),
    ],
)
def test_a_header_encode_cannot_have_written_is_malformed(raw: Any, field: str) -> None:
    """Each bad field raises ``MalformedHeader`` naming the field, a ``ValueError``."""
    with pytest.raises(MalformedHeader) as caught:
        LockHeader.decode(raw)
    assert caught.value.field == field
    assert isinstance(caught.value, ValueError)
    assert field in str(caught.value)
    with pytest.raises(MalformedHeader):
        read_header({HEADER: raw})


def test_the_message_of_a_malformed_header_is_short_whatever_it_held() -> None:
    """A huge value is cut in the message (it goes to the worker's log)."""
    with pytest.raises(MalformedHeader) as caught:
        LockHeader.decode({"v": 1, "key": "k" * 1_000_000})
    assert len(str(caught.value)) < 300


def test_read_header_reads_none_without_the_header() -> None:
    """No headers, headers without ours, or ours set to ``None``: no header."""
    assert read_header(None) is None
    assert read_header({}) is None
    assert read_header({HEADER: None}) is None
    assert read_header({HEADER: GOOD.encode()}) == GOOD
    guard = LockHeader("k", UniqueUntil.EXPIRY, 30.0, token="guard:a")
    assert read_header({HEADER: GUARD}) == guard


def test_the_longest_unique_for_is_the_options_one() -> None:
    """The header accepts exactly the ``unique_for`` values the options do."""
    assert MAX_SECONDS == OPTIONS_MAX_SECONDS
