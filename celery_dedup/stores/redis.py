"""Redis lock store: one Lua script per atomic operation, one round trip each.

A lock is a hash ``{owner, id, task, policy, at, st}`` with a millisecond
TTL; a revoked marker is a plain key in the lock's hash slot. Keys reach the
scripts only through ``KEYS`` (a script touches one lock and, at most, its
marker in the same slot, so every script is cluster-safe) and TTLs as
integer milliseconds in ``ARGV``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

from .base import Claim, ClaimOutcome, Lock, LockMeta, RevokeOutcome, unavailable_on

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["RedisStore"]

# The hash of a lock: owner (token), id (holder task id), task, policy, at
# (acquired, epoch ms) and st ("1" once the holder's message started).
# A holder is returned as {owner, task, policy, at, pttl, id, st}; fields a
# record lacks come back as false (0.1.0 records have no id and no st).

# KEYS[1] - lock key
# ARGV[1] - owner token
# ARGV[2] - ttl in milliseconds
# ARGV[3] - task name
# ARGV[4] - unlock policy
# ARGV[5] - acquired at, epoch milliseconds
# ARGV[6] - holder task id
# ARGV[7] - "1" to create the lock already started
# return nil when acquired, else the holder
ACQUIRE = """
local h = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at', 'id', 'st')
if h[1] then
    return {h[1], h[2], h[3], h[4], redis.call('pttl', KEYS[1]), h[5], h[6]}
end
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'task', ARGV[3], 'policy', ARGV[4],
           'at', ARGV[5], 'id', ARGV[6])
if ARGV[7] == '1' then
    redis.call('hset', KEYS[1], 'st', '1')
end
redis.call('pexpire', KEYS[1], ARGV[2])
return false
"""

# KEYS[1] - lock key
# ARGV[1] - owner token
# return 1 if the owner held the lock and it was deleted, else 0
RELEASE = """
if redis.call('hget', KEYS[1], 'owner') == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

# KEYS[1] - lock key
# ARGV[1] - owner token
# ARGV[2] - new ttl in milliseconds
# return 1 if the owner holds the lock and its ttl was set, else 0
EXTEND = """
if redis.call('hget', KEYS[1], 'owner') == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] - lock key
# ARGV[1] - owner token
# ARGV[2] - new ttl in milliseconds, or "" to keep the ttl
# return 1 if the owner holds the lock (now not started), else 0
SETTLE = """
if redis.call('hget', KEYS[1], 'owner') == ARGV[1] then
    redis.call('hdel', KEYS[1], 'st')
    if ARGV[2] ~= '' then
        redis.call('pexpire', KEYS[1], ARGV[2])
    end
    return 1
end
return 0
"""

# KEYS[1] - lock key
# ARGV[1..6] - as ACQUIRE
# return nil when the key was free, else the previous holder
TAKE_OVER = """
local h = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at', 'id', 'st')
local pttl = redis.call('pttl', KEYS[1])
redis.call('del', KEYS[1])
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'task', ARGV[3], 'policy', ARGV[4],
           'at', ARGV[5], 'id', ARGV[6])
redis.call('pexpire', KEYS[1], ARGV[2])
if h[1] then
    return {h[1], h[2], h[3], h[4], pttl, h[5], h[6]}
end
return false
"""

# KEYS[1] - lock key
# KEYS[2] - revoked marker of the owner on this key (same hash slot)
# ARGV[1] - owner token
# ARGV[2] - "1" to release the owner's lock
# ARGV[3] - ttl in milliseconds to take a free key with, or "" not to take it
# ARGV[4..7] - task name, unlock policy, acquired at (epoch ms), holder task id
# return {"revoked"}, {"owned"}, {"free"} or {"held", <holder>}
CLAIM = """
local owner = redis.call('hget', KEYS[1], 'owner')
if redis.call('exists', KEYS[2]) == 1 then
    if owner == ARGV[1] then
        redis.call('del', KEYS[1])
    end
    return {'revoked'}
end
if owner == ARGV[1] then
    if ARGV[2] == '1' then
        redis.call('del', KEYS[1])
    else
        redis.call('hset', KEYS[1], 'st', '1')
    end
    return {'owned'}
