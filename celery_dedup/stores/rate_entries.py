"""One window entry per publish: a task id made unique by a nonce, and the rate it
was admitted under.

A rate window counts publishes, not task ids: calls that share a task id
(``deterministic_id=True``, a caller's stable ``task_id=``) are each a
publish. Stores keep ``<task id>#<16 hex digits>~<limit>/<period ms>`` as an
entry's member and give the task id back in their answers and listings.

The rate (``rate_limit_per_key`` may be a callable: each call has its own)
rides with the entry: a store drops an entry only once it is older than
both the period of the call looking at the window and its own period
(``WINDOW_TRIM``), so a call under a shorter period never erases what a
call under a longer one must count; and ``celery dedup limits`` shows the
rate the newest publish was admitted under. Entries written before the
suffix (``<task id>#<nonce>``, or a bare task id) have no period of their own.
"""

from __future__ import annotations

import re
import secrets
from typing import Final

__all__ = ["WINDOW_TRIM", "new_entry", "own_period", "rate_of", "task_id_of"]

_SEPARATOR = "#"
_NONCE_HEX = 16
_ENTRY = re.compile(r"(?P<task_id>.*)#[0-9a-f]{16}(?:~(?P<limit>\d+)/(?P<period>\d+))?", re.S)

#: Lua, for the Redis scripts: drop the entries of the sorted set ``key`` older
#: than ``now - period`` whose own period (the member's ``~<limit>/<ms>``
#: suffix) is over too; returns how many older entries stay (the lowest
#: ranks of the set: the window of this call starts above them).
WINDOW_TRIM: Final = """
local function trim(key, now, period)
  local kept = 0
  local old = redis.call('ZRANGEBYSCORE', key, '-inf', now - period, 'WITHSCORES')
  for i = 1, #old, 2 do
    local own = tonumber(string.match(old[i], '#%x+~%d+/(%d+)$') or '0')
    if tonumber(old[i + 1]) <= now - own then
      redis.call('ZREM', key, old[i])
    else
      kept = kept + 1
    end
  end
  return kept
end
"""


def new_entry(task_id: str, limit: int | None = None, period: float | None = None) -> str:
    """A window member for one publish of ``task_id`` under ``limit``/``period``, unique
    among its window's."""
    entry = f"{task_id}{_SEPARATOR}{secrets.token_hex(_NONCE_HEX // 2)}"
    if limit is not None and period is not None:
        entry += f"~{limit}/{max(1, int(period * 1000))}"
    return entry


def task_id_of(entry: str) -> str:
    """The task id of a window member (a member written before nonces: itself)."""
    match = _ENTRY.fullmatch(entry)
    return match.group("task_id") if match else entry


def rate_of(entry: str) -> tuple[int, float] | None:
    """``(limit, period in seconds)`` a member was admitted under (``None``: not recorded)."""
    match = _ENTRY.fullmatch(entry)
    if match is None or match.group("limit") is None:
        return None
    return int(match.group("limit")), int(match.group("period")) / 1000.0


def own_period(entry: str) -> float:
    """The period a member was admitted under, in seconds (``0``: not recorded)."""
    rate = rate_of(entry)
    return 0.0 if rate is None else rate[1]
