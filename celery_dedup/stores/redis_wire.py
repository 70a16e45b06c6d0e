"""Lua scripts run on the store's own connections, outside redis-py's per-command machinery.

A lock operation is one ``EVALSHA`` on the hot path of every enqueue and
every executed task. Through ``Redis.execute_command`` each one also checks
a connection out of the pool and back, records observability metrics and
dispatches events: about as much CPU as the round trip itself. ``ScriptWire``
keeps its own stack of idle connections (a thread takes one, runs its
command and puts it back; a forked child starts with none), built from the
client pool's own connection class and arguments, so TLS, Sentinel master
discovery, credentials, timeouts, health checks and the client's retry
policy all still apply.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from redis.exceptions import AuthenticationError, AuthorizationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["ScriptWire"]


class ScriptWire:
    """Runs registered Lua scripts of one Redis client on connections of its own."""

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._mutex = threading.Lock()
        self._pid = os.getpid()
        #: connections not in use; list.pop/append are atomic, so no lock
        self._idle: list[Any] = []
        #: every connection opened in this process, to close them in ``close()``
        self._opened: weakref.WeakSet[Any] = weakref.WeakSet()

    def _checkout(self) -> Any:
        if self._pid != os.getpid():
            with self._mutex:
                if self._pid != os.getpid():
                    # A child of fork() never writes to its parent's sockets
                    # (nor closes them: the parent still uses them).
                    self._idle, self._opened = [], weakref.WeakSet()
                    self._pid = os.getpid()
        try:
            return self._idle.pop()
        except IndexError:
            pool = self._pool
            connection = pool.connection_class(**pool.connection_kwargs)
            self._opened.add(connection)
            return connection

    def evalsha(self, sha: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """``EVALSHA sha`` (loading ``script`` once if the server lacks it); one round trip."""
        command = ("EVALSHA", sha, len(keys), *keys, *args)
        connection = self._checkout()
        try:
            try:
                return _call(connection, command)
            except NoScriptError:
                # A restarted or flushed server: load the script, run it once more.
                _call(connection, ("SCRIPT", "LOAD", script))
                return _call(connection, command)
        finally:
            # Also after an error: _call left it disconnected or clean, and a
            # disconnected connection reconnects on its next use.
            self._idle.append(connection)

    def close(self) -> None:
        """Disconnect every connection this wire opened in this process."""
        for connection in list(self._opened):
            connection.disconnect()


def _call(connection: Any, command: tuple[Any, ...]) -> Any:
    def send() -> Any:
        _ready(connection)
        connection.send_command(*command)
        return connection.read_response()

    try:
        return connection.retry.call_with_retry(
            send, lambda _error: connection.disconnect(), is_retryable=_retryable
        )
    except ResponseError:
        raise  # the server answered: the connection is in a clean state
    except BaseException:
        # A half-read reply must never be read as the next command's.
        connection.disconnect()
        raise


def _retryable(error: Exception) -> bool:
    # redis-py's authentication errors are ConnectionErrors, but a refused
    # password stays refused: retrying it (around a connect that retries it
    # again) only delays the answer, by tens of seconds.
    return not isinstance(error, (AuthenticationError, AuthorizationError))


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