end
if owner then
    local h = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at', 'id', 'st')
    return {'held', h[1], h[2], h[3], h[4], redis.call('pttl', KEYS[1]), h[5], h[6]}
end
if ARGV[3] ~= '' and ARGV[2] ~= '1' then
    redis.call('hset', KEYS[1], 'owner', ARGV[1], 'task', ARGV[4], 'policy', ARGV[5],
               'at', ARGV[6], 'id', ARGV[7], 'st', '1')
    redis.call('pexpire', KEYS[1], ARGV[3])
end
return {'free'}
"""

# KEYS[1] - lock key
# KEYS[2] - revoked marker of the owner on this key (same hash slot)
# ARGV[1] - owner token
# ARGV[2] - marker ttl in milliseconds (an existing longer marker is kept)
# return 1 released, 2 running (kept), 0 not held
REVOKE = """
if redis.call('pttl', KEYS[2]) < tonumber(ARGV[2]) then
    redis.call('set', KEYS[2], '1', 'PX', ARGV[2])
end
local h = redis.call('hmget', KEYS[1], 'owner', 'st')
if h[1] ~= ARGV[1] then
    return 0
end
if h[2] then
    return 2
end
redis.call('del', KEYS[1])
return 1
"""

# KEYS[1] - lock key
# return nil when free, else the holder
GET = """
local h = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at', 'id', 'st')
if h[1] then
    return {h[1], h[2], h[3], h[4], redis.call('pttl', KEYS[1]), h[5], h[6]}
