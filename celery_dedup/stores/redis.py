"""Redis lock store: one Lua script per atomic operation, one round trip each.

A lock is one compact string with a millisecond TTL (the record, below); a
revoked marker is a plain key in the lock's hash slot. Keys reach the
scripts only through ``KEYS`` (a script touches one lock and, at most, its
marker in the same slot, so every script is cluster-safe) and TTLs as
integer milliseconds in ``ARGV``. Every script also honours a lock written
by an earlier version as a hash ``{owner, task, policy, at, id?, st?}``.
"""

from __future__ import annotations

import functools
import re
import secrets
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis
from redis.commands.core import Script
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    InvalidResponse,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..exceptions import (
    StoreError,
    StorePermissionDenied,
    StoreRefused,
    StoreUnavailable,
)
from ..policy import UniqueUntil
from . import is_result_backend
from .base import (
    FENCE_TTL,
    OUTCOME_FIELD,
    AcquireItem,
    Claim,
    ClaimOutcome,
    Durability,
    Lock,
    LockMeta,
    RatedLock,
    RevokeOutcome,
    RunOutcome,
    RunRef,
    server_answer,
    store_errors,
    translate,
)
from .rate_entries import WINDOW_TRIM, new_entry
from .redis_limits import RedisLimits, rate_answer
from .redis_wire import ScriptWire

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["RedisStore"]

# The record. A lock is the string
#
#     <started 0|1><policy code><owner>|<acquired at>|[<extra fields>|]<task id>
#
# with "acquired at" in epoch milliseconds, base 36. The scripts only ever
# read the first byte (started: SETRANGE flips it and keeps the TTL) and the
# owner, from the third byte to the first "|"; the rest is read back in
# Python (``_unpack``). The policy code is a letter (``_CODES``): lowercase
# when the task name is the middle segment of the key (``_task_of``: the
# ``<prefix>:<task name>:<digest>`` keys celery-dedup makes) and so is not
# stored; uppercase when the task name is the one extra field. A policy
# without a letter is "*" with the policy and the task name as two extra
# fields. The task id comes last because it may hold any character; owner,
# task name and policy have "%" and "|" percent-encoded (``_enc``: tokens,
# guard tokens and uuids are left as they are), so "|" always ends a field.
# A 22-character token, a uuid task id and a 30-character task name make a
# 70-byte value: with the 76-character key, 200 bytes of server memory.
#
# A lock written by an earlier version is a hash {owner, task, policy, at,
# id?, st?}. ``read`` turns it into the head of a record ("<st>-<owner>|")
# for the owner check and keeps its fields to report it as a holder.
#
# A holder is returned as {pttl, record}, or {pttl, owner, task, policy, at,
# id, st} for a hash (fields it lacks come back as nil).
_PRELUDE = """
local function read(k)
    local v = redis.pcall('get', k)
    if type(v) ~= 'table' then
        return v, nil
    end
    local h = redis.call('hmget', k, 'owner', 'task', 'policy', 'at', 'id', 'st')
    if not h[1] then
        return false, nil
    end
    local o = string.gsub(string.gsub(h[1], '%%', '%%25'), '|', '%%7C')
    return (h[6] and '1' or '0') .. '-' .. o .. '|', h
end
local function owns(v, o)
    return string.sub(v, 3, 2 + #o) == o and string.byte(v, 3 + #o) == 124
end
local function write(k, record, ttl, first)
    if #ARGV < first then
        redis.call('set', k, record, 'PX', ttl)
        return
    end
    -- A key an earlier version made: its producers read a hash (fields from ARGV[first]).
    redis.call('del', k)
    redis.call('hset', k, unpack(ARGV, first))
    if string.byte(record, 1) == 49 then
        redis.call('hset', k, 'st', '1')
    end
    redis.call('pexpire', k, ttl)
end
local function holder(k, v, h)
    local pttl = redis.call('pttl', k)
    if h then
        return {pttl, h[1], h[2], h[3], h[4], h[5], h[6]}
    end
    return {pttl, v}
end
"""

# KEYS[1] - lock key
# ARGV[1] - the record
# ARGV[2] - ttl in milliseconds
# ARGV[3..] - the hash fields to write instead, on a key of an earlier version
# return nil when acquired, else the holder
ACQUIRE = _PRELUDE + """
local v, h = read(KEYS[1])
if v then
    return holder(KEYS[1], v, h)
end
write(KEYS[1], ARGV[1], ARGV[2], 3)
return false
"""

# ACQUIRE for many keys at once (``enqueue_many(per_item=True)``): each key on
# its own, in the order given; every key in one hash slot on a cluster.
# KEYS[i] - the lock key of item i
# ARGV[2i-1] - the record of item i
# ARGV[2i] - its ttl in milliseconds
# return one answer per key: false when acquired, else the holder
ACQUIRE_MANY = _PRELUDE + """
local answers = {}
for i = 1, #KEYS do
    local v, h = read(KEYS[i])
    if v then
        answers[i] = holder(KEYS[i], v, h)
    else
        redis.call('set', KEYS[i], ARGV[2 * i - 1], 'PX', ARGV[2 * i])
        answers[i] = false
    end
end
return answers
"""

# ACQUIRE behind HIT_RATE's window (``redis_limits``), checks before effects:
# a held key answers its holder and counts nothing; a full window (not
# delayed) answers the refusal and writes nothing; else the publish is
# counted and the lock taken. Both keys in one script: one hash slot.
# KEYS[1] - lock key
# KEYS[2] - rate key
# ARGV[1] - the record
# ARGV[2] - ttl in milliseconds (the lock lives max(ttl, unique_for + wait))
# ARGV[3] - the window entry
# ARGV[4] - the limit
# ARGV[5] - the period in milliseconds
# ARGV[6] - "1": admit at the earliest free place; "0": refuse a full window
# ARGV[7] - unique_for in milliseconds
# ARGV[8] - owner token (encoded)
# ARGV[9..] - the hash fields to write instead, on a key of an earlier version
# return {2, holder} when held; else {admitted 1/0, wait ms, count, last member or ""}
ACQUIRE_RATED = _PRELUDE + WINDOW_TRIM + """
local v, h = read(KEYS[1])
if v and not owns(v, ARGV[8]) then
    return {2, holder(KEYS[1], v, h)}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if v then
    -- a command re-sent after its reply was lost: answer what the first run did
    local placed = redis.call('zscore', KEYS[2], ARGV[3])
    local wait = placed and math.max(0, tonumber(placed) - now) or 0
    return {1, wait, redis.call('zcard', KEYS[2]), ARGV[3]}
end
local limit = tonumber(ARGV[4])
local period = tonumber(ARGV[5])
local kept = trim(KEYS[2], now, period)
local n = redis.call('zcard', KEYS[2]) - kept
local newest = redis.call('zrange', KEYS[2], -1, -1)
local last = newest[1] or ''
local at = now
if n >= limit then
    local blocker = redis.call('zrange', KEYS[2], kept + n - limit, kept + n - limit,
        'WITHSCORES')
    at = math.max(now, tonumber(blocker[2]) + period)
end
if at > now and ARGV[6] ~= '1' then
    return {0, at - now, n, last}
end
redis.call('zadd', KEYS[2], at, ARGV[3])
if redis.call('pttl', KEYS[2]) < at - now + period then
    redis.call('pexpire', KEYS[2], at - now + period)
end
write(KEYS[1], ARGV[1], math.max(tonumber(ARGV[2]), tonumber(ARGV[7]) + at - now), 9)
return {1, at - now, n + 1, ARGV[3]}
"""

