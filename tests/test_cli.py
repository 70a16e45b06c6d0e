"""``celery dedup …`` through Celery's own root command, against a real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals, states
from celery.bin.celery import celery
from click.testing import CliRunner, Result

from celery_dedup import lock_released
from celery_dedup.runtime import runtime_for
from celery_dedup.worker import short
from tests.apps import cli_app
from tests.apps.cli_app import SLOW, SYNC, make_app
from tests.fixtures.redis import RedisServer

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]
BROKER_DB = 8


@pytest.fixture
def broker_url(redis_server: RedisServer) -> Iterator[str]:
    """A flushed Redis database for the CLI tests' broker."""
    client = redis_server.client(BROKER_DB)
    client.flushdb()
    yield redis_server.url(BROKER_DB)
    client.flushdb()
    client.close()


@pytest.fixture(params=[
    pytest.param("redis", id="redis"),
    pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The lock store: derived from the Redis result backend, or an SQLite file."""
    return "" if request.param == "redis" else f"db+sqlite:///{tmp_path / 'locks.db'}"


@pytest.fixture
def app(
    broker_url: str, redis_url: str, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Celery]:
    """The demo app on real Redis, installed as ``tests.apps.cli_app:app`` for ``-A``."""
    app = make_app(broker_url, redis_url, store_url)
    monkeypatch.setattr(cli_app, "app", app)
    yield app
    runtime_for(app).metrics.flush()
    app.close()


def dedup(*args: str, input: str | None = None) -> Result:
    """Run ``celery -A tests.apps.cli_app:app dedup ARGS`` in-process."""
    return CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", *args],
                              input=input)


def test_list_shows_live_locks(app: Celery) -> None:
    """``list`` shows each live lock's digest, task, holder, policy and seconds left."""
    first = app.tasks[SYNC].delay(1, "a")
    second = app.tasks[SYNC].delay(2, "b")
    slow = app.tasks[SLOW].delay(5, tag="x")
    result = dedup("list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["DIGEST", "TASK", "HOLDER", "POLICY", "SECONDS", "LEFT"]
    rows = {line.split()[2]: line.split() for line in lines[1:-1]}
    assert set(rows) == {first.id, second.id, slow.id}
    assert rows[first.id][:2] == [short(first.deduplication_key), SYNC]
    assert rows[first.id][3] == "success"
    assert 590 <= int(rows[first.id][4]) <= 600
    assert lines[-1] == "3 live locks."


def test_list_task_filter_and_json(app: Celery) -> None:
    """``list --task NAME --json`` returns only that task's locks, as JSON with full keys."""
    mine = app.tasks[SYNC].delay(1)
    app.tasks[SLOW].delay(5)
    result = dedup("list", "--task", SYNC, "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert row["key"] == mine.deduplication_key
    assert row["holder"] == mine.id and row["task"] == SYNC and row["policy"] == "success"
    assert 0 < row["seconds_left"] <= 600


def test_list_empty(app: Celery) -> None:
    """``list`` with no locks says so and succeeds."""
    result = dedup("list")
    assert result.exit_code == 0 and result.output.strip() == "No live locks."


def test_show_by_task_id_and_digest(app: Celery) -> None:
    """``show`` finds a lock by its holder's task id and by a digest prefix."""
    holder = app.tasks[SYNC].delay(7)
    by_id = dedup("show", holder.id, "--json")
    assert by_id.exit_code == 0, by_id.output
    data = json.loads(by_id.output)
    assert data["key"] == holder.deduplication_key and data["holder"] == holder.id
    assert data["holder_state"] == states.PENDING
    by_digest = dedup("show", short(holder.deduplication_key)[:10])
    assert by_digest.exit_code == 0, by_digest.output
    assert f"holder:       {holder.id}" in by_digest.output
    assert f"key:          {holder.deduplication_key}" in by_digest.output


def test_show_unknown(app: Celery) -> None:
    """``show`` of something no lock matches fails with a message."""
    result = dedup("show", "0123abcd")
    assert result.exit_code == 1
    assert "no live lock matches" in result.output


def test_release_queued_holder(app: Celery) -> None:
    """``release KEY`` frees a lock whose holder is not running, and sends lock_released."""
    holder = app.tasks[SYNC].delay(3)
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock_released.connect(receiver)
    try:
        result = dedup("release", holder.deduplication_key)
    finally:
        lock_released.disconnect(receiver)
    assert result.exit_code == 0, result.output
    assert f"released {short(holder.deduplication_key)}" in result.output
    assert runtime_for(app).store.get(holder.deduplication_key) is None  # type: ignore[union-attr]
    assert [(s["key"], s["task_id"], s["reason"]) for s in seen] == [
        (holder.deduplication_key, holder.id, "manual")
    ]
    assert app.tasks[SYNC].delay(3).id != holder.id  # the same call publishes again


def test_release_running_holder_needs_force(app: Celery) -> None:
    """A lock whose holder is STARTED is kept without --force, with the holder named."""
    holder = app.tasks[SLOW].delay(30, tag="running")
    app.backend.store_result(holder.id, {"pid": 1, "hostname": "w@h"}, states.STARTED)
    key = holder.deduplication_key
    refused = dedup("release", short(key))
    assert refused.exit_code == 1
    assert holder.id in refused.output and SLOW in refused.output
    assert "running (STARTED)" in refused.output and "--force" in refused.output
    assert runtime_for(app).store.get(key) is not None  # type: ignore[union-attr]
    forced = dedup("release", short(key), "--force")
    assert forced.exit_code == 0, forced.output
    assert runtime_for(app).store.get(key) is None  # type: ignore[union-attr]


def test_purge_one_task_confirms(app: Celery) -> None:
    """``purge --task`` asks first, then releases only that task's locks."""
    syncs = [app.tasks[SYNC].delay(i) for i in range(3)]
    other = app.tasks[SLOW].delay(5)
    store = runtime_for(app).store
    assert store is not None
    declined = dedup("purge", "--task", SYNC, input="n\n")
    assert declined.exit_code == 1 and "3 locks of demo.sync" in declined.output
    assert all(store.get(r.deduplication_key) for r in syncs)
    accepted = dedup("purge", "--task", SYNC, input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert "released 3 of 3 locks of demo.sync" in accepted.output
    assert not any(store.get(r.deduplication_key) for r in syncs)
    assert store.get(other.deduplication_key) is not None


def test_purge_expired_force(app: Celery) -> None:
    """``purge --expired --force`` releases only locks whose holder already finished."""
    finished = app.tasks[SYNC].delay(1)
    pending = app.tasks[SYNC].delay(2)
    app.backend.mark_as_done(finished.id, 1)
    result = dedup("purge", "--expired", "--force")
    assert result.exit_code == 0, result.output
    assert "released 1 of 1 lock." in result.output
    store = runtime_for(app).store
    assert store is not None
    assert store.get(finished.deduplication_key) is None
    assert store.get(pending.deduplication_key) is not None


def test_stats_counts_and_live_locks(app: Celery) -> None:
    """``stats --json`` flushes this process's counts and shows them with live locks."""
    holder = app.tasks[SYNC].delay(9)
    for _ in range(4):
        assert app.tasks[SYNC].delay(9).id == holder.id
    result = dedup("stats", "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)[SYNC]
    assert row["acquired"] == 1 and row["deduplicated"] == 4
    assert row["released"] == 0 and row["fallback"] == 0
    assert row["live_locks"] == 1
    table = dedup("stats")
    assert table.output.splitlines()[0].split()[:3] == ["TASK", "ACQUIRED", "DEDUPLICATED"]
    assert table.output.splitlines()[1].split() == [SYNC, "1", "4", "0", "0", "0", "1"]


def test_commands_import_default_modules(app: Celery) -> None:
    """Every command runs the loader's import_default_modules (django.setup() under Django)."""
    fired: list[Any] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        fired.append(sender)

    signals.import_modules.connect(receiver)
    try:
        result = dedup("list")
    finally:
        signals.import_modules.disconnect(receiver)
    assert result.exit_code == 0
    assert app in fired


def test_no_store_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An app from which no store can be derived gets a clear error, exit code 1."""
    app = make_app("memory://", "rpc://")
    monkeypatch.setattr(cli_app, "app", app)
    result = dedup("list")
    assert result.exit_code == 1
    assert "no celery-dedup lock store" in result.output
    app.close()


def test_real_celery_subprocess_lists_locks(
    app: Celery, broker_url: str, redis_url: str, store_url: str
) -> None:
    """A real ``celery -A … dedup list`` and ``stats`` process sees this process's locks."""
    holder = app.tasks[SYNC].delay(42)
    assert app.tasks[SYNC].delay(42).id == holder.id
    runtime_for(app).metrics.flush()
    env = {
        **os.environ,
        "DEDUP_TEST_BROKER": broker_url,
        "DEDUP_TEST_BACKEND": redis_url,
        "DEDUP_TEST_STORE": store_url,
        "PYTHONPATH": str(ROOT),
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "dedup", *args],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )

    listed = run("list")
    assert listed.returncode == 0, listed.stderr
    assert holder.id in listed.stdout and short(holder.deduplication_key) in listed.stdout
    stats = run("stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)[SYNC]["deduplicated"] == 1


def test_reap_releases_locks_of_finished_holders(app: Celery) -> None:
    """``reap`` frees a lock whose holder's result says SUCCESS, and keeps a pending one."""
    finished = app.tasks[SYNC].delay(11)
    pending = app.tasks[SYNC].delay(12)
    # The worker died after recording success, before releasing: only the backend knows.
    app.backend.mark_as_done(finished.id, None)
    result = dedup("reap")
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "1 lock reaped."
    assert short(finished.deduplication_key) in result.output
    store = runtime_for(app).store
    assert store is not None
    assert store.get(finished.deduplication_key) is None
    lock = store.get(pending.deduplication_key)
    assert lock is not None and lock.task_id == pending.id