end
return false
"""

_HOLDER_FIELDS = ("owner", "task", "policy", "at", "id", "st")
_REVOKE_OUTCOMES = {0: RevokeOutcome.NOT_HELD, 1: RevokeOutcome.RELEASED, 2: RevokeOutcome.RUNNING}

#: The driver errors that mean "the server cannot be reached" (or is not a
#: Redis server: an answer outside the protocol is one of them).
UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    InvalidResponse,
    OSError,
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisStore:
    """Owner-checked TTL locks in Redis (also Sentinel and TLS via ``rediss://``).

    Built on the result backend's own client when the backend is Redis, so
    TLS, Sentinel, credentials and ``global_keyprefix`` come along.
    """

    name = "redis"
    #: the driver errors that mean "the server cannot be reached"
    unreachable: tuple[type[BaseException], ...] = UNREACHABLE

    def __init__(self, client: Any, *, keyprefix: str = "", label: str = "redis") -> None:
        self.client = client
        self.keyprefix = keyprefix
        self.label = label
        self._acquire: Script = client.register_script(ACQUIRE)
        self._release: Script = client.register_script(RELEASE)
        self._extend: Script = client.register_script(EXTEND)
        self._take_over: Script = client.register_script(TAKE_OVER)
        self._claim: Script = client.register_script(CLAIM)
        self._settle: Script = client.register_script(SETTLE)
        self._revoke: Script = client.register_script(REVOKE)
        self._get: Script = client.register_script(GET)

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> RedisStore:
        """Build on ``app``'s Redis result backend client when ``url`` is that backend."""
        from kombu.utils.url import maybe_sanitize_url

        label = f"redis ({maybe_sanitize_url(url)})"
        if app is None:
            return cls(redis.Redis.from_url(url, **dict(options or {})), label=label)
        keyprefix = ""
        backend: Any
        transport_options = app.conf.get("result_backend_transport_options") or {}
        if url == app.conf.get("result_backend"):
            backend = app.backend
            keyprefix = transport_options.get("global_keyprefix") or ""
        else:
            backend = _backend_for_url(app, url)
        client = backend.client
        if options:
            client = _with_options(backend, options)
        return cls(client, keyprefix=keyprefix, label=label)

    @contextmanager
    def _boundary(self) -> Iterator[None]:
        """Translate this store's unreachable errors into ``StoreUnavailable``."""
        with unavailable_on(self.unreachable, self.name, lambda: self.label):
            yield

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()

    def _k(self, key: str) -> str:
        return self.keyprefix + key

    def _marker(self, key: str, owner: str) -> str:
        """The revoked marker of ``owner`` on ``key``: a key in the lock's hash slot."""
        physical = self._k(key)
        opening = physical.find("{")
        tagged = opening >= 0 and physical.find("}", opening + 2) > opening
        return (physical if tagged else "{" + physical + "}") + ":revoked:" + owner

    def _lock(self, key: str, raw: Sequence[Any] | None) -> Lock | None:
        if not raw:
            return None
        owner, task, policy, at, pttl, *rest = raw
        task_id, started = [*rest, None, None][:2]
        now = time.time()
        return Lock(
            key=key,
            owner=_text(owner),
            task_name=_text(task or b""),
            acquired_at=int(at or 0) / 1000.0,
            expires_at=now + max(0, int(pttl)) / 1000.0,
            policy=_text(policy or b""),
            task_id=_text(task_id) if task_id else _text(owner),
            started=bool(started),
        )

    @staticmethod
    def _meta_argv(meta: LockMeta) -> list[Any]:
        return [
            meta.get("task_name", ""),
            meta.get("policy", ""),
            int(time.time() * 1000),
            meta.get("task_id", ""),
        ]

    def _argv(self, owner: str, ttl: float, meta: LockMeta) -> list[Any]:
        return [owner, _ms(ttl), *self._meta_argv(meta), meta.get("started", "")]

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Take the lock, or return the holder (one EVALSHA)."""
        with self._boundary():
            raw = self._acquire(keys=[self._k(key)], args=self._argv(owner, ttl, meta))
        return self._lock(key, raw)

    def release(self, key: str, owner: str) -> bool:
        """Compare-and-delete on the owner (one EVALSHA)."""
        with self._boundary():
            return bool(self._release(keys=[self._k(key)], args=[owner]))

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Compare-and-pexpire on the owner (one EVALSHA)."""
        with self._boundary():
            return bool(self._extend(keys=[self._k(key)], args=[owner, _ms(ttl)]))

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Make ``owner`` the holder; return the previous one (one EVALSHA)."""
        with self._boundary():
            raw = self._take_over(keys=[self._k(key)], args=self._argv(owner, ttl, meta))
        return self._lock(key, raw)

    def claim(
        self, key: str, owner: str, *, release: bool, ttl: float | None, meta: LockMeta
    ) -> Claim:
        """The worker's start check (one EVALSHA over the lock and its marker)."""
        args = [owner, "1" if release else "", "" if ttl is None else _ms(ttl)]
        with self._boundary():
            raw = self._claim(
                keys=[self._k(key), self._marker(key, owner)],
                args=[*args, *self._meta_argv(meta)],
            )
        outcome = ClaimOutcome(_text(raw[0]))
        return Claim(outcome, self._lock(key, raw[1:]) if outcome is ClaimOutcome.HELD else None)

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Mark ``owner`` revoked; release its lock unless started (one EVALSHA)."""
        with self._boundary():
            raw = self._revoke(
                keys=[self._k(key), self._marker(key, owner)], args=[owner, _ms(ttl)]
            )
        return _REVOKE_OUTCOMES[int(raw)]

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Mark the owner's lock not started, keeping or resetting its TTL (one EVALSHA)."""
        with self._boundary():
            raw = self._settle(keys=[self._k(key)], args=[owner, "" if ttl is None else _ms(ttl)])
        return bool(raw)

    def unrevoke(self, key: str, owner: str) -> None:
        """Delete the revoked marker of ``owner`` (one DEL)."""
        with self._boundary():
            self.client.delete(self._marker(key, owner))

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key`` (one EVALSHA)."""
        with self._boundary():
            raw = self._get(keys=[self._k(key)])
        return self._lock(key, raw)

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix`` (SCAN plus one pipelined read per batch)."""
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
                    pipe.hmget(physical, *_HOLDER_FIELDS)
                    pipe.pttl(physical)
                replies = pipe.execute(raise_on_error=False)
            for i, physical in enumerate(batch):
                fields, pttl = replies[2 * i], replies[2 * i + 1]
                if isinstance(fields, Exception) or not fields or not fields[0]:
                    continue
                owner, task, policy, at, task_id, started = fields
                raw = [owner, task, policy, at, pttl, task_id, started]
                lock = self._lock(physical[len(self.keyprefix) :], raw)
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
