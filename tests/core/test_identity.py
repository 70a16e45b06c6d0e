"""Identity: which calls are the same, canonical JSON, digests and time buckets."""

from __future__ import annotations

import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_dedup import (
    DedupKeyError,
    DedupTask,
    InvalidOptionError,
    MissingDeduplicationKey,
    dedup_key_for,
    time_bucket,
)
from celery_dedup.identity import ArgumentBinder, canonical_json, deterministic_task_id, lock_key


@pytest.fixture
def app() -> Celery:
    """An eager app on the memory store (identity needs no server)."""
    app = Celery("identity", set_as_current=False)
    app.conf.update(dedup_store="memory://identity", task_always_eager=True)
    return app


def make_task(app: Celery, **attrs: Any) -> Any:
    @app.task(base=DedupTask, shared=False, **attrs)
    def sync(a: Any, b: Any = 2, *, c: Any = None) -> None:
        return None

    return sync


def test_binding_makes_positional_and_keyword_calls_equal(app: Celery) -> None:
    """f(1, b=2), f(a=1, b=2), f(1, 2) and f(1) (default b=2) share one key."""
    task = make_task(app)
    keys = {
        dedup_key_for(task, (1,), {"b": 2}),
        dedup_key_for(task, (), {"a": 1, "b": 2}),
        dedup_key_for(task, (1, 2)),
        dedup_key_for(task, (1,)),
    }
    assert len(keys) == 1
    assert dedup_key_for(task, (1, 3)) not in keys


def test_bound_self_is_excluded(app: Celery) -> None:
    """A bind=True task's identity does not include the task instance."""

    @app.task(base=DedupTask, bind=True, shared=False)
    def bound(self: Any, x: int) -> int:
        return x

    assert dedup_key_for(bound, (1,)) == dedup_key_for(bound, (), {"x": 1})


def test_dict_keys_sorted_recursively_arrays_ordered(app: Celery) -> None:
    """Nested dict order never matters; list order does."""
    task = make_task(app)
    one = dedup_key_for(task, ({"x": {"p": 1, "q": [1, 2]}, "y": 0},))
    two = dedup_key_for(task, ({"y": 0, "x": {"q": [1, 2], "p": 1}},))
    three = dedup_key_for(task, ({"y": 0, "x": {"q": [2, 1], "p": 1}},))
    assert one == two
    assert one != three


def test_int_and_str_never_collide(app: Celery) -> None:
    """1, "1", 1.0 and True are four identities: JSON delivers each as itself."""
    task = make_task(app)
    keys = {dedup_key_for(task, (value,)) for value in (1, "1", 1.0, True)}
    assert len(keys) == 4


def test_dict_keys_are_keyed_as_the_serializer_delivers_them(app: Celery) -> None:
    """JSON delivers {1: x} as {"1": x}: one identity; pickle keeps them apart."""
    task = make_task(app)
    assert dedup_key_for(task, ({1: "x"},)) == dedup_key_for(task, ({"1": "x"},))
    assert dedup_key_for(task, ((1, 2),)) == dedup_key_for(task, ([1, 2],))
    pickled = make_task(app, serializer="pickle", name="pickled")
    assert dedup_key_for(pickled, ({1: "x"},)) != dedup_key_for(pickled, ({"1": "x"},))
    assert dedup_key_for(task, ({1: "x"},), serializer="pickle") != dedup_key_for(
        task, ({"1": "x"},), serializer="pickle"
    )


def test_user_dict_cannot_forge_a_tagged_value(app: Celery) -> None:
    """A dict shaped like an internal tag differs from the value it imitates."""
    task = make_task(app)
    when = date(2026, 11, 22)
    assert dedup_key_for(task, (when,)) != dedup_key_for(task, ({"$date": "2026-11-22"},))


def test_common_types_canonicalise_deterministically(app: Celery) -> None:
    """datetime, date, Decimal, UUID and tuples give stable keys; tuple equals list."""
    task = make_task(app)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    args = (datetime(2026, 11, 22, 14, 5, tzinfo=timezone.utc), Decimal("10.50"))
    assert dedup_key_for(task, args, {"c": ident}) == dedup_key_for(task, args, {"c": ident})
    assert dedup_key_for(task, ((1, 2),)) == dedup_key_for(task, ([1, 2],))
    assert dedup_key_for(task, (Decimal("10.5"),)) == dedup_key_for(task, (Decimal("10.50"),))
    assert dedup_key_for(task, (date(2026, 1, 1),)) != dedup_key_for(task, ("2026-01-01",))


