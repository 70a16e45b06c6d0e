"""Redis Cluster lock store: the Redis store's scripts and records, routed by key slot.

Every script of ``stores/redis.py`` touches one lock key and keys that share
its hash slot (revoked markers, run records), passed in ``KEYS`` but for the
marker of the owner a take-over displaces, named from the record in the
script (in the same slot), so redis-py's ``RedisCluster`` sends each
``EVALSHA`` to the primary that owns the slot: every operation stays one
atomic round trip. A lock is the same
string as on a single Redis (and an earlier version's hash is honoured the
same way). ``scan`` walks every primary in turn; the counters live in one
hash whose name carries a hash tag.

The cluster client connects on first use, not when the store is built, so a
cluster that is down at start-up is reported as ``StoreUnavailable`` by the
first call (and ``dedup_fallback`` applies) rather than breaking the app.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from redis.commands.core import Script
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .base import Lock, RunRef
from .redis import RedisStore, _ms

if TYPE_CHECKING:
    from celery import Celery
    from redis.cluster import RedisCluster

__all__ = ["RedisClusterStore", "cluster_url"]

#: The driver errors that mean "the cluster cannot serve this key now".
UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    SlotNotCoveredError,
    TryAgainError,
    # What RedisCluster raises when no start-up node answers.
    RedisClusterException,
    OSError,
)

#: Client settings used unless ``dedup_store_options`` overrides them.
DEFAULT_OPTIONS: Mapping[str, Any] = {"socket_connect_timeout": 1.0, "socket_timeout": 2.0}


def cluster_url(url: str) -> str:
    """``redis+cluster://h:p`` → ``redis://h:p`` (and ``rediss+cluster`` → ``rediss``)."""
    scheme, sep, rest = url.partition("://")
    return scheme.replace("+cluster", "") + sep + rest


class _LazyCluster:
    """A ``RedisCluster`` built on first attribute access, so building the store never connects.

    ``register_script`` returns a ``Script`` bound to this proxy: the script is
    hashed from its bytes here, and ``EVALSHA`` goes through the real client.
    """

    def __init__(self, connect: Callable[[], RedisCluster]) -> None:
        self._connect = connect
        self._client: RedisCluster | None = None
        self._mutex = threading.Lock()

    def register_script(self, script: str) -> Script:
        """A script run through this proxy (EVALSHA with NOSCRIPT reload)."""
        return Script(self, script.encode())  # type: ignore[arg-type]

    def real(self) -> RedisCluster:
        """The connected ``RedisCluster`` (connects on first call)."""
        if self._client is None:
            with self._mutex:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)

    def close(self) -> None:
        """Close the cluster's connections, if it ever connected."""
        if self._client is not None:
            self._client.close()
            self._client = None


class RedisClusterStore(RedisStore):
    """Owner-checked TTL locks in a Redis Cluster (``redis+cluster://host:port``).

    Any node of the cluster can be given; the others are discovered.
    ``global_keyprefix`` in ``dedup_store_options`` prefixes every key. The
    scripts are the Redis store's: single-key, so each runs on the key's
    primary in one round trip; ``acquire_many`` sends one script per hash
    slot among its keys.
    """

    name = "redis-cluster"
    unreachable = UNREACHABLE

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> RedisClusterStore:
        """Build a lazily connecting ``RedisCluster`` client for ``url``."""
        from kombu.utils.url import maybe_sanitize_url
        from redis.cluster import RedisCluster

        given = {**DEFAULT_OPTIONS, **dict(options or {})}
        keyprefix = str(given.pop("global_keyprefix", "") or "")
        target = cluster_url(url)

        def connect() -> RedisCluster:
            return RedisCluster.from_url(target, **given)

        return cls(
            _LazyCluster(connect),
            keyprefix=keyprefix,
            label=f"redis-cluster ({maybe_sanitize_url(url)})",
        )

    def _same_slot(self, key: str, rate_key: str) -> bool:
        """A rate key and a lock key share a hash slot only when both carry one hash
        tag: otherwise ``acquire_rated`` answers ``None`` and the two steps run."""
        return key_slot(self._k(key).encode()) == key_slot(self._k(rate_key).encode())

    def _bulk_groups(self, keys: Sequence[str]) -> list[list[int]]:
        """``acquire_many`` sends one script per hash slot (a script's keys share one):
        keys without a common hash tag cost one round trip each."""
        slots: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            slots.setdefault(key_slot(self._k(key).encode()), []).append(index)
        return list(slots.values())

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix``: SCAN each primary, read its keys in one pipeline.

        Keys that move between primaries during the walk (resharding) can be
        missed or reported twice.
        """
        with self._boundary():
            primaries = self.client.get_primaries()
            for node in primaries:
                node_client = self.client.get_redis_connection(node)
                yield from self._scan_client(node_client, prefix)

    def _limit_nodes(self) -> list[Any]:
        """Each primary's client: ``list_slots``/``list_rates`` SCAN them in turn."""
        with self._boundary():
            return [self.client.get_redis_connection(node) for node in self.client.get_primaries()]

    def renew_runs(self, runs: Sequence[RunRef], lease: float) -> int:
        """Renew every lease its copy holds: one EVALSHA per run (on its key's primary)."""
        ms = _ms(lease)
        return sum(int(self._run(self._lease, self._run_keys(r), [r.token, ms])) for r in runs)

    def keep_runs(
        self, runs: Sequence[RunRef], lease: float, retake: Collection[str]
    ) -> list[bool]:
        """Renew, or take back, every lease: one EVALSHA per run (on its key's primary)."""
        ms = _ms(lease)
        return [
            bool(int(self._run(self._keep, self._run_keys(r), [r.token, ms, _retake(r, retake)])))
            for r in runs
        ]

    def _counts_key(self, prefix: str) -> str:
        # One hash; the tag keeps it in one slot whatever is appended to it.
        return str(self._k("{" + prefix + "}/counters"))


def _retake(run: RunRef, retake: Collection[str]) -> str:
    return "1" if run.token in retake else ""
