"""Concurrency slots and publish rates in PostgreSQL (``SlotSupport``, ``RateSupport``).

One row per slot key and one per rate key, the holders (``{holder: lease
expiry}``) or the window (``[[time, publish], …]``, a publish being its task
id and a nonce, so calls sharing a task id count apart) kept as JSON in the
row. Each operation is one ``INSERT … ON CONFLICT DO UPDATE`` whose new
value is computed from the row it locked: PostgreSQL evaluates it on the
row's latest version, so concurrent calls serialise on the row and a
limit holds exactly, in one statement. Times are epoch seconds on the
database's clock; each row carries an expiry, and expired rows are
deleted by the call that finds the reap interval passed.

The handoff (``SlotHandoff``) keeps a key's wait list and reservations in
a table of its own (``celery_dedup_sql_slot_wait``: rows of workers that
predate it keep working, the holders stay where they were) and runs in one
server-side function (``celery_dedup_slot_turn_v2``, created with that
table): one round trip, a transaction that locks the key's slot row, then
its wait row, and writes both.

Other SQL dialects (MySQL, MariaDB, SQLite) do not keep limits: a task
using one there raises ``LimitsNotSupported``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import DDL, Column, Double, Table, Text, event, text
from sqlalchemy.exc import DBAPIError

from ..exceptions import LimitsNotSupported
from .base import RateAnswer, RateWindow, SlotTurn, SlotUsage, SlotWaiter, slot_limit_of
from .rate_entries import new_entry, rate_of, task_id_of
from .sql_dialects import KEY_LENGTH, _varchar, metadata

__all__ = [
    "RATE_TABLE",
    "SLOT_TABLE",
    "SLOT_WAIT_TABLE",
    "SQLLimits",
    "rate_table",
    "slot_table",
    "slot_wait_table",
]

T = TypeVar("T")

SLOT_TABLE = "celery_dedup_sql_slot"
RATE_TABLE = "celery_dedup_sql_rate"
SLOT_WAIT_TABLE = "celery_dedup_sql_slot_wait"
#: The handoff's function; a new version gets a new name (workers of both
#: versions may run side by side).
TURN_FUNCTION = "celery_dedup_slot_turn_v2"

#: One row per concurrency key: its holders and their lease expiries (JSON).
slot_table = Table(
    SLOT_TABLE,
    metadata,
    Column("key", _varchar(KEY_LENGTH), primary_key=True),
    Column("holders", Text(), nullable=False),
    Column("expires_at", Double(), nullable=False),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

#: One row per concurrency key with waiters: its wait list (waiter id ->
#: [place, expiry, payload in base64, the limit it waits under]) and
#: reservations (waiter id -> expiry), JSON.
slot_wait_table = Table(
    SLOT_WAIT_TABLE,
    metadata,
    Column("key", _varchar(KEY_LENGTH), primary_key=True),
    Column("waiters", Text(), nullable=False),
    Column("reserved", Text(), nullable=False),
    Column("expires_at", Double(), nullable=False),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

#: One row per rate key: its window of admitted publishes (JSON).
rate_table = Table(
    RATE_TABLE,
    metadata,
    Column("key", _varchar(KEY_LENGTH), primary_key=True),
    Column("entries", Text(), nullable=False),
    Column("expires_at", Double(), nullable=False),
    mysql_engine="InnoDB",
    mysql_charset="utf8mb4",
)

_NOW = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) AS DOUBLE PRECISION)"

TAKE_SLOT = text(f"""
INSERT INTO {SLOT_TABLE} AS s (key, holders, expires_at)
VALUES (:key, jsonb_build_object(CAST(:holder AS text), {_NOW} + :ttl)::text, {_NOW} + :ttl)
ON CONFLICT (key) DO UPDATE SET
  holders = (
    WITH live AS (
      SELECT e.k, CAST(e.v AS DOUBLE PRECISION) AS v
      FROM jsonb_each_text(CAST(s.holders AS jsonb)) AS e(k, v)
      WHERE CAST(e.v AS DOUBLE PRECISION) > {_NOW}
    ), n AS (
      SELECT count(*) AS c, coalesce(bool_or(k = :holder), false) AS mine FROM live
    )
    SELECT CASE WHEN n.mine OR n.c < :limit THEN
        (coalesce((SELECT jsonb_object_agg(k, v) FROM live WHERE k <> :holder), '{{}}'::jsonb)
         || jsonb_build_object(CAST(:holder AS text), {_NOW} + :ttl))::text
      ELSE coalesce((SELECT jsonb_object_agg(k, v) FROM live), '{{}}'::jsonb)::text
    END
    FROM n
  ),
  expires_at = greatest(s.expires_at, {_NOW} + :ttl)