@pytest.mark.parametrize(
    ("value", "fragment"),
    [({1, 2}, "set"), (object(), "object"), (float("nan"), "nan"), (float("inf"), "inf")],
)
def test_uncanonicalisable_argument_is_named(app: Celery, value: Any, fragment: str) -> None:
    """Sets, arbitrary objects, NaN and infinities raise DedupKeyError naming the argument."""
    task = make_task(app)
    with pytest.raises(DedupKeyError) as info:
        dedup_key_for(task, (1,), {"b": value})
    assert isinstance(info.value, TypeError)
    assert info.value.argument == "b"
    assert "'b'" in str(info.value) and fragment in str(info.value)


def test_nested_bad_value_names_its_path(app: Celery) -> None:
    """A set inside a dict is reported with its path."""
    task = make_task(app)
    with pytest.raises(DedupKeyError) as info:
        dedup_key_for(task, ({"tags": {"a"}},))
    assert info.value.argument == "a['tags']"


def test_unique_on_restricts_identity_and_uses_defaults(app: Celery) -> None:
    """unique_on keys on the named parameters only; a missing optional one uses its default."""
    task = make_task(app, unique_on=("a", "c"))
    assert dedup_key_for(task, (1, 5)) == dedup_key_for(task, (1, 9))
    assert dedup_key_for(task, (1,)) == dedup_key_for(task, (1,), {"c": None})
    assert dedup_key_for(task, (1,), {"c": 3}) != dedup_key_for(task, (1,))


def test_unique_on_unknown_parameter_is_rejected(app: Celery) -> None:
    """unique_on naming a parameter the task lacks raises InvalidOptionError when defined."""
    with pytest.raises(InvalidOptionError, match="unique_on") as info:
        make_task(app, unique_on=("nope",)).name  # noqa: B018 - evaluates the lazy task
    assert "'a', 'b', 'c'" in str(info.value)


def test_target_queue_is_part_of_identity(app: Celery) -> None:
    """The same arguments to another queue are another identity (Faktory)."""
    task = make_task(app)
    assert dedup_key_for(task, (1,), queue="a") != dedup_key_for(task, (1,), queue="b")
    assert dedup_key_for(task, (1,), queue="a") == dedup_key_for(task, (1,), queue="a")


def test_key_format_is_prefix_task_sha256(app: Celery) -> None:
    """Keys are {prefix}:{task}:{sha256 hex} and never contain raw arguments or keys."""
    task = make_task(app)
    key = dedup_key_for(task, ("secret@example.com",))
    assert key is not None
    prefix, name, digest = key.rsplit(":", 2)
    assert prefix == "celery-dedup" and name == task.name
    assert len(digest) == 32 and int(digest, 16) >= 0
    caller = dedup_key_for(task, (1,), deduplication_key="user-42-secret")
    assert caller is not None and "user-42-secret" not in caller


def test_deduplication_key_wins_over_strategy(app: Celery) -> None:
    """A per-call key makes calls with different arguments the same, and vice versa."""
    task = make_task(app)
    assert dedup_key_for(task, (1,), deduplication_key="k") == dedup_key_for(
        task, (2,), deduplication_key="k"
    )
    assert dedup_key_for(task, (1,), deduplication_key="k") != dedup_key_for(task, (1,))


def test_task_level_key_callable(app: Celery) -> None:
    """A task's deduplication_key callable receives the call's arguments; a call key wins."""
    task = make_task(app, deduplication_key=lambda a, b=2, c=None: f"user:{a}")
    assert dedup_key_for(task, (7, 1)) == dedup_key_for(task, (7, 2))
    assert dedup_key_for(task, (7,)) != dedup_key_for(task, (8,))
    assert dedup_key_for(task, (7,), deduplication_key="x") == dedup_key_for(
        task, (8,), deduplication_key="x"
    )


def test_caller_provided_requires_a_key(app: Celery) -> None:
    """identity='caller_provided' without a key raises MissingDeduplicationKey."""
    task = make_task(app, identity="caller_provided")
    with pytest.raises(MissingDeduplicationKey) as info:
        dedup_key_for(task, (1,))
    assert isinstance(info.value, ValueError) and task.name in str(info.value)
    assert dedup_key_for(task, (1,), deduplication_key="order-1") is not None


def test_always_unique_takes_no_lock_without_key(app: Celery) -> None:
    """identity='always_unique' has no key unless one is given."""
    task = make_task(app, identity="always_unique")
    assert dedup_key_for(task, (1,)) is None
    assert dedup_key_for(task, (1,), deduplication_key="k") is not None


def test_canonical_json_is_compact_and_sorted() -> None:
    """canonical_json sorts keys and drops whitespace."""
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == '{"a":[1,{"c":3,"d":2}],"b":1}'


