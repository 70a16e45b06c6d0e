"""Issue 10 with a real prefork worker subprocess: restart, terminate, time limits, Reject, replace.

The worker runs ``celery -A tests.core.test_ownership_prefork worker -P
prefork -c 1``: the tasks below are defined at module level so the worker
and the test see the same names. Task bodies record every execution in a
Redis list (``OWN_RUNS_URL``); the tests assert the exact count, then the
lock state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, states
from celery.exceptions import Reject

import celery_dedup
from celery_dedup import DedupTask, RevokeOutcome, inspect_lock
from celery_dedup.runtime import runtime_for
from tests.fixtures._servers import stop
from tests.fixtures.redis import RedisServer

from .conftest import wait_until
from .test_ownership import state_of, texts

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "own-prefork"
BROKER_DB, BACKEND_DB, RUNS_DB = 23, 24, 25
RUNS_KEY = "runs"

app = Celery("own_prefork", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("OWN_BROKER_URL", "memory://"),
    result_backend=os.environ.get("OWN_BACKEND_URL"),
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    result_expires=None,
    dedup_metrics_flush_interval=3600,
)

_client: list[redis.Redis] = []


def record(label: str) -> int:
    """Append one execution to the shared log; return how many ``label`` runs there are."""
    if not _client:
        _client.append(redis.Redis.from_url(os.environ["OWN_RUNS_URL"]))
    client = _client[0]
    client.rpush(RUNS_KEY, label)
    return texts(client.lrange(RUNS_KEY, 0, -1)).count(label)


@app.task(base=DedupTask, unique_for=60, unique_until="finish")
def slow(x: int) -> int:
    """Sleeps 30 s the first time: terminated by a revoke."""
    if record("slow") == 1:
        time.sleep(30)
    return x


@app.task(base=DedupTask, unique_for=60, unique_until="finish", deterministic_id=True)
def det_slow(x: int) -> int:
    """As ``slow``, under a deterministic id."""
    if record("det_slow") == 1:
        time.sleep(30)
    return x


@app.task(base=DedupTask, unique_for=60, unique_until="finish", time_limit=2)
def overrun(x: int) -> int:
    """Sleeps past its hard time limit the first time: the pool child is killed."""
    if record("overrun") == 1:
        time.sleep(10)
    return x


# Its lock deliberately ends before its time limit (the settings lint's W101).
@app.task(base=DedupTask, unique_for=1, unique_until="finish", deterministic_id=True,
          time_limit=3, dedup_silenced=("W101",))
def det_overrun(x: int) -> int:
    """Killed by its hard time limit the first time, long after its 1 s lock expired."""
    if record("det_overrun") == 1:
        time.sleep(10)
    return x


@app.task(base=DedupTask, unique_for=60, unique_until="finish", soft_time_limit=1)
def soft(x: int) -> int:
    """Overruns its soft time limit the first time: ``SoftTimeLimitExceeded`` ends the body."""
    if record("soft") == 1:
        time.sleep(5)
    return x


@app.task(base=DedupTask, unique_for=60)
def queued(x: int) -> int:
    """Just records."""
    record("queued")
    return x


def _rejecting(until: str) -> Any:
    @app.task(
        base=DedupTask,
        name=f"own.reject_{until}",
        acks_late=True,
        unique_for=60,
        unique_until=until,
    )
    def reject(requeue: bool) -> int:
        n = record(f"reject_{until}")
        if n == 1 or not requeue:
            raise Reject("rejected by the test", requeue=requeue)
        time.sleep(1.5)
        return n

    return reject


reject_finish = _rejecting("finish")
reject_success = _rejecting("success")


@app.task
def plain_target(tag: str) -> str:
    """A plain (non-dedup) replacement."""
    record("plain_target")
    return tag


@app.task(base=DedupTask, unique_for=60)
def dedup_target(tag: str) -> str:
    """A ``DedupTask`` replacement: runs 1.5 s, so the test can look at the lock meanwhile."""
    record("dedup_target")
    time.sleep(1.5)
    return tag


@app.task(base=DedupTask, bind=True, unique_for=60, unique_until="finish")
def replacer(self: Any, target: str) -> Any:
    """Replaces itself with ``plain_target`` or ``dedup_target``."""
    record("replacer")
    replacement = plain_target.s(target) if target == "plain" else dedup_target.s(target)
    raise self.replace(replacement)


@app.task(
    base=DedupTask,
    unique_for=60,
    on_duplicate="replace",
    deterministic_id=True,
    unique_on=("doc",),
)
def debounce(doc: int, version: str) -> str:
    """Debounced per ``doc`` under a deterministic id."""
    record(f"debounce:{version}")
    return version


class Worker:
    """A ``celery worker -P prefork`` subprocess that can be stopped and started again."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        app_module: str = __name__,
        queue: str = QUEUE,
        concurrency: int = 1,
        pool: str = "prefork",
    ) -> None:
        self.env = env
        self.log = log
        self.app_module = app_module
        self.queue = queue
        self.concurrency = concurrency
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        #: where the current process's lines start in the log
        self.offset = 0

    def start(self, wait: bool = True) -> None:
        """Start a new worker process (and wait until it consumes)."""
        self.offset = offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    self.app_module,
                    "worker",
                    "-P",
                    self.pool,
                    "-c",
                    str(self.concurrency),
                    "-Q",
                    self.queue,
                    "-l",
                    "INFO",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                ],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if wait:
            wait_until(lambda: b" ready." in self.log.read_bytes()[offset:], timeout=45)

    def stop(self) -> None:
        """Warm shutdown (SIGTERM to the main process): unacked messages go back to the queue."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            # A loaded machine can take long to tear a pool down; past the
            # wait, stop() kills it (nothing a test asserts depends on it).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(45)
            stop(self.proc)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool): nothing is acked or restored."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def text(self) -> str:
        """What the current worker process logged so far."""
        return self.log.read_bytes()[self.offset :].decode(errors="replace")


@pytest.fixture
def worker(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Worker]:
    """A prefork worker on the test Redis (started by the test), stopped at teardown."""
    redis_server.flush(BROKER_DB, BACKEND_DB, RUNS_DB)
    env = {
        **os.environ,
        "OWN_BROKER_URL": redis_server.url(BROKER_DB),
        "OWN_BACKEND_URL": redis_server.url(BACKEND_DB),
        "OWN_RUNS_URL": redis_server.url(RUNS_DB),
        "PYTHONPATH": str(ROOT),
    }
    monkeypatch.setenv("OWN_RUNS_URL", env["OWN_RUNS_URL"])
    app.conf.update(broker_url=env["OWN_BROKER_URL"], result_backend=env["OWN_BACKEND_URL"])
    proc = Worker(env, tmp_path / "worker.log")
    try:
        yield proc
    finally:
        proc.stop()
        runtime_for(app).metrics.flush()


def runs(redis_server: RedisServer) -> list[str]:
    """Every execution recorded so far, in order."""
    with redis_server.client(RUNS_DB) as client:
        return texts(client.lrange(RUNS_KEY, 0, -1))


def lock_of(result: Any) -> celery_dedup.Lock | None:
    """The live lock at the key of a call."""
    return inspect_lock(result.deduplication_key, app=app)


# -- item 1(a) / Deliver 1: deterministic ids and replace ----------------------------


def test_five_deterministic_replaces_run_once(worker: Worker, redis_server: RedisServer) -> None:
    """5 replacing calls sharing a deterministic id: only the last runs, once."""
    results = [debounce.delay(1, f"v{i}") for i in range(1, 6)]
    assert {result.id for result in results} == {results[0].id}
    assert all(result.deduplicated is False for result in results)
    worker.start()
    wait_until(lambda: runs(redis_server) == ["debounce:v5"], timeout=15)
    wait_until(lambda: lock_of(results[-1]) is None)
    time.sleep(0.5)
    assert runs(redis_server) == ["debounce:v5"]
    # Four visible skips: each older message (they share one id, so the run
    # records may first defer one as a copy of the running v5) ends skipped.
    def skips() -> int:
        text = worker.text()
        return sum(text.count(f"{reason})") for reason in ("revoked", "replaced", "already ran"))

    wait_until(lambda: skips() >= 4, timeout=30)
    assert skips() == 4, worker.text()
    assert runs(redis_server) == ["debounce:v5"]


def test_deterministic_replace_result_is_the_last_runs(
    worker: Worker, redis_server: RedisServer
) -> None:
    """``get()`` on the last replacing call returns its value (not a skipped copy's REVOKED)."""
    results = [debounce.delay(2, f"v{i}") for i in range(1, 6)]
    worker.start(wait=False)  # the caller is already waiting when the copies are skipped
    assert results[-1].get(timeout=15) == "v5"
    assert runs(redis_server) == ["debounce:v5"]


# -- item 1(b) in the main process: a hard time limit of an old run -------------------


def test_hard_time_limit_of_an_old_run_keeps_the_new_runs_lock(
    worker: Worker, redis_server: RedisServer
) -> None:
    """Run A (deterministic id, TTL 1 s) is killed at 3 s; run B (same id) was received meanwhile.

    The main process must release A's token, not B's: B's lock survives
    and a third call stays a duplicate.
    """
    worker.start()
    first = det_overrun.delay(1)
    wait_until(lambda: runs(redis_server) == ["det_overrun"])
    wait_until(lambda: lock_of(first) is None, timeout=5)  # A's 1 s TTL ran out
    second = det_overrun.apply_async((1,), countdown=5)
    assert second.deduplicated is False and second.id == first.id
    taken = lock_of(second)
    assert taken is not None
    wait_until(lambda: "TimeLimitExceeded" in worker.text(), timeout=10)
    time.sleep(0.5)
    held = lock_of(second)
    assert held is not None and held.owner == taken.owner, "A's time limit freed B's lock"
    third = det_overrun.delay(1)
    assert third.deduplicated is True
    wait_until(lambda: len(runs(redis_server)) >= 2, timeout=10)
    time.sleep(1)
    assert runs(redis_server) == ["det_overrun", "det_overrun"]


# -- item 4: hard time limit and terminate, including worker-taken (guard) locks ------


@pytest.mark.parametrize("path", ["delay", "send_task"])
def test_hard_time_limit_releases(worker: Worker, redis_server: RedisServer, path: str) -> None:
    """A killed pool child's 'finish' lock is released from the main process."""
    worker.start()
    if path == "delay":
        result = overrun.delay(1)
        key = result.deduplication_key
    else:
        result = app.send_task(overrun.name, (1,))
        wait_until(lambda: runs(redis_server) == ["overrun"])
        key = overrun.delay(1).deduplication_key  # a duplicate now; tells the key
    wait_until(lambda: state_of(app, result.id) == states.FAILURE, timeout=15)
    wait_until(lambda: inspect_lock(key, app=app) is None, timeout=5)
    fresh = overrun.delay(1)
    assert fresh.deduplicated is False
    assert fresh.get(timeout=10) == 1
    assert runs(redis_server) == ["overrun", "overrun"]


def test_soft_time_limit_releases_finish_lock(worker: Worker, redis_server: RedisServer) -> None:
    """``SoftTimeLimitExceeded`` is a final failure: the 'finish' lock is released."""
    worker.start()
    result = soft.delay(1)
    wait_until(lambda: state_of(app, result.id) == states.FAILURE, timeout=10)
    assert lock_of(result) is None
    fresh = soft.delay(1)
    assert fresh.deduplicated is False and fresh.get(timeout=10) == 1
    assert runs(redis_server) == ["soft", "soft"]


def test_pool_child_result_is_stored_after_the_release(
    worker: Worker, redis_server: RedisServer
) -> None:
    """In a pool child too: once ``get()`` returns, the identical call is accepted (x 30)."""
    worker.start()
    suppressed = 0
    for _ in range(30):
        result = queued.delay(3)
        suppressed += bool(result.deduplicated)
        assert result.get(timeout=10) == 3
    assert suppressed == 0
    assert len(runs(redis_server)) == 30


@pytest.mark.parametrize("path", ["delay", "send_task", "deterministic"])
def test_revoke_terminate_releases(worker: Worker, redis_server: RedisServer, path: str) -> None:
    """``revoke(terminate=True)`` on a running task: RUNNING, terminated, lock released.

    Then the same call runs again (for a deterministic id: not discarded;
    its handle may report the terminated run's REVOKED until it ends, as
    any reused Celery id does, so the count and final state are checked).
    """
    worker.start()
    task = det_slow if path == "deterministic" else slow
    result = app.send_task(task.name, (1,)) if path == "send_task" else task.delay(1)
    wait_until(lambda: runs(redis_server) == [task.name.rsplit(".", 1)[-1]])
    key = task.delay(1).deduplication_key  # a duplicate while it runs
    assert celery_dedup.revoke(result.id, key=key, terminate=True, app=app) is (
        RevokeOutcome.RUNNING
    )
    wait_until(lambda: state_of(app, result.id) == states.REVOKED, timeout=10)
    wait_until(lambda: inspect_lock(key, app=app) is None, timeout=5)
    fresh = task.delay(1)
    assert fresh.deduplicated is False
    wait_until(lambda: len(runs(redis_server)) == 2, timeout=10)
    wait_until(lambda: state_of(app, fresh.id) == states.SUCCESS, timeout=10)
    wait_until(lambda: inspect_lock(key, app=app) is None, timeout=5)
    assert len(runs(redis_server)) == 2


# -- item 5: revoke, then a new worker process ---------------------------------------


def test_revoked_message_never_runs_after_a_worker_restart(
    worker: Worker, redis_server: RedisServer
) -> None:
    """The worker reserved the (ETA) message and learnt the revoke; a new worker gets it back."""
    worker.start()
    result = queued.apply_async((1,), countdown=4)
    wait_until(lambda: f"[{result.id}] received" in worker.text())
    assert celery_dedup.revoke(result) is RevokeOutcome.RELEASED
    worker.stop()  # the revoke lived in that process's memory only
    worker.start()
    wait_until(lambda: "revoked)" in worker.text(), timeout=15)  # the start check refused it
    wait_until(lambda: state_of(app, result.id) == states.REVOKED)  # stored after the log line
    assert runs(redis_server) == []
    assert lock_of(result) is None
    fresh = queued.delay(1)
    assert fresh.deduplicated is False and fresh.get(timeout=10) == 1
    assert runs(redis_server) == ["queued"]


# -- item 4: Reject --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "released"),
    [(reject_finish, True), (reject_success, False)],
    ids=["finish", "success"],
)
def test_reject_without_requeue_is_a_failure(
    worker: Worker, redis_server: RedisServer, task: Any, released: bool
) -> None:
    """``Reject(requeue=False)`` releases like a final failure: 'finish' frees, 'success' keeps."""
    worker.start()
    result = task.delay(False)
    wait_until(lambda: len(runs(redis_server)) == 1)
    if released:
        wait_until(lambda: lock_of(result) is None, timeout=5)
        assert task.delay(False).deduplicated is False
        wait_until(lambda: len(runs(redis_server)) == 2)
    else:
        time.sleep(1)
        lock = lock_of(result)
        assert lock is not None and lock.task_id == result.id
        assert task.delay(False).deduplicated is True
        assert len(runs(redis_server)) == 1


