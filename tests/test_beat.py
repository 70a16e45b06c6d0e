"""Two real ``celery beat`` processes scheduling the same entry: one execution per slot.

Both beats fire the entry at the start of every 2-second wall-clock slot
(``Slots``: an interval schedule aligned on the clock, so the two processes
fire within milliseconds of each other whenever they started). Each beat
records what it fired (``RecordingScheduler``); the worker's task body records
the slot it ran in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.beat import PersistentScheduler, ScheduleEntry
from celery.contrib.testing.worker import start_worker
from celery.schedules import schedstate, schedule
from celery.utils.time import maybe_make_aware

from celery_dedup import DedupTask
from tests.fixtures._servers import stop
from tests.fixtures.redis import RedisServer

#: seconds between two firings of the entry
INTERVAL = 2.0
#: the beat test's broker, result backend (and lock store) and record databases
BROKER_DB, BACKEND_DB, RECORD_DB = 30, 31, 32
QUEUE = "q-beat"
TICK = "beat.tick"
#: a throttle shorter than the interval: see ``test_two_beats_run_each_slot_once``
TICK_OPTIONS: dict[str, Any] = {"unique_for": 1.5, "unique_until": "expiry"}

BEAT_MODULE = "from tests.test_beat import beat_app\n\napp = beat_app()\n"


def slot_now() -> int:
    """The number of the wall-clock slot we are in."""
    return int(time.time() // INTERVAL)


class Slots(schedule):
    """Due once per wall-clock slot of ``run_every`` seconds, at the slot's start."""

    def is_due(self, last_run_at: datetime) -> schedstate:
        """Due when the last run was before the current slot began."""
        period = float(self.seconds)
        now = time.time()
        slot_start = now - now % period
        last = maybe_make_aware(last_run_at).timestamp()
        return schedstate(last < slot_start, slot_start + period - now)


