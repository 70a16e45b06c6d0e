"""Throwaway redis-server and postgres processes on free loopback ports.

The minimal logic of ``tests/fixtures`` without pytest: the benchmark never
touches a server it did not start.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: Debian keeps some server binaries outside PATH.
EXTRA_PATHS = [
    "/usr/sbin",
    "/sbin",
    *sorted(str(p) for p in Path("/usr/lib/postgresql").glob("*/bin")),
]


def find_binary(name: str) -> str:
    """The path of an installed server binary, or exit naming it."""
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(EXTRA_PATHS))
    if found is None:
        raise SystemExit(f"{name} is not installed (see docs/benchmarks.md)")
    return found


def free_port() -> int:
    """A TCP port nothing listens on right now, on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Wait until 127.0.0.1:port accepts connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    """Signal the process group, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server without persistence on a free port; yield its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="celery-dedup-bench-") as directory:
        argv = [find_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(port),
                "--save", "", "--appendonly", "no", "--dir", directory]
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            wait_for_port(port, proc)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop(proc)


def _as_user(argv: list[str]) -> list[str]:
    """``argv`` run as an unprivileged user when we are root (postgres refuses root)."""
    if os.geteuid() != 0:
        return argv
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam(name)
            return [find_binary("setpriv"), f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                    "--clear-groups", "--", *argv]
    raise SystemExit("running as root and neither a postgres nor a nobody user exists")


def _owner_uid() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam(name)
            return user.pw_uid, user.pw_gid
    return None


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A postgres (fsync off) on a free port; yield its SQLAlchemy psycopg URL."""
    import psycopg

    directory = Path(tempfile.mkdtemp(prefix="celery-dedup-bench-pg-"))
    try:
        owner = _owner_uid()
        if owner is not None:
            os.chown(directory, *owner)
        env = {**os.environ, "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}
        env.pop("PGDATA", None)
        data = directory / "data"
        subprocess.run(
            _as_user([find_binary("initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--no-sync"]),
            check=True, capture_output=True, env=env, cwd=directory,
        )
        port = free_port()
        argv = _as_user([find_binary("postgres"), "-D", str(data), "-k", str(directory),
                         "-p", str(port), "-h", "127.0.0.1", "-c", "fsync=off",
                         "-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )
        try:
            wait_for_port(port, proc)
            deadline = time.monotonic() + 30
            while True:  # postgres listens before it accepts queries
                try:
                    with psycopg.connect(host="127.0.0.1", port=port, user="postgres",
                                         dbname="postgres", connect_timeout=2) as conn:
                        conn.execute("SELECT 1")
                    break
                except psycopg.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        finally:
            # SIGINT is postgres's fast shutdown (SIGTERM waits for clients).
            stop(proc, signal.SIGINT)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
