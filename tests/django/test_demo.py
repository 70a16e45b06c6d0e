"""``manage.py demo`` (README's first command) against a real worker subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = {
    #                     published, suppressed, dup_error, no_key, run, released
    "send_digest": (2, 2, 0, 0, 2, 0),
    "sync_address": (3, 1, 0, 0, 3, 3),
    "process_payment": (1, 0, 2, 0, 1, 0),
    "fulfill_order": (1, 1, 0, 1, 1, 0),
    "probe_server": (1, 1, 0, 0, 0, 1),
    "notify": (3, 1, 0, 0, 3, 0),
    "purge_expired_locks": (1, 1, 0, 0, 1, 1),
    "total": (12, 7, 2, 1, 11, 5),
}


def run_demo(var_dir: Path, **env: str) -> tuple[dict[str, tuple[int, ...]], str, float]:
    """Run the demo as a user would; return its table, its output and its duration."""
    skip = ("DJANGO_SETTINGS_MODULE", "REDIS_URL")
    environ = {k: v for k, v in os.environ.items() if k not in skip}
    environ.update(EXAMPLE_VAR_DIR=str(var_dir), **env)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "example_project/manage.py", "demo"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120, check=False,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    table = {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if len(cells) == 7 and cells[0] in EXPECTED and all(c.isdigit() for c in cells[1:]):
            table[cells[0]] = tuple(int(c) for c in cells[1:])
    return table, done.stdout, elapsed


@pytest.mark.slow
def test_demo_on_the_zero_server_default(tmp_path: Path) -> None:
    """On the embedded default the demo prints the expected table in under a minute."""
    table, out, elapsed = run_demo(tmp_path)
    assert table == EXPECTED, out
    assert "broker filesystem://" in out
    assert "locks in the project's database (django-db store" in out
    # One paragraph per scenario, saying what was called and what celery-dedup did.
    words = " ".join(out.split())
    for told in ("send_digest: user 1 asks", "raises DuplicateTaskError",
                 "raises MissingDeduplicationKey", "RELEASED: it had not started",
                 "released the lock before it stored SUCCESS",
                 "pay-1001 submitted again after the worker charged 19.99 EUR",
                 "Refused again with DuplicateTaskError: the charge ran once",
                 "the second welcome is suppressed"):
        assert told in words
    assert "dup_error: duplicates refused with DuplicateTaskError" in out  # columns explained
    assert elapsed < 60
    assert (tmp_path / "db.sqlite3").exists() and (tmp_path / "broker" / "queue").is_dir()


@pytest.mark.slow
@pytest.mark.redis
def test_demo_on_redis(tmp_path: Path, redis_url: str) -> None:
    """With REDIS_URL set, the demo runs on Redis (broker, results, locks): the same table."""
    table, out, _elapsed = run_demo(tmp_path, REDIS_URL=redis_url)
    assert table == EXPECTED, out
    assert "broker redis://" in out and "locks in the redis store at redis://" in out


@pytest.mark.slow
def test_demo_never_touches_a_running_worker(tmp_path: Path) -> None:
    """With a worker already answering on the broker, the demo stops before clearing anything."""
    environ = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE",
                                                                 "REDIS_URL")}
    environ.update(EXAMPLE_VAR_DIR=str(tmp_path), PYTHONPATH=str(ROOT / "example_project"))
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "example_project", "worker", "--pool", "solo",
         "--hostname", "mine@%h", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "--loglevel", "WARNING"],
        cwd=ROOT / "example_project", env=environ, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        out = ""
        for _ in range(30):  # until the hand-started worker answers pings
            done = subprocess.run(
                [sys.executable, "example_project/manage.py", "demo"], cwd=ROOT, env=environ,
                capture_output=True, text=True, timeout=120, check=False,
            )
            out = done.stdout + done.stderr
            if "already running" in out:
                break
            time.sleep(0.5)
        assert "a worker is already running on this broker (mine@" in out, out
        assert done.returncode != 0
        assert (tmp_path / "broker" / "control").is_dir()  # its control folder is intact
    finally:
        worker.terminate()
        worker.wait(30)
