"""A redis-server a test can kill, pause (SIGSTOP), resume and restart on the same port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.fixtures._servers import free_port, stop, wait_for_port
from tests.fixtures.redis import start_redis

__all__ = ["FlakyRedis", "flaky_redis"]


class FlakyRedis:
    """One redis-server (no persistence: a restart comes back empty) on a fixed port."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:PORT/DB``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> FlakyRedis:
        """Start (or restart) the server and wait for its port."""
        self.starts += 1
        argv, _ = start_redis(self.directory, self.port)
        with (self.directory / f"redis-{self.starts}.log").open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for_port(self.port, self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL the server: connections drop, the port refuses."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(15)

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop the server for good."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            stop(self.proc)


@contextlib.contextmanager
def flaky_redis(directory: Path, *, started: bool = True) -> Iterator[FlakyRedis]:
    """A ``FlakyRedis`` (started unless told otherwise), closed when the block ends."""
    directory.mkdir(parents=True, exist_ok=True)
    server = FlakyRedis(directory)
    try:
        yield server.start() if started else server
    finally:
        server.close()