class RecordingScheduler(PersistentScheduler):
    """Records ``<beat name>:<slot>`` in Redis each time the entry is sent."""

    def apply_async(
        self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Record the firing, then send as celery beat does."""
        with redis.Redis.from_url(os.environ["BEAT_TEST_RECORD"]) as client:
            client.rpush("fired", f"{os.environ['BEAT_TEST_NAME']}:{slot_now()}")
        return super().apply_async(entry, producer, advance, **kwargs)


def configure(app: Celery, *, broker: str, backend: str, record: Callable[[], None] | None) -> None:
    """The app beat and the worker share; ``record`` registers the task (the body's action)."""
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        beat_schedule={"tick": {"task": TICK, "schedule": Slots(INTERVAL)}},
    )
    if record is not None:
        action = record

        @app.task(base=DedupTask, shared=False, name=TICK, **TICK_OPTIONS)
        def tick() -> None:
            action()


def beat_app() -> Celery:
    """The app of a beat process, from its environment (see ``start_beat``)."""
    app = Celery("beat-test", set_as_current=False)
    registered = os.environ.get("BEAT_TEST_REGISTER") == "1"
    configure(
        app,
        broker=os.environ["BEAT_TEST_BROKER"],
        backend=os.environ["BEAT_TEST_BACKEND"],
        record=(lambda: None) if registered else None,
    )
    return app


def start_beat(
    directory: Path, name: str, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``celery beat`` with its own schedule file; its process and log."""
    home = directory / name
    home.mkdir()
    (home / "beatmod.py").write_text(BEAT_MODULE)
    log = home / "beat.log"
    root = str(Path(__file__).resolve().parent.parent)
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "beatmod",
        "beat",
        "-S",
        "tests.test_beat:RecordingScheduler",
        "-s",
        str(home / "schedule"),
        "--pidfile",
        str(home / "beat.pid"),
        "-l",
        "INFO",
    ]
    full_env = {
        **os.environ,
        **env,
        "BEAT_TEST_NAME": name,
        "PYTHONPATH": os.pathsep.join([str(home), root]),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=home,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    """Poll until ``predicate()`` is truthy."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def record(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """The Redis database beats and the worker record into (flushed, as are broker/backend)."""
    redis_server.flush(BROKER_DB, BACKEND_DB, RECORD_DB)
    client = redis_server.client(RECORD_DB)
    yield client
    client.close()
    redis_server.flush(BROKER_DB, BACKEND_DB, RECORD_DB)


@pytest.mark.slow
@pytest.mark.parametrize("registered", [True, False], ids=["producer-lock", "send-task-guard"])
def test_two_beats_run_each_slot_once(
    redis_server: RedisServer, record: redis.Redis, tmp_path: Path, registered: bool
) -> None:
    """Two beats (own schedule files) fire the same entry every 2 s; one worker: every slot
    either beat fired runs exactly once.

    ``producer-lock``: the task class is registered in beat, so beat publishes
    through ``DedupTask.apply_async`` and the second beat's copy is never
    published. ``send-task-guard``: beat knows the task by name only, both
    copies are published, and the worker's guard skips the second.

    Why ``unique_for=1.5`` (``expiry``) and no time-bucket key: each slot is
    one identity because the lock outlives the gap between the two beats'
    copies of a slot (milliseconds, aligned schedule) and expires before the
    next slot (2 s). A time-bucket ``deduplication_key`` would be computed by
    the guard in the worker at start time, not at the firing, so a copy
    started late could land in the next bucket; the throttle needs no clock
    agreement between processes.
    """
    broker, backend = redis_server.url(BROKER_DB), redis_server.url(BACKEND_DB)
    env = {
        "BEAT_TEST_BROKER": broker,
        "BEAT_TEST_BACKEND": backend,
        "BEAT_TEST_RECORD": redis_server.url(RECORD_DB),
        "BEAT_TEST_REGISTER": "1" if registered else "",
    }
    app = Celery("beat-worker", set_as_current=False)

    def ran() -> None:
        record.rpush("ran", slot_now())

    configure(app, broker=broker, backend=backend, record=ran)
    beats: list[tuple[subprocess.Popen[bytes], Path]] = []

    def fired() -> list[list[str]]:
        return [_text(v).split(":") for v in record.lrange("fired", 0, -1)]

    try:
        with start_worker(
            app,
            pool="threads",
            concurrency=2,
            perform_ping_check=False,
            shutdown_timeout=30,
            loglevel="WARNING",
        ):
            beats = [start_beat(tmp_path, name, env) for name in ("beat-a", "beat-b")]
            wait_for(lambda: {n for n, _ in fired()} == {"beat-a", "beat-b"}, 25, "both beats")
            time.sleep(2 * INTERVAL)
            # Stop mid-slot, while both beats sleep, so no firing is cut in half.
            wait_for(lambda: 0.5 < time.time() % INTERVAL < 1.2, INTERVAL, "mid-slot")
            for proc, _ in beats:
                assert proc.poll() is None, "a beat exited early"
                stop(proc)
            with redis_server.client(BROKER_DB) as broker_client:
                wait_for(lambda: broker_client.llen(QUEUE) == 0, 10, "the queue to drain")
            time.sleep(0.5)
    finally:
        for proc, _ in beats:
            stop(proc)

    logs = "\n".join(log.read_text() for _, log in beats)
    assert "Traceback" not in logs and "SchedulingError" not in logs, logs[-3000:]
    by_beat: dict[str, set[int]] = {"beat-a": set(), "beat-b": set()}
    for name, slot in fired():
        by_beat[name].add(int(slot))
    both = by_beat["beat-a"] & by_beat["beat-b"]
    assert len(both) >= 2, by_beat
    executed = sorted(int(v) for v in record.lrange("ran", 0, -1))
    assert executed == sorted(by_beat["beat-a"] | by_beat["beat-b"]), (executed, by_beat)
