"""``manage.py dedup_locks check`` and the system checks that connect to the store."""

from __future__ import annotations

import socket
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from celery import shared_task
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_dedup.contrib.django.checks import check_store, check_tasks
from celery_dedup.options import DedupConfigWarning
from celery_dedup.runtime import reset_runtime


def _dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def dead_store(celery_app: Any) -> Iterator[Any]:
    """The example app with its lock store on a port nothing listens on."""
    celery_app.conf.dedup_store = f"redis://:hunter2@127.0.0.1:{_dead_port()}/0"
    reset_runtime(celery_app)
    yield celery_app
    celery_app.conf.changes.pop("dedup_store")
    reset_runtime(celery_app)


def test_check_action_reports_each_task_on_a_working_store(
    celery_app: Any, transactional_db: None, capsys: Any
) -> None:
    """On the django-db store the round trip passes and each example task's policy is listed."""
    call_command("dedup_locks", "check")
    out = capsys.readouterr().out
    assert "django-db store at django-db: acquire/release round trip in" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("shop.")}
    assert rows["shop.tasks.process_payment"][1:3] == ["expiry", "1d"]
    assert rows["shop.tasks.sync_address"][1] == "success"
    assert "deduplication is working" in out


def test_check_action_fails_on_an_unreachable_store(dead_store: Any, capsys: Any) -> None:
    """With the store down the command exits 1 and says so, the password masked."""
    with pytest.raises(CommandError) as excinfo:
        call_command("dedup_locks", "check", "--timeout", "5")
    assert excinfo.value.returncode == 1
    out = capsys.readouterr().out
    assert "ERROR redis store at redis://:**@127.0.0.1" in out and "hunter2" not in out


def test_store_check_runs_only_with_databases(dead_store: Any) -> None:
    """E015 comes from the database-tagged check: with ``--database`` only."""
    assert check_store(databases=None) == []
    [error] = check_store(databases=["default"])
    assert error.id == "celery_dedup.E015" and "unusable" in error.msg


def test_plain_task_with_dedup_options_is_a_warning(celery_app: Any) -> None:
    """A task without ``DedupTask`` setting ``unique_for`` is W020, naming the task."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DedupConfigWarning)

        @shared_task(name="shop.forgot_base", unique_for=60)
        def forgot_base() -> None:
            """Meant to be deduplicated."""

        celery_app.tasks  # noqa: B018 (registers the shared task on the app)
    try:
        [warning] = [m for m in check_tasks() if m.obj == "shop.forgot_base"]
        assert warning.id == "celery_dedup.W020" and "unique_for" in warning.msg
    finally:
        celery_app.tasks.unregister("shop.forgot_base")
