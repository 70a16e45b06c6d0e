"""``manage.py dedup_locks``: list, show, release, purge on the project's lock store."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_dedup.runtime import runtime_for


def _run(*args: str) -> str:
    out = StringIO()
    call_command("dedup_locks", *args, stdout=out)
    return out.getvalue()


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
    assert "DIGEST" in table and sync.id in table and digest.id in table
    assert "2 live locks." in table
    data = json.loads(_run("list", "--json"))
    assert {row["holder"] for row in data} == {sync.id, digest.id}
    only = json.loads(_run("list", "--task", "shop.tasks.send_digest", "--json"))
    assert [row["holder"] for row in only] == [digest.id]


def test_show_by_digest_prefix_and_holder_id(two_locks: tuple[Any, Any]) -> None:
    """``show`` finds a lock by a digest prefix or by its holder's task id."""
    sync, _digest = two_locks
    digest_prefix = sync.deduplication_key.rsplit(":", 1)[-1][:12]
    by_digest = json.loads(_run("show", digest_prefix, "--json"))
    by_holder = json.loads(_run("show", sync.id, "--json"))
    assert by_digest["key"] == by_holder["key"] == sync.deduplication_key
    assert by_digest["holder_state"] == "PENDING"
    with pytest.raises(CommandError, match="no live lock"):
        _run("show", "f" * 64)


def test_release_is_owner_checked(two_locks: tuple[Any, Any], celery_app: Any) -> None:
    """``release KEY`` frees that lock only; the other stays."""
    sync, digest = two_locks
    out = _run("release", sync.deduplication_key)
    assert "released" in out
    store = runtime_for(celery_app).store
    assert store.get(sync.deduplication_key) is None
    assert store.get(digest.deduplication_key) is not None
    with pytest.raises(CommandError):
        _run("release", sync.deduplication_key)


def test_purge_asks_first(two_locks: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``purge`` without ``--force`` asks; anything but "yes" cancels and keeps the locks."""
    monkeypatch.setattr("builtins.input", lambda prompt: "no")
    with pytest.raises(CommandError, match="cancelled"):
        _run("purge")
    assert "2 live locks." in _run("list")


def test_purge_task_then_all(two_locks: tuple[Any, Any]) -> None:
    """``purge --task`` releases one task's locks; ``purge --force`` the rest."""
    assert "released 1 of 1 lock of shop.tasks.sync_address" in _run(
        "purge", "--task", "shop.tasks.sync_address", "--force"
    )
    assert "1 live lock." in _run("list")
    assert "released 1 of 1 lock." in _run("purge", "--noinput")
    assert "No live locks." in _run("list")


def test_purge_expired_only_releases_finished_holders(
    two_locks: tuple[Any, Any], celery_app: Any
) -> None:
    """``purge --expired`` releases locks whose holder the result backend reports finished."""
    sync, digest = two_locks
    celery_app.backend.store_result(digest.id, "done", "SUCCESS")
    assert "released 1 of 1 lock." in _run("purge", "--expired", "--force")
    store = runtime_for(celery_app).store
    assert store.get(digest.deduplication_key) is None
    assert store.get(sync.deduplication_key) is not None
