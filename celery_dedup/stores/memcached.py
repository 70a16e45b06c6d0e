"""memcached lock store: ``add`` to acquire, ``gets`` + ``cas`` to check owners.

memcached has no scripting and no compare-and-delete, so the guarantees are
built from its two atomic primitives, one key at a time:

* ``add`` stores a key only if it is absent: a free lock is taken in one
  round trip; a held one costs a second (``gets``) to report the holder.
* ``cas`` stores only if nobody wrote the key since our ``gets``. Every
  owner-checked write (release, extend, settle, take-over, start check,
  revoke) is ``gets`` + ``cas``, re-read and re-checked if anyone wrote the
  key in between. A delete is a ``cas`` to an already-expired item: a true
  compare-and-delete, never a check followed by a blind ``delete``.

``claim`` and ``revoke`` touch two keys, the lock and the owner's revoked
marker, which memcached cannot change together. ``claim`` reads both with one
``gets_many`` and changes only the lock, by ``cas``; ``revoke`` writes the
marker first, then reads and changes the lock; a ``claim`` that takes a free
key reads the marker again after its ``add``. Whatever the interleaving,
either the claim sees the marker or the revoke sees the claimed lock.

Clocks: a lock lives exactly as long as its item, and memcached counts the
item's expiry on its own clock, so no client's clock decides whether a lock
is free. Items get ``ceil(ttl) + 1`` seconds (memcached's clock ticks once a
second): a lock lives at least its TTL and less than 2 s more. The times kept
in the item (for reports, and for the start check, which rewrites the item
and must keep its end) are on the server's clock as well, read from its
``stats`` and carried forward on this host's monotonic clock.

Several servers: keys are spread by rendezvous hashing (as pymemcache's
``HashClient`` does with every server up) and never fail over. A server that
does not answer makes its own keys raise ``StoreUnavailable``; moving them to
another server would let a second producer take a lock that is still held.

memcached cannot list its keys on the data path, so ``scan`` and
``read_counts`` walk the server with ``lru_crawler metadump hash`` (memcached
1.4.31+, on by default); nothing is added to ``acquire`` to keep an index.

pymemcache is imported only by the functions that use it.
``stores/django_cache.py`` reuses ``CacheLocks`` (the algorithms) for Django's
``PyMemcacheCache`` and for generic Django caches.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import parse_qsl, quote, unquote

from ..exceptions import (
    DedupError,
    ImproperlyConfigured,
    ScanNotSupported,
    StoreContention,
    StoreError,
    StoreRefused,
    StoreUnavailable,
)
from .base import (
    Claim,
    ClaimOutcome,
    Lock,
    LockMeta,
    RevokeOutcome,
    revoked_marker_key,
    server_answer,
    store_errors,
)

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["CacheLocks", "MemcachedStore", "expiry_for", "parse_servers"]

#: ``(host, port)``, or the path of a unix socket.
Server: TypeAlias = "tuple[str, int] | str"

#: memcached's limit on key length, in bytes.
MAX_KEY_LENGTH = 250
#: Expiries above this many seconds are read by memcached as a Unix time.
MAX_RELATIVE_EXPIRY = 30 * 24 * 3600
#: The last Unix time memcached can expire an item at (2038-01-19): an item
#: meant to outlive it is stored without expiry.
MAX_UNIX_EXPIRY = 2**31 - 1
#: How often a contended read-then-write is tried before giving up.
CAS_ATTEMPTS = 10
#: The longest pause between two attempts, in seconds (jittered, doubling from 1 ms).
MAX_BACKOFF = 0.2
#: Keys per ``get_many`` when scanning.
SCAN_BATCH = 100
#: pymemcache settings used unless ``dedup_store_options`` overrides them.
DEFAULT_CLIENT_OPTIONS: Mapping[str, Any] = {"connect_timeout": 1.0, "timeout": 1.0}
#: The pymemcache options about the connection (a Django cache's ``serde`` is not).
TRANSPORT_OPTIONS = frozenset({
    "connect_timeout", "timeout", "no_delay", "socket_module", "socket_keepalive",
    "tls_context", "max_pool_size", "pool_idle_timeout", "lock_generator",
})
#: Seconds between two readings of a server's clock.
CLOCK_REFRESH = 300.0
#: Seconds added when the start check rewrites a lock: the server clock as
#: read here lags the server by up to 1 s (its tick) plus a round trip.
CLOCK_MARGIN = 2.0
#: The value of a revoked marker (never decodes as a lock).
MARKER = "revoked"

E_NO_SCAN = (
    "the {store} lock store cannot list its locks: {reason}. Locks still work; "
    "inspect a single key with inspect_lock()."
)
E_OPTIONS = (
    "{store}: {names} are not options of pymemcache's PooledClient. Keys are spread over "
    "the servers without failover, so HashClient options (retry_attempts, dead_timeout, "
    "ignore_exc, use_pooling) do not apply."
)
E_KEY_PREFIX = (
    "{store}: key_prefix {prefix!r} is not a memcached key (printable ASCII without spaces, "
    "at most 100 bytes)"
)
E_CONTENDED = "lock store {store}: key kept changing during {op} ({attempts} attempts)"
E_PROTOCOL_ANSWER = (
    "the server did not answer as memcached does (is the URL's port a memcached?): {error}"
)


# -- records -------------------------------------------------------------------------------


def _safe_key(key: str, room: int) -> str:
    """``key`` if memcached accepts it within ``room`` bytes, else ``#`` + its sha256."""
    raw = key.encode()
    if len(raw) <= room and all(0x21 <= b <= 0x7E for b in raw):
        return key
    return "#" + hashlib.sha256(raw).hexdigest()


