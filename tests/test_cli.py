"""``celery dedup …`` through Celery's own root command, against a real Redis."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals, states
from celery.bin.celery import celery
from celery.contrib.testing.worker import start_worker
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


def started(app: Celery, result: Any) -> None:
    """Mark ``result``'s lock started, as the worker's claim does (the run then died)."""
    store = runtime_for(app).store
    assert store is not None
    lock = store.get(result.deduplication_key)
    assert lock is not None
    store.claim(lock.key, lock.owner, release=False, ttl=None, meta={})


def dedup(*args: str, input: str | None = None) -> Result:
    """Run ``celery -A tests.apps.cli_app:app dedup ARGS`` in-process."""
    return CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", *args],
                              input=input)


def test_list_shows_live_locks(app: Celery) -> None:
    """``list`` shows each live lock's digest, task, holder, policy, start and time left."""
    first = app.tasks[SYNC].delay(1, "a")
    second = app.tasks[SYNC].delay(2, "b")
    slow = app.tasks[SLOW].delay(5, tag="x")
    result = dedup("list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["DIGEST", "TASK", "HOLDER", "POLICY", "STATE", "EXPIRES", "IN"]
    rows = {line.split()[2]: line.split() for line in lines[1:-1]}
    assert set(rows) == {first.id, second.id, slow.id}
    assert rows[first.id][:2] == [short(first.deduplication_key), SYNC]
    assert rows[first.id][3:5] == ["success", "queued"]
    assert rows[first.id][5:] in (["9m", "59s"], ["10m", "0s"])
    assert lines[-1] == "3 live locks."


def test_list_task_filter_and_json(app: Celery) -> None:
    """``list --task NAME --json`` returns only that task's locks, with full keys and ISO times."""
    mine = app.tasks[SYNC].delay(1)
    app.tasks[SLOW].delay(5)
    result = dedup("list", "--task", SYNC, "--json")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert row["key"] == mine.deduplication_key
    assert row["holder"] == mine.id and row["task"] == SYNC and row["policy"] == "success"
    assert row["started"] is False and 0 < row["seconds_left"] <= 600
    assert row["phase"] == "not started" and row["holder_state"] == "PENDING"
    assert row["expires"].endswith("+00:00") and row["expires_at"] > row["acquired_at"]


def test_list_empty(app: Celery) -> None:
    """``list`` with no locks says so and succeeds."""
    result = dedup("list")
    assert result.exit_code == 0 and result.output.strip() == "No live locks."


def test_list_on_a_memory_store_says_it_sees_this_process_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On ``memory://`` the list says that it only holds this process's locks."""
    app = make_app("memory://", None, "memory://cli-note")
    monkeypatch.setattr(cli_app, "app", app)
    app.tasks[SYNC].delay(1)
    result = dedup("list")
    assert result.exit_code == 0, result.output
    assert "only the locks of this very process" in result.output
    app.close()


def test_show_by_task_id_prefix_and_digest(app: Celery) -> None:
    """``show`` finds a lock by its holder's task id (or a prefix of it) and by a digest prefix."""
    holder = app.tasks[SYNC].delay(7)
    by_id = dedup("show", holder.id, "--json")
    assert by_id.exit_code == 0, by_id.output
    data = json.loads(by_id.output)
    assert data["key"] == holder.deduplication_key and data["holder"] == holder.id
    assert data["holder_state"] == states.PENDING and data["phase"] == "not started"
    assert data["needed"] is True
    by_prefix = dedup("show", holder.id[:13], "--json")
    assert json.loads(by_prefix.output)["key"] == holder.deduplication_key
    by_digest = dedup("show", short(holder.deduplication_key)[:10])
    assert by_digest.exit_code == 0, by_digest.output
    assert f"holder:       {holder.id}" in by_digest.output
    assert f"key:          {holder.deduplication_key}" in by_digest.output
    assert "holder state: PENDING (not started)" in by_digest.output
    assert re.search(r"^expires: +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(in (9m 5\ds|10m 0s)\)$",
                     by_digest.output, re.M), by_digest.output


def test_show_unknown(app: Celery) -> None:
    """``show`` of something no lock matches fails with a message."""
    result = dedup("show", "0123abcd")
    assert result.exit_code == 1
    assert "no live lock matches" in result.output


def _released(app: Celery, *args: str) -> tuple[Result, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock_released.connect(receiver)
    try:
        return dedup(*args), seen
    finally:
        lock_released.disconnect(receiver)


def test_release_queued_holder_needs_force(app: Celery) -> None:
    """A lock whose holder has not started is refused with the reason; --force releases it."""
    holder = app.tasks[SYNC].delay(3)
    key = holder.deduplication_key
    refused, seen = _released(app, "release", key)
    assert refused.exit_code == 1 and seen == []
    assert "still needed: its holder has not started (PENDING" in refused.output
    assert "--force" in refused.output
    assert runtime_for(app).store.get(key) is not None  # type: ignore[union-attr]
    dry = dedup("release", key, "--force", "--dry-run")
    assert "(dry run) would release" in dry.output
    assert runtime_for(app).store.get(key) is not None  # type: ignore[union-attr]
    forced, seen = _released(app, "release", key, "--force")
    assert forced.exit_code == 0, forced.output
    assert f"released {short(key)}" in forced.output
    assert runtime_for(app).store.get(key) is None  # type: ignore[union-attr]
    assert [(s["key"], s["task_id"], s["reason"]) for s in seen] == [(key, holder.id, "manual")]
    assert app.tasks[SYNC].delay(3).id != holder.id  # the same call publishes again


def test_release_running_holder_needs_force(app: Celery) -> None:
    """A lock whose holder is STARTED is kept without --force, with the holder named."""
    holder = app.tasks[SLOW].delay(30, tag="running")
    app.backend.store_result(holder.id, {"pid": 1, "hostname": "w@h"}, states.STARTED)
    key = holder.deduplication_key
    refused = dedup("release", short(key))
    assert refused.exit_code == 1
    assert holder.id in refused.output and SLOW in refused.output
    assert "its holder is running (STARTED)" in refused.output and "--force" in refused.output
    assert runtime_for(app).store.get(key) is not None  # type: ignore[union-attr]
    forced = dedup("release", short(key), "--force")
    assert forced.exit_code == 0, forced.output
    assert runtime_for(app).store.get(key) is None  # type: ignore[union-attr]


def test_release_refuses_a_finished_idempotency_window(app: Celery) -> None:
    """An ``expiry`` lock whose holder succeeded is still needed: released only with --force."""
    charge = app.tasks[SYNC].apply_async((99,), unique_until="expiry", unique_for=86400)
    app.backend.mark_as_done(charge.id, 99)
    refused = dedup("release", charge.deduplication_key)
    assert refused.exit_code == 1
    assert "its holder ended SUCCESS, and unique_until='expiry' keeps the lock" in refused.output
    assert "throttle or idempotency window" in refused.output
    assert app.tasks[SYNC].apply_async((99,), unique_until="expiry").deduplicated is True


def test_list_shows_a_kept_lock_whose_run_ended_as_finished(app: Celery) -> None:
    """A 24 h ``expiry`` lock whose charge ran on a real worker: ``finished:SUCCESS``, not queued.

    The worker clears the lock's start flag when the run ends, so the flag
    alone would call it "not started".
    """
    charge = app.tasks[SYNC].apply_async((99,), unique_until="expiry", unique_for=86400)
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                      shutdown_timeout=30, loglevel="WARNING"):
        assert charge.get(timeout=30) == 99
    store = runtime_for(app).store
    assert store is not None
    lock = store.get(charge.deduplication_key)
    assert lock is not None and lock.started is False  # settled at the end of the run
    result = dedup("list")
    assert result.exit_code == 0, result.output
    (row,) = [line.split() for line in result.output.splitlines() if charge.id in line]
    assert row[3:5] == ["expiry", "finished:SUCCESS"]
    (data,) = json.loads(dedup("list", "--json").output)
    assert data["phase"] == "finished" and data["holder_state"] == "SUCCESS"
    assert data["needed"] is True


def test_release_a_lock_nobody_needs(app: Celery) -> None:
    """A ``success`` lock whose holder's SUCCESS is stored (a lost release) goes without --force."""
    finished = app.tasks[SYNC].delay(4)
    started(app, finished)
    app.backend.mark_as_done(finished.id, 4)
    result = dedup("release", finished.deduplication_key)
    assert result.exit_code == 0, result.output
    assert "(finished)" in result.output
    assert runtime_for(app).store.get(finished.deduplication_key) is None  # type: ignore[union-attr]


def _three_locks(app: Celery) -> tuple[Any, Any, Any]:
    """A stale ``success`` lock, a pending holder's, and a finished ``expiry`` window."""
    stale = app.tasks[SYNC].delay(1)
    pending = app.tasks[SYNC].delay(2)
    window = app.tasks[SYNC].apply_async((3,), unique_until="expiry")
    started(app, stale)
    app.backend.mark_as_done(stale.id, 1)
    app.backend.mark_as_done(window.id, 3)
    return stale, pending, window


@pytest.mark.parametrize("flags", [(), ("--expired",)], ids=["purge", "purge-expired"])
def test_purge_releases_only_locks_nobody_needs(app: Celery, flags: tuple[str, ...]) -> None:
    """``purge`` (and the deprecated ``--expired``) keeps pending holders and expiry windows."""
    stale, pending, window = _three_locks(app)
    store = runtime_for(app).store
    assert store is not None
    dry = dedup("purge", "--dry-run", *flags)
    assert dry.exit_code == 0, dry.output
    assert "(dry run) 1 lock would be released." in dry.output
    assert store.get(stale.deduplication_key) is not None
    result = dedup("purge", *flags)
    assert result.exit_code == 0, result.output
    assert "Keeping 2 locks still needed" in result.output
    assert "unique_until='expiry' keeps the lock" in result.output
    assert "has not started" in result.output
    assert "released 1 of 1 lock." in result.output
    assert store.get(stale.deduplication_key) is None
    assert store.get(pending.deduplication_key) is not None
    assert store.get(window.deduplication_key) is not None
    if flags:
        assert "--expired is deprecated" in result.output


def test_purge_force_asks_then_releases_everything(app: Celery) -> None:
    """``purge --force`` asks before releasing needed locks; ``--yes`` skips the question."""
    _stale, pending, window = _three_locks(app)
    other = app.tasks[SLOW].delay(5)
    store = runtime_for(app).store
    assert store is not None
    declined = dedup("purge", "--task", SYNC, "--force", input="n\n")
    assert declined.exit_code == 1 and "2 locks of demo.sync still needed" in declined.output
    assert store.get(pending.deduplication_key) is not None
    accepted = dedup("purge", "--task", SYNC, "--force", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert "released 3 of 3 locks of demo.sync" in accepted.output
    assert store.get(window.deduplication_key) is None
    assert store.get(other.deduplication_key) is not None
    assert "released 1 of 1 lock." in dedup("purge", "--force", "--yes").output
    assert dedup("list").output.strip() == "No live locks."


def test_stats_counts_and_live_locks(app: Celery) -> None:
    """``stats --json`` flushes this process's counts and shows them with live locks."""
    holder = app.tasks[SYNC].delay(9)
    for _ in range(4):
        assert app.tasks[SYNC].delay(9).id == holder.id
    result = dedup("stats", "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)[SYNC]
    assert row["acquired"] == 1 and row["deduplicated"] == 4
    assert row["released"] == 0 and row["released_manual"] == 0 and row["fallback"] == 0
    assert row["live_locks"] == 1
    assert dedup("release", holder.deduplication_key, "--force").exit_code == 0
    table = dedup("stats")
    assert table.output.splitlines()[0].split() == [
        "TASK", "ACQUIRED", "DEDUPLICATED", "RELEASED", "RELEASED_MANUAL", "FALLBACK", "SKIPPED",
        "KEY_REUSED", "COALESCED", "REPLACED", "CANCELLED", "DEFERRED", "RATE_LIMITED",
        "WOULD_DEDUPLICATE", "WOULD_REPLACE", "WOULD_CANCEL", "WOULD_RATE_LIMIT", "LIVE_LOCKS",
    ]
    assert table.output.splitlines()[1].split() == [
        SYNC, "1", "4", "0", "1", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0"
    ]


def test_stats_top_lists_the_keys_with_the_most_observed_calls(app: Celery) -> None:
    """``stats --top N``: per-key counts of ``dedup_mode="observe"``, most first (SQL too)."""
    sync = app.tasks[SYNC]
    hot = sync.delay(1)
    for _ in range(3):
        assert sync.apply_async((1,), dedup_mode="observe").deduplicated is False
    sync.delay(2)
    assert sync.apply_async((2,), dedup_mode="observe").deduplicated is False
    sync.delay(3)  # no observed call: not listed
    result = dedup("stats", "--top", "5", "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert answer["tasks"][SYNC]["would_deduplicate"] == 4
    digest = hot.deduplication_key.rsplit(":", 1)[-1][:16]
    assert [(k["task"], k["would_deduplicate"], k["total"]) for k in answer["top_keys"]] == [
        (SYNC, 3, 3), (SYNC, 1, 1)
    ]
    assert answer["top_keys"][0]["key"] == digest
    table = dedup("stats", "--top", "1").output.splitlines()
    at = table.index("Top 1 keys by observed calls (dedup_mode='observe'):")
    assert table[at + 1].split() == [
        "TASK", "KEY", "WOULD_DEDUPLICATE", "WOULD_REPLACE", "WOULD_CANCEL", "WOULD_RATE_LIMIT",
        "TOTAL",
    ]
    assert table[at + 2].split() == [SYNC, digest, "3", "0", "0", "0", "3"]
    assert len(table) == at + 3
    # Without --top the JSON keeps its shape: one row per task, no per-key row.
    rows = json.loads(dedup("stats", "--json").output)
    assert set(rows) == {SYNC}


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
    app = make_app("memory://", "rpc://", dedup_fallback="open")
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
    started(app, finished)
    app.backend.mark_as_done(finished.id, None)
    dry = dedup("reap", "--dry-run")
    assert f"(dry run) would reap {short(finished.deduplication_key)}" in dry.output
    assert "(dry run) 1 lock would be reaped." in dry.output
    result = dedup("reap")
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "1 lock reaped."
    assert short(finished.deduplication_key) in result.output
    assert dedup("reap", "--dry-run").output.strip() == "(dry run) 0 locks would be reaped."
    store = runtime_for(app).store
    assert store is not None
    assert store.get(finished.deduplication_key) is None
    lock = store.get(pending.deduplication_key)
    assert lock is not None and lock.task_id == pending.id


def test_help_lines_are_whole(app: Celery) -> None:
    """``celery dedup --help`` lists every command with a summary click does not cut off."""
    result = CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", "--help"])
    assert result.exit_code == 0, result.output
    commands = result.output.split("Commands:")[1].strip().splitlines()
    assert [line.split()[0] for line in commands] == [
        "check", "limits", "list", "purge", "reap", "release", "show", "stats"
    ]
    assert not any(line.rstrip().endswith("...") for line in commands), commands
    release_help = dedup("release", "--help").output
    assert "KEY" in release_help and "--dry-run" in release_help
