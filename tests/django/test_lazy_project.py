"""A project whose task modules only Celery's autodiscovery imports (``lazy_project``).

Each case runs in a fresh process, as ``runserver`` or ``manage.py check``
starts: nothing has imported the tasks or finalized the Celery app. The
admin's call lookup knows the tasks; ``manage.py check`` reports what
``manage.py dedup_locks check`` fails on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent / "lazy_project"
ROOT = PROJECT.parents[2]

#: the admin's lookup, in a fresh process, through Django's test client
ADMIN_LOOKUP = """
import json, sys
import django
from django.core.management import call_command
django.setup()
call_command("migrate", verbosity=0)
from django.contrib.auth.models import User
from django.test import Client
imported = "orders.tasks" in sys.modules
client = Client()
client.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
page = client.get(
    "/admin/celery_dedup/deduplock/",
    {"lookup_task": "orders.sync", "lookup_args": "[7]"},
)
from orders.tasks import sync
from celery_dedup import dedup_key_for
print(json.dumps({
    "imported_before": imported,
    "status": page.status_code,
    "body": page.content.decode(),
    "digest": dedup_key_for(sync, [7], {}).rsplit(":", 1)[-1][:16],
}))
"""


def _run(argv: list[str], tmp_path: Path, faults: str = "") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PROJECT), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "lazyproj.settings",
        "LAZY_SQLITE": str(tmp_path / "db.sqlite3"),
        "LAZY_FAULTS": faults,
    }
    return subprocess.run(
        [sys.executable, *argv], cwd=PROJECT, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )


def test_admin_lookup_knows_autodiscovered_tasks(tmp_path: Path) -> None:
    """Under ``runserver`` no view imported ``orders.tasks``: the lookup still finds the
    task (the admin imports the task modules, as a worker does) and shows its key."""
    result = _run(["-c", ADMIN_LOOKUP], tmp_path)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["imported_before"] is False
    assert answer["status"] == 200
    assert "No deduplicated task is called" not in answer["body"]
    assert answer["digest"] in answer["body"]
    assert '<option value="orders.sync"' in answer["body"]


@pytest.mark.parametrize(
    ("faults", "names"),
    [("plain", ["faults.forgot_base"]), ("option", ["faults.bad_policy"])],
    ids=["plain-task-with-options", "invalid-option"],
)
def test_check_reports_what_dedup_locks_check_fails_on(
    tmp_path: Path, faults: str, names: list[str]
) -> None:
    """Where ``dedup_locks check`` exits 1, ``manage.py check`` (a fresh process, task
    modules not imported) names the same tasks: W020 for a task with ``unique_for`` but
    no ``base=DedupTask``, E017 (exit 1) for an option its registration refuses."""
    migrated = _run(["manage.py", "migrate", "-v0"], tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    dedup_check = _run(["manage.py", "dedup_locks", "check"], tmp_path, faults)
    dedup_output = dedup_check.stdout + dedup_check.stderr
    assert dedup_check.returncode == 1, dedup_output
    check = _run(["manage.py", "check"], tmp_path, faults)
    output = check.stdout + check.stderr
    assert "no issues" not in output
    for name in names:
        assert name in dedup_output
        assert name in output
    if faults == "plain":
        assert "(celery_dedup.W020) task faults.forgot_base sets unique_for" in output
        assert check.returncode == 0  # a warning
    else:
        assert "(celery_dedup.E017)" in output and "unique_until='sometime'" in output
        assert check.returncode == 1


def test_check_is_clean_without_faults(tmp_path: Path) -> None:
    """The same project with sound tasks: no issue, and ``dedup_locks check`` agrees."""
    migrated = _run(["manage.py", "migrate", "-v0"], tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    check = _run(["manage.py", "check"], tmp_path)
    assert check.returncode == 0 and "no issues" in check.stdout, check.stdout + check.stderr
    dedup_check = _run(["manage.py", "dedup_locks", "check"], tmp_path)
    assert dedup_check.returncode == 0, dedup_check.stdout + dedup_check.stderr
    assert "orders.sync" in dedup_check.stdout


def test_a_refused_registration_leaves_the_app_unfinalized() -> None:
    """The check's finalize fails as the worker's would, and leaves the app unfinalized:
    a worker whose Django fixup ran the checks still fails at its own finalize instead of
    starting without the tasks registered after the refused one."""
    from celery import Celery

    from celery_dedup import DedupTask
    from celery_dedup.contrib.django.checks import _finalize
    from celery_dedup.exceptions import InvalidOptionError

    app = Celery("lazy-refused", broker="memory://", set_as_current=False)

    @app.task(base=DedupTask, name="lazy.bad", unique_until="sometime")
    def lazy_refused_bad() -> None:
        """Refused at registration."""

    try:
        with pytest.raises(InvalidOptionError):
            _finalize(app)
        assert app.finalized is False
        with warnings.catch_warnings(), pytest.raises(InvalidOptionError):
            # Celery registers its built-in tasks again: a warning per name.
            warnings.simplefilter("ignore")
            app.finalize()
    finally:
        app.close()
        # A shared task (the default) would be registered in every app finalized later
        # in this process, and refuse each.
        from celery import _state

        for finalizer in list(_state._on_app_finalizers):
            if getattr(finalizer, "__name__", "") == "lazy_refused_bad":
                _state._on_app_finalizers.discard(finalizer)