def test_reject_with_requeue_keeps_the_lock(worker: Worker, redis_server: RedisServer) -> None:
    """``Reject(requeue=True)``: the same lock (same acquisition) covers the redelivery."""
    result = reject_finish.delay(True)
    taken = lock_of(result)
    assert taken is not None
    worker.start()
    wait_until(lambda: len(runs(redis_server)) == 2, timeout=10)  # rejected, then redelivered
    held = lock_of(result)
    assert held is not None and held.acquired_at == taken.acquired_at, "released at the Reject"
    assert reject_finish.delay(True).deduplicated is True
    assert result.get(timeout=10) == 2
    wait_until(lambda: lock_of(result) is None)
    assert len(runs(redis_server)) == 2


# -- item 4: self.replace() --------------------------------------------------------------


def test_replace_with_a_plain_task_releases(worker: Worker, redis_server: RedisServer) -> None:
    """``self.replace(plain_task.s())``: the replacement runs once; the lock is released."""
    worker.start()
    result = replacer.delay("plain")
    assert result.get(timeout=10) == "plain"
    wait_until(lambda: lock_of(result) is None, timeout=5)
    assert runs(redis_server) == ["replacer", "plain_target"]
    assert replacer.delay("plain").deduplicated is False


def test_replace_with_a_dedup_task_hands_the_lock_over(
    worker: Worker, redis_server: RedisServer
) -> None:
    """``self.replace(dedup_task.s())``: the lock covers the replacement, then is released."""
    worker.start()
    result = replacer.delay("dedup")
    wait_until(lambda: "dedup_target" in runs(redis_server), timeout=10)
    lock = lock_of(result)
    assert lock is not None and lock.task_id == result.id
    duplicate = replacer.delay("dedup")
    assert duplicate.deduplicated is True and duplicate.id == result.id
    assert result.get(timeout=10) == "dedup"
    wait_until(lambda: lock_of(result) is None, timeout=5)
    assert runs(redis_server) == ["replacer", "dedup_target"]
