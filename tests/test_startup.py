"""No silent "no dedup": the worker-start probe, ``celery dedup check``, options nothing reads."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from celery.bin.celery import celery
from celery.contrib.testing.worker import start_worker
from click.testing import CliRunner

from celery_dedup import DedupTask
from celery_dedup.options import DedupConfigWarning
from celery_dedup.runtime import runtime_for
from celery_dedup.startup import probe_store, task_plans, warn_plain_task_options
from tests.apps import cli_app
from tests.apps.cli_app import SLOW, SYNC, make_app
from tests.apps.isolation import own_tasks_only
from tests.fixtures._servers import free_port
from tests.fixtures.logs import DedupLog
from tests.fixtures.memcached import MemcachedServer

ROOT = Path(__file__).resolve().parents[1]


def _dead_store() -> str:
    """A Redis URL on a loopback port nothing listens on, with a password to mask."""
    return f"redis://:hunter2@127.0.0.1:{free_port()}/0"


@pytest.fixture
def dead_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    """The CLI demo app whose lock store cannot be reached, installed for ``-A``."""
    app = make_app("memory://", "cache+memory://", _dead_store())
    monkeypatch.setattr(cli_app, "app", app)
    yield app
    app.close()


def _worker_output(store: str, needle: str, timeout: float = 60) -> str:
    """Start ``celery worker`` on the demo app; its output once ``needle`` appeared."""
    env = {**os.environ, "DEDUP_TEST_BROKER": "memory://",
           "DEDUP_TEST_BACKEND": "cache+memory://", "DEDUP_TEST_STORE": store,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "worker", "--pool",
         "solo", "--without-gossip", "--without-mingle", "--without-heartbeat",
         "--loglevel", "INFO", "--hostname", f"startup-{os.getpid()}@%h"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while needle.encode() not in out and time.monotonic() < deadline:
            chunk = proc.stdout.read()
            if chunk:
                out += chunk
            elif proc.poll() is not None:
                break
            else:
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
    return out.decode(errors="replace")


@pytest.mark.slow
def test_worker_with_an_unreachable_store_says_so_loudly() -> None:
    """``celery worker`` with a dead store logs an ERROR block and flags it in its banner."""
    store = _dead_store()
    out = _worker_output(store, " ready.")
    assert "[celery-dedup] LOCK STORE UNUSABLE: redis store at redis://:**@127.0.0.1" in out, out
    assert "celery-dedup: DEDUPLICATION IS NOT WORKING" in out
    assert "Tasks affected: demo.slow, demo.sync" in out
    assert "published WITHOUT deduplication" in out
    assert "hunter2" not in out  # the URL's password is masked
    assert out.index("LOCK STORE UNUSABLE") < out.index(" ready.")


@pytest.mark.slow
@pytest.mark.redis
def test_worker_with_a_working_store_names_it_in_the_banner(redis_url: str) -> None:
    """With a reachable store the banner says which store passed the round trip."""
    out = _worker_output(redis_url, " ready.")
    assert "[celery-dedup] 2 task(s), redis store at redis://" in out, out
    assert "OK (acquire/release round trip in" in out
    assert "DEDUPLICATION IS NOT WORKING" not in out


@pytest.mark.slow
@pytest.mark.memcached
def test_worker_banner_names_the_settings_lint_findings(
    memcached_pair: tuple[MemcachedServer, MemcachedServer],
) -> None:
    """``celery worker`` logs each lint finding with its fix and names the ids under its banner."""
    one, two = memcached_pair
    out = _worker_output(f"memcached://127.0.0.1:{one.port};127.0.0.1:{two.port}", " ready.")
    assert "[celery-dedup] settings lint: W109 (see the log)" in out, out
    assert "celery-dedup W109: the memcached store spreads keys over 2 servers" in out
    assert "Fix: use one memcached server (or a Redis/SQL store)." in out
    assert out.index("settings lint: W109") < out.index(" ready.")
    single = _worker_output(one.url, " ready.")
    assert "settings lint" not in single and "W109" not in single, single


def test_embedded_worker_logs_the_unreachable_store(
    dead_app: Celery, dedup_log: DedupLog
) -> None:
    """A ``start_worker`` worker (``worker_init``) logs the same ERROR block."""
    dead_app.conf.broker_connection_retry_on_startup = True
    with start_worker(dead_app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        pass
    errors = [r.getMessage() for r in dedup_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "DEDUPLICATION IS NOT WORKING" in errors[0]
    assert "dedup_fallback='open'" in errors[0]


def test_probe_takes_and_releases_one_lock() -> None:
    """On a working store the probe succeeds and leaves no lock behind."""
    app = make_app("memory://", "cache+memory://", "memory://")
    probe = probe_store(app)
    store = runtime_for(app).store
    assert probe.ok and probe.store == "memory" and probe.error is None
    assert store is not None and list(store.scan("celery-dedup:")) == []


def test_probe_reports_an_app_without_any_store() -> None:
    """No derivable store is reported, never raised."""
    app = Celery("nostore", broker="amqp://127.0.0.1:1//", backend="rpc://",
                 set_as_current=False)
    probe = probe_store(app)
    assert not probe.ok and probe.url is None
    assert "no lock store can be derived" in (probe.error or "")


def test_check_fails_on_an_unreachable_store(dead_app: Celery) -> None:
    """``celery dedup check`` exits 1 naming the store (masked) and what each task would use."""
    result = CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", "check",
                                         "--timeout", "5"])
    assert result.exit_code == 1, result.output
    assert "ERROR redis store at redis://:**@127.0.0.1" in result.output
    assert "hunter2" not in result.output
    assert any(line.split()[:2] == ["demo.sync", "success"] for line in result.output.splitlines())
    assert "deduplication is NOT working" in result.output


def test_check_passes_and_lists_each_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a working store ``check`` exits 0 and prints each task's policy, TTL and identity."""
    app = own_tasks_only(make_app("memory://", "cache+memory://", "memory://"), cli_app.__name__)
    monkeypatch.setattr(cli_app, "app", app)
    result = CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", "check"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.split() == ["demo.slow", "success", "10m", "0s", "strict", "existing"]
               for line in lines), result.output
    assert "deduplication is working" in result.output
    plans = {plan.name: plan for plan in task_plans(app)}
    assert {SLOW, SYNC} <= set(plans) and plans[SYNC].unique_for == 600