def _ms(t: float) -> float:
    # Rounded down: a reported TTL never exceeds the one asked for.
    return math.floor(t * 1000) / 1000


def _encode(
    key: str, owner: str, meta: LockMeta, acquired_at: float, expires_at: float, started: bool
) -> str:
    """The stored record: compact ASCII JSON, carrying the logical key for ``scan``."""
    record = {
        "k": key,
        "o": owner,
        "i": meta.get("task_id") or owner,
        "s": int(started),
        "t": meta.get("task_name", ""),
        "p": meta.get("policy", ""),
        "a": _ms(acquired_at),
        "e": _ms(expires_at),
    }
    return json.dumps(record, separators=(",", ":"))


def _reencode(lock: Lock, *, expires_at: float | None = None, started: bool | None = None) -> str:
    """``lock``'s record with a new end or start flag, every other field kept."""
    meta = {"task_name": lock.task_name, "policy": lock.policy, "task_id": lock.task_id}
    return _encode(
        lock.key,
        lock.owner,
        meta,
        lock.acquired_at,
        lock.expires_at if expires_at is None else expires_at,
        lock.started if started is None else started,
    )


def _decode(raw: Any) -> Lock | None:
    """The lock a stored record describes, or ``None`` for anything else (markers too).

    0.1.0 records have no task id (the owner was the task id) and no start flag.
    """
    if raw is None:
        return None
    try:
        record = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        owner = str(record["o"])
        return Lock(
            key=str(record["k"]),
            owner=owner,
            task_name=str(record["t"]),
            acquired_at=float(record["a"]),
            expires_at=float(record["e"]),
            policy=str(record["p"]),
            task_id=str(record.get("i") or owner),
            started=bool(record.get("s")),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


#: The fields of a gate's record that hold the follow-up waiting at it (``GateWaiters``):
#: its payload (base64) and when the listing lapses (on the record's clock).
WAITER_FIELD, WAITER_UNTIL = "w", "we"


def _record_of(raw: Any) -> dict[str, Any] | None:
    try:
        record = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, TypeError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def _with_waiter(raw: Any, payload: bytes, until: float) -> str:
    """The gate's record ``raw`` with ``payload`` listed as its waiter until ``until``."""
    record = _record_of(raw) or {}
    record[WAITER_FIELD] = base64.b64encode(payload).decode("ascii")
    record[WAITER_UNTIL] = _ms(until)
    return json.dumps(record, separators=(",", ":"))


def _waiter_in(raw: Any, now: float) -> bytes | None:
    """The payload of the waiter listed in the gate's record ``raw``, unless it lapsed."""
    record = _record_of(raw)
    if record is None or WAITER_FIELD not in record:
        return None
    if float(record.get(WAITER_UNTIL) or 0) <= now:
        return None
    return base64.b64decode(record[WAITER_FIELD])


def _keep_waiter(raw: Any, value: str) -> str:
    """``value`` (a rewrite of the record ``raw``) with ``raw``'s waiter kept, if it has one."""
    mark = f'"{WAITER_FIELD}":'
    if not (mark.encode() in raw if isinstance(raw, bytes) else mark in str(raw)):
        return value
    old, new = _record_of(raw), _record_of(value)
    if old is None or new is None or WAITER_FIELD not in old:
        return value
    new[WAITER_FIELD], new[WAITER_UNTIL] = old[WAITER_FIELD], old.get(WAITER_UNTIL, 0)
    return json.dumps(new, separators=(",", ":"))


def expiry_for(seconds: float) -> int:
    """The relative memcached expiry of an item living ``seconds``: ``ceil(seconds) + 1``.

    memcached's clock ticks once a second, so an item given ``n`` seconds
    lives between ``n - 1`` and ``n``: one more tick than rounded up keeps
    the item at least ``seconds``.
    """
    return max(1, math.ceil(seconds)) + 1


# -- the algorithms ------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """What one read found at a physical key: its value and ``cas`` token."""

    physical: str
    raw: Any
    token: Any

    @property
    def lock(self) -> Lock | None:
        """The lock stored there, if the value is one."""
        return _decode(self.raw)


def _attempts() -> Iterator[int]:
    """``range(CAS_ATTEMPTS)``, pausing a jittered, doubling moment before each retry."""
    for attempt in range(CAS_ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, min(MAX_BACKOFF, 0.001 * 2**attempt)))
        yield attempt


