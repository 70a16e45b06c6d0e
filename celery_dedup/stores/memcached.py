"""memcached lock store: ``add`` to acquire, ``gets`` + ``cas`` to check owners.

memcached has no scripting and no compare-and-delete, so the guarantees are
built from its two atomic primitives:

* ``add`` stores a key only if it is absent. A free lock is taken in one
  round trip; a held one costs a second (``gets``) to report the holder.
* ``cas`` stores only if nobody wrote the key since our ``gets``. Every
  owner-checked write (release, extend, take-over, taking a lock whose time
  is up) is ``gets`` + ``cas``: two round trips, refused if anyone wrote the
  key in between. Release writes with a negative expiry, which memcached
  treats as "expired at once", so it is a true owner-checked
  compare-and-delete (never a check followed by a blind ``delete``).

Expiry: memcached counts whole seconds on a clock that ticks once a second,
so an item stored with expiry ``n`` can vanish after ``n - 1`` seconds. Each
lock therefore records its exact ``expires_at`` and counts as free from then
on; the item's own expiry is ``ceil(ttl) + 1`` seconds (rounded up, plus one
tick) and only reclaims memory. Exact expiry is judged on the clients'
clocks, so hosts should keep them in sync (NTP).

memcached cannot list its keys on the data path, so ``scan`` and
``read_counts`` walk the server with ``lru_crawler metadump all`` (memcached
1.4.31+, on by default); nothing is added to ``acquire`` to keep an index.

pymemcache is not imported at module import, only inside the functions that
use it. ``stores/django_cache.py`` reuses this protocol for Django's
``PyMemcacheCache``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote

from ..exceptions import ScanNotSupported, StoreUnavailable
from .base import Lock, LockMeta, unavailable_on

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["MemcachedStore", "expiry_for", "parse_servers"]

#: memcached's limit on key length, in bytes.
MAX_KEY_LENGTH = 250
#: Expiries above this many seconds are read by memcached as a Unix time.
MAX_RELATIVE_EXPIRY = 30 * 24 * 3600
#: How often a contended ``gets`` + ``cas`` is retried before giving up.
CAS_ATTEMPTS = 5
#: Keys per ``get_many`` when scanning.
SCAN_BATCH = 100
#: pymemcache settings used unless ``dedup_store_options`` overrides them.
DEFAULT_CLIENT_OPTIONS: Mapping[str, Any] = {"connect_timeout": 1.0, "timeout": 1.0}

E_NO_SCAN = (
    "the {store} lock store cannot list its locks: {reason}. Locks still work; "
    "inspect a single key with inspect_lock()."
)
E_CONTENDED = "lock store {store}: key kept changing during {op} ({attempts} attempts)"


# -- shared helpers ------------------------------------------------------------------------


@cache
def _unreachable() -> tuple[type[BaseException], ...]:
    """The pymemcache and socket errors that mean "the server cannot be reached"."""
    from pymemcache.exceptions import MemcacheUnexpectedCloseError

    return (MemcacheUnexpectedCloseError, ConnectionError, socket.timeout, OSError)


def _safe_key(key: str, room: int) -> str:
    """``key`` if memcached accepts it within ``room`` bytes, else ``#`` + its sha256."""
    raw = key.encode()
    if len(raw) <= room and all(0x21 <= b <= 0x7E for b in raw):
        return key
    return "#" + hashlib.sha256(raw).hexdigest()


def _encode(key: str, owner: str, meta: LockMeta, acquired_at: float, expires_at: float) -> str:
    """The stored record: compact JSON, carrying the logical key for ``scan``."""
    record = {
        "k": key,
        "o": owner,
        "t": meta.get("task_name", ""),
        "p": meta.get("policy", ""),
        # Milliseconds, rounded down: a reported TTL never exceeds the one asked for.
        "a": math.floor(acquired_at * 1000) / 1000,
        "e": math.floor(expires_at * 1000) / 1000,
    }
    return json.dumps(record, separators=(",", ":"))


