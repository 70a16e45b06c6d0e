"""``manage.py dedup_locks``: the ``celery dedup`` subcommands and rules on the project's store."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_dedup.runtime import runtime_for


def started(app: Any, result: Any) -> None:
    """Mark ``result``'s lock started, as the worker's claim does (the run then died)."""
    store = runtime_for(app).store
    assert store is not None
    lock = store.get(result.deduplication_key)
    assert lock is not None
    store.claim(lock.key, lock.owner, release=False, ttl=None, meta={})


def _run(*args: str) -> str:
    out, err = StringIO(), StringIO()
    call_command("dedup_locks", *args, stdout=out, stderr=err)
    return out.getvalue() + err.getvalue()


@pytest.fixture
def two_locks(celery_app: Any, transactional_db: None) -> tuple[Any, Any]:
    """Two pending calls (no worker): a sync_address and a send_digest lock."""
    from shop.tasks import send_digest, sync_address

    return sync_address.delay(1, {"zip": "1"}), send_digest.delay(2)


def test_list_empty(celery_app: Any, transactional_db: None) -> None:
    """With no locks, ``list`` says so."""
    assert "No live locks." in _run("list")


def test_list_table_json_and_task_filter(two_locks: tuple[Any, Any]) -> None:
    """``list`` shows digest, task and holder; ``--json`` is parseable; ``--task`` filters."""
    sync, digest = two_locks
    table = _run("list")
    assert table.splitlines()[0].split() == [
        "DIGEST", "TASK", "HOLDER", "POLICY", "STATE", "EXPIRES", "IN"
    ]
    assert sync.id in table and digest.id in table
    assert "2 live locks." in table
    data = json.loads(_run("list", "--json"))
    assert {row["holder"] for row in data} == {sync.id, digest.id}
    only = json.loads(_run("list", "--task", "shop.tasks.send_digest", "--json"))
    assert [row["holder"] for row in only] == [digest.id]


def test_show_by_digest_prefix_and_holder_id(two_locks: tuple[Any, Any]) -> None:
    """``show`` finds a lock by a digest prefix, its holder's task id or a prefix of that."""
    sync, _digest = two_locks
    digest_prefix = sync.deduplication_key.rsplit(":", 1)[-1][:12]
    by_digest = json.loads(_run("show", digest_prefix, "--json"))
    by_holder = json.loads(_run("show", sync.id, "--json"))
    by_prefix = json.loads(_run("show", sync.id[:18], "--json"))
    assert by_digest["key"] == by_holder["key"] == by_prefix["key"] == sync.deduplication_key
    assert by_digest["holder_state"] == "PENDING" and by_digest["needed"] is True
    with pytest.raises(CommandError, match="no live lock"):
        _run("show", "f" * 64)


def test_release_needs_force_and_is_owner_checked(
    two_locks: tuple[Any, Any], celery_app: Any
) -> None:
    """``release KEY`` refuses a holder that has not started; ``--force`` frees that lock only."""
    sync, digest = two_locks
    store = runtime_for(celery_app).store
    with pytest.raises(CommandError, match=r"has not started.*--force"):
        _run("release", sync.deduplication_key)
    assert store.get(sync.deduplication_key) is not None
    assert "would release" in _run("release", sync.deduplication_key, "--force", "--dry-run")
    assert "released" in _run("release", sync.deduplication_key, "--force")
    assert store.get(sync.deduplication_key) is None
    assert store.get(digest.deduplication_key) is not None
    with pytest.raises(CommandError, match="no live lock"):
        _run("release", sync.deduplication_key, "--force")


def test_purge_keeps_needed_locks(two_locks: tuple[Any, Any], celery_app: Any) -> None:
    """``purge`` (and the deprecated ``--expired``) keeps the throttle of a finished send_digest."""
    sync, digest = two_locks
    started(celery_app, sync)
    celery_app.backend.store_result(digest.id, "done", "SUCCESS")
    celery_app.backend.store_result(sync.id, "synced", "SUCCESS")
    out = _run("purge", "--expired")
    assert "--expired is deprecated" in out
    assert "unique_until='expiry' keeps the lock" in out
    assert "released 1 of 1 lock." in out
    store = runtime_for(celery_app).store
    assert store.get(digest.deduplication_key) is not None  # the day's digest stays throttled
    assert store.get(sync.deduplication_key) is None  # its SUCCESS released nothing: now freed


def test_purge_force_asks_first(
    two_locks: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``purge --force`` asks; anything but "yes" cancels; ``--noinput`` releases every lock."""
    monkeypatch.setattr("builtins.input", lambda prompt: "no")
    with pytest.raises(CommandError, match="cancelled"):
        _run("purge", "--force")
    assert "2 live locks." in _run("list")
    assert "released 1 of 1 lock of shop.tasks.sync_address" in _run(
        "purge", "--task", "shop.tasks.sync_address", "--force", "--noinput"
    )
    assert "(dry run) 1 lock would be released." in _run("purge", "--force", "--dry-run")
    assert "released 1 of 1 lock." in _run("purge", "--force", "--noinput")
    assert "No live locks." in _run("list")


def test_reap_and_stats(two_locks: tuple[Any, Any], celery_app: Any) -> None:
    """``reap`` frees a lock whose holder's SUCCESS was stored; ``stats`` counts it as manual."""
    sync, digest = two_locks
    started(celery_app, sync)
    celery_app.backend.store_result(sync.id, "synced", "SUCCESS")
    assert "(dry run) 1 lock would be reaped." in _run("reap", "--dry-run")
    assert runtime_for(celery_app).store.get(sync.deduplication_key) is not None
    assert "1 lock reaped." in _run("reap")
    stats = json.loads(_run("stats", "--json"))
    assert stats["shop.tasks.sync_address"]["released_manual"] == 1
    assert stats["shop.tasks.send_digest"]["live_locks"] == 1
    assert stats["shop.tasks.send_digest"]["acquired"] >= 1
    assert digest.id in _run("list")
