"""Real ``celery worker`` subprocesses (prefork pool) that tests start, kill and restart."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tests.fixtures._servers import stop

from .apps import worker_env
from .probe import Recorder, poll

__all__ = ["Worker", "WorkerPool", "wait_pid_gone"]

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    """One ``celery -A tests.reliability.worker_app worker -P prefork`` process group."""

    def __init__(
        self,
        name: str,
        conf: Mapping[str, Any],
        recorder: Recorder,
        log: Path,
        *,
        concurrency: int = 2,
        queue: str = "rel",
    ) -> None:
        self.name = name
        self.conf = dict(conf)
        self.recorder = recorder
        self.log = log
        self.concurrency = concurrency
        self.queue = queue
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def hostname(self) -> str:
        return f"{self.name}@rel"

    def start(self, timeout: float = 60) -> Worker:
        """Start the worker and wait until it consumes (its ``worker_ready`` record)."""
        ready_before = self._ready_count()
        env = {
            **os.environ,
            **worker_env(self.conf, self.recorder.url, self.name),
            "PYTHONPATH": str(ROOT),
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "celery", "-A", "tests.reliability.worker_app",
                    "worker", "-P", "prefork", "-c", str(self.concurrency),
                    "-n", self.hostname, "-Q", self.queue,
                    "--without-gossip", "--without-mingle", "--without-heartbeat",
                    "-l", "INFO",
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        poll(
            lambda: self._ready_count() > ready_before or self._exited(),
            timeout,
            what=f"worker {self.name} ready",
        )
        if self._exited():
            raise RuntimeError(f"worker {self.name} exited: {self.tail()}")
        return self

    def _ready_count(self) -> int:
        return sum(1 for m in self.recorder.marks("ready") if m["hostname"] == self.hostname)

    def _exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def children(self) -> list[int]:
        """The pool children's pids."""
        path = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        with contextlib.suppress(OSError):
            return [int(p) for p in path.read_text().split()]
        return []

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children) and reap it."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 10) -> None:
        """Warm shutdown (SIGTERM), then SIGKILL if it lingers (a task may hang on purpose)."""
        if self.proc is not None:
            stop(self.proc, timeout=timeout)

    def tail(self, chars: int = 4000) -> str:
        """The end of the worker's log."""
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


class WorkerPool:
    """Workers of one test; all stopped at its end."""

    def __init__(self, recorder: Recorder, directory: Path) -> None:
        self.recorder = recorder
        self.directory = directory
        self.workers: list[Worker] = []

    def start(
        self, conf: Mapping[str, Any], count: int = 1, *, concurrency: int = 2, queue: str = "rel"
    ) -> list[Worker]:
        """Start ``count`` workers at once on ``conf``; return them when all are ready."""
        started = [
            Worker(
                f"w{len(self.workers) + i + 1}",
                conf,
                self.recorder,
                self.directory / f"worker-{len(self.workers) + i + 1}.log",
                concurrency=concurrency,
                queue=queue,
            )
            for i in range(count)
        ]
        self.workers.extend(started)
        for worker in started:
            worker.start()
        return started

    def logs(self) -> str:
        """Every worker's log tail, for an assertion message."""
        return "\n".join(f"--- {w.name}\n{w.tail()}" for w in self.workers)

    def log_texts(self) -> list[str]:
        """Every worker's whole log."""
        return [w.log.read_text(errors="replace") for w in self.workers]

    def stop_all(self) -> None:
        """Stop every worker."""
        for worker in self.workers:
            worker.stop()

    @contextlib.contextmanager
    def running(self) -> Iterator[WorkerPool]:
        """Stop every worker when the block ends."""
        try:
            yield self
        finally:
            self.stop_all()


def wait_pid_gone(pid: int, timeout: float = 10) -> None:
    """Wait until ``pid`` no longer exists (or is a zombie)."""

    def gone() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            return True
        return state == "Z"

    poll(gone, timeout, what=f"pid {pid} gone")