# KEYS[1] - lock key
# ARGV[1] - owner token (encoded)
# return 1 if the owner held the lock and it was deleted, else 0
RELEASE = _PRELUDE + """
local v = read(KEYS[1])
if v and owns(v, ARGV[1]) then
    return redis.call('del', KEYS[1])
end
return 0
"""

# KEYS[1] - lock key
# ARGV[1] - owner token (encoded)
# ARGV[2] - new ttl in milliseconds
# return 1 if the owner holds the lock and its ttl was set, else 0
EXTEND = _PRELUDE + """
local v = read(KEYS[1])
if v and owns(v, ARGV[1]) then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] - lock key
# ARGV[1] - owner token (encoded)
# ARGV[2] - new ttl in milliseconds, or "" to keep the ttl
# return 1 if the owner holds the lock (now not started), else 0
SETTLE = _PRELUDE + """
local v, h = read(KEYS[1])
if not (v and owns(v, ARGV[1])) then
    return 0
end
if string.byte(v, 1) == 49 then
    if h then
        redis.call('hdel', KEYS[1], 'st')
    else
        redis.call('setrange', KEYS[1], 0, '0')
    end
end
if ARGV[2] ~= '' then
    redis.call('pexpire', KEYS[1], ARGV[2])
end
return 1
"""

# The head of both take-overs: a command re-sent after its reply was lost
# answers what its first run answered (the holder it displaced, to be
# revoked); else ``previous`` is the live holder, if any (``v`` its record).
_TAKE_OVER_HEAD = _PRELUDE + """
local v, h = read(KEYS[1])
if v and owns(v, ARGV[3]) then
    local kept = redis.call('get', KEYS[2])
    if kept and string.sub(kept, 1, #ARGV[4] + 1) == ARGV[4] .. '|' then
        local answer = string.sub(kept, #ARGV[4] + 2)
        if answer == '' then
            return false
        end
        return cjson.decode(answer)
    end
end
local previous = false
if v then
    previous = holder(KEYS[1], v, h)
end
"""

# The tail of both: remember the answer for a re-sent command, write the
# displaced owner's revoked marker when asked (as REVOKE: a longer one is
# kept; its key is ARGV[5] followed by the owner, decoded), take the key.
_TAKE_OVER_TAIL = """
redis.call('set', KEYS[2], ARGV[4] .. '|' .. (previous and cjson.encode(previous) or ''),
           'PX', 60000)
local displaced = ARGV[5] ~= '' and v and not owns(v, ARGV[3]) and string.match(v, '^..([^|]*)|')
if displaced then
    local m = ARGV[5] .. string.gsub(string.gsub(displaced, '%%7C', '|'), '%%25', '%%')
    local ttl = math.max(previous[1], tonumber(ARGV[6]))
    if redis.call('pttl', m) < ttl then
        redis.call('set', m, '1', 'PX', ttl)
    end
end
write(KEYS[1], ARGV[1], ARGV[2], 7)
return previous
"""

# KEYS[1] - lock key
# KEYS[2] - what this owner's last take-over answered, kept a minute for a
#           re-sent command (same hash slot): "<nonce>|<holder as JSON>"
# ARGV[1..2] - as ACQUIRE
# ARGV[3] - owner token (encoded)
# ARGV[4] - a nonce of this call (the same in a command re-sent after a lost reply)
# ARGV[5] - the revoked marker key of the displaced owner without the owner
#           (same hash slot), or "" to write no marker
# ARGV[6] - the marker's ttl in milliseconds when longer than the holder's
# ARGV[7..] - the hash fields to write instead, on a key of an earlier version
# return nil when the key was free, else the previous holder (both scripts)
TAKE_OVER = _TAKE_OVER_HEAD + _TAKE_OVER_TAIL

# As TAKE_OVER, but a started holder keeps the key (it is returned, nothing written)
TAKE_OVER_QUEUED = _TAKE_OVER_HEAD + """
if v and string.byte(v, 1) == 49 then
    return previous
end
""" + _TAKE_OVER_TAIL

# KEYS[1] - lock key
# KEYS[2] - revoked marker of the owner on this key (same hash slot)
# ARGV[1] - owner token (encoded)
# ARGV[2] - "1" to release the owner's lock
# ARGV[3] - ttl in milliseconds to take a free key with, or "" not to take it
# ARGV[4] - the record to take it with (started)
# ARGV[5..] - the hash fields to write instead, on a key of an earlier version
# return {"revoked"}, {"owned"}, {"free"} or {"held", <holder>}
CLAIM = _PRELUDE + """
local v, h = read(KEYS[1])
local mine = v and owns(v, ARGV[1])
if redis.call('exists', KEYS[2]) == 1 then
    if mine then
        redis.call('del', KEYS[1])
    end
    return {'revoked'}
end
if mine then
    if ARGV[2] == '1' then
        redis.call('del', KEYS[1])
    elseif h then
        redis.call('hset', KEYS[1], 'st', '1')
    elseif string.byte(v, 1) ~= 49 then
        redis.call('setrange', KEYS[1], 0, '1')
    end
    return {'owned'}
end
if v then
    local held = holder(KEYS[1], v, h)
    table.insert(held, 1, 'held')
    return held
end
if ARGV[3] ~= '' and ARGV[2] ~= '1' then
    write(KEYS[1], ARGV[4], ARGV[3], 5)
end
return {'free'}
"""

# KEYS[1] - lock key
# KEYS[2] - revoked marker of the owner on this key (same hash slot)
# ARGV[1] - owner token (encoded)
# ARGV[2] - marker ttl in milliseconds (an existing longer marker is kept)
# return 1 released, 2 running (kept), 0 not held
REVOKE = _PRELUDE + """
if redis.call('pttl', KEYS[2]) < tonumber(ARGV[2]) then
    redis.call('set', KEYS[2], '1', 'PX', ARGV[2])
end
local v = read(KEYS[1])
if not (v and owns(v, ARGV[1])) then
    return 0
end
if string.byte(v, 1) == 49 then
    return 2
end
redis.call('del', KEYS[1])
return 1
"""

# KEYS[1] - lock key
# return nil when free, else the holder
GET = _PRELUDE + """
local v, h = read(KEYS[1])
if v then
    return holder(KEYS[1], v, h)
end
return false
"""

# Run records (``RunRecords``): one string per attempt of a publish, in the
# lock's hash slot: "L<delivery token>" while a copy runs (the lease), then
# "D<delivery token>" once the attempt ended (the done marker; followed by a
# space and how the body ended, when the worker said: ``done_by``).

# A gated run (``keep_last``) also holds its key's run gate, "L<delivery
# token>" like a lease, from its start to its end.

# KEYS[1..2] - as CLAIM
# KEYS[3] - the attempt's run record (same hash slot)
# KEYS[4] - the key's run gate, for a gated run only (same hash slot)
# ARGV[1] - this copy's delivery token
# ARGV[2] - lease in milliseconds
# ARGV[3] - a delivery token whose lease and gate pass to this copy, or ""
# ARGV[4..] - as CLAIM's ARGV[1..]
# return {"running"}, {"done"} or {"waiting"} (nothing written), else CLAIM's answer
CLAIM_RUN = (
    _PRELUDE
    + """
local heir = ARGV[3] ~= '' and 'L' .. ARGV[3]
local run = redis.call('get', KEYS[3])
if run and run ~= heir and string.sub(run, 2) ~= ARGV[1] then
    return {string.sub(run, 1, 1) == 'D' and 'done' or 'running'}
end
if KEYS[4] then
    local gate = redis.call('get', KEYS[4])
    if gate and gate ~= heir and gate ~= 'L' .. ARGV[1] then
        return {'waiting'}
    end
    redis.call('set', KEYS[4], 'L' .. ARGV[1], 'PX', ARGV[2])
end
redis.call('set', KEYS[3], 'L' .. ARGV[1], 'PX', ARGV[2])
local A = {unpack(ARGV, 4)}
"""
    + CLAIM[len(_PRELUDE) :]
    .replace("ARGV[", "A[")
    .replace("write(KEYS[1], A[4], A[3], 5)", "write(KEYS[1], A[4], A[3], 8)")
)

# KEYS[1] - lock key
# KEYS[2] - the attempt's run record (same hash slot)
# KEYS[3] - the key's run gate, for a gated run only (same hash slot)
# ARGV[1] - owner token (encoded)
# ARGV[2] - this copy's delivery token
# ARGV[3] - done marker ttl in milliseconds
# ARGV[4] - "release", "settle" or "" (leave the lock)
# ARGV[5] - how the body ended ("success", "failure"...), or "" (kept after a space)
# return 1 if the owner held the lock it released or settled, else 0
END_RUN = _PRELUDE + """
local done = 'D' .. ARGV[2]
if ARGV[5] and ARGV[5] ~= '' then
    done = done .. ' ' .. ARGV[5]
end
redis.call('set', KEYS[2], done, 'PX', ARGV[3])
if KEYS[3] and redis.call('get', KEYS[3]) == 'L' .. ARGV[2] then
    redis.call('del', KEYS[3])
end
if ARGV[4] == '' then
    return 0
end
local v, h = read(KEYS[1])
if not (v and owns(v, ARGV[1])) then
    return 0
end
if ARGV[4] == 'release' then
    return redis.call('del', KEYS[1])
end
if string.byte(v, 1) == 49 then
    if h then
        redis.call('hdel', KEYS[1], 'st')
    else
        redis.call('setrange', KEYS[1], 0, '0')
    end
end
return 1
"""

# END_RUN for a gated run, waking the gate's waiter (``GateHandoff``).
# KEYS[1..3] - as END_RUN (KEYS[3], the gate, always)
# KEYS[4] - the gate's waiter: the payload of the follow-up waiting at it (same hash slot)
# ARGV - as END_RUN
# return {END_RUN's answer, the waiter's payload when this end opened the gate}
END_RUN_TURN = _PRELUDE + """
local opened = redis.call('get', KEYS[3]) == 'L' .. ARGV[2]
local function finish()
""" + END_RUN[len(_PRELUDE):] + """
end
local answer = finish()
if opened then
    local payload = redis.call('get', KEYS[4])
    if payload then
        redis.call('del', KEYS[4])
        return {answer, payload}
    end
end
return {answer}
"""

# KEYS[1] - a key's run gate
# KEYS[2] - the gate's waiter (same hash slot)
# ARGV[1] - the waiting copy's delivery token
# ARGV[2] - its payload
# ARGV[3] - the waiter's life in milliseconds
# return 1 if listed (another run holds the gate), else 0
WAIT_AT_GATE = """
local gate = redis.call('get', KEYS[1])
if not gate or gate == 'L' .. ARGV[1] then
    return 0
end
redis.call('set', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""

# A run gate kept as a plain lock (``GateWaiters``: the Django cache store on a
# RedisCache, which keeps run records with the lock operations): the
# follow-up's payload, listed while another owner holds the gate lock.
# KEYS[1] - the gate lock
# KEYS[2] - its waiter (same hash slot)
# ARGV[1] - the listing token (encoded)
# ARGV[2] - the payload
# ARGV[3] - the waiter's life in milliseconds
# return 1 if listed, else 0
LIST_GATE_WAITER = _PRELUDE + """
local v = read(KEYS[1])
if not v or owns(v, ARGV[1]) then
    return 0
end
redis.call('set', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""

# RELEASE of a gate lock, taking its waiter unless another owner holds the gate.
# KEYS[1..2] - as LIST_GATE_WAITER
# ARGV[1] - the owner token (encoded)
# return {the waiter's payload} when one was taken, else {}
OPEN_GATE = _PRELUDE + """
local v = read(KEYS[1])
if v then
    if not owns(v, ARGV[1]) then
        return {}
    end
    redis.call('del', KEYS[1])
end
local payload = redis.call('get', KEYS[2])
if payload then
    redis.call('del', KEYS[2])
    return {payload}
end
return {}
"""

# KEYS[1] - a run record
# KEYS[2] - its key's run gate, for a gated run only (same hash slot)
# ARGV[1] - the delivery token
# ARGV[2] - lease in milliseconds, or "" to delete the lease
# return how many of them the token holds (each renewed or deleted)
LEASE = """
local answer = 0
for _, k in ipairs(KEYS) do
    if redis.call('get', k) == 'L' .. ARGV[1] then
        if ARGV[2] == '' then
            answer = answer + redis.call('del', k)
        else
            answer = answer + redis.call('pexpire', k, ARGV[2])
        end
    end
end
return answer
"""

# KEYS[1] - a run record
# KEYS[2] - its key's run gate, for a gated run only (same hash slot)
# ARGV[1] - the delivery token
# ARGV[2] - lease in milliseconds
# ARGV[3] - "1" to take back a record nobody holds (absent), else ""
# return 1 if the token holds the run record now (renewed or taken back), else 0
# (the gate is kept only with the record)
KEEP = """
local mine = 'L' .. ARGV[1]
for _, k in ipairs(KEYS) do
    local v = redis.call('get', k)
    if v == mine or (not v and ARGV[3] == '1') then
        redis.call('set', k, mine, 'PX', ARGV[2])
    elseif k == KEYS[1] then
        return 0
    end
end
return 1
"""

# KEYS[1] - a run record
# return its value, or nil
PEEK = "return redis.call('get', KEYS[1])"

# Fenced claims (``FencedClaims``): CLAIM and CLAIM_RUN that, when the body
# runs ("owned" or "free"), also answer the key's next fence, taken from its
# fence counter (a string in the lock's hash slot): above its last fence and
# above the server's clock in microseconds (a lapsed counter starts again
# above every fence it issued). The counter lives FENCE_TTL.
_FENCE = f"""
local function fence(k)
    local t = redis.call('time')
    local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local f = math.max(tonumber(redis.call('get', k) or '0') + 1, now)
    redis.call('set', k, string.format('%.0f', f), 'PX', {int(FENCE_TTL * 1000)})
    return f
end
"""


def _fenced(script: str, head: str) -> str:
    """``script`` (CLAIM or CLAIM_RUN) answering a fence with "owned" and "free"."""
    body = script[len(_PRELUDE) :]
    body = body.replace("return {'owned'}", "return {'owned', fence(F)}")
    body = body.replace("return {'free'}", "return {'free', fence(F)}")
    return _PRELUDE + _FENCE + head + body


# KEYS[1..2] - as CLAIM
# KEYS[3] - the key's fence counter (same hash slot)
# ARGV - as CLAIM
# return as CLAIM; {"owned", <fence>} or {"free", <fence>} when the body runs
CLAIM_FENCED = _fenced(CLAIM, "local F = KEYS[3]\n")

# KEYS[1..3] - as CLAIM_RUN
# KEYS[4] - the key's run gate, for a gated run only (same hash slot)
# KEYS[#KEYS] - the key's fence counter (same hash slot)
# ARGV - as CLAIM_RUN
# return as CLAIM_RUN; {"owned", <fence>} or {"free", <fence>} when the body runs
CLAIM_RUN_FENCED = _fenced(
    CLAIM_RUN.replace("KEYS[4]", "G"),
    "local F = KEYS[#KEYS]\nlocal G = #KEYS == 5 and KEYS[4] or nil\n",
)

# KEYS[1] - the key's fence counter
# return its value, or nil
FENCE_OF = "return redis.call('get', KEYS[1])"

_REVOKE_OUTCOMES = {0: RevokeOutcome.NOT_HELD, 1: RevokeOutcome.RELEASED, 2: RevokeOutcome.RUNNING}

#: policy -> its one-letter code in a record (lowercase: task name not stored)
_CODES: dict[str, str] = {
    UniqueUntil.START.value: "b",
    UniqueUntil.SUCCESS.value: "s",
    UniqueUntil.FINISH.value: "f",
    UniqueUntil.EXPIRY.value: "e",
}
_POLICIES: dict[str, str] = {code: policy for policy, code in _CODES.items()}
_NAMED: dict[str, str] = {code: code.upper() for code in _CODES.values()}
_POLICIES.update({upper: _POLICIES[code] for code, upper in _NAMED.items()})
_DERIVED = frozenset(_CODES.values())
_CUSTOM = "*"

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_PAIRS = [a + b for a in _DIGITS for b in _DIGITS]

#: The driver errors that mean "the server cannot be reached" (or is not a
#: Redis server: an answer outside the protocol is one of them).
UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    InvalidResponse,
    OSError,
)


#: Error codes of a server that cannot serve now and will again by itself
#: (loading its data, a replica without its master, a cluster re-forming):
#: ``StoreUnavailable``. Every other error answer (``READONLY`` after a
#: failover, ``OOM`` under ``noeviction``, ``MISCONF``, ``BUSY``,
#: ``NOREPLICAS``...) is ``StoreRefused``.
UNAVAILABLE_CODES = frozenset({"LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"})
#: Error codes of an ACL or authentication refusal: ``StorePermissionDenied``.
PERMISSION_CODES = frozenset({"NOPERM", "NOAUTH", "WRONGPASS"})
#: Every exception the driver raises (a socket error is an ``OSError``).
DRIVER_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)


def error_code(exc: BaseException) -> str:
    """The error code of a Redis error answer (``READONLY``, ``OOM``...), or ``""``.

    redis-py keeps it in ``status_code`` for the answers it maps to a class,
    else the message starts with it.
    """
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code:
        return code
    first = str(exc).split(" ", 1)[0]
    return first if first.isupper() else ""


def classify(
    exc: BaseException, unreachable: tuple[type[BaseException], ...] = UNREACHABLE
) -> type[StoreError] | None:
    """What a redis-py error means: the ``StoreError`` class to raise, or None if no driver's.

    ACL and authentication refusals (``NOPERM``, ``NOAUTH``, ``WRONGPASS``):
    ``StorePermissionDenied``; ``UNAVAILABLE_CODES`` and ``unreachable``:
    ``StoreUnavailable``; every other error answer or driver error:
    ``StoreRefused``.
    """
    if isinstance(exc, (AuthenticationError, AuthorizationError, NoPermissionError)):
        return StorePermissionDenied
    if isinstance(exc, ResponseError):
        code = error_code(exc)
        if code in PERMISSION_CODES:
            return StorePermissionDenied
        if code in UNAVAILABLE_CODES or isinstance(exc, (ClusterDownError, TryAgainError)):
            return StoreUnavailable
        if isinstance(exc, unreachable):
            return StoreUnavailable
        return StoreRefused
    if isinstance(exc, unreachable):
        return StoreUnavailable
    if isinstance(exc, DRIVER_ERRORS):
        return StoreRefused
    return None


def _claim_answer(lock: Any, key: str, raw: Sequence[Any]) -> Claim:
    """A claim script's answer: the outcome, then the holder (``HELD``) or the fence."""
    outcome = ClaimOutcome(_text(raw[0]))
    if outcome is ClaimOutcome.HELD:
        return Claim(outcome, lock(key, raw[1:]))
    return Claim(outcome, fence=int(raw[1]) if len(raw) > 1 else None)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _enc(text: str) -> str:
    """``text`` with "%" and "|" percent-encoded (so "|" can end a field)."""
    if "%" in text or "|" in text:
        return text.replace("%", "%25").replace("|", "%7C")
    return text


def _dec(text: str) -> str:
    """The inverse of ``_enc``."""
    if "%" in text:
        return text.replace("%7C", "|").replace("%25", "%")
    return text


@functools.lru_cache(maxsize=4)
def _base36_high(n: int) -> str:
    out = ""
    while n:
        n, digit = divmod(n, 36)
        out = _DIGITS[digit] + out
    return out


def _base36(n: int) -> str:
    """``n`` >= 0 in base 36 (the high digits change every 28 minutes: cached)."""
    high, low = divmod(n, 36**4)
    a, b = divmod(low, 36**2)
    return _base36_high(high) + _PAIRS[a] + _PAIRS[b]


#: A key an earlier version made ends in a 64-character sha256: producers not
#: yet upgraded read its lock with HMGET, so a lock written there is a hash.
_LEGACY_KEY = re.compile(r":[0-9a-f]{64}\Z")


def _legacy_fields(key: str, owner: str, meta: LockMeta) -> list[Any]:
    """The hash fields of a lock on a key of an earlier version (else nothing)."""
    if _LEGACY_KEY.search(key) is None:
        return []
    return [
        "owner", owner, "task", meta.get("task_name", ""), "policy", meta.get("policy", ""),
        "at", int(time.time() * 1000), "id", meta.get("task_id", "") or owner,
    ]


def _task_of(key: str) -> str | None:
    """The task name a key of the shape ``<prefix>:<task name>:<digest>`` names."""
    _, sep, rest = key.partition(":")
    name, sep, _ = rest.rpartition(":")
    return name if sep else None


def _pack(key: str, owner: str, meta: LockMeta, started: bool) -> str:
    """The record of a new lock on ``key`` (``owner`` already encoded)."""
    name = meta.get("task_name", "")
    policy = meta.get("policy", "")
    at = _base36(int(time.time() * 1000))
    code = _CODES.get(policy)
    if code is None:
        head = f"{_CUSTOM}{owner}|{at}|{_enc(policy)}|{_enc(name)}|"
    elif name == _task_of(key):
        head = f"{code}{owner}|{at}|"
    else:
        head = f"{_NAMED[code]}{owner}|{at}|{_enc(name)}|"
    return ("1" if started else "0") + head + meta.get("task_id", "")


def _unpack(key: str, record: str) -> tuple[str, str, str, int, str, bool] | None:
    """``(owner, task name, policy, acquired at ms, task id, started)``, or None if not a lock."""
    end = record.find("|", 2)
    stop = record.find("|", end + 1) if end > 0 else -1
    if stop < 0 or record[0] not in "01":
        return None
    try:
        at = int(record[end + 1 : stop], 36)
    except ValueError:
        return None
    code, rest = record[1], record[stop + 1 :]
    if code == _CUSTOM:
        policy, sep, rest = rest.partition("|")
        name, sep2, rest = rest.partition("|")
        if not (sep and sep2):
            return None
        policy, name = _dec(policy), _dec(name)
    elif code in _POLICIES:
        policy = _POLICIES[code]
        if code in _DERIVED:
            name = _task_of(key) or ""
        else:
            name, sep, rest = rest.partition("|")
            if not sep:
                return None
            name = _dec(name)
    else:
        return None
    return _dec(record[2:end]), name, policy, at, rest, record[0] == "1"


#: Connect and operation timeouts (seconds) of the store's connections; override
#: them with ``dedup_store_options`` (e.g. ``{"socket_timeout": 10}``).
DEFAULT_TIMEOUTS: Mapping[str, float] = {"socket_connect_timeout": 5.0, "socket_timeout": 5.0}


class RedisStore(RedisLimits):
    """Owner-checked TTL locks in Redis (also Sentinel and TLS via ``rediss://``).

    Built on the result backend's own client when the backend is Redis, so
    TLS, Sentinel, credentials and ``global_keyprefix`` come along.
    """

    name = "redis"
    #: the driver errors that mean "the server cannot be reached"
    unreachable: tuple[type[BaseException], ...] = UNREACHABLE

    def __init__(
        self,
        client: Any,
        *,
        keyprefix: str = "",
        label: str = "redis",
        timeouts: Mapping[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.keyprefix = keyprefix
        self.label = label
        self._acquire: Script = client.register_script(ACQUIRE)
        self._acquire_many: Script = client.register_script(ACQUIRE_MANY)
        self._release: Script = client.register_script(RELEASE)
        self._extend: Script = client.register_script(EXTEND)
        self._take_over: Script = client.register_script(TAKE_OVER)
        self._take_over_queued: Script = client.register_script(TAKE_OVER_QUEUED)
        self._claim: Script = client.register_script(CLAIM)
        self._settle: Script = client.register_script(SETTLE)
        self._revoke: Script = client.register_script(REVOKE)
        self._get: Script = client.register_script(GET)
        self._claim_run: Script = client.register_script(CLAIM_RUN)
        self._end_run: Script = client.register_script(END_RUN)
        self._end_run_turn: Script = client.register_script(END_RUN_TURN)
        self._wait_at_gate: Script = client.register_script(WAIT_AT_GATE)
        self._list_gate_waiter: Script = client.register_script(LIST_GATE_WAITER)
        self._open_gate: Script = client.register_script(OPEN_GATE)
        self._lease: Script = client.register_script(LEASE)
        self._keep: Script = client.register_script(KEEP)
        self._peek: Script = client.register_script(PEEK)
        self._acquire_rated: Script = client.register_script(ACQUIRE_RATED)
        self._claim_fenced: Script = client.register_script(CLAIM_FENCED)
        self._claim_run_fenced: Script = client.register_script(CLAIM_RUN_FENCED)
        #: per-thread connections the scripts run on (None: through the
        #: client's own command path, e.g. a cluster client routing by slot), with
        #: the store's connect and operation timeouts (``DEFAULT_TIMEOUTS``)
        wanted = {**DEFAULT_TIMEOUTS, **(timeouts or {})}
        bounded = {name: wanted[name] for name in DEFAULT_TIMEOUTS}
        self._wire = ScriptWire(client, bounded) if isinstance(client, redis.Redis) else None

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> RedisStore:
        """Build on ``app``'s Redis result backend client when ``url`` is that backend."""
        from kombu.utils.url import maybe_sanitize_url

        label = f"redis ({maybe_sanitize_url(url)})"
        # Bounded waits unless dedup_store_options says otherwise (a hung server
        # costs a call seconds, not the result backend's 120 s socket timeout).
        given = dict(options or {})
        options = {**DEFAULT_TIMEOUTS, **given}
        if app is None:
            return cls(redis.Redis.from_url(url, **options), label=label, timeouts=options)
        keyprefix = ""
        backend: Any
        transport_options = app.conf.get("result_backend_transport_options") or {}
        if is_result_backend(app, url):
            backend = app.backend
            keyprefix = transport_options.get("global_keyprefix") or ""
        else:
            backend = _backend_for_url(app, url)
        client = backend.client
        if given:
            client = _with_options(backend, given)
        return cls(client, keyprefix=keyprefix, label=label, timeouts=options)

    def durability(self) -> Durability:
        """``CONFIG GET`` of the eviction policy and persistence, in one round trip.

        Managed servers often refuse ``CONFIG``: the answer then says so in
        ``error`` instead of guessing.
        """
        try:
            pipe = self.client.pipeline(transaction=False)
            for name in ("maxmemory-policy", "maxmemory", "save", "appendonly"):
                pipe.config_get(name)
            answers = pipe.execute()
        except Exception as exc:  # refused, unknown command, unreachable: all "cannot tell"
            return Durability(None, None, None, server_answer(exc))
        found = {_text(k): _text(v) for answer in answers for k, v in dict(answer).items()}
        if "maxmemory-policy" not in found:
            return Durability(None, None, None, "CONFIG GET answered nothing")
        persistent = bool(found.get("save", "").strip()) or found.get("appendonly") == "yes"
        return Durability(
            eviction_policy=found["maxmemory-policy"],
            maxmemory=int(found.get("maxmemory") or 0),
            persistent=persistent,
        )

    def classify(self, exc: BaseException) -> type[StoreError] | None:
        """What a driver error means (``classify``, with this store's ``unreachable``)."""
        return classify(exc, self.unreachable)

    @contextmanager
    def _boundary(self) -> Iterator[None]:
        """Translate every driver error into a ``StoreError`` (``classify``)."""
        with store_errors(self.classify, self.name, lambda: self.label):
            yield

    def close(self) -> None:
        """Close the client's connections."""
        if self._wire is not None:
            self._wire.close()
        self.client.close()

    def _run(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """Run one of this store's scripts: one EVALSHA, unreachable errors translated."""
        try:
            if self._wire is not None:
                return self._wire.evalsha(script.sha, script.script, keys, args)
            return script(keys=keys, args=args)
        except Exception as exc:
            error = translate(exc, self.classify, self.name, self.label)
            if error is exc:
                raise
            raise error from exc

    def _k(self, key: str) -> str:
        return self.keyprefix + key

    def _marker(self, key: str, owner: str, kind: str = "revoked") -> str:
        """The ``kind`` marker of ``owner`` on ``key``: a key in the lock's hash slot."""
        physical = self._k(key)
        opening = physical.find("{")
        tagged = opening >= 0 and physical.find("}", opening + 2) > opening
        return (physical if tagged else "{" + physical + "}") + f":{kind}:" + owner

    def _lock(self, key: str, raw: Sequence[Any] | None) -> Lock | None:
        """The holder a script returned, or None when the key was free.

        A string that is not a record (nothing this library writes) is
        reported as held by nobody known: never as free.
        """
        if not raw:
            return None
        lock = _decode(key, raw)
        if lock is None:
            expires_at = time.time() + max(0, int(raw[0])) / 1000.0
            return Lock(
                key=key, owner="", task_name="", acquired_at=0.0, expires_at=expires_at, policy=""
            )
        return lock

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock, or return the holder (one EVALSHA)."""
        record = _pack(key, _enc(owner), meta, meta.get("started") == "1")
        args = [record, _ms(ttl), *_legacy_fields(key, owner, meta)]
        raw = self._run(self._acquire, [self._k(key)], args)
        return self._lock(key, raw)

    def acquire_many(self, items: Sequence[AcquireItem]) -> list[Lock | None]:
        """``acquire`` for every item in one EVALSHA (a key of an earlier version's
        shape, rare, in one more each)."""
        answers: list[Lock | None] = [None] * len(items)
        batch: list[int] = []
        for index, (key, owner, ttl, meta) in enumerate(items):
            if _legacy_fields(key, owner, meta):
                answers[index] = self.acquire(key, owner, ttl, meta)
            else:
                batch.append(index)
        for group in self._bulk_groups([items[i][0] for i in batch]):
            indexes = [batch[i] for i in group]
            keys: list[str] = []
            args: list[Any] = []
            for index in indexes:
                key, owner, ttl, meta = items[index]
                keys.append(self._k(key))
                args += [_pack(key, _enc(owner), meta, meta.get("started") == "1"), _ms(ttl)]
            raws = self._run(self._acquire_many, keys, args)
            for index, raw in zip(indexes, raws, strict=True):
                answers[index] = self._lock(items[index][0], raw)
        return answers

    def _bulk_groups(self, keys: Sequence[str]) -> list[list[int]]:
        """The positions of ``keys`` sent in one script each: all of them, on one server."""
        return [list(range(len(keys)))] if keys else []

    def acquire_rated(
        self,
        key: str,
        owner: str,
        ttl: float,
        meta: LockMeta,
        rate_key: str,
        member: str,
        limit: int,
        period: float,
        *,
        delay: bool,
        unique_for: float,
    ) -> RatedLock | None:
        """Count the publish and take the lock, or answer the holder or the full
        window (``RatedAcquire``; one EVALSHA)."""
        if not self._same_slot(key, rate_key):
            return None
        mine = _enc(owner)
        record = _pack(key, mine, meta, meta.get("started") == "1")
        entry = new_entry(member, limit, period)
        args = [
            record, _ms(ttl), entry, limit, _ms(period), "1" if delay else "0",
            _ms(unique_for), mine, *_legacy_fields(key, owner, meta),
        ]  # fmt: skip
        raw = self._run(self._acquire_rated, [self._k(key), self._k(rate_key)], args)
        if int(raw[0]) == 2:
            return RatedLock(None, self._lock(key, raw[1]))
        answer = rate_answer(raw)
        return RatedLock(replace(answer, entry=entry) if answer.admitted else answer)

    def _same_slot(self, key: str, rate_key: str) -> bool:
        """Whether one script may touch both keys (always, on one server)."""
        return True

    def release(self, key: str, owner: str) -> bool:
        """Compare-and-delete on the owner (one EVALSHA)."""
        return bool(self._run(self._release, [self._k(key)], [_enc(owner)]))

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Compare-and-pexpire on the owner (one EVALSHA)."""
        return bool(self._run(self._extend, [self._k(key)], [_enc(owner), _ms(ttl)]))

    def list_gate_waiter(self, gate: str, token: str, payload: bytes, life: float) -> bool:
        """List the follow-up at a gate kept as a plain lock (``GateWaiters``; one EVALSHA).

        Only a store whose run records are built from its lock operations
        (the Django cache store) keeps gates so: this store's own run
        records keep them natively (``GateHandoff``).
        """
        keys = [self._k(gate), self._marker(gate, "", "gatewait")]
        return bool(self._run(self._list_gate_waiter, keys, [_enc(token), payload, _ms(life)]))

    def open_gate(self, gate: str, token: str) -> bytes | None:
        """Release a gate kept as a plain lock and take its waiter (``GateWaiters``; one
        EVALSHA, as ``release``)."""
        keys = [self._k(gate), self._marker(gate, "", "gatewait")]
        raw = self._run(self._open_gate, keys, [_enc(token)])
        return _as_bytes(raw[0]) if raw else None

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder; return the previous one (one EVALSHA)."""
        return self._take(self._take_over, key, owner, ttl, meta, None)

    def take_over_queued(
        self, key: str, owner: str, ttl: float, meta: LockMeta
    ) -> Lock | None:
        """``take_over`` unless a started holder holds the key (one EVALSHA)."""
        return self._take(self._take_over_queued, key, owner, ttl, meta, None)

    def take_over_revoking(
        self,
        key: str,
        owner: str,
        ttl: float,
        meta: LockMeta,
        revoked_ttl: float,
        *,
        queued_only: bool = False,
    ) -> Lock | None:
        """``take_over`` (or ``take_over_queued``) writing the displaced owner's
        revoked marker in the same script (one EVALSHA: ``RevokingTakeOver``)."""
        script = self._take_over_queued if queued_only else self._take_over
        return self._take(script, key, owner, ttl, meta, revoked_ttl)

    def _take(
        self,
        script: Script,
        key: str,
        owner: str,
        ttl: float,
        meta: LockMeta,
        revoked_ttl: float | None,
    ) -> Lock | None:
        """Run a take-over script; with a ``revoked_ttl``, it revokes the displaced owner."""
        mine = _enc(owner)
        record = _pack(key, mine, meta, False)
        keys = [self._k(key), self._marker(key, owner, "replaced")]
        nonce = secrets.token_hex(6)
        if revoked_ttl is None:
            revoking: list[Any] = ["", ""]
        else:
            revoking = [self._marker(key, ""), _ms(revoked_ttl)]
        args = [record, _ms(ttl), mine, nonce, *revoking, *_legacy_fields(key, owner, meta)]
        raw = self._run(script, keys, args)
        return self._lock(key, raw)

    def claim(
        self,
        key: str,
        owner: str,
        *,
        release: bool,
        ttl: float | None,
        meta: LockMeta,
        fence: bool = False,
    ) -> Claim:
        """The worker's start check (one EVALSHA over the lock and its marker);
        with ``fence``, over the key's fence counter too (``FencedClaims``)."""
        mine = _enc(owner)
        take = ttl is not None and not release
        args = [
            mine,
            "1" if release else "",
            "" if ttl is None else _ms(ttl),
            _pack(key, mine, meta, True) if take else "",
            *(_legacy_fields(key, owner, meta) if take else ()),
        ]
        keys = [self._k(key), self._marker(key, owner)]
        if fence:
            raw = self._run(self._claim_fenced, [*keys, self._fence_key(key)], args)
        else:
            raw = self._run(self._claim, keys, args)
        return _claim_answer(self._lock, key, raw)

    def _fence_key(self, key: str) -> str:
        """The key's fence counter: in the lock's hash slot."""
        return self._marker(key, "", "fence")

    def fence_of(self, key: str) -> int | None:
        """The last fence issued for ``key`` (one EVALSHA; ``FencedClaims``)."""
        raw = self._run(self._peek, [self._fence_key(key)], [])
        return None if raw is None else int(_text(raw))

    #: ``claim_run``, ``end_run``, ``abandon_run`` and ``renew_runs`` keep the
    #: run gate of a gated run in the same script (``RunRecords``)
    run_gates = True

    def _run_record(self, run: RunRef) -> str:
        return self._marker(run.key, run.owner, f"run{run.attempt}")

    def _run_keys(self, run: RunRef) -> list[str]:
        """The run record, and the key's run gate when ``run`` is gated (same hash slot)."""
        record = self._run_record(run)
        return [record, self._marker(run.key, "", "gate")] if run.gated else [record]

    def claim_run(
        self,
        run: RunRef,
        lease: float,
        meta: LockMeta,
        *,
        release: bool,
        ttl: float | None,
    ) -> tuple[RunOutcome, Claim | None]:
        """The lease, then the start claim (one EVALSHA over lock, marker and run record)."""
        key, owner = run.key, run.owner
        mine = _enc(owner)
        take = ttl is not None and not release
        args = [
            run.token,
            _ms(lease),
            run.inherits,
            mine,
            "1" if release else "",
            "" if ttl is None else _ms(ttl),
            _pack(key, mine, meta, True) if take else "",
            *(_legacy_fields(key, owner, meta) if take else ()),
        ]
        keys = [self._k(key), self._marker(key, owner), *self._run_keys(run)]
        if run.fenced:
            raw = self._run(self._claim_run_fenced, [*keys, self._fence_key(key)], args)
        else:
            raw = self._run(self._claim_run, keys, args)
        answer = _text(raw[0])
        if answer in ("running", "done", "waiting"):
            return RunOutcome(answer), None
        return RunOutcome.BEGUN, _claim_answer(self._lock, key, raw)

    def end_run(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> bool:
        """The done marker, then release or settle (one EVALSHA)."""
        action = "" if release is None else ("release" if release else "settle")
        keys = [self._k(run.key), *self._run_keys(run)]
        args = [_enc(run.owner), run.token, _ms(done_ttl), action, meta.get(OUTCOME_FIELD, "")]
        return bool(self._run(self._end_run, keys, args))

    def end_run_in_turn(
        self, run: RunRef, done_ttl: float, meta: LockMeta, *, release: bool | None
    ) -> tuple[bool, bytes | None]:
        """``end_run``, taking the gate's waiter when it opens the gate (one EVALSHA)."""
        if not run.gated:
            return self.end_run(run, done_ttl, meta, release=release), None
        action = "" if release is None else ("release" if release else "settle")
        keys = [self._k(run.key), *self._run_keys(run), self._marker(run.key, "", "gatewait")]
        args = [_enc(run.owner), run.token, _ms(done_ttl), action, meta.get(OUTCOME_FIELD, "")]
        raw = self._run(self._end_run_turn, keys, args)
        payload = raw[1] if len(raw) > 1 else None
        return bool(raw[0]), (_as_bytes(payload) if payload is not None else None)

    def wait_at_gate(self, run: RunRef, payload: bytes, life: float) -> bool:
        """List the follow-up's payload at the gate another run holds (one EVALSHA)."""
        keys = [self._marker(run.key, "", "gate"), self._marker(run.key, "", "gatewait")]
        return bool(self._run(self._wait_at_gate, keys, [run.token, payload, _ms(life)]))

    def abandon_run(self, run: RunRef) -> bool:
        """Delete the lease if this copy holds it (one EVALSHA)."""
        return bool(self._run(self._lease, self._run_keys(run), [run.token, ""]))

    def renew_runs(self, runs: Sequence[RunRef], lease: float) -> int:
        """Renew every lease its copy holds: one pipelined round trip for all of them."""
        if not runs:
            return 0
        ms = _ms(lease)
        with self._boundary():
            pipe = self.client.pipeline(transaction=False)
            for run in runs:
                self._lease(keys=self._run_keys(run), args=[run.token, ms], client=pipe)
            return sum(int(answer) for answer in pipe.execute())

    def keep_runs(
        self, runs: Sequence[RunRef], lease: float, retake: Collection[str]
    ) -> list[bool]:
        """Renew, or take back, every lease: one pipelined round trip for all of them."""
        if not runs:
            return []
        ms = _ms(lease)
        with self._boundary():
            pipe = self.client.pipeline(transaction=False)
            for run in runs:
                args: list[str | int] = [run.token, ms, "1" if run.token in retake else ""]
                self._keep(keys=self._run_keys(run), args=args, client=pipe)
            return [bool(int(answer)) for answer in pipe.execute()]

    def peek_run(self, run: RunRef) -> RunOutcome | None:
        """Read the attempt's run record (one EVALSHA of a GET: the store's timeouts apply)."""
        value = self._run_record_value(run)
        if value is None:
            return None
        if value.startswith("D"):
            return RunOutcome.DONE
        return RunOutcome.BEGUN if value[1:] == run.token else RunOutcome.RUNNING

    def _run_record_value(self, run: RunRef) -> str | None:
        raw = self._run(self._peek, [self._run_record(run)], [])
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def lease_token(self, run: RunRef) -> str | None:
        """The token of the attempt's live lease (the same read as ``peek_run``)."""
        value = self._run_record_value(run)
        return None if value is None or value.startswith("D") else value[1:]

    def done_by(self, run: RunRef) -> tuple[str, str] | None:
        """The attempt's done marker: its token and outcome (the same read as ``peek_run``)."""
        value = self._run_record_value(run)
        if value is None or not value.startswith("D"):
            return None
        token, _, outcome = value[1:].partition(" ")
        return token, outcome

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Mark ``owner`` revoked; release its lock unless started (one EVALSHA)."""
        raw = self._run(
            self._revoke, [self._k(key), self._marker(key, owner)], [_enc(owner), _ms(ttl)]
        )
        return _REVOKE_OUTCOMES[int(raw)]

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Mark the owner's lock not started, keeping or resetting its TTL (one EVALSHA)."""
        args = [_enc(owner), "" if ttl is None else _ms(ttl)]
        raw = self._run(self._settle, [self._k(key)], args)
        return bool(raw)

    def unrevoke(self, key: str, owner: str) -> None:
        """Delete the revoked marker of ``owner`` (one DEL)."""
        with self._boundary():
            self.client.delete(self._marker(key, owner))

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key`` (one EVALSHA)."""
        raw = self._run(self._get, [self._k(key)], [])
        return self._lock(key, raw)

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix`` (SCAN, then the get script pipelined per batch)."""
        yield from self._scan_client(self.client, prefix)

    def _scan_client(self, client: Any, prefix: str) -> Iterator[Lock]:
        pattern = _glob_escape(self._k(prefix)) + "*"
        with self._boundary():
            keys = [_text(k) for k in client.scan_iter(match=pattern, count=500)]
        for start in range(0, len(keys), 500):
            batch = keys[start : start + 500]
            with self._boundary():
                pipe = client.pipeline(transaction=False)
                for physical in batch:
                    self._get(keys=[physical], client=pipe)
                replies = pipe.execute(raise_on_error=False)
                for raw in replies:
                    # A key of another type answers WRONGTYPE (not a lock);
                    # any other error is the server refusing the read.
                    if isinstance(raw, Exception) and error_code(raw) != "WRONGTYPE":
                        raise raw
            for physical, raw in zip(batch, replies, strict=True):
                # Undecodable strings are not locks (revoked markers, for one).
                if raw and not isinstance(raw, Exception):
                    lock = _decode(physical[len(self.keyprefix) :], raw)
                    if lock is not None:
                        yield lock

    def _counts_key(self, prefix: str) -> str:
        return self._k(f"{prefix}/counters")

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """HINCRBY every counter in one pipelined round trip."""
        if not counts:
            return
        with self._boundary():
            pipe = self.client.pipeline(transaction=False)
            for (task_name, event), n in counts.items():
                pipe.hincrby(self._counts_key(prefix), f"{task_name}\x1f{event}", n)
            pipe.execute()

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every stored counter under ``prefix``."""
        with self._boundary():
            raw = self.client.hgetall(self._counts_key(prefix))
        counts: dict[tuple[str, str], int] = {}
        for field, value in raw.items():
            task_name, _, event = _text(field).partition("\x1f")
            counts[(task_name, event)] = int(value)
        return counts


def _decode(key: str, raw: Sequence[Any]) -> Lock | None:
    """A holder as the scripts return it: ``{pttl, record}`` or a hash's fields."""
    expires_at = time.time() + max(0, int(raw[0])) / 1000.0
    if len(raw) == 2:
        try:
            record = _text(raw[1])
        except UnicodeDecodeError:
            return None  # foreign bytes: not a record this library writes
        fields = _unpack(key, record)
        if fields is None:
            return None
        owner, name, policy, at, task_id, started = fields
        return Lock(
            key=key,
            owner=owner,
            task_name=name,
            acquired_at=at / 1000.0,
            expires_at=expires_at,
            policy=policy,
            task_id=task_id or owner,
            started=started,
        )
    owner, name, policy, at, task_id, st = raw[1:7]
    return Lock(
        key=key,
        owner=_text(owner),
        task_name=_text(name or b""),
        acquired_at=int(at or 0) / 1000.0,
        expires_at=expires_at,
        policy=_text(policy or b""),
        task_id=_text(task_id) if task_id else _text(owner),
        started=bool(st),
    )


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _backend_for_url(app: Celery, url: str) -> Any:
    """A Celery Redis backend object for ``url`` (parses TLS and Sentinel like Celery)."""
    from celery.backends.redis import RedisBackend, SentinelBackend

    cls = SentinelBackend if url.startswith("sentinel") else RedisBackend
    return cls(app=app, url=url)


def _with_options(backend: Any, options: Mapping[str, Any]) -> Any:
    params = {**backend.connparams, **options}
    return backend._create_client(**params)