class _Contended(DedupError):
    """A key kept changing under ``gets`` + ``cas`` (reported as ``StoreContention``).

    A ``DedupError``, so the error boundary passes it to ``_op`` unchanged.
    """


class CacheLocks:
    """The ``LockStore`` operations over a cache's ``add`` and ``cas``.

    A lock is alive while its item exists: the cache's own expiry decides,
    never a time written in the record. Subclasses give the primitives:
    ``_read`` (values and ``cas`` tokens of some keys), ``_add`` (store if
    absent), ``_cas`` (store, or delete with ``None``, if unchanged since the
    read), ``_set`` and ``_delete`` (unconditional, for revoked markers),
    ``_operation`` (the error boundary around one operation) and the clock
    of the records (``_now``, ``_remaining``, ``_local``).
    """

    name = "cache"
    label = "cache"

    # -- primitives --------------------------------------------------------

    def _operation(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _read(self, physical: str, *others: str) -> tuple[Slot, set[str]]:
        """The slot of ``physical`` and which of ``others`` exist."""
        raise NotImplementedError

    def _add(self, physical: str, value: str, seconds: float) -> bool:
        raise NotImplementedError

    def _cas(self, slot: Slot, value: str | None, seconds: float) -> bool:
        raise NotImplementedError

    def _set(self, physical: str, value: str, seconds: float) -> None:
        raise NotImplementedError

    def _delete(self, physical: str) -> None:
        raise NotImplementedError

    def _physical(self, key: str) -> str:
        raise NotImplementedError

    def _now(self, physical: str) -> float:
        """Now on the clock of the records at ``physical``."""
        raise NotImplementedError

    def _remaining(self, physical: str, lock: Lock) -> float:
        """Seconds an item rewritten now must live to keep ``lock``'s end."""
        return lock.expires_at - self._now(physical)

    def _local(self, physical: str, lock: Lock) -> Lock:
        """``lock`` with its times on this host's clock."""
        return lock

    # -- helpers -----------------------------------------------------------

    @contextmanager
    def _op(self, op: str) -> Iterator[None]:
        try:
            with self._operation():
                yield
        except _Contended:
            raise StoreContention(
                E_CONTENDED.format(store=self.label, op=op, attempts=CAS_ATTEMPTS),
                store=self.name,
            ) from None

    def _new(
        self, physical: str, key: str, owner: str, ttl: float, meta: LockMeta, started: bool
    ) -> str:
        now = self._now(physical)
        return _encode(key, owner, meta, now, now + ttl, started)

    def _put(self, slot: Slot, value: str, seconds: float) -> bool:
        """Store over what ``slot`` saw: ``add`` where it saw nothing, else ``cas``."""
        if slot.raw is None:
            return self._add(slot.physical, value, seconds)
        return self._cas(slot, value, seconds)

    def _rewrite_owned(
        self, physical: str, owner: str, rewrite: Callable[[Lock], tuple[str | None, float]]
    ) -> bool:
        """``cas`` ``owner``'s record to ``rewrite(holder)`` (value or ``None``, seconds).

        Read again when someone wrote the key meanwhile; False when
        ``owner`` does not hold it.
        """
        for _ in _attempts():
            slot, _found = self._read(physical)
            holder = slot.lock
            if holder is None or holder.owner != owner:
                return False
            value, seconds = rewrite(holder)
            if value is not None:
                value = _keep_waiter(slot.raw, value)  # a gate's waiter outlives its renewals
            if self._cas(slot, value, seconds):
                return True
        raise _Contended

    def _release_owned(self, physical: str, owner: str) -> bool:
        return self._rewrite_owned(physical, owner, lambda _holder: (None, 0))

    # -- LockStore ---------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """``add``; if held, read the holder (``cas`` over a value that is not a lock)."""
        physical = self._physical(key)
        with self._op("acquire"):
            record = self._new(physical, key, owner, ttl, meta, meta.get("started") == "1")
            if self._add(physical, record, ttl):
                return None
            for _ in _attempts():
                slot, _found = self._read(physical)
                holder = slot.lock
                if holder is not None:
                    return self._local(physical, holder)
                # Gone since the add (released or expired), or not a lock.
                if self._put(slot, record, ttl):
                    return None
            raise _Contended

    def release(self, key: str, owner: str) -> bool:
        """Read, compare the owner, compare-and-delete."""
        physical = self._physical(key)
        with self._op("release"):
            return self._release_owned(physical, owner)

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """Read, compare the owner, ``cas`` the record with a new end (fields kept)."""
        physical = self._physical(key)
        with self._op("extend"):
            return self._rewrite_owned(
                physical,
                owner,
                lambda holder: (_reencode(holder, expires_at=self._now(physical) + ttl), ttl),
            )

    def settle(self, key: str, owner: str, ttl: float | None = None) -> bool:
        """Read, compare the owner, ``cas`` the record not started.

        The item keeps its end (the record's, on the server's clock), or
        lives ``ttl`` seconds from now when given.
        """
        physical = self._physical(key)

        def settled(holder: Lock) -> tuple[str, float]:
            if ttl is None:
                return _reencode(holder, started=False), self._remaining(physical, holder)
            expires_at = self._now(physical) + ttl
            return _reencode(holder, expires_at=expires_at, started=False), ttl

        with self._op("settle"):
            return self._rewrite_owned(physical, owner, settled)

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """Read the holder, then store the new lock over it (``cas``, or ``add`` if free)."""
        physical = self._physical(key)
        with self._op("take_over"):
            for _ in _attempts():
                slot, _found = self._read(physical)
                if self._put(slot, self._new(physical, key, owner, ttl, meta, False), ttl):
                    previous = slot.lock
                    return None if previous is None else self._local(physical, previous)
            raise _Contended

    def take_over_queued(
        self, key: str, owner: str, ttl: float, meta: LockMeta
    ) -> Lock | None:
        """``take_over`` unless a started holder holds the key (``QueuedTakeOver``).

        The read and the ``cas`` of ``take_over``: a holder that starts in
        between changes the item, so the ``cas`` fails and the next attempt
        sees it started.
        """
        physical = self._physical(key)
        with self._op("take_over_queued"):
            for _ in _attempts():
                slot, _found = self._read(physical)
                previous = slot.lock
                if previous is not None and previous.started:
                    return self._local(physical, previous)
                if self._put(slot, self._new(physical, key, owner, ttl, meta, False), ttl):
                    return None if previous is None else self._local(physical, previous)
            raise _Contended

    def claim(
        self, key: str, owner: str, *, release: bool, ttl: float | None, meta: LockMeta
    ) -> Claim:
        """The start check: read lock and marker together, then change the lock by ``cas``."""
        physical = self._physical(key)
        marker = self._physical(revoked_marker_key(key, owner))
        with self._op("claim"):
            for _ in _attempts():
                slot, found = self._read(physical, marker)
                holder = slot.lock
                mine = holder is not None and holder.owner == owner
                if marker in found:
                    if not mine or self._cas(slot, None, 0):
                        return Claim(ClaimOutcome.REVOKED)
                    continue
                if holder is not None and mine:
                    if self._mark_started(slot, holder, release):
                        return Claim(ClaimOutcome.OWNED)
                    continue
                if holder is not None:
                    return Claim(ClaimOutcome.HELD, self._local(physical, holder))
                if ttl is None or release:
                    return Claim(ClaimOutcome.FREE)
                if self._put(slot, self._new(physical, key, owner, ttl, meta, True), ttl):
                    return self._after_free_claim(physical, marker, owner)
            raise _Contended

    def _mark_started(self, slot: Slot, holder: Lock, release: bool) -> bool:
        if release:
            return self._cas(slot, None, 0)
        remaining = self._remaining(slot.physical, holder)
        return self._cas(slot, _reencode(holder, started=True), remaining)

    def _after_free_claim(self, physical: str, marker: str, owner: str) -> Claim:
        # A revoke writes the marker before it reads the lock; reading the
        # marker after our write means one of the two sees the other.
        if self._read(marker)[0].raw is None:
            return Claim(ClaimOutcome.FREE)
        self._release_owned(physical, owner)
        return Claim(ClaimOutcome.REVOKED)

    def revoke(self, key: str, owner: str, ttl: float) -> RevokeOutcome:
        """Write the marker, then compare-and-delete the lock if ``owner`` holds it unstarted."""
        physical = self._physical(key)
        with self._op("revoke"):
            self._set(self._physical(revoked_marker_key(key, owner)), MARKER, ttl)
            for _ in _attempts():
                slot, _found = self._read(physical)
                holder = slot.lock
                if holder is None or holder.owner != owner:
                    return RevokeOutcome.NOT_HELD
                if holder.started:
                    return RevokeOutcome.RUNNING
                if self._cas(slot, None, 0):
                    return RevokeOutcome.RELEASED
            raise _Contended

    def unrevoke(self, key: str, owner: str) -> None:
        """Delete the revoked marker of ``owner`` (no owner check needed: it is its own key)."""
        with self._op("unrevoke"):
            self._delete(self._physical(revoked_marker_key(key, owner)))

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key`` (one read)."""
        physical = self._physical(key)
        with self._op("get"):
            slot, _found = self._read(physical)
            lock = slot.lock
            return None if lock is None or lock.key != key else self._local(physical, lock)

    # -- GateWaiters -------------------------------------------------------

    def list_gate_waiter(self, gate: str, token: str, payload: bytes, life: float) -> bool:
        """List the follow-up in the record of the gate another owner holds (``GateWaiters``).

        ``gets`` + ``cas`` of the gate's own item (its end kept): the
        listing lives and goes with the gate, and the release that opens it
        reads it in the same ``gets``.
        """
        physical = self._physical(gate)
        with self._op("list_gate_waiter"):
            for _ in _attempts():
                slot, _found = self._read(physical)
                holder = slot.lock
                if holder is None or holder.key != gate or holder.owner == token:
                    return False
                value = _with_waiter(slot.raw, payload, self._now(physical) + life)
                if self._cas(slot, value, self._remaining(physical, holder)):
                    return True
            raise _Contended

    def open_gate(self, gate: str, token: str) -> bytes | None:
        """Release ``token``'s gate (``gets`` + compare-and-delete, as ``release``) and
        answer the waiter its record listed (``GateWaiters``)."""
        physical = self._physical(gate)
        with self._op("open_gate"):
            for _ in _attempts():
                slot, _found = self._read(physical)
                holder = slot.lock
                if holder is None or holder.owner != token:
                    return None
                if self._cas(slot, None, 0):
                    return _waiter_in(slot.raw, self._now(physical))
            raise _Contended


# -- memcached -----------------------------------------------------------------------------


@cache
def _unreachable() -> tuple[type[BaseException], ...]:
    """The pymemcache and socket errors that mean "the server cannot be reached"."""
    from pymemcache.exceptions import MemcacheUnexpectedCloseError

    return (MemcacheUnexpectedCloseError, ConnectionError, socket.timeout, OSError)


@cache
def _server_errors() -> tuple[type[BaseException], ...]:
    """``SERVER_ERROR`` answers (out of memory under ``-M``, object too large)."""
    from pymemcache.exceptions import MemcacheServerError

    return (MemcacheServerError,)


@cache
def _protocol_errors() -> tuple[type[BaseException], ...]:
    """Answers outside memcached's protocol (pymemcache's parse errors are ``ValueError``)."""
    from pymemcache.exceptions import MemcacheError

    return (MemcacheError, ValueError)


def classify(exc: BaseException) -> type[StoreError] | None:
    """What a pymemcache or socket error means.

    Unreachable: ``StoreUnavailable``; a ``SERVER_ERROR`` answer:
    ``StoreRefused``; an answer outside the protocol (another service on the
    port): ``StoreUnavailable``. Input pymemcache rejects before sending
    (``MemcacheIllegalInputError``: keys are made safe first, so a bug of
    ours) passes unchanged.
    """
    from pymemcache.exceptions import MemcacheIllegalInputError

    if isinstance(exc, _unreachable()):
        return StoreUnavailable
    if isinstance(exc, _server_errors()):
        return StoreRefused
    if isinstance(exc, MemcacheIllegalInputError):
        return None
    if isinstance(exc, _protocol_errors()):
        return StoreUnavailable
    return None


def _answer(exc: BaseException) -> str:
    if exc.args and isinstance(exc.args[0], bytes):
        # pymemcache keeps the server's line as bytes: show it as text.
        text = f"{type(exc).__name__}: {exc.args[0].decode(errors='replace')}"
    else:
        text = server_answer(exc)
    if isinstance(exc, _protocol_errors()) and not isinstance(
        exc, (*_unreachable(), *_server_errors())
    ):
        return E_PROTOCOL_ANSWER.format(error=text)
    return text


def _node(server: Server) -> str:
    """A server's name on the hash ring (pymemcache ``HashClient``'s)."""
    return server if isinstance(server, str) else f"{server[0]}:{server[1]}"


def parse_servers(url: str) -> tuple[list[Server], dict[str, str]]:
    """``memcached://h1:p1;h2:p2/?timeout=1`` → ``([(h1, p1), (h2, p2)], {"timeout": "1"})``.

    Servers are separated by ``;`` or ``,`` (as Celery's cache backend);
    ``unix:/path`` names a socket; the port defaults to 11211.
    """
    rest = url.partition("://")[2]
    rest, _, query = rest.partition("?")
    netloc = rest.split("/", 1)[0] if not rest.startswith("unix:") else rest.rstrip("/")
    servers: list[Server] = []
    for raw_part in netloc.replace(",", ";").split(";"):
        part = raw_part.strip()
        if not part:
            continue
        if part.startswith("unix:"):
            servers.append(part[len("unix:") :])
            continue
        host, port = part, 11211
        if part.startswith("["):
            host, _, tail = part[1:].partition("]")
            if tail.startswith(":"):
                port = int(tail[1:])
        elif part.count(":") == 1:
            host, port_text = part.split(":")
            port = int(port_text)
        servers.append((host, port))
    if not servers:
        servers.append(("localhost", 11211))
    return servers, dict(parse_qsl(query))


def _float_options(query: Mapping[str, str]) -> dict[str, Any]:
    return {k: float(v) for k, v in query.items() if k in ("timeout", "connect_timeout")}


@cache
def _client_parameters() -> frozenset[str]:
    from pymemcache.client.base import PooledClient

    return frozenset(inspect.signature(PooledClient).parameters) - {"server"}


class _Ring:
    """One pymemcache ``PooledClient`` per server, and each key on a fixed one of them."""

    def __init__(self, servers: Sequence[Server], options: Mapping[str, Any]) -> None:
        from pymemcache.client.base import PooledClient
        from pymemcache.client.rendezvous import RendezvousHash

        kwargs = {**options, "default_noreply": False}
        self.clients = {_node(s): PooledClient(s, **kwargs) for s in servers}
        self._hash = RendezvousHash(list(self.clients))
        self._only = next(iter(self.clients)) if len(self.clients) == 1 else None

    def node(self, physical: str) -> str:
        """The server that holds ``physical``, whether it answers or not."""
        if self._only is not None:
            return self._only
        node: str = self._hash.get_node(physical)
        return node

    def client(self, physical: str) -> Any:
        """The client of the server that holds ``physical``."""
        return self.clients[self.node(physical)]

    def get_many(self, keys: Sequence[str], *, gets: bool = False) -> dict[str, Any]:
        """``get_many`` (or ``gets_many``) grouped by server: one round trip per server."""
        by_node: dict[str, list[str]] = {}
        for key in keys:
            by_node.setdefault(self.node(key), []).append(key)
        found: dict[Any, Any] = {}
        for node, batch in by_node.items():
            client = self.clients[node]
            found.update(client.gets_many(batch) if gets else client.get_many(batch))
        return {k.decode() if isinstance(k, bytes) else str(k): v for k, v in found.items()}

    def close(self) -> None:
        """Close every connection."""
        for client in self.clients.values():
            client.close()


@dataclass(frozen=True)
class _ServerClock:
    """One server's clock as read here: its ``stats`` time, carried on the monotonic clock.

    Never ahead of the server; behind by less than 1 s (memcached's clock
    ticks once a second) plus ``slack``, the round trip of the reading.
    """

    server_at: float
    mono_at: float
    wall_at: float
    slack: float

    def now(self) -> float:
        """The server's time now."""
        return self.server_at + time.monotonic() - self.mono_at

    def to_local(self, t: float) -> float:
        """A time on the server's clock → on this host's clock."""
        return t - self.server_at + self.wall_at


def _require_driver(label: str) -> None:
    """pymemcache is imported lazily: say which extra installs it, as every store does."""
    try:
        import pymemcache  # noqa: F401
    except ImportError as exc:
        from . import E_MISSING_DRIVER

        raise ImproperlyConfigured(
            E_MISSING_DRIVER.format(url=label, error=exc, extra="memcached")
        ) from exc


class MemcachedStore(CacheLocks):
    """Owner-checked TTL locks in memcached (pymemcache).

    Each server gets a thread-safe ``PooledClient``; a key always goes to
    the same server (no failover). Clients are rebuilt in a forked child, so
    no socket is shared across a fork.

    Round trips: acquire 1 (free key) or 2 (held: ``add`` then ``gets``);
    release, extend, settle, take-over and revoke 2 (``gets`` + ``cas``;
    revoke adds the marker's ``set``); claim 2 (``gets_many`` + ``cas``, plus a marker
    read when it takes a free key); get 1. The first operation on a server in
    a process also reads its clock (``stats``), again every 5 minutes.
    """

    name = "memcached"

    def __init__(
        self,
        servers: Sequence[Server],
        *,
        options: Mapping[str, Any] | None = None,
        keyprefix: str = "",
        label: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.servers = list(servers)
        self.keyprefix = keyprefix
        self.label = label or f"memcached ({';'.join(_node(s) for s in self.servers)})"
        _require_driver(self.label)
        if _safe_key(keyprefix, 100) != keyprefix and keyprefix:
            raise ImproperlyConfigured(E_KEY_PREFIX.format(store=self.label, prefix=keyprefix))
        self.options = {**DEFAULT_CLIENT_OPTIONS, **(options or {})}
        unknown = sorted(set(self.options) - _client_parameters())
        if unknown:
            raise ImproperlyConfigured(E_OPTIONS.format(store=self.label, names=", ".join(unknown)))
        #: this host's clock: only for reporting lock times in it
        self.clock = clock
        self._ring: _Ring | None = None
        self._pid = 0
        self._clocks: dict[str, _ServerClock] = {}
        self._ring_lock = threading.Lock()

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> MemcachedStore:
        """``memcached://host:port`` (also ``cache+memcached://h1:p1;h2:p2/``).

        ``options`` (``dedup_store_options``) go to the pymemcache clients;
        ``key_prefix`` among them namespaces the keys of this store.
        """
        servers, query = parse_servers(url)
        given = dict(options or {})
        keyprefix = str(given.pop("key_prefix", query.get("key_prefix", "")))
        return cls(servers, options={**_float_options(query), **given}, keyprefix=keyprefix)

    # -- plumbing ----------------------------------------------------------

    def ring(self) -> _Ring:
        """The clients of this process (built on first use, and again after a fork)."""
        pid = os.getpid()
        if self._ring is None or self._pid != pid:
            with self._ring_lock:
                if self._ring is None or self._pid != pid:
                    # An inherited ring is dropped, not closed: its sockets
                    # are the parent's.
                    self._ring = _Ring(self.servers, self.options)
                    self._pid = pid
        return self._ring

    def close(self) -> None:
        """Close this process's connections."""
        ring, self._ring = self._ring, None
        if ring is not None and self._pid == os.getpid():
            ring.close()

    @contextmanager
    def _operation(self) -> Iterator[None]:
        with store_errors(classify, self.name, lambda: self.label, _answer):
            yield

    def _physical(self, key: str) -> str:
        return self.keyprefix + _safe_key(key, MAX_KEY_LENGTH - len(self.keyprefix.encode()))

    def _server_clock(self, physical: str) -> _ServerClock:
        ring = self.ring()
        node = ring.node(physical)
        clock = self._clocks.get(node)
        if clock is None or time.monotonic() - clock.mono_at > CLOCK_REFRESH:
            clock = self._clocks[node] = self._read_clock(ring.clients[node])
        return clock

    def _read_clock(self, client: Any) -> _ServerClock:
        """The best of three ``stats`` readings (the shortest round trip)."""
        best: _ServerClock | None = None
        for _ in range(3):
            sent = time.monotonic()
            server_time = client.stats().get(b"time")
            if not isinstance(server_time, int):
                raise ValueError(f"no time in the stats answer: {server_time!r}")
            received = time.monotonic()
            # The server read its time somewhere in the round trip: pinning
            # it to the end keeps the estimate from running ahead.
            reading = _ServerClock(server_time, received, self.clock(), received - sent)
            if best is None or reading.slack < best.slack:
                best = reading
            if best.slack < 0.05:
                break
        assert best is not None
        return best

    def _now(self, physical: str) -> float:
        return self._server_clock(physical).now()

    def _remaining(self, physical: str, lock: Lock) -> float:
        return lock.expires_at - self._now(physical) + CLOCK_MARGIN

    def _local(self, physical: str, lock: Lock) -> Lock:
        clock = self._server_clock(physical)
        return replace(
            lock,
            acquired_at=clock.to_local(lock.acquired_at),
            expires_at=clock.to_local(lock.expires_at),
        )

    def _expiry(self, physical: str, seconds: float) -> int:
        relative = expiry_for(seconds)
        if relative <= MAX_RELATIVE_EXPIRY:
            return relative
        # memcached reads longer expiries as a Unix time on its own clock.
        absolute = math.ceil(self._now(physical) + seconds + CLOCK_MARGIN) + 1
        return absolute if absolute <= MAX_UNIX_EXPIRY else 0

    # -- primitives --------------------------------------------------------

    def _read(self, physical: str, *others: str) -> tuple[Slot, set[str]]:
        ring = self.ring()
        if not others:
            raw, token = ring.client(physical).gets(physical)
            return Slot(physical, raw, token), set()
        found = ring.get_many([physical, *others], gets=True)
        raw, token = found.get(physical, (None, None))
        return Slot(physical, raw, token), set(found) - {physical}

    def _add(self, physical: str, value: str, seconds: float) -> bool:
        client = self.ring().client(physical)
        return bool(client.add(physical, value, self._expiry(physical, seconds)))

    def _cas(self, slot: Slot, value: str | None, seconds: float) -> bool:
        client = self.ring().client(slot.physical)
        if value is None:
            # A negative expiry stores the item already expired: deleted iff unchanged.
            return bool(client.cas(slot.physical, "", slot.token, -1))
        expire = self._expiry(slot.physical, seconds)
        return bool(client.cas(slot.physical, value, slot.token, expire))

    def _set(self, physical: str, value: str, seconds: float) -> None:
        self.ring().client(physical).set(physical, value, self._expiry(physical, seconds))

    def _delete(self, physical: str) -> None:
        self.ring().client(physical).delete(physical)

    # -- listing -----------------------------------------------------------

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix``: walk each server's keys, then ``get_many`` them."""
        physical_prefix = self.keyprefix + prefix
        hashed = self.keyprefix + "#"
        keys = [
            k for k in self._dump_keys()
            if k.startswith(physical_prefix) or k.startswith(hashed)
        ]
        for start in range(0, len(keys), SCAN_BATCH):
            with self._operation():
                found = self.ring().get_many(keys[start : start + SCAN_BATCH])
                # Markers and counters do not decode as locks.
                locks = [
                    self._local(physical, lock)
                    for physical, raw in found.items()
                    if (lock := _decode(raw)) is not None and lock.key.startswith(prefix)
                ]
            yield from locks

    def _dump_keys(self) -> list[str]:
        """Every key of every server (``lru_crawler metadump hash``), unquoted."""
        keys: list[str] = []
        for server in self.servers:
            keys.extend(self._dump_server(server))
        return keys

    def _dump_server(self, server: Server) -> list[str]:
        deadline = time.monotonic() + 10
        while True:
            with self._operation():
                answer = _metadump(server, self.options)
            lines = answer.split("\n")
            last = lines[-1].strip()
            if last.startswith("BUSY") and time.monotonic() < deadline:
                time.sleep(0.05)  # another crawl runs on this server
                continue
            if last != "END":
                raise ScanNotSupported(
                    E_NO_SCAN.format(store=self.label, reason=f"the server answered {last!r}"),
                    store=self.name,
                )
            return [
                unquote(line.split(" ", 1)[0][len("key=") :])
                for line in lines[:-1]
                if line.startswith("key=")
            ]

    # -- CounterSupport ----------------------------------------------------

    def _counter_key(self, prefix: str, task_name: str, event: str) -> str:
        name = f"{prefix}/counters/{quote(task_name, safe='')}/{quote(event, safe='')}"
        return self._physical(name)

    def add_counts(self, prefix: str, counts: Mapping[tuple[str, str], int]) -> None:
        """``incr`` each counter (``add`` it first time): one round trip per counter.

        memcached has no multi-key increment, and answers are awaited so a
        flushed count is never lost silently. Counters never expire
        (memcached may still evict them under memory pressure).
        """
        with self._operation():
            for (task_name, event), n in counts.items():
                physical = self._counter_key(prefix, task_name, event)
                client = self.ring().client(physical)
                if client.incr(physical, n) is not None:
                    continue
                if not client.add(physical, str(n), 0):
                    client.incr(physical, n)  # created meanwhile

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix`` (a server walk plus ``get_many``)."""
        head = self.keyprefix + f"{prefix}/counters/"
        keys = [k for k in self._dump_keys() if k.startswith(head)]
        counts: dict[tuple[str, str], int] = {}
        for start in range(0, len(keys), SCAN_BATCH):
            with self._operation():
                found = self.ring().get_many(keys[start : start + SCAN_BATCH])
                for physical, raw in found.items():
                    task_q, _, event_q = physical[len(head) :].partition("/")
                    value = raw.decode() if isinstance(raw, bytes) else str(raw)
                    counts[(unquote(task_q), unquote(event_q))] = int(value.strip())
        return counts


def _metadump(server: Server, options: Mapping[str, Any]) -> str:
    """The answer to ``lru_crawler metadump hash`` on a dedicated connection.

    Dump lines end in ``\\n``; the answer ends at the first ``\\r\\n`` (after
    ``END``, or an error line). Read here rather than with pymemcache's
    ``raw_command``, whose reader drops data when an answer spans several
    reads.
    """
    timeout = float(options.get("timeout") or 5.0)
    if isinstance(server, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(server)
    else:
        sock = socket.create_connection(server, timeout=options.get("connect_timeout") or timeout)
        sock.settimeout(timeout)
    tls = options.get("tls_context")
    if tls is not None and not isinstance(server, str):
        sock = tls.wrap_socket(sock, server_hostname=server[0])
    with sock:
        sock.sendall(b"lru_crawler metadump hash\r\n")
        chunks: list[bytes] = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("memcached closed the connection during metadump")
            chunks.append(chunk)
            if chunk.endswith(b"\r\n"):
                break
    return b"".join(chunks)[:-2].decode("utf-8", "replace")