def test_check_flags_dedup_options_on_a_plain_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain task with ``unique_for`` makes ``check`` fail and name it."""
    app = make_app("memory://", "cache+memory://", "memory://")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DedupConfigWarning)

        @app.task(name="plain.mailer", unique_for=60, shared=False)
        def mailer() -> None:
            """Meant to be deduplicated, but not a DedupTask."""

        monkeypatch.setattr(cli_app, "app", app)
        result = CliRunner().invoke(celery, ["-A", "tests.apps.cli_app:app", "dedup", "check"])
    assert result.exit_code == 1, result.output
    assert "WARNING plain.mailer sets unique_for but is not a DedupTask" in result.output


def test_plain_task_options_warn_once_naming_the_task() -> None:
    """Dedup options on a task without ``DedupTask`` warn once at finalize, naming it."""
    app = Celery("plain", broker="memory://", set_as_current=False)

    @app.task(name="plain.charge", unique_for=300, on_duplicate="raise", shared=False)
    def charge() -> None:
        """A payment task that forgot ``base=DedupTask``."""

    @app.task(base=DedupTask, name="plain.fine", unique_for=300, shared=False)
    def fine() -> None:
        """A real DedupTask: never warned about."""

    with pytest.warns(DedupConfigWarning) as caught:
        app.finalize()
    messages = [str(w.message) for w in caught]
    assert messages == [
        "celery-dedup: task plain.charge sets on_duplicate, unique_for but is not a "
        "DedupTask, so nothing deduplicates it: the options are ignored. Define it with "
        "@app.task(base=DedupTask, ...) (from celery_dedup import DedupTask)."
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_plain_task_options(app) == {"plain.charge": ("unique_for", "on_duplicate")}


def test_dedup_options_given_to_a_plain_call_warn_once() -> None:
    """``apply_async(unique_for=…)`` on a plain task warns once, naming the task."""
    app = Celery("plaincall", broker="memory://", set_as_current=True)

    @app.task(name="plain.notify", shared=False)
    def notify(user_id: int) -> None:
        """A plain task."""

    @app.task(base=DedupTask, name="plain.deduped", shared=False)
    def deduped(user_id: int) -> None:
        """A DedupTask: its options never reach the broker, so never warn."""

    app.conf.dedup_store = "memory://"
    with pytest.warns(DedupConfigWarning) as caught:
        notify.apply_async((1,), unique_for=60, deduplication_key="n:1")
        notify.apply_async((2,), unique_for=60)
    assert len(caught) == 1
    assert "a call of plain.notify passes deduplication_key, unique_for" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deduped.apply_async((1,), unique_for=60, deduplication_key="d:1")
        notify.apply_async((3,))


def test_events_default_follows_the_task_event_settings() -> None:
    """Unset, ``dedup_send_events`` is on when the config turns Celery's task events on."""
    plain = make_app("memory://", "cache+memory://", "memory://")
    flower = make_app("memory://", "cache+memory://", "memory://", worker_send_task_events=True)
    opted_out = make_app("memory://", "cache+memory://", "memory://",
                         worker_send_task_events=True, dedup_send_events=False)
    assert runtime_for(plain).settings.send_events is False
    assert runtime_for(flower).settings.send_events is True
    assert runtime_for(opted_out).settings.send_events is False


def test_worker_sending_events_without_dedup_events_says_what_to_set(
    dedup_log: DedupLog,
) -> None:
    """A worker with ``-E`` whose config leaves dedup events off logs what to set."""
    app = make_app("memory://", "cache+memory://", "memory://", dedup_send_events=False)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10,
                      task_events=True):
        pass
    [warning] = [w for w in dedup_log.warnings() if "sends task events" in w]
    assert "CELERY_DEDUP_SEND_EVENTS = True" in warning and "DEDUPLICATED" in warning


def test_checks_never_finalize_an_app_that_forbids_it() -> None:
    """An ``autofinalize=False`` app not finalized yet: the checks see no task, raise nothing."""
    app = Celery("manual", broker="memory://", autofinalize=False, set_as_current=False)

    @app.task(base=DedupTask, name="manual.job", shared=False)
    def job() -> None:
        """Registered only once the app is finalized by hand."""

    assert task_plans(app) == [] and warn_plain_task_options(app) == {}
    assert not app.finalized