RETURNING holders, {_NOW} AS now
""")

GIVE_SLOT = text(f"""
UPDATE {SLOT_TABLE} SET holders = (CAST(holders AS jsonb) - CAST(:holder AS text))::text
WHERE key = :key AND CAST(holders AS jsonb) ? :holder
""")

RENEW_SLOT = text(f"""
UPDATE {SLOT_TABLE}
SET holders = (CAST(holders AS jsonb)
               || jsonb_build_object(CAST(:holder AS text), {_NOW} + :ttl))::text,
    expires_at = greatest(expires_at, {_NOW} + :ttl)
WHERE key = :key
  AND CAST(CAST(holders AS jsonb) ->> CAST(:holder AS text) AS DOUBLE PRECISION) > {_NOW}
""")

READ_SLOTS = text(f"SELECT holders, {_NOW} AS now FROM {SLOT_TABLE} WHERE key = :key")

# The period a window entry was admitted under, in seconds (0: not recorded),
# from its member's ``~<limit>/<period ms>`` suffix (``rate_entries``).
_OWN_PERIOD = (
    "coalesce(CAST(substring(e ->> 1 from '#[0-9a-f]{16}~[0-9]+/([0-9]+)$') "
    "AS DOUBLE PRECISION) / 1000.0, 0)"
)

# The window: entries newer than now - period, in time order; older ones
# stay while their own period lasts (``rate_entries``). A new entry
# goes at now when fewer than `limit` are in it, else at the time the
# (n - limit + 1)th newest leaves it plus nothing earlier than now; it is
# written when that is now, or always under `delay`.
HIT_RATE = text(f"""
INSERT INTO {RATE_TABLE} AS r (key, entries, expires_at)
VALUES (:key, jsonb_build_array(jsonb_build_array({_NOW}, CAST(:member AS text)))::text,
        {_NOW} + :period)
ON CONFLICT (key) DO UPDATE SET
  entries = (
    WITH kept AS (
      SELECT CAST(e ->> 0 AS DOUBLE PRECISION) AS at, e ->> 1 AS m, ord
      FROM jsonb_array_elements(CAST(r.entries AS jsonb)) WITH ORDINALITY AS t(e, ord)
      WHERE CAST(e ->> 0 AS DOUBLE PRECISION) > {_NOW} - greatest(:period, {_OWN_PERIOD})
    ), live AS (
      SELECT at, m, ord FROM kept WHERE at > {_NOW} - :period
    ), n AS (
      SELECT count(*) AS c FROM live
    ), place AS (
      SELECT CASE WHEN n.c < :limit THEN {_NOW}
        ELSE greatest({_NOW}, (
          SELECT z.at FROM (
            SELECT at, row_number() OVER (ORDER BY at, ord) AS rn FROM live
          ) AS z
          WHERE z.rn = n.c - :limit + 1
        ) + :period)
      END AS at
      FROM n
    )
    SELECT coalesce(jsonb_agg(x ORDER BY CAST(x ->> 0 AS DOUBLE PRECISION)), '[]'::jsonb)::text
    FROM (
      SELECT jsonb_build_array(at, m) AS x FROM kept
      UNION ALL
      SELECT jsonb_build_array(place.at, CAST(:member AS text)) FROM place
      WHERE place.at <= {_NOW} OR :delay
    ) AS q
  ),
  expires_at = greatest(r.expires_at, {_NOW} + :period)
    + CASE WHEN :delay THEN :period ELSE 0 END