@pytest.mark.parametrize(
    ("granularity", "expected"),
    [
        ("minute", "2026-11-22T14:05"),
        ("hour", "2026-11-22T14"),
        ("day", "2026-11-22"),
        ("week", "2026-W47"),
        ("month", "2026-11"),
    ],
)
def test_time_bucket(granularity: str, expected: str) -> None:
    """time_bucket formats each granularity in UTC."""
    assert time_bucket(granularity, datetime(2026, 11, 22, 14, 5, 59)) == expected


def test_time_bucket_converts_aware_datetimes() -> None:
    """Aware datetimes are converted to UTC before bucketing; the ISO week year is used."""
    berlin = timezone(timedelta(hours=1))
    assert time_bucket("day", datetime(2026, 11, 23, 0, 30, tzinfo=berlin)) == "2026-11-22"
    assert time_bucket("week", datetime(2027, 1, 1, tzinfo=timezone.utc)) == "2026-W53"


def test_time_bucket_defaults_to_now() -> None:
    """Without a datetime, the current UTC day is used."""
    assert time_bucket("day") == datetime.now(timezone.utc).strftime("%Y-%m-%d")


def test_time_bucket_rejects_unknown_granularity() -> None:
    """An unknown granularity names the allowed ones."""
    with pytest.raises(InvalidOptionError, match="'minute', 'hour', 'day', 'week', 'month'"):
        time_bucket("year")


def test_deterministic_id_is_uuid5_of_the_key() -> None:
    """The derived task id is a stable UUID for a key."""
    first = deterministic_task_id("celery-dedup:t:abc")
    assert first == deterministic_task_id("celery-dedup:t:abc")
    assert uuid.UUID(first).version == 5
    assert first != deterministic_task_id("celery-dedup:t:abd")


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["\ud800", "é\"\\\n\x00", "\u2028"])  # a lone surrogate, escapes
)


@given(a=_SCALARS, b=_SCALARS, queue=st.sampled_from(["celery", "q-é", 'q"x']))
@settings(max_examples=300, deadline=None)
def test_positional_scalar_keys_are_the_canonical_json_keys(a: Any, b: Any, queue: str) -> None:
    """The one-step key of positional scalars is the key of the canonical JSON identity.

    Written out by hand, the text must match ``canonical_json`` byte for
    byte: producers of other versions compute the same keys the general way.
    """
    app = Celery("identity-scalars", set_as_current=False)
    app.conf.update(dedup_store="memory://identity-scalars")

    @app.task(base=DedupTask, shared=False, name="t.scalars")
    def scalars(zed: Any, alpha: Any) -> None:
        return None

    expected = lock_key(
        "celery-dedup",
        "t.scalars",
        canonical_json(["strict", "t.scalars", queue, {"zed": a, "alpha": b}]),
    )
    assert dedup_key_for(scalars, (a, b), queue=queue) == expected
    # the general path (keyword arguments), which the one-step key must never differ from
    assert dedup_key_for(scalars, (), {"zed": a, "alpha": b}, queue=queue) == expected


def test_cached_key_parts_follow_the_queue_and_the_prefix(app: Celery) -> None:
    """What is kept per task for the key is kept per queue; a prefix changed later applies."""
    @app.task(base=DedupTask, shared=False, name="t.cached")
    def cached(x: int) -> None:
        return None

    first_a = dedup_key_for(cached, (1,), queue="a")
    first_b = dedup_key_for(cached, (1,), queue="b")
    assert first_a != first_b
    assert first_a == lock_key(
        "celery-dedup", "t.cached", canonical_json(["strict", "t.cached", "a", {"x": 1}])
    )
    assert dedup_key_for(cached, (1,), queue="a") == first_a
    app.conf.dedup_key_prefix = "other"
    later = dedup_key_for(cached, (1,), queue="a")
    assert later == "other:" + first_a.split(":", 1)[1]
    held = cached.apply_async((1,), queue="a")
    assert held.deduplication_key == later


_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4) | st.sampled_from(["$k", "$datetime"]), inner,
                      max_size=4),
    max_leaves=20,
)


@given(a=_JSON, b=_JSON)
@settings(max_examples=300, deadline=None)
def test_json_arguments_key_as_their_canonical_form(a: Any, b: Any) -> None:
    """JSON data keyed as it is (no canonical copy) gives the canonical form's text exactly."""
    def task(zed: Any, alpha: Any) -> None:
        return None

    binder = ArgumentBinder(task, "t.json")
    expected = canonical_json(["strict", "t.json", "q", {"zed": a, "alpha": b}])
    assert binder.identity("q", (a, b), None) == expected
    assert binder.identity("q", (), {"alpha": b, "zed": a}) == expected
