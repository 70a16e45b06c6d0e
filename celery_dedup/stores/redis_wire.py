"""Lua scripts run on a per-thread connection, outside redis-py's per-command machinery.

A lock operation is one ``EVALSHA`` on the hot path of every enqueue and
every executed task. Through ``Redis.execute_command`` each one also checks
a connection out of the pool and back, records observability metrics and
dispatches events: about as much CPU as the round trip itself. ``ScriptWire``
keeps one connection per thread (per process: a forked child opens its own)
built from the client pool's own connection class and arguments, so TLS,
Sentinel master discovery, credentials, timeouts, health checks and the
client's retry policy all still apply.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["ScriptWire"]


class ScriptWire:
    """Runs registered Lua scripts of one Redis client on per-thread connections."""

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._local = threading.local()
        #: every connection opened, to close them all in ``close()``
        self._opened: weakref.WeakSet[Any] = weakref.WeakSet()
        self._loaded: dict[str, str] = {}

    def _connection(self) -> Any:
        local = self._local
        pid = os.getpid()
        if getattr(local, "pid", None) != pid:
            # A child of fork() never writes to its parent's socket.
            pool = self._pool
            local.connection = pool.connection_class(**pool.connection_kwargs)
            local.pid = pid
            self._opened.add(local.connection)
        return local.connection

    def evalsha(self, sha: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """``EVALSHA sha`` (loading ``script`` once if the server lacks it); one round trip."""
        connection = self._connection()
        command = ("EVALSHA", sha, len(keys), *keys, *args)
        try:
            return self._call(connection, command)
        except NoScriptError:
            # A restarted or flushed server: load the script, then run it once more.
            self._call(connection, ("SCRIPT", "LOAD", script))
            return self._call(connection, command)

    @staticmethod
    def _call(connection: Any, command: tuple[Any, ...]) -> Any:
        def send() -> Any:
            _ready(connection)
            connection.send_command(*command)
            return connection.read_response()

        try:
            return connection.retry.call_with_retry(send, lambda _error: connection.disconnect())
        except ResponseError:
            raise  # the server answered: the connection is in a clean state
        except BaseException:
            # A half-read reply must never be read as the next command's.
            connection.disconnect()
            raise

    def close(self) -> None:
        """Disconnect every connection this wire opened (any thread's)."""
        for connection in list(self._opened):
            connection.disconnect()
        self._opened.clear()
        self._local = threading.local()


def _ready(connection: Any) -> None:
    """Connect, or reconnect a connection the server closed while it was idle.

    As ``ConnectionPool.get_connection`` does before handing one out: an idle
    connection that has something to read was closed (server ``timeout``, a
    restart) and is replaced before the command is sent, so the command is
    never lost on a dead socket. ``connect()`` is what a Sentinel-managed
    connection overrides to find the master (the implicit connect inside
    ``send_command`` would not).
    """
    if getattr(connection, "_sock", None) is None:
        connection.connect()
        return
    try:
        if connection.can_read():
            raise RedisConnectionError("connection has unread data or was closed")
    except (RedisConnectionError, RedisTimeoutError, OSError):
        connection.disconnect()
        connection.connect()