RETURNING entries, {_NOW} AS now
""")

FORGET_RATE = text(f"""
UPDATE {RATE_TABLE} SET entries = coalesce((
    SELECT jsonb_agg(e ORDER BY ord)
    FROM jsonb_array_elements(CAST(entries AS jsonb)) WITH ORDINALITY AS t(e, ord)
    WHERE e ->> 1 <> :member
  ), '[]'::jsonb)::text
WHERE key = :key AND EXISTS (
  SELECT 1 FROM jsonb_array_elements(CAST(entries AS jsonb)) AS u(e) WHERE e ->> 1 = :member
)
""")

READ_RATE = text(f"SELECT entries, {_NOW} AS now FROM {RATE_TABLE} WHERE key = :key")

LIST_SLOTS = text(
    f"SELECT key, holders, {_NOW} AS now FROM {SLOT_TABLE} "
    f"WHERE key LIKE :pattern ESCAPE '\\' AND expires_at > {_NOW} ORDER BY key"
)

LIST_RATES = text(
    f"SELECT key, entries, {_NOW} AS now FROM {RATE_TABLE} "
    f"WHERE key LIKE :pattern ESCAPE '\\' AND expires_at > {_NOW} ORDER BY key"
)

# The handoff, as ``MemoryLimits.take_slot_in_turn``/``give_slot_in_turn`` do it.
# p_ttl NULL: give p_holder's slot back; p_me NULL: no waiter. The slot row
# is locked first (as every slot statement does), then the wait row: the
# key's calls serialise on it, and every statement in the function sees
# the rows as the last one committed them.
TURN_SQL = f"""
CREATE OR REPLACE FUNCTION {TURN_FUNCTION}(
  p_key text, p_holder text, p_limit integer, p_ttl double precision,
  p_me text, p_place double precision, p_life double precision, p_payload text,
  p_grace double precision,
  OUT taken boolean, OUT in_use integer, OUT woken text[])
LANGUAGE plpgsql AS $fn$
DECLARE
  v_now double precision := {_NOW};
  v_holders jsonb;
  v_waiters jsonb;
  v_reserved jsonb;
  v_used integer;
  v_next record;
