"""Fencing tokens: a side effect that a newer run of its key has passed is refused.

A lock keeps two runs of a key from *starting* together, but not from
*overlapping*: a body that outlives its lock (``unique_for`` lapsed while
it ran), a run cancelled or replaced that does not stop, or one a stalled
store let a copy overlap, still finishes its work after a newer run did
its own. A task with ``fence=True`` gets, in its start claim's round trip,
a fencing token (``current_fence()``): a number greater than every token
given to an earlier run of its key. A write that stores the token beside
the data and only lands while the stored token is not greater
(``fenced_update``, ``fenced_hset``, the Django ``FencedQuerySet``) cannot
be overwritten by an older run: the late write of a stale run is refused.

The same run may write several times: a write lands while the stored token
is less than **or equal to** its own (two runs never share a token).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from .exceptions import NoFenceError

if TYPE_CHECKING:
    from redis import Redis
    from sqlalchemy import Table

__all__ = [
    "FENCED_HSET",
    "FENCE_FIELD",
    "current_fence",
    "fenced_hset",
    "fenced_update",
]

#: The request field a fenced run's token is kept in (``self.request.dedup_fence``).
FENCE_FIELD: Final = "dedup_fence"


def current_fence() -> int:
    """The fencing token of the run executing now (a task with ``fence=True``).

    Raises ``NoFenceError`` outside such a run: outside a task, in a task
    without ``fence=True``, in a call that has no deduplication key (no
    lock, no fence) and in an eager call (``task.apply()``).
    """
    from celery import current_task

    if not current_task:  # a proxy: false outside a task
        raise NoFenceError("not called inside a task's body")
    task = current_task
    if task.request.id is None:
        raise NoFenceError("not called inside a task's body")
    fence = getattr(task.request, FENCE_FIELD, None)
    if fence is None:
        reason = (
            "the task does not set fence=True"
            if not getattr(task, "fence", None)
            else "this run took no lock (no deduplication key, or an eager call)"
        )
        raise NoFenceError(reason, task.name)
    return int(fence)


# KEYS[1] - the hash the side effect writes
# ARGV[1] - the writer's fencing token
# ARGV[2] - the hash field the token is kept in
# ARGV[3..] - field, value pairs to write
# return 1 written, 0 refused (the hash holds a greater token)
FENCED_HSET: Final = """
local kept = redis.call('hget', KEYS[1], ARGV[2])
if kept and tonumber(kept) > tonumber(ARGV[1]) then
    return 0
end
redis.call('hset', KEYS[1], ARGV[2], ARGV[1], unpack(ARGV, 3))
return 1
"""


def fenced_hset(
    client: Redis,
    key: str,
    fence: int,
    mapping: Mapping[str, Any],
    *,
    fence_field: str = "fence",
) -> bool:
    """Write ``mapping`` into the hash ``key`` unless it holds a greater token.

    One script (one round trip): the token is stored in ``fence_field``
    with the values. Returns whether the write landed.
    """
    if not mapping:
        raise ValueError("fenced_hset needs at least one field to write")
    if fence_field in mapping:
        raise ValueError(f"fenced_hset: {fence_field!r} is the token's field, not a value")
    pairs = [item for pair in mapping.items() for item in pair]
    script = client.register_script(FENCED_HSET)
    return bool(script(keys=[key], args=[int(fence), fence_field, *pairs]))


def fenced_update(
    connection: Any,
    table: Table,
    fence: int,
    where: Mapping[str, Any],
    values: Mapping[str, Any],
    *,
    fence_column: str = "fence",
) -> bool:
    """``UPDATE table SET values, fence = :fence WHERE where AND fence <= :fence``.

    ``connection`` is a SQLAlchemy ``Connection`` or ``Session`` (the
    caller commits); ``where`` maps column names to the values selecting
    the row, ``values`` the columns to set. A row whose token is ``NULL``
    counts as never written. One statement; returns whether a row was
    updated (``False``: no such row, or a newer run wrote it).
    """
    from sqlalchemy import and_, or_, update

    if not where:
        raise ValueError("fenced_update needs a where= to select the row")
    if fence_column in values:
        raise ValueError(f"fenced_update: {fence_column!r} is the token's column, not a value")
    token = table.c[fence_column]
    conditions = [table.c[name] == value for name, value in where.items()]
    statement = (
        update(table)
        .where(and_(*conditions, or_(token.is_(None), token <= int(fence))))
        .values({**values, fence_column: int(fence)})
    )
    return bool(connection.execute(statement).rowcount)
