"""Concurrency slots and publish rates in Redis (``SlotSupport``, ``RateSupport``).

A slot key is a sorted set of holder → lease expiry (ms, server clock); a
rate key is a sorted set of admitted publishes (task id plus a nonce, so
calls sharing a task id count apart) → admission time (ms, server clock; a
delayed publish is entered at the time it may run). Each
operation is one script on one key, so a cluster routes it by that key's
slot, and every script leaves a TTL on the key it writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from functools import cached_property
from typing import Any

import redis
from redis.commands.core import Script

from .base import RateAnswer, RateWindow, SlotTurn, SlotUsage, SlotWaiter, slot_limit_of
from .rate_entries import WINDOW_TRIM, new_entry, rate_of, task_id_of

__all__ = ["RedisLimits", "rate_answer"]

# KEYS[1] - the slot key (sorted set holder -> lease expiry in ms)
# ARGV[1] - the holder
# ARGV[2] - the number of slots
# ARGV[3] - the lease in milliseconds
# return {1 if the holder holds a slot now else 0, slots in use}
TAKE_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
local n = redis.call('ZCARD', KEYS[1])
if not held and n >= tonumber(ARGV[2]) then
  return {0, n}
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
if held then
  return {1, n}
end
return {1, n + 1}
"""

# The handoff (SlotHandoff): beside the slot key K, in its hash slot,
# W (sorted set waiter id -> place), E (sorted set waiter id -> expiry ms),
# P (hash waiter id -> payload), R (sorted set waiter id -> reservation
# expiry ms; each one a slot in use) and L (sorted set waiter id -> the
# limit it was called under: a slot goes to a waiter only while fewer than
# its own limit are in use; a waiter without one, listed by an older
# version, waits under ARGV[2]).
# KEYS[1..6] - K, W, E, P, R, L
# ARGV[1] - the holder
# ARGV[2] - the number of slots (the caller's limit)
# ARGV[3] - the lease in milliseconds ("" : give the holder's slot back)
# ARGV[4] - the waiter id ("" : none)
# ARGV[5] - the waiter's place (its call time in microseconds)
# ARGV[6] - the waiter's life in milliseconds
# ARGV[7] - the waiter's payload
# ARGV[8] - a reservation's grace in milliseconds
# return {1 if the holder holds a slot now else 0, slots in use, payload, ...}
TURN_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local K, W, E, P, R, L = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local limit = tonumber(ARGV[2])
local grace = tonumber(ARGV[8])
local me = ARGV[4]
local function longer(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end
local function unlist(name)
  redis.call('ZREM', W, name)
  redis.call('ZREM', E, name)
  redis.call('HDEL', P, name)
  redis.call('ZREM', L, name)
end
redis.call('ZREMRANGEBYSCORE', K, '-inf', now)
redis.call('ZREMRANGEBYSCORE', R, '-inf', now)
for _, name in ipairs(redis.call('ZRANGEBYSCORE', E, '-inf', now)) do
  unlist(name)
end
local taken = false
local ttl = 0
if ARGV[3] == '' then
  redis.call('ZREM', K, ARGV[1])
else
  ttl = tonumber(ARGV[3])
  taken = redis.call('ZSCORE', K, ARGV[1]) ~= false
  if not taken and me ~= '' and redis.call('ZREM', R, me) == 1 then
    taken = true
  elseif not taken and me ~= '' then
    redis.call('ZADD', W, 'NX', ARGV[5], me)
    redis.call('ZADD', E, now + tonumber(ARGV[6]), me)
    redis.call('HSET', P, me, ARGV[7])
    redis.call('ZADD', L, limit, me)
    longer(W, tonumber(ARGV[6]))
    longer(E, tonumber(ARGV[6]))
    longer(P, tonumber(ARGV[6]))
    longer(L, tonumber(ARGV[6]))
  end
  if taken then
    redis.call('ZADD', K, now + ttl, ARGV[1])
    if me ~= '' then
      unlist(me)
    end
  end
end
-- The dispatch: the oldest waiters (at most 64 looked at), each while
-- fewer slots are in use than its own limit; one whose limit is reached
-- keeps its place. None is looked at when even the highest limit is reached.
local used = redis.call('ZCARD', K) + redis.call('ZCARD', R)
local highest = limit
local top = redis.call('ZREVRANGE', L, 0, 0, 'WITHSCORES')
if top[2] and tonumber(top[2]) > highest then
  highest = tonumber(top[2])
end
local woken = {}
if used < highest then
  for _, name in ipairs(redis.call('ZRANGE', W, 0, 63)) do
    local own = tonumber(redis.call('ZSCORE', L, name)) or limit
    if used < own then
      if name == me and not taken then
        redis.call('ZADD', K, now + ttl, ARGV[1])
        taken = true
        used = used + 1
      else
        local payload = redis.call('HGET', P, name)
        if payload then
          redis.call('ZADD', R, now + grace, name)
          table.insert(woken, payload)
          used = used + 1
        end
      end
      unlist(name)
    end
  end
  if #woken > 0 then
    longer(R, grace)
  end
end
if not taken and ttl > 0 and me == '' and
    redis.call('ZCARD', K) + redis.call('ZCARD', R) < limit then
  redis.call('ZADD', K, now + ttl, ARGV[1])
  taken = true
end
if taken then
  longer(K, ttl)
end
local answer = {taken and 1 or 0, redis.call('ZCARD', K) + redis.call('ZCARD', R)}
for _, payload in ipairs(woken) do
  table.insert(answer, payload)
end
return answer
"""

# KEYS[1] - the slot key
# ARGV[1] - the holder
# ARGV[2] - the lease in milliseconds
# return 1 if the holder's live lease was renewed, else 0
RENEW_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then
  return 0
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return 1
"""

# KEYS[1] - the slot key
# return the number of live leases
SLOTS_IN_USE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""

# KEYS[1] - the rate key (sorted set publish -> admission time in ms)
# ARGV[1] - the member (the publish's task id, a nonce: unique per publish, and
#           the rate it is admitted under: ``rate_entries``)
# ARGV[2] - the limit (publishes per period)
# ARGV[3] - the period in milliseconds
# ARGV[4] - "1": admit at the earliest free place; "0": refuse a full window;
#           "": count nothing (read the window)
# return {admitted 1/0, wait in ms, count after the call, last member or ""}
HIT_RATE = WINDOW_TRIM + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local kept = trim(KEYS[1], now, period)
local n = redis.call('ZCARD', KEYS[1]) - kept
local newest = redis.call('ZRANGE', KEYS[1], -1, -1)
local last = newest[1] or ''
local at = now
if n >= limit then
  -- the window ending at `at` must drop the (n - limit + 1)th newest entry
  local blocker = redis.call('ZRANGE', KEYS[1], kept + n - limit, kept + n - limit, 'WITHSCORES')
  at = math.max(now, tonumber(blocker[2]) + period)
end
if ARGV[4] == '' or (at > now and ARGV[4] ~= '1') then
  return {0, at - now, n, last}
end
redis.call('ZADD', KEYS[1], at, ARGV[1])
-- never shorter than a place reserved earlier (delayed publishes)
if redis.call('PTTL', KEYS[1]) < at - now + period then
  redis.call('PEXPIRE', KEYS[1], at - now + period)
end
return {1, at - now, n + 1, ARGV[1]}
"""


# KEYS[1] - a slot or rate key
# return {now in ms, member, score, member, score, ...} newest first
READ_KEY = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local found = redis.call('ZREVRANGE', KEYS[1], 0, -1, 'WITHSCORES')
table.insert(found, 1, now)
return found
"""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisLimits:
    """``SlotSupport`` and ``RateSupport`` for ``RedisStore`` (a mixin of it).

    Relies on the store's ``client``, ``_k`` (the key prefix), ``_run`` (one
    EVALSHA, errors translated) and ``_boundary``.
    """

    client: Any

    def _k(self, key: str) -> str:
        raise NotImplementedError

    def _run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        raise NotImplementedError

    def _boundary(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _marker(self, key: str, owner: str, kind: str = "revoked") -> str:
        raise NotImplementedError

    @cached_property
    def _limit_scripts(self) -> dict[str, Script]:
        register = self.client.register_script
        return {
            "take": register(TAKE_SLOT),
            "turn": register(TURN_SLOT),
            "renew": register(RENEW_SLOT),
            "in_use": register(SLOTS_IN_USE),
            "rate": register(HIT_RATE),
            "read": register(READ_KEY),
        }

    def _limit_nodes(self) -> list[Any]:
        """The clients to SCAN (a cluster: one per primary)."""
        return [self.client]

    # -- SlotSupport -------------------------------------------------------

    def take_slot(self, key: str, holder: str, limit: int, ttl: float) -> tuple[bool, int]:
        """Take a slot, or report the key full (one EVALSHA)."""
        raw = self._run(self._limit_scripts["take"], [self._k(key)], [holder, limit, _ms(ttl)])
        return bool(int(raw[0])), int(raw[1])

    def give_slot(self, key: str, holder: str) -> bool:
        """ZREM the holder (one round trip)."""
        with self._boundary():
            return bool(self.client.zrem(self._k(key), holder))

    # -- SlotHandoff ------------------------------------------------------

    def _turn_keys(self, key: str) -> list[str]:
        """The slot key and its wait list's keys (all in the slot key's hash slot)."""
        kinds = ("w", "e", "p", "r", "l")
        return [self._k(key)] + [self._marker(key, "", kind) for kind in kinds]

    def take_slot_in_turn(
        self,
        key: str,
        holder: str,
        limit: int,
        ttl: float,
        waiter: SlotWaiter | None,
        grace: float,
    ) -> SlotTurn:
        """Take a slot in turn, or wait for one (one EVALSHA)."""
        if waiter is None:
            listed: list[Any] = ["", 0, 0, b""]
        else:
            # The place in microseconds: calls a loop publishes are well under a
            # millisecond apart, and equal places would sort by id, not call time.
            listed = [waiter.id, int(waiter.order * 1_000_000), _ms(waiter.life), waiter.payload]
        args = [holder, limit, _ms(ttl), *listed, _ms(grace)]
        raw = self._run(self._limit_scripts["turn"], self._turn_keys(key), args)
        return SlotTurn(bool(int(raw[0])), int(raw[1]), tuple(_bytes(p) for p in raw[2:]))

    def give_slot_in_turn(
        self, key: str, holder: str, limit: int, grace: float
    ) -> tuple[bytes, ...]:
        """Give the slot back and wake the oldest waiters (one EVALSHA)."""
        args = [holder, limit, "", "", 0, 0, b"", _ms(grace)]
        raw = self._run(self._limit_scripts["turn"], self._turn_keys(key), args)
        return tuple(_bytes(p) for p in raw[2:])

    def renew_slots(self, slots: Sequence[tuple[str, str]], ttl: float) -> int:
        """Renew every held lease: one pipelined round trip for all of them (a cluster:
        one per slot)."""
        if not slots:
            return 0
        script = self._limit_scripts["renew"]
        if not isinstance(self.client, redis.Redis):
            # A cluster client: one EVALSHA per slot, each on its key's primary.
            return sum(
                int(self._run(script, [self._k(key)], [holder, _ms(ttl)])) for key, holder in slots
            )
        with self._boundary():
            pipe = self.client.pipeline(transaction=False)
            for key, holder in slots:
                script(keys=[self._k(key)], args=[holder, _ms(ttl)], client=pipe)
            return sum(int(answer) for answer in pipe.execute())

    def slots_in_use(self, key: str) -> int:
        """How many live leases the key has (one EVALSHA)."""
        return int(self._run(self._limit_scripts["in_use"], [self._k(key)], []))

    # -- RateSupport -------------------------------------------------------

    def hit_rate(
        self, key: str, member: str, limit: int, period: float, *, delay: bool
    ) -> RateAnswer:
        """Count the publish in the sliding window, or refuse it (one EVALSHA)."""
        entry = new_entry(member, limit, period)
        args = [entry, limit, _ms(period), "1" if delay else "0"]
        answer = rate_answer(self._run(self._limit_scripts["rate"], [self._k(key)], args))
        return replace(answer, entry=entry) if answer.admitted else answer

    def rate_window(self, key: str, limit: int, period: float) -> RateAnswer:
        """The window as it is (one EVALSHA that counts nothing)."""
        args = ["", limit, _ms(period), ""]
        return rate_answer(self._run(self._limit_scripts["rate"], [self._k(key)], args))

    # -- LimitListing ------------------------------------------------------

    def list_slots(self, prefix: str) -> list[SlotUsage]:
        """Every slot key under ``prefix`` with a live lease (SCAN, then one pipelined
        read per batch of keys)."""
        found = []
        for key, now, entries in self._read_keys(prefix):
            live = sum(1 for _, expiry in entries if expiry > now)
            if live:
                # (newest first: the most recently taken or renewed lease)
                found.append(SlotUsage(key, live, slot_limit_of(entries[0][0])))
        return found

    def list_rates(self, prefix: str) -> list[RateWindow]:
        """Every rate key under ``prefix`` with entries (SCAN, then pipelined reads)."""
        return [
            RateWindow(
                key,
                tuple((now - at) / 1000.0 for _, at in entries),
                task_id_of(entries[0][0]),
                rate_of(entries[0][0]),
            )
            for key, now, entries in self._read_keys(prefix)
            if entries
        ]

    def _read_keys(self, prefix: str) -> list[tuple[str, float, list[tuple[str, float]]]]:
        script = self._limit_scripts["read"]
        pattern = _glob_escape(self._k(prefix)) + "*"
        strip = len(self._k(""))
        found = []
        with self._boundary():
            for client in self._limit_nodes():
                keys = [_text(k) for k in client.scan_iter(match=pattern, count=500)]
                for start in range(0, len(keys), 500):
                    batch = keys[start : start + 500]
                    pipe = client.pipeline(transaction=False)
                    for physical in batch:
                        script(keys=[physical], args=[], client=pipe)
                    for physical, raw in zip(
                        batch, pipe.execute(raise_on_error=False), strict=True
                    ):
                        if isinstance(raw, Exception):
                            # Another program's key of another type: not ours.
                            if str(raw).startswith("WRONGTYPE"):
                                continue
                            raise raw
                        pairs = raw[1:]
                        entries = [
                            (_text(pairs[i]), float(pairs[i + 1])) for i in range(0, len(pairs), 2)
                        ]
                        found.append((physical[strip:], float(raw[0]), entries))
        return sorted(found)

    def forget_rate(self, key: str, member: str) -> bool:
        """ZREM the member from the window (``RateRelease``; one round trip)."""
        with self._boundary():
            return bool(self.client.zrem(self._k(key), member))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def rate_answer(raw: Sequence[Any]) -> RateAnswer:
    """A window script's ``{admitted, wait ms, count, last member}`` as a ``RateAnswer``."""
    return RateAnswer(
        admitted=bool(int(raw[0])),
        wait=int(raw[1]) / 1000.0,
        count=int(raw[2]),
        last=task_id_of(_text(raw[3])),
    )