BEGIN
  woken := ARRAY[]::text[];
  INSERT INTO {SLOT_TABLE} (key, holders, expires_at) VALUES (p_key, '{{}}', v_now)
    ON CONFLICT (key) DO NOTHING;
  SELECT CAST(s.holders AS jsonb) INTO v_holders FROM {SLOT_TABLE} AS s
    WHERE s.key = p_key FOR UPDATE;
  INSERT INTO {SLOT_WAIT_TABLE} (key, waiters, reserved, expires_at)
    VALUES (p_key, '{{}}', '{{}}', v_now) ON CONFLICT (key) DO NOTHING;
  SELECT CAST(w.waiters AS jsonb), CAST(w.reserved AS jsonb) INTO v_waiters, v_reserved
    FROM {SLOT_WAIT_TABLE} AS w WHERE w.key = p_key FOR UPDATE;
  v_holders := coalesce((SELECT jsonb_object_agg(e.k, e.v) FROM jsonb_each(v_holders) AS e(k, v)
    WHERE CAST(e.v #>> '{{}}' AS double precision) > v_now), '{{}}');
  v_reserved := coalesce((SELECT jsonb_object_agg(e.k, e.v) FROM jsonb_each(v_reserved) AS e(k, v)
    WHERE CAST(e.v #>> '{{}}' AS double precision) > v_now), '{{}}');
  v_waiters := coalesce((SELECT jsonb_object_agg(e.k, e.v) FROM jsonb_each(v_waiters) AS e(k, v)
    WHERE CAST(e.v ->> 1 AS double precision) > v_now), '{{}}');
  taken := false;
  IF p_ttl IS NULL THEN
    v_holders := v_holders - p_holder;
  ELSE
    taken := v_holders ? p_holder;
    IF NOT taken AND p_me IS NOT NULL AND v_reserved ? p_me THEN
      v_reserved := v_reserved - p_me;
      taken := true;
    ELSIF NOT taken AND p_me IS NOT NULL THEN
      v_waiters := v_waiters || jsonb_build_object(p_me, jsonb_build_array(
        coalesce(v_waiters -> p_me -> 0, to_jsonb(p_place)), v_now + p_life, p_payload,
        p_limit));
    END IF;
    IF taken THEN
      v_holders := v_holders || jsonb_build_object(p_holder, v_now + p_ttl);
      IF p_me IS NOT NULL THEN
        v_waiters := v_waiters - p_me;
      END IF;
    END IF;
  END IF;
  -- The dispatch: the oldest waiters (at most 64 looked at), each while
  -- fewer slots are in use than the limit it waits under (p_limit for one
  -- listed by v1); one whose limit is reached keeps its place.
  v_used := (SELECT count(*) FROM jsonb_object_keys(v_holders))
    + (SELECT count(*) FROM jsonb_object_keys(v_reserved));
  IF v_used < greatest(p_limit, coalesce((SELECT max(CAST(e.v ->> 3 AS integer))
      FROM jsonb_each(v_waiters) AS e(k, v)), 0)) THEN
    FOR v_next IN
      SELECT e.k, e.v ->> 2 AS payload, coalesce(CAST(e.v ->> 3 AS integer), p_limit) AS lim
      FROM jsonb_each(v_waiters) AS e(k, v)
      ORDER BY CAST(e.v ->> 0 AS double precision), e.k LIMIT 64
    LOOP
      CONTINUE WHEN v_used >= v_next.lim;
      v_used := v_used + 1;
      v_waiters := v_waiters - v_next.k;
      IF v_next.k = p_me AND NOT taken THEN
        v_holders := v_holders || jsonb_build_object(p_holder, v_now + p_ttl);
        taken := true;
      ELSE
        v_reserved := v_reserved || jsonb_build_object(v_next.k, v_now + p_grace);
        woken := woken || v_next.payload;
      END IF;
    END LOOP;
  END IF;
  in_use := (SELECT count(*) FROM jsonb_object_keys(v_holders))
    + (SELECT count(*) FROM jsonb_object_keys(v_reserved));
  IF NOT taken AND p_ttl IS NOT NULL AND p_me IS NULL AND in_use < p_limit THEN
    v_holders := v_holders || jsonb_build_object(p_holder, v_now + p_ttl);
    taken := true;
    in_use := in_use + 1;
  END IF;
  UPDATE {SLOT_TABLE} SET holders = CAST(v_holders AS text),
    expires_at = greatest(expires_at, v_now + coalesce(p_ttl, 0))
    WHERE key = p_key;
  UPDATE {SLOT_WAIT_TABLE} SET waiters = CAST(v_waiters AS text),
    reserved = CAST(v_reserved AS text),
    expires_at = greatest(expires_at, v_now,
      (SELECT max(CAST(e.v ->> 1 AS double precision)) FROM jsonb_each(v_waiters) AS e(k, v)),
      (SELECT max(CAST(e.v #>> '{{}}' AS double precision)) FROM jsonb_each(v_reserved) AS e(k, v)))
    WHERE key = p_key;
END
$fn$
"""

# Created with the wait table (``metadata.create_all``); a database whose table
# came another way gets it on the first handoff call (``_turn``).
event.listen(
    slot_wait_table,
    "after_create",
    DDL(TURN_SQL).execute_if(dialect="postgresql"),  # type: ignore[no-untyped-call]
)

TURN = text(
    f"SELECT taken, in_use, woken FROM {TURN_FUNCTION}(:key, :holder, :limit, :ttl, :me, "
    ":place, :life, :payload, :grace)"
)

REAP = (
    text(f"DELETE FROM {SLOT_TABLE} WHERE expires_at <= {_NOW}"),
    text(f"DELETE FROM {SLOT_WAIT_TABLE} WHERE expires_at <= {_NOW}"),
    text(f"DELETE FROM {RATE_TABLE} WHERE expires_at <= {_NOW}"),
)


class SQLLimits:
    """``SlotSupport`` and ``RateSupport`` for ``SQLStore`` on PostgreSQL (a mixin).

    Relies on the store's ``_run`` (a pooled connection, errors translated,
    lost races run again) and ``engine``.
    """

    engine: Any
    reap_interval: float
    _next_limits_reap: float = 0.0

    def _run(self, operation: Callable[[Any, Any], T], key: str = "") -> T:
        raise NotImplementedError

    def _limits(self, statement: Any, params: dict[str, Any], key: str) -> Any:
        if self.engine.dialect.name != "postgresql":
            name = self.engine.dialect.name
            raise LimitsNotSupported("", "concurrency_limit or rate_limit_per_key", name)
        if len(key) > KEY_LENGTH:
            raise ValueError(f"limit key of {len(key)} characters; at most {KEY_LENGTH}")

        def run(_dialect: Any, runner: Any) -> Any:
            return runner.connection.execute(statement, params)

        result = self._run(run, key)
        self._maybe_reap_limits()
        return result

    def _maybe_reap_limits(self) -> None:
        if not self.reap_interval or time.monotonic() < self._next_limits_reap:
            return
        self._next_limits_reap = time.monotonic() + self.reap_interval

        def reap(_dialect: Any, runner: Any) -> None:
            for statement in REAP:
                runner.connection.execute(statement)

        # Housekeeping never fails a call: expired rows are ignored anyway.
        with contextlib.suppress(Exception):
            self._run(reap)

    # -- SlotSupport -------------------------------------------------------

    def take_slot(self, key: str, holder: str, limit: int, ttl: float) -> tuple[bool, int]:
        """Take a slot, or report the key full (one upsert)."""
        params = {"key": key, "holder": holder, "limit": limit, "ttl": float(ttl)}
        row = self._limits(TAKE_SLOT, params, key).one()
        holders = json.loads(row.holders)
        return holder in holders, len(holders)

    def give_slot(self, key: str, holder: str) -> bool:
        """Remove the holder (one UPDATE)."""
        return bool(self._limits(GIVE_SLOT, {"key": key, "holder": holder}, key).rowcount)

    def renew_slots(self, slots: Sequence[tuple[str, str]], ttl: float) -> int:
        """Renew each live lease (one UPDATE per slot, on one connection)."""
        if not slots:
            return 0
        renewed = 0
        for key, holder in slots:
            params = {"key": key, "holder": holder, "ttl": float(ttl)}
            renewed += int(self._limits(RENEW_SLOT, params, key).rowcount or 0)
        return renewed

    def slots_in_use(self, key: str) -> int:
        """How many live leases the key has (one SELECT)."""
        row = self._limits(READ_SLOTS, {"key": key}, key).first()
        if row is None:
            return 0
        now = float(row.now)
        return sum(1 for expiry in json.loads(row.holders).values() if float(expiry) > now)

    # -- SlotHandoff ------------------------------------------------------

    def take_slot_in_turn(
        self,
        key: str,
        holder: str,
        limit: int,
        ttl: float,
        waiter: SlotWaiter | None,
        grace: float,
    ) -> SlotTurn:
        """Take a slot in turn, or wait for one (``SlotHandoff``; one function call)."""
        params: dict[str, Any] = {
            "key": key, "holder": holder, "limit": limit, "ttl": float(ttl), "grace": float(grace),
            "me": None, "place": None, "life": None, "payload": None,
        }
        if waiter is not None:
            params.update(
                me=waiter.id,
                place=float(waiter.order),
                life=float(waiter.life),
                payload=base64.b64encode(waiter.payload).decode("ascii"),
            )
        row = self._turn(params, key)
        return SlotTurn(bool(row.taken), int(row.in_use), _payloads(row.woken))

    def give_slot_in_turn(
        self, key: str, holder: str, limit: int, grace: float
    ) -> tuple[bytes, ...]:
        """Give the holder's slot back and wake the oldest waiters (one function call)."""
        params: dict[str, Any] = {
            "key": key, "holder": holder, "limit": limit, "ttl": None, "grace": float(grace),
            "me": None, "place": None, "life": None, "payload": None,
        }
        return _payloads(self._turn(params, key).woken)

    def _turn(self, params: dict[str, Any], key: str) -> Any:
        try:
            return self._limits(TURN, params, key).one()
        except Exception as exc:
            if not _undefined_function(exc):
                raise

        # The wait table predates the function, or came from a migration tool.
        def create(_dialect: Any, runner: Any) -> None:
            runner.connection.execute(text(TURN_SQL).execution_options(no_parameters=True))

        # Workers racing to create it: one wins, the others' errors change nothing.
        with contextlib.suppress(Exception):
            self._run(create, key)
        return self._limits(TURN, params, key).one()

    # -- RateSupport -------------------------------------------------------

    def hit_rate(
        self, key: str, member: str, limit: int, period: float, *, delay: bool
    ) -> RateAnswer:
        """Count the publish in the sliding window, or refuse it (one upsert)."""
        entry = new_entry(member, limit, period)
        params = {
            "key": key, "member": entry, "limit": limit, "period": float(period), "delay": delay
        }
        row = self._limits(HIT_RATE, params, key).one()
        now = float(row.now)
        # (Older entries stay while their own, longer, period lasts: not this window's.)
        entries = [
            (float(at), str(m)) for at, m in json.loads(row.entries) if float(at) > now - period
        ]
        mine = [at for at, m in entries if m == entry]
        if mine:
            return RateAnswer(True, max(0.0, mine[0] - now), len(entries), member, entry)
        return _refused(entries, now, limit, period)

    def rate_window(self, key: str, limit: int, period: float) -> RateAnswer:
        """The window as it is (one SELECT; nothing counted)."""
        row = self._limits(READ_RATE, {"key": key}, key).first()
        if row is None:
            return RateAnswer(False, 0.0, 0, "")
        now = float(row.now)
        entries = [
            (float(at), str(m)) for at, m in json.loads(row.entries) if float(at) > now - period
        ]
        return _refused(entries, now, limit, period)


    # -- LimitListing ------------------------------------------------------

    def list_slots(self, prefix: str) -> list[SlotUsage]:
        """Every slot key under ``prefix`` with a live lease (one SELECT)."""
        found = []
        for row in self._limits(LIST_SLOTS, {"pattern": _like(prefix)}, prefix):
            now = float(row.now)
            holders = {h: float(e) for h, e in json.loads(row.holders).items() if float(e) > now}
            if holders:
                newest = max(holders, key=lambda h: holders[h])
                found.append(SlotUsage(str(row.key), len(holders), slot_limit_of(newest)))
        return found

    def list_rates(self, prefix: str) -> list[RateWindow]:
        """Every rate key under ``prefix`` with entries (one SELECT)."""
        found = []
        for row in self._limits(LIST_RATES, {"pattern": _like(prefix)}, prefix):
            now = float(row.now)
            entries = sorted(
                ((float(at), str(m)) for at, m in json.loads(row.entries)), reverse=True
            )
            if entries:
                ages = tuple(now - at for at, _ in entries)
                newest = entries[0][1]
                found.append(
                    RateWindow(str(row.key), ages, task_id_of(newest), rate_of(newest))
                )
        return found

    def forget_rate(self, key: str, member: str) -> bool:
        """Take ``member`` back out of the window (``RateRelease``; one UPDATE)."""
        return bool(self._limits(FORGET_RATE, {"key": key, "member": member}, key).rowcount)


def _payloads(woken: Any) -> tuple[bytes, ...]:
    return tuple(base64.b64decode(payload) for payload in woken or ())


def _undefined_function(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is PostgreSQL's "function does not exist"."""
    seen: BaseException | None = exc
    while seen is not None:
        orig = seen.orig if isinstance(seen, DBAPIError) else None
        if getattr(orig, "sqlstate", None) == "42883" or getattr(orig, "pgcode", None) == "42883":
            return True
        seen = seen.__cause__
    return False


def _like(prefix: str) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


def _refused(entries: list[tuple[float, str]], now: float, limit: int, period: float) -> RateAnswer:
    entries = sorted(entries)
    n = len(entries)
    last = task_id_of(entries[-1][1]) if entries else ""
    wait = 0.0
    if n >= limit:
        wait = max(0.0, entries[n - limit][0] + period - now)
    return RateAnswer(False, wait, n, last)