def _decode(raw: Any) -> Lock | None:
    """The lock a stored record describes, or ``None`` for anything else."""
    if raw is None:
        return None
    try:
        record = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return Lock(
            key=str(record["k"]),
            owner=str(record["o"]),
            task_name=str(record["t"]),
            acquired_at=float(record["a"]),
            expires_at=float(record["e"]),
            policy=str(record["p"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _with_meta(lock: Lock) -> dict[str, str]:
    return {"task_name": lock.task_name, "policy": lock.policy}


def expiry_for(ttl: float, now: float) -> int:
    """The memcached expiry of a lock living ``ttl`` seconds: ``ceil(ttl) + 1``.

    Rounded up and one tick longer than the lock, so memcached's one-second
    clock never drops a live lock; above 30 days it is sent as a Unix time,
    which is how memcached reads such values.
    """
    seconds = max(1, math.ceil(ttl)) + 1
    if seconds > MAX_RELATIVE_EXPIRY:
        return math.ceil(now) + seconds
    return seconds


def parse_servers(url: str) -> tuple[list[tuple[str, int] | str], dict[str, str]]:
    """``memcached://h1:p1;h2:p2/?timeout=1`` → ``([(h1, p1), (h2, p2)], {"timeout": "1"})``.

    Servers are separated by ``;`` or ``,`` (as Celery's cache backend);
    ``unix:/path`` names a socket; the port defaults to 11211.
    """
    rest = url.partition("://")[2]
    rest, _, query = rest.partition("?")
    netloc = rest.split("/", 1)[0] if not rest.startswith("unix:") else rest.rstrip("/")
    servers: list[tuple[str, int] | str] = []
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


def _describe(server: tuple[str, int] | str) -> str:
    return f"unix:{server}" if isinstance(server, str) else f"{server[0]}:{server[1]}"


def _float_options(query: Mapping[str, str]) -> dict[str, Any]:
    return {k: float(v) for k, v in query.items() if k in ("timeout", "connect_timeout")}


# -- memcached -----------------------------------------------------------------------------


class MemcachedStore:
    """Owner-checked TTL locks in memcached (pymemcache).

    One server uses a thread-safe ``PooledClient``; several (``;``-separated)
    use a ``HashClient`` spreading keys over them. The client is rebuilt in a
    forked child, so no socket is shared across a fork.

    Round trips: acquire 1 (free key) or 2 (held: ``add`` then ``gets`` to
    report the holder); release, extend and take-over 2 (``gets`` + ``cas``);
    get 1. See the module docstring for expiry and ``scan``.
    """

    name = "memcached"

    def __init__(
        self,
        client_factory: Callable[[], Any],
        *,
        servers: Sequence[tuple[str, int] | str] = (),
        keyprefix: str = "",
        scan_options: Mapping[str, Any] | None = None,
        label: str = "memcached",
        per_process: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client_factory = client_factory
        self.servers = list(servers)
        self.keyprefix = keyprefix
        self.label = label
        self.clock = clock
        self._scan_options = dict(scan_options or DEFAULT_CLIENT_OPTIONS)
        self._per_process = per_process
        self._client: Any = None
        self._pid = 0
        self._client_lock = threading.Lock()

    @classmethod
    def from_url(
        cls, url: str, *, app: Celery | None = None, options: Mapping[str, Any] | None = None
    ) -> MemcachedStore:
        """``memcached://host:port`` (also ``cache+memcached://h1:p1;h2:p2/``).

        ``options`` (``dedup_store_options``) go to the pymemcache client;
        ``key_prefix`` among them namespaces the keys of this store.
        """
        servers, query = parse_servers(url)
        given = dict(options or {})
        keyprefix = str(given.pop("key_prefix", query.get("key_prefix", "")))
        client_options = {**DEFAULT_CLIENT_OPTIONS, **_float_options(query), **given}
        scan_options = {
            k: v for k, v in client_options.items()
            if k in ("connect_timeout", "timeout", "tls_context", "socket_module")
        }

        def factory() -> Any:
            return _make_client(servers, client_options)

        return cls(
            factory,
            servers=servers,
            keyprefix=keyprefix,
            scan_options=scan_options,
            label=f"memcached ({';'.join(_describe(s) for s in servers)})",
        )

    # -- plumbing ----------------------------------------------------------

    def client(self) -> Any:
        """The pymemcache client of this process (built on first use)."""
        if not self._per_process:
            return self.client_factory()
        pid = os.getpid()
        if self._client is None or self._pid != pid:
            with self._client_lock:
                if self._client is None or self._pid != pid:
                    # An inherited client is dropped, not closed: its sockets
                    # are the parent's.
                    self._client = self.client_factory()
                    self._pid = pid
        return self._client

    def close(self) -> None:
        """Close this process's connections."""
        client, self._client = self._client, None
        if client is not None and self._per_process and self._pid == os.getpid():
            client.close()

    @contextmanager
    def _boundary(self) -> Iterator[None]:
        from pymemcache.exceptions import MemcacheError

        try:
            with unavailable_on(_unreachable(), self.name, lambda: self.label):
                yield
        except MemcacheError as exc:
            # HashClient raises the bare base class once every server is marked dead.
            if type(exc) is not MemcacheError:
                raise
            raise StoreUnavailable(
                f"lock store {self.label} is unavailable: {exc}", store=self.name
            ) from exc

    def _physical(self, key: str) -> str:
        return self.keyprefix + _safe_key(key, MAX_KEY_LENGTH - len(self.keyprefix.encode()))

    def _gets(self, client: Any, physical: str) -> tuple[Any, Any]:
        found = client.gets(physical)
        if not isinstance(found, tuple):
            # A HashClient configured to ignore a failing server answers None.
            raise StoreUnavailable(
                f"lock store {self.label} is unavailable: no answer for gets", store=self.name
            )
        return found

    def _contended(self, op: str) -> StoreUnavailable:
        return StoreUnavailable(
            E_CONTENDED.format(store=self.label, op=op, attempts=CAS_ATTEMPTS), store=self.name
        )

    # -- LockStore ---------------------------------------------------------

    def acquire(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """``add``; if held, ``gets`` the holder (or ``cas`` over a lock whose time is up)."""
        physical = self._physical(key)
        with self._boundary():
            client = self.client()
            for _ in range(CAS_ATTEMPTS):
                now = self.clock()
                record = _encode(key, owner, meta, now, now + ttl)
                if client.add(physical, record, expiry_for(ttl, now), noreply=False):
                    return None
                raw, token = self._gets(client, physical)
                if raw is None:
                    continue  # released or evicted since the add: try again
                holder = _decode(raw)
                if holder is not None and holder.expires_at > now:
                    return holder
                # Past its expires_at (or not a lock): take it unless someone else did.
                if client.cas(physical, record, token, expiry_for(ttl, now), noreply=False):
                    return None
        raise self._contended("acquire")

    def release(self, key: str, owner: str) -> bool:
        """``gets`` + owner check + ``cas`` to an already-expired item (compare-and-delete)."""
        physical = self._physical(key)
        with self._boundary():
            client = self.client()
            for _ in range(CAS_ATTEMPTS):
                raw, token = self._gets(client, physical)
                holder = _decode(raw)
                if holder is None or holder.owner != owner or holder.expires_at <= self.clock():
                    return False
                # A negative expiry stores the item already expired: deleted iff unchanged.
                if client.cas(physical, "", token, -1, noreply=False):
                    return True
        raise self._contended("release")

    def extend(self, key: str, owner: str, ttl: float) -> bool:
        """``gets`` + owner check + ``cas`` of the record with a new ``expires_at``."""
        physical = self._physical(key)
        with self._boundary():
            client = self.client()
            for _ in range(CAS_ATTEMPTS):
                raw, token = self._gets(client, physical)
                holder = _decode(raw)
                now = self.clock()
                if holder is None or holder.owner != owner or holder.expires_at <= now:
                    return False
                record = _encode(key, owner, _with_meta(holder), holder.acquired_at, now + ttl)
                if client.cas(physical, record, token, expiry_for(ttl, now), noreply=False):
                    return True
        raise self._contended("extend")

    def take_over(self, key: str, owner: str, ttl: float, meta: LockMeta) -> Lock | None:
        """``gets`` the holder, then ``cas`` (or ``add`` when free) the new record."""
        physical = self._physical(key)
        with self._boundary():
            client = self.client()
            for _ in range(CAS_ATTEMPTS):
                raw, token = self._gets(client, physical)
                now = self.clock()
                record = _encode(key, owner, meta, now, now + ttl)
                expire = expiry_for(ttl, now)
                if raw is None:
                    if client.add(physical, record, expire, noreply=False):
                        return None
                    continue
                if client.cas(physical, record, token, expire, noreply=False):
                    previous = _decode(raw)
                    return previous if previous is not None and previous.expires_at > now else None
        raise self._contended("take_over")

    def get(self, key: str) -> Lock | None:
        """The live lock at ``key`` (one ``get``)."""
        with self._boundary():
            raw = self.client().get(self._physical(key))
        lock = _decode(raw)
        if lock is None or lock.key != key or lock.expires_at <= self.clock():
            return None
        return lock

    def scan(self, prefix: str) -> Iterator[Lock]:
        """Every live lock under ``prefix``: walk each server's keys, then ``get_many`` them."""
        physical_prefix = self.keyprefix + prefix
        hashed = self.keyprefix + "#"
        keys = [
            k for k in self._dump_keys()
            if k.startswith(physical_prefix) or k.startswith(hashed)
        ]
        now = self.clock()
        for start in range(0, len(keys), SCAN_BATCH):
            with self._boundary():
                found = self.client().get_many(keys[start : start + SCAN_BATCH])
            for raw in found.values():
                lock = _decode(raw)
                if lock is not None and lock.key.startswith(prefix) and lock.expires_at > now:
                    yield lock

    def _dump_keys(self) -> list[str]:
        """Every key of every server (``lru_crawler metadump all``), unquoted."""
        keys: list[str] = []
        for server in self.servers:
            keys.extend(self._dump_server(server))
        return keys

    def _dump_server(self, server: tuple[str, int] | str) -> list[str]:
        deadline = time.monotonic() + 10
        while True:
            with self._boundary():
                answer = _metadump(server, self._scan_options)
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
        with self._boundary():
            client = self.client()
            for (task_name, event), n in counts.items():
                physical = self._counter_key(prefix, task_name, event)
                if client.incr(physical, n, noreply=False) is not None:
                    continue
                if not client.add(physical, str(n), 0, noreply=False):
                    client.incr(physical, n, noreply=False)  # created meanwhile

    def read_counts(self, prefix: str) -> dict[tuple[str, str], int]:
        """Every counter under ``prefix`` (a server walk plus ``get_many``)."""
        head = self.keyprefix + f"{prefix}/counters/"
        keys = [k for k in self._dump_keys() if k.startswith(head)]
        counts: dict[tuple[str, str], int] = {}
        for start in range(0, len(keys), SCAN_BATCH):
            with self._boundary():
                found = self.client().get_many(keys[start : start + SCAN_BATCH])
            for physical, raw in found.items():
                task_q, _, event_q = str(physical)[len(head) :].partition("/")
                value = raw.decode() if isinstance(raw, bytes) else str(raw)
                counts[(unquote(task_q), unquote(event_q))] = int(value.strip())
        return counts


def _metadump(server: tuple[str, int] | str, options: Mapping[str, Any]) -> str:
    """The answer to ``lru_crawler metadump all`` on a dedicated connection.

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
        sock.sendall(b"lru_crawler metadump all\r\n")
        chunks: list[bytes] = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("memcached closed the connection during metadump")
            chunks.append(chunk)
            if chunk.endswith(b"\r\n"):
                break
    return b"".join(chunks)[:-2].decode("utf-8", "replace")


def _make_client(servers: Sequence[tuple[str, int] | str], options: Mapping[str, Any]) -> Any:
    """A thread-safe pymemcache client for ``servers``."""
    from pymemcache.client.base import PooledClient
    from pymemcache.client.hash import HashClient

    kwargs = {"default_noreply": False, **options}
    if len(servers) == 1:
        return PooledClient(servers[0], **kwargs)
    # retry_attempts=0: a failing server raises at once (never a silent default
    # that would look like "held"), then its keys move to the other servers.
    return HashClient(list(servers), **{"use_pooling": True, "retry_attempts": 0, **kwargs})
