"""A real prefork worker subprocess: pool-child releases and hard time limits."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import states

from celery_dedup import inspect_lock
from celery_dedup.runtime import runtime_for
from tests.apps import prefork_app
from tests.fixtures._servers import stop
from tests.fixtures.redis import RedisServer

from .conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefork_worker(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """``celery worker -P prefork -c 1`` on the test Redis, as a subprocess."""
    redis_server.flush(12, 13)
    env = {
        **os.environ,
        "TEST_BROKER_URL": redis_server.url(12),
        "TEST_BACKEND_URL": redis_server.url(13),
        "PYTHONPATH": str(ROOT),
    }
    for name in ("TEST_BROKER_URL", "TEST_BACKEND_URL"):
        monkeypatch.setenv(name, env[name])
    prefork_app.app.conf.update(
        broker_url=env["TEST_BROKER_URL"], result_backend=env["TEST_BACKEND_URL"]
    )
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.apps.prefork_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "1",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "INFO",
            "-Q",
            "prefork",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield
    finally:
        stop(proc)
        log.close()
        runtime_for(prefork_app.app).metrics.flush()


def test_pool_child_releases_on_success(prefork_worker: None) -> None:
    """A forked pool child releases the lock over its own connection after success."""
    app = prefork_app.app
    result = prefork_app.quick.delay(21)
    assert prefork_app.quick.delay(21).deduplicated is True
    assert result.get(timeout=30) == 42
    wait_until(lambda: inspect_lock(result.deduplication_key, app=app) is None)


def test_a_cancel_signal_after_the_body_ended_is_ignored(
    prefork_worker: None, tmp_path: Path
) -> None:
    """SIGUSR1 (the cancel signal) landing after the body returned raises nowhere.

    Without the guard billiard's handler raised SoftTimeLimitExceeded in
    whatever the child did next (storing the result, a signal receiver, a
    store command half read: that connection then answered every later task
    with another command's reply). The result is stored, the same child runs
    the next task, and the worker says it ignored the signal.
    """
    first = prefork_app.cancelled_as_it_ends.delay(1)
    child = first.get(timeout=30)
    assert prefork_app.pid_of_child.delay(2).get(timeout=30) == child
    ignored = "cancel signal arrived after its body had ended"

    def log() -> str:
        return (tmp_path / "worker.log").read_text(errors="replace")

    wait_until(lambda: ignored in log() or "SoftTimeLimitExceeded" in log(), timeout=10)
    assert "SoftTimeLimitExceeded" not in log()
    assert ignored in log()
    assert prefork_app.app.AsyncResult(first.id).state == states.SUCCESS


def test_hard_time_limit_releases_finish_lock(prefork_worker: None) -> None:
    """A hard time limit kills the child; the main process releases the 'finish' lock first."""
    app = prefork_app.app
    result = prefork_app.overrun.delay(1)
    assert prefork_app.overrun.delay(1).deduplicated is True
    wait_until(lambda: app.AsyncResult(result.id).state == states.FAILURE, timeout=30)
    # released before the failure was stored, as after any other ending
    assert inspect_lock(result.deduplication_key, app=app) is None
    fresh = prefork_app.overrun.delay(1)
    assert fresh.deduplicated is False
    prefork_app.app.control.revoke(fresh.id)


def test_hard_time_limit_keeps_a_success_lock_only_for_its_cooldown(
    prefork_worker: None,
) -> None:
    """A killed run is a failure: its ``"success"`` lock is kept for ``retry_window`` (30 s),
    not the rest of its ``unique_for`` (600 s), set before the failure was stored."""
    app = prefork_app.app
    result = prefork_app.overrun_cooled.delay(1)
    wait_until(lambda: app.AsyncResult(result.id).state == states.FAILURE, timeout=30)
    lock = inspect_lock(result.deduplication_key, app=app)
    assert lock is not None and lock.task_id == result.id and lock.ttl <= 30
    assert prefork_app.overrun_cooled.delay(1).id == result.id  # within the cooldown


def test_a_call_override_without_super_releases_from_the_pool_child(
    prefork_worker: None,
) -> None:
    """Flask's base-task pattern in a prefork child: released before each result is stored."""
    app = prefork_app.app
    ok, failed = prefork_app.flask_style.delay(2), prefork_app.flask_style.delay(-1)
    assert prefork_app.flask_style.delay(2).deduplicated is True
    assert ok.get(timeout=30) == 6
    assert inspect_lock(ok.deduplication_key, app=app) is None
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    assert inspect_lock(failed.deduplication_key, app=app) is None
