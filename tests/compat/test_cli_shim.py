"""``celery dedup`` finds the locks a shim task took in its library's lock store."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.bin.celery import celery
from click.testing import CliRunner

from celery_dedup.compat.celery_once import QueueOnce
from celery_dedup.compat.celery_singleton import Singleton
from tests.apps import cli_app
from tests.apps.isolation import own_tasks_only
from tests.compat.conftest import AppFactory

pytestmark = pytest.mark.redis


def _define(app: Celery, base: type, **options: Any) -> Any:
    @app.task(base=base, name="shim.job", shared=False, **options)
    def job(x: int) -> int:
        """A task of a project migrated with one changed import."""
        return x

    return job


@pytest.mark.parametrize("library", ["celery_once", "celery_singleton"])
def test_list_and_check_use_the_shims_lock_store(
    make_app: AppFactory, lib_url: str, library: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh CLI process (app not finalized) lists the lock in ONCE's / singleton's store."""
    if library == "celery_once":
        conf: dict[str, Any] = {"ONCE": {"backend": "celery_once.backends.Redis",
                                         "settings": {"url": lib_url}}}
        base: type = QueueOnce
        options: dict[str, Any] = {"once": {"graceful": True}}
    else:
        conf = {"singleton_backend_url": lib_url}
        base, options = Singleton, {}
    producer = make_app(**conf)
    held = _define(producer, base, **options).delay(7)
    # what `celery -A proj` builds: tasks not bound yet
    cli_side = own_tasks_only(make_app(**conf), __name__)
    _define(cli_side, base, **options)
    monkeypatch.setattr(cli_app, "app", cli_side)

    listed = CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", "list"])
    assert listed.exit_code == 0, listed.output
    assert held.id in listed.output and "1 live lock." in listed.output

    checked = CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", "check"])
    assert checked.exit_code == 0, checked.output
    assert f"redis store at {lib_url}" in checked.output
