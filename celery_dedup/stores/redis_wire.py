"""Lua scripts run on the store's own connections, outside redis-py's per-command machinery.

A lock operation is one ``EVALSHA`` on the hot path of every enqueue and
every executed task. Through ``Redis.execute_command`` each one also checks
a connection out of the pool and back, records observability metrics and
dispatches events: about as much CPU as the round trip itself. ``ScriptWire``
keeps its own stack of idle connections (a thread takes one, runs its
command and puts it back; a forked child starts with none; at most the
pool's ``max_connections`` open at once, a thread beyond them waiting for one
to come back), built from the
client pool's own connection class and arguments, so TLS, Sentinel master
discovery, credentials, timeouts, health checks and the client's retry
policy all still apply.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import AuthenticationError, AuthorizationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["WAIT_FOR_CONNECTION", "ScriptWire"]

#: Seconds a thread waits for one of ``max_connections`` busy connections
#: when neither the pool nor the socket timeout says otherwise.
WAIT_FOR_CONNECTION = 5.0


class ScriptWire:
    """Runs registered Lua scripts of one Redis client on connections of its own."""

    def __init__(self, client: Any, timeouts: Mapping[str, Any] | None = None) -> None:
        self._pool = client.connection_pool
        #: the client's connection arguments, with the store's own timeouts
        self._kwargs = {**self._pool.connection_kwargs, **(timeouts or {})}
        self._mutex = threading.Lock()
        self._pid = os.getpid()
        #: the pool's ``max_connections`` (Celery's ``redis_max_connections``) caps this stack too
        self._limit = int(getattr(self._pool, "max_connections", None) or 2**31 - 1)
        #: how long a thread waits for a free connection when all are in use
        self._wait = float(
            getattr(self._pool, "timeout", None)
            or self._kwargs.get("socket_timeout")
            or WAIT_FOR_CONNECTION
        )
        self._reset()

    def _reset(self) -> None:
        #: connections not in use; list.pop/append are atomic, so no lock
        self._idle: list[Any] = []
        #: every connection opened in this process, to close them in ``close()``
        self._opened: weakref.WeakSet[Any] = weakref.WeakSet()
        #: one slot per connection that may be open at once
        self._slots = threading.BoundedSemaphore(self._limit)

    def _checkout(self) -> Any:
        if self._pid != os.getpid():
            with self._mutex:
                if self._pid != os.getpid():
                    # A child of fork() never writes to its parent's sockets
                    # (nor closes them: the parent still uses them).
                    self._reset()
                    self._pid = os.getpid()
        if not self._slots.acquire(timeout=self._wait):
            raise RedisConnectionError(
                f"all {self._limit} connections of the lock store are in use "
                f"(waited {self._wait:g} s; max_connections)"
            )
        try:
            return self._idle.pop()
        except IndexError:
            pass
        try:
            pool = self._pool
            connection = pool.connection_class(**self._kwargs)
        except BaseException:
            self._slots.release()
            raise
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
            self._slots.release()

    def close(self) -> None:
        """Disconnect every connection this wire opened in this process."""
        for connection in list(self._opened):
            connection.disconnect()


class _NotRetried(Exception):
    """Carries an error the connection's retry must not retry (see ``_call``)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _call(connection: Any, command: tuple[Any, ...]) -> Any:
    def send() -> Any:
        try:
            _ready(connection)
            connection.send_command(*command)
            return connection.read_response()
        except Exception as exc:
            if not _retryable(exc):
                # (redis-py 6.4's call_with_retry takes no is_retryable: an error
                # outside the retried classes is how it is told not to retry.)
                raise _NotRetried(exc) from exc
            raise

    try:
        try:
            return connection.retry.call_with_retry(send, lambda _error: connection.disconnect())
        except _NotRetried as wrapped:
            raise wrapped.error from wrapped.error.__cause__
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
