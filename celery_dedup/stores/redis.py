"""Redis lock store: one Lua script per atomic operation, one round trip each.

A lock is a hash ``{owner, task, policy, at}`` with a millisecond TTL. Keys
reach the scripts only through ``KEYS`` (so every script is single-key and
cluster-safe) and TTLs as integer milliseconds in ``ARGV``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .base import Lock, LockMeta, unavailable_on

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["RedisStore"]

# KEYS[1] - lock key
# ARGV[1] - owner task id
# ARGV[2] - ttl in milliseconds
# ARGV[3] - task name
# ARGV[4] - unlock policy
# ARGV[5] - acquired at, epoch milliseconds
# return nil when acquired, else {owner, task, policy, at, pttl} of the holder
ACQUIRE = """
local holder = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at')
if holder[1] then
    return {holder[1], holder[2], holder[3], holder[4], redis.call('pttl', KEYS[1])}
end
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'task', ARGV[3], 'policy', ARGV[4], 'at', ARGV[5])
redis.call('pexpire', KEYS[1], ARGV[2])
return false
"""

# KEYS[1] - lock key
# ARGV[1] - owner task id
# return 1 if the owner held the lock and it was deleted, else 0
RELEASE = """
if redis.call('hget', KEYS[1], 'owner') == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

# KEYS[1] - lock key
# ARGV[1] - owner task id
# ARGV[2] - new ttl in milliseconds
# return 1 if the owner holds the lock and its ttl was set, else 0
EXTEND = """
if redis.call('hget', KEYS[1], 'owner') == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] - lock key
# ARGV[1..5] - as ACQUIRE
# return nil when the key was free, else {owner, task, policy, at, pttl} of the previous holder
TAKE_OVER = """
local holder = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at')
local pttl = redis.call('pttl', KEYS[1])
redis.call('del', KEYS[1])
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'task', ARGV[3], 'policy', ARGV[4], 'at', ARGV[5])
redis.call('pexpire', KEYS[1], ARGV[2])
if holder[1] then
    return {holder[1], holder[2], holder[3], holder[4], pttl}
end
return false
"""

# KEYS[1] - lock key
# return nil when free, else {owner, task, policy, at, pttl}
GET = """
local holder = redis.call('hmget', KEYS[1], 'owner', 'task', 'policy', 'at')
if holder[1] then
    return {holder[1], holder[2], holder[3], holder[4], redis.call('pttl', KEYS[1])}
end
return false
"""

#: The driver errors that mean "the server cannot be reached".
UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
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

    def _lock(self, key: str, raw: Sequence[Any] | None) -> Lock | None:
        if not raw:
            return None
        owner, task, policy, at, pttl = raw
        now = time.time()
        return Lock(
            key=key,
            owner=_text(owner),
            task_name=_text(task or b""),
            acquired_at=int(at or 0) / 1000.0,
            expires_at=now + max(0, int(pttl)) / 1000.0,
            policy=_text(policy or b""),
        )

    def _argv(self, owner: str, ttl: float, meta: LockMeta) -> list[Any]:
        return [
            owner,
            _ms(ttl),
            meta.get("task_name", ""),
            meta.get("policy", ""),
            int(time.time() * 1000),
        ]

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
                    pipe.hmget(physical, "owner", "task", "policy", "at")
                    pipe.pttl(physical)
                replies = pipe.execute(raise_on_error=False)
            for i, physical in enumerate(batch):
                fields, pttl = replies[2 * i], replies[2 * i + 1]
                if isinstance(fields, Exception) or not fields or not fields[0]:
                    continue
                lock = self._lock(physical[len(self.keyprefix) :], [*fields, pttl])
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
